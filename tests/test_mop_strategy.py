"""The ``mop`` strategy (MixGCN MoP + MoA): sparse group on feature columns, dense group on vertex rows,
graph chunks pipelined between them.

The property test draws small graphs, models, 2-4 ranks, the sparse group's size, 1-4 chunks and
RCM reordering, and checks with :func:`gnncompile.testing.check_plan` that one training step equals
the single-device reference (float64). Bytes are checked against Proposition 3.4's volume: every
vertex's row crosses between the groups once per conversion and direction, whatever the rank count.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError
from gnncompile.ir.plan import Backward, Forward, Recv, Send
from gnncompile.graph.reorder import reorder as reorder_graph
from gnncompile.passes.chunked import chunk_bounds, chunk_reads
from gnncompile.passes.schedule import list_schedule
from gnncompile.testing import check_plan
from graph_strategies import DT, labelled, sbm_graph, seeded_model, small_graphs

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.0),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.0),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 5, c, num_layers=3, dropout=0.0),
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcn3": lambda f, c: gc.nn.GCN(f, 4, c, num_layers=3, dropout=0.5),
    "appnp": lambda f, c: gc.nn.APPNP(f, 5, c, K=3, dropout=0.0),  # each step's mix runs on the dense group
    "mygcn": lambda f, c: MyGCN(f, 5, c),  # README's example: the output is a propagation
}


class MyGCN(torch.nn.Module):
    """README's ``MyGCN`` (section "Use"), verbatim: its forward ends in ``ops.propagate``."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(d_in, d_hidden), torch.nn.Linear(d_hidden, d_out)

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(gc.ops.propagate(g, self.lin1(x), norm="gcn", add_self_loops=True))
        return gc.ops.propagate(g, self.lin2(x), norm="gcn", add_self_loops=True)


class MyGCNPlusZero(MyGCN):
    """``MyGCN`` with a dense op after its output propagation (what ``gather_output`` adds)."""

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        return super().forward(g, x) + 0.0


def model_for(name: str, g: gc.Graph) -> torch.nn.Module:
    return seeded_model(MODELS[name], g)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(90)


def ring(n: int, num_features: int = 4, num_classes: int = 3, shuffle: bool = True) -> gc.Graph:
    """A cycle (bandwidth n-1 in ring order, 2 after RCM) with randomly permuted ids."""
    src = torch.arange(n)
    dst = (src + 1) % n
    ei = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], dim=1)
    if shuffle:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        ei = perm[ei]
    g = gc.Graph.from_edge_index(ei, num_nodes=n)
    return labelled(g, num_classes, seed=0, num_features=num_features)


# --------------------------------------------------------------------------- exactness
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), ranks=st.integers(2, 4), chunks=st.integers(1, 4),
       sparse=st.integers(1, 3), reorder=st.sampled_from(["none", "rcm"]))
def test_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, chunks: int, sparse: int,
                                        reorder: str) -> None:
    chunks = min(chunks, g.num_nodes)
    sparse = min(sparse, ranks - 1)
    check_plan(model_for(name, g), g, ranks, strategy="mop", chunks=chunks, sparse_ranks=sparse, reorder=reorder,
               rtol=1e-9, atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_with_four_chunks(sbm: gc.Graph, name: str) -> None:
    """Three ranks (1 sparse + 2 dense): widths 5 and 3 on one sparse rank, 90 rows over 4 chunks x 2."""
    check_plan(model_for(name, sbm), sbm, 3, strategy="mop", chunks=4, sparse_ranks=1, reorder="rcm",
               rtol=1e-9, atol=1e-11, timeout=60)


def test_two_sparse_ranks_uneven_columns(sbm: gc.Graph) -> None:
    """3 classes over 2 sparse ranks (2/1 columns), 5 hidden (3/2), one dense rank."""
    check_plan(model_for("gcn_dropout", sbm), sbm, 3, strategy="mop", chunks=3, sparse_ranks=2, reorder="none",
               rtol=1e-9, atol=1e-11, timeout=60)


# --------------------------------------------------------------------------- structure
def test_groups_stages_and_messages(sbm: gc.Graph) -> None:
    plan = gc.plan(model_for("gcn", sbm), sbm, 4, strategy="mop", chunks=2, reorder="none")
    assert plan.info["sparse_ranks"] == [0, 1] and plan.info["dense_ranks"] == [2, 3]
    for dp in plan.ranks:
        kinds = {s.kinds.split()[0][0] for s in dp.stages}
        assert kinds == ({"P"} if dp.rank < 2 else {"T"})
        assert all(s.group == ("cols" if dp.rank < 2 else "rows") for s in dp.stages)
        # every stage runs forward and backward once per chunk
        for s in dp.stages:
            for c in range(2):
                assert dp.instructions.count(Forward(s.index, c)) == 1
                assert dp.instructions.count(Backward(s.index, c)) == 1
        # the dense ranks hold the parameters: one all-reduce among them; the sparse ranks none
        ars = [i for i in dp.instructions if i.kind == "AR"]
        assert (len(ars), ars[0].group if ars else None) == ((1, (2, 3)) if dp.rank >= 2 else (0, None))
        # messages only cross between the groups
        for i in dp.instructions:
            if isinstance(i, (Send, Recv)):
                assert (i.peer < 2) != (dp.rank < 2)
    assert "on cols" in str(plan) and "SEND" in str(plan)


def test_bytes_are_one_row_per_vertex_per_conversion_whatever_the_ranks(sbm: gc.Graph) -> None:
    """MixGCN Prop. 3.4: the volume is O(|V|), the same for 2, 3 and 4 ranks."""
    h, c = 5, sbm.num_classes
    # GCN: lin0 (h) -> cols, propagate (h) -> rows, lin1 (c) -> cols, propagate_1 (c) -> rows; all
    # four need gradients (they depend on parameters): each crosses twice
    expected = sbm.num_nodes * (2 * h + 2 * c) * 2 * 8
    totals = []
    for ranks, sparse in ((2, 1), (3, 1), (3, 2), (4, 2)):
        plan = gc.plan(model_for("gcn", sbm), sbm, ranks, strategy="mop", chunks=3, sparse_ranks=sparse,
                       reorder="none")
        totals.append(sum(plan.predictions["bytes_sent"]))
        # the gradient all-reduce of the dense group is the only other traffic
        dense = ranks - sparse
        numel = sum(p.numel() for p in model_for("gcn", sbm).parameters())
        ar = 2 * (dense - 1) * numel * 8 // dense * dense if dense > 1 else 0
        assert totals[-1] == pytest.approx(expected + ar, rel=1e-9)
    res = gc.plan(model_for("gcn", sbm), sbm, 3, strategy="mop", chunks=3, sparse_ranks=2,
                  reorder="none").run(epochs=1, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == res.plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == res.plan.predictions["bytes_received"]


def test_chunk_reads_of_a_ring_after_rcm() -> None:
    """In a shuffled ring a chunk reads most chunks; after RCM a chunk reads only its neighbours
    (bandwidth 2), so the pipeline's lag is one chunk."""
    g = ring(64)
    b = chunk_bounds(g.num_nodes, 8)
    assert sum(len(r) for r in chunk_reads(g, b)) >= 5 * 8
    assert chunk_reads(reorder_graph(g)[0], b) == ((0, 1),) + tuple((j - 1, j, j + 1) for j in range(1, 7)) \
        + ((6, 7),)
    plan = gc.plan(gc.nn.GCN(4, 4, 3, num_layers=2, dropout=0.0), g, 2, strategy="mop", chunks=8, reorder="rcm")
    assert plan.info["bandwidth"] > 32 and plan.info["bandwidth_reordered"] <= 2
    assert plan.info["pipeline_lag"] == 1
    # the sparse rank starts aggregating chunk 0 after 2 chunks arrived, not after all 8
    sparse = plan.ranks[0].instructions
    first = sparse.index(Forward(1, 0))
    assert sum(1 for i in sparse[:first] if isinstance(i, Recv)) == 2


def test_pipelined_schedule_overlaps_the_groups(sbm: gc.Graph) -> None:
    """With chunks the groups work at the same time: the simulated step is shorter than unchunked."""
    g = ring(256)
    times = {}
    for k in (1, 8):
        plan = gc.plan(gc.nn.GCN(4, 64, 3, num_layers=2, dropout=0.0), g, "2xA100-nvlink3", strategy="mop", chunks=k,
                       reorder="rcm")
        times[k] = plan.prediction.simulation.bubble_fraction
    assert times[8] < times[1]


def test_list_schedule_prefers_finishing_a_chunk() -> None:
    # two stages on two groups, 3 chunks, stage 1 chunk j needs stage 0 chunk j
    deps = {Forward(0, c): set() for c in range(3)}
    deps.update({Forward(1, c): {Forward(0, c)} for c in range(3)})
    order = list_schedule(deps, {0: "rows", 1: "cols"})
    assert [(s, str(t)) for s, t in order] == [(0.0, "F0c0"), (1.0, "F1c0"), (1.0, "F0c1"), (2.0, "F1c1"),
                                               (2.0, "F0c2"), (3.0, "F1c2")]
    with pytest.raises(PlanningError, match="cycle"):
        list_schedule({Forward(0, 0): {Forward(1, 0)}, Forward(1, 0): {Forward(0, 0)}}, {0: "rows", 1: "cols"})


@pytest.mark.parametrize("ranks, chunks", [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)])
def test_output_propagation_is_gathered_to_the_dense_group(sbm: gc.Graph, ranks: int, chunks: int) -> None:
    """README's MyGCN ends in a propagation: the dense group receives its rows in a stage of its own
    (an identity), so one step is exact, the measured bytes are the plan's, and the plan predicts
    what it predicts for the model with an explicit dense op after the propagation."""
    res = check_plan(seeded_model(lambda f, c: MyGCN(f, 5, c), sbm), sbm, ranks, strategy="mop", chunks=chunks,
                     rtol=1e-9, atol=1e-11, timeout=60, device="cpu")
    plan = res.plan
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == plan.predictions["bytes_received"]
    dense = set(plan.info["dense_ranks"])
    last = max((s for dp in plan.ranks for s in dp.stages), key=lambda s: s.index)
    assert last.ops == (plan.info["output"],) and last.inputs == ("propagate_1@rows",)
    assert all(any(s.index == last.index for s in dp.stages) == (dp.rank in dense) for dp in plan.ranks)
    explicit = gc.plan(seeded_model(lambda f, c: MyGCNPlusZero(f, 5, c), sbm), sbm, ranks, strategy="mop",
                       chunks=chunks)
    assert plan.predictions == explicit.predictions
    assert plan.prediction.step_time == pytest.approx(explicit.prediction.step_time, rel=1e-12)
    assert plan.prediction.peak_memory == explicit.prediction.peak_memory


def test_gather_output_is_an_identity_after_an_output_propagation(sbm: gc.Graph) -> None:
    from gnncompile.ir.verify import verify
    from gnncompile.passes.mop import gather_output

    m = seeded_model(lambda f, c: MyGCN(f, 5, c), sbm)
    tp = gc.trace(m, sbm)
    out = verify(gather_output(tp, share_parameters=True))
    last = next(n for n in out.graph.nodes if n.op == "output").args[0]
    assert (last.op, last.target, last.args[0].name) == ("call_method", "clone", "propagate_1")
    assert last.meta["tp"].kind == "T" and last.meta["tp"].dims == (3,)
    with torch.no_grad():
        assert torch.equal(out(sbm, sbm.x), m(sbm, sbm.x))
    gcn = gc.trace(model_for("gcn", sbm), sbm)  # ends in a dense op (the bias): unchanged
    assert len(gather_output(gcn).graph.nodes) == len(gcn.graph.nodes)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("model, match", [
    (lambda: gc.nn.GAT(6, 4, 3, heads=2, num_layers=2, dropout=0.0), "edge-wise"),
    # with attention dropout too: the edge-wise op is named, not the dropout's row space (the
    # refusal a user would hit after removing the dropout)
    (lambda: gc.nn.GAT(6, 4, 3, heads=2, num_layers=2, dropout=0.6), "does not support edge-wise ops 'edge_attention'"),
    (lambda: gc.nn.SGC(6, 3, K=2), "chained propagations"),
    (lambda: gc.nn.GraphSAGE(6, 4, 3, aggr="max"),
     r"strategy 'mop' does not support edge-wise ops 'gather_src', 'aggregate', 'gather_src_1', 'aggregate_1'"),
])
def test_unsupported_models_are_refused(sbm: gc.Graph, model: Callable, match: str) -> None:
    with pytest.raises(PlanningError, match=match):
        gc.plan(model().to(DT), sbm, 2, strategy="mop")


def test_bad_options(sbm: gc.Graph) -> None:
    m = model_for("gcn", sbm)
    with pytest.raises(PlanningError, match="at least 2 ranks"):
        gc.plan(m, sbm, 1, strategy="mop")
    with pytest.raises(PlanningError, match="sparse_ranks must be in 1..1"):
        gc.plan(m, sbm, 2, strategy="mop", sparse_ranks=2)
    with pytest.raises(PlanningError, match="chunks must be in 1..90"):
        gc.plan(m, sbm, 2, strategy="mop", chunks=91)
    with pytest.raises(PlanningError, match="unknown reorder"):
        gc.plan(m, sbm, 2, strategy="mop", reorder="metis")
    with pytest.raises(PlanningError, match="chunks: expected a positive integer"):
        gc.plan(m, sbm, 2, strategy="mop", chunks=0)
    with pytest.raises(PlanningError, match="no candidate|recomput"):
        gc.plan(m, sbm, 2, strategy="mop", recompute=True)


def test_plan_from_statistics_is_printable_and_simulated() -> None:
    stats = gc.datasets.stats("ogbn-products")
    plan = gc.plan(gc.nn.GCN(stats.num_features, 128, stats.num_classes, num_layers=2), stats, "8xA100-nvlink3",
                   strategy="mop", chunks=4)
    assert plan.prediction.step_time > 0 and plan.program is None
    assert "mop" in str(plan)


def test_chunk_graph_self_loops_read_the_chunks_own_rows() -> None:
    """Sources are whole chunks in ascending order; a chunk's own rows sit at its offset there."""
    from gnncompile.passes.chunked import Chunking, chunk_graph

    g = ring(12, shuffle=False)
    b = chunk_bounds(12, 3)
    ch = Chunking(b, chunk_reads(g, b))
    assert ch.reads == ((0, 1, 2), (0, 1, 2), (0, 1, 2))  # the ring's wrap-around edge reaches both ends
    local = chunk_graph(g, ch, 1, {})
    assert (local.num_nodes, local.num_src, local.own_offset) == (4, 12, 4)
    x = torch.arange(12, dtype=DT).unsqueeze(1)
    out = gc.ops.propagate(local, x, "sum", add_self_loops=True)
    # vertex v (4..7) sums its neighbours v-1, v+1 and itself
    assert out.squeeze(1).tolist() == [3.0 * v for v in range(4, 8)]
    with pytest.raises(gc.GraphError, match="do not fit"):
        gc.graph.LocalGraph(local.indptr, local.indices, 4, 12, own_offset=9)


class _OneWide(torch.nn.Module):
    """A propagation of a value one column wide: narrower than a group of two sparse ranks, one of
    which holds none of its columns."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(fin, 1), torch.nn.Linear(1, fout)

    def forward(self, g, x):
        return self.l2(torch.relu(gc.ops.propagate(g, self.l1(x), norm="gcn")))


@pytest.mark.parametrize("gpus, options", [(3, dict(sparse_ranks=2)), (5, {}), (3, dict(sparse_ranks=2, chunks=3))])
def test_a_value_narrower_than_the_sparse_group_is_exact(gpus: int, options: dict) -> None:
    """The member with no column sends an empty [rows, 0] block beside the other's [rows, 1]: the
    reader concatenated them along the rows (the first block's slab) and every rank failed."""
    g = sbm_graph(40)
    check_plan(seeded_model(_OneWide, g), g, gpus, strategy="mop", rtol=1e-9, atol=1e-11, device="cpu", timeout=120,
               **options)
