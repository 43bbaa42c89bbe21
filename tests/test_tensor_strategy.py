"""The ``tensor`` strategy (NeutronTP): P ops on feature columns, T ops on vertex rows, all-to-all between.

The property test draws small graphs, models (T and P ops only, and GAT: edge-wise attention with
replicated scores), 1-4 ranks (widths and vertex counts that do not divide by the rank count
included) and recomputation on/off, and checks with :func:`gnncompile.testing.check_plan` that one
training step equals the single-device reference (float64). Bytes are compared with NeutronTP's
closed form, and for GAT with the all-gather / reduce-scatter of the attention scores added.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError, ops
from gnncompile.cost_models import formulas
from gnncompile.ir.plan import AllGather, AllToAll, Forward
from gnncompile.passes.tensor import column_splits, row_blocks
from gnncompile.runtime.comm import Communicator, all_gather_rows, cols_to_rows, offsets, reduce_scatter_rows, \
    rows_to_cols
from gnncompile.runtime.launcher import RankContext, launch
from gnncompile.testing import check_plan
from graph_strategies import DT, assert_same_step, labelled, sbm_graph, seeded_model, small_graphs


def _attention_dropout(model: torch.nn.Module, p: float) -> torch.nn.Module:
    """``model`` with dropout ``p`` on every GAT layer's attention coefficients only."""
    for conv in model.convs:
        conv.dropout = p
    return model


MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.0),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.0),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 5, c, num_layers=3, dropout=0.0),
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcnii_dropout": lambda f, c: gc.nn.GCNII(f, 5, c, num_layers=3, dropout=0.5),
    # GAT: hidden heads concatenated, output heads averaged; C = 3 splits unevenly over 2 and 4 ranks
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, dropout=0.0),
    "gat_1head": lambda f, c: gc.nn.GAT(f, 4, c, num_layers=2, heads=1, dropout=0.0),
    "gat_mean": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, out_heads=2, dropout=0.0),
    "gat_attention_dropout": lambda f, c: _attention_dropout(
        gc.nn.GAT(f, 3, c, num_layers=2, heads=2, out_heads=2, dropout=0.0), 0.5),
    "gat_dropout": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, dropout=0.4),
}


def model_for(name: str, g: gc.Graph) -> torch.nn.Module:
    return seeded_model(MODELS[name], g)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(120)


# --------------------------------------------------------------------------- exactness
@settings(max_examples=55, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), ranks=st.integers(1, 4), recompute=st.booleans())
def test_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, recompute: bool) -> None:
    ranks = min(ranks, g.num_nodes)
    check_plan(model_for(name, g), g, ranks, strategy="tensor", recompute=recompute, rtol=1e-9, atol=1e-11,
               timeout=60)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_on_three_ranks(sbm: gc.Graph, name: str) -> None:
    """Three ranks: the hidden width 5 and the 3 classes split unevenly (2/2/1, 1/1/1)."""
    check_plan(model_for(name, sbm), sbm, 3, strategy="tensor", rtol=1e-9, atol=1e-11, timeout=60)


# --------------------------------------------------------------------------- layout and bytes
def test_splits_are_balanced() -> None:
    assert column_splits(5, 3) == [2, 2, 1] and column_splits(2, 4) == [1, 1, 0, 0]
    assert row_blocks(10, 4) == [3, 3, 2, 2] and sum(row_blocks(10, 4)) == 10


def test_plan_alternates_layouts(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 4, strategy="tensor")
    a2a = [i for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    # per layer: rows->cols before the propagation, cols->rows after it; both again for the gradients
    assert [(i.src_layout, i.dst_layout, i.grad) for i in a2a[:4]] == [
        ("rows", "cols", False), ("cols", "rows", False), ("rows", "cols", False), ("cols", "rows", False)]
    assert len(a2a) == 8
    ops_layout = {op.name: op.layout for s in p.ranks[0].stages for op in s.costs}
    assert ops_layout["propagate"] == "cols" and ops_layout["convs_0_lin"] == "rows"


def test_bytes_equal_neutrontp_closed_form() -> None:
    """Widths and vertex counts that divide: the total is 4 (N-1)/N V D L (forward and backward)."""
    g = labelled(gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=8, seed=2),
                 num_classes=8, num_features=6)
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 8, 8, num_layers=2, dropout=0.0).to(DT)
    for n in (2, 4):
        p = gc.plan(model, g, n, strategy="tensor")
        ring = 2 * (n - 1) * p.info["params"] * 8 // n
        conversions = sum(p.predictions["bytes_sent"]) - n * ring
        assert conversions == formulas.comm_tensor(120, 8, 2, num_workers=n, elsize=8)


def test_measured_bytes_equal_predicted(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 3, strategy="tensor")
    res = p.run(epochs=2, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == p.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == p.predictions["bytes_received"]


# --------------------------------------------------------------------------- GAT: replicated attention
def _gat_closed_form(num_nodes: int, layers: list[tuple[int, int]], params: int, n: int, elsize: int) -> int:
    """Bytes one rank sends per step for a GAT plan when ``n`` divides ``|V|`` and every ``C``: per layer
    (``H`` heads of ``C``) NeutronTP's split and gather of ``[V, H, C]``, forward and backward
    (``4 (n-1)/n^2 V H C``), the all-gather of ``a_src`` and ``a_dst`` and its backward reduce-scatter
    (``4 (n-1)/n V H``); then the ring all-reduce of the gradients."""
    total = 0
    for heads, c in layers:
        total += 4 * (n - 1) * num_nodes * heads * c * elsize // (n * n)
        total += 4 * ((n - 1) * num_nodes * heads * elsize // n)
    return total + 2 * (n - 1) * params * elsize // n


def test_gat_plan_replicates_attention(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GAT(6, 3, 3, num_layers=2, heads=2, dropout=0.5).to(DT), sbm, 3, strategy="tensor")
    ops_layout = {op.name: op.layout for s in p.ranks[0].stages for op in s.costs}
    assert ops_layout["convs_0_lin"] == ops_layout["sum_1"] == "rows" and ops_layout["propagate"] == "cols"
    edge_ops = [op for s in p.ranks[0].stages for op in s.costs if op.kind == "E"]
    # per layer the fused attention and the dropout of its coefficients
    names = sorted(op.name for op in edge_ops)
    assert len(names) == 4 and names[2:] == ["edge_attention", "edge_attention_1"] and "dropout" in names[0]
    assert {op.layout for op in edge_ops} == {"replicated"}
    ag = [i for i in p.ranks[0].instructions if isinstance(i, AllGather)]
    # a_src and a_dst of both layers, forward and (reduce-scatter) backward
    assert [(i.value, i.grad) for i in ag[:4]] == [("sum_1", False), ("sum_2", False), ("sum_3", False),
                                                    ("sum_4", False)]
    assert len(ag) == 8 and all(i.grad for i in ag[4:]) and ag[0].shape == (120, 2)
    # the propagation splits C of [V, H, C]: every rank keeps both heads
    a2a = next(i for i in p.ranks[2].instructions if isinstance(i, AllToAll) and i.value == "view")
    assert a2a.recv_shapes == ((40, 2, 1),) * 3 and a2a.send_shapes == ((40, 2, 1),) * 3


@pytest.mark.parametrize("n", [2, 4])
def test_gat_measured_bytes_equal_predicted_and_closed_form(n: int) -> None:
    g = labelled(gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=8, seed=2),
                 num_classes=8, num_features=6)
    torch.manual_seed(0)
    model = gc.nn.GAT(6, 4, 8, num_layers=2, heads=2, out_heads=2, dropout=0.3).to(DT)
    p = gc.plan(model, g, n, strategy="tensor")
    closed = _gat_closed_form(120, [(2, 4), (2, 8)], p.info["params"], n, 8)
    assert p.predictions["bytes_sent"] == p.predictions["bytes_received"] == [closed] * n
    res = p.run(epochs=2, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == p.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == p.predictions["bytes_received"]


def test_gat_uneven_measured_bytes_equal_predicted() -> None:
    """|V| = 121 and C = 3 over 4 ranks: uneven vertex blocks and column slices (one rank has none)."""
    g = labelled(gc.datasets.synthetic("sbm", num_nodes=121, avg_degree=5, num_features=6, num_classes=3, seed=3),
                 num_classes=3, num_features=6)
    torch.manual_seed(0)
    model = gc.nn.GAT(6, 3, 3, num_layers=2, heads=2, out_heads=2, dropout=0.3).to(DT)
    p = gc.plan(model, g, 4, strategy="tensor")
    res = p.run(epochs=1, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == p.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == p.predictions["bytes_received"]


def test_gat_tensor_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-products")
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GAT(100, 32, 47, num_layers=3, heads=8), stats, "8xA100", strategy="tensor")
    assert p.program is None and p.prediction.step_time > 0 and p.prediction.time_by_kind()["AG"] > 0
    # the attention scores' all-gathers: (n - 1) / n of [V, H] per value, forward and backward
    ag = [i for i in p.ranks[0].instructions if isinstance(i, AllGather)]
    assert len(ag) == 2 * 2 * 3 and ag[0].shape == (stats.num_nodes, 8)


ROWS = (3, 0, 5)      # an empty rank too
COLS = (2, 3, 1)


def _collectives_worker(ctx: RankContext) -> dict:
    comm = Communicator(ctx.rank, ctx.world_size)
    n, h, d = sum(ROWS), 2, sum(COLS)
    gen = torch.Generator().manual_seed(0)
    x, up = torch.randn(n, h, d, generator=gen, dtype=DT), torch.randn(n, h, d, generator=gen, dtype=DT)
    r, c = offsets(ROWS), offsets(COLS)
    mine = x[r[ctx.rank]:r[ctx.rank + 1]].clone().requires_grad_(True)
    # rows -> cols of a [V, H, C] value splits the last dimension
    cols = rows_to_cols(mine, comm, ROWS, COLS)
    ok = [torch.equal(cols, x[..., c[ctx.rank]:c[ctx.rank + 1]]),
          torch.equal(cols_to_rows(cols.detach(), comm, ROWS, COLS), mine.detach())]
    # rows -> replicated; every rank's loss <up, x> * (rank + 1): the gradients sum over ranks
    sent = comm.stats.total_sent()
    whole = all_gather_rows(mine, comm, ROWS)
    ok.append(torch.equal(whole, x))
    ((whole * up).sum() * (ctx.rank + 1)).backward()
    total = sum(q + 1 for q in range(ctx.world_size))
    ok.append(torch.allclose(mine.grad, total * up[r[ctx.rank]:r[ctx.rank + 1]], rtol=0, atol=1e-12))
    part = reduce_scatter_rows(up * (ctx.rank + 1), comm, ROWS)
    ok.append(torch.allclose(part, total * up[r[ctx.rank]:r[ctx.rank + 1]], rtol=0, atol=1e-12))
    return dict(ok=ok, ring=comm.stats.total_sent() - sent, recv=comm.stats.total_received())


def test_all_gather_rows_and_its_reduce_scatter_gradient() -> None:
    out = launch(_collectives_worker, 3, timeout=60)
    ring = 2 * sum(ROWS) * 2 * sum(COLS) * 8 // 3  # (n - 1) / n of the gathered tensor, per collective
    for rank, o in enumerate(out):
        assert all(o["ok"]), f"rank {rank}: {o['ok']}"
        assert o["ring"] == 3 * ring  # all-gather, its backward, the reduce-scatter


# --------------------------------------------------------------------------- what is refused
def test_edge_values_outside_attention_are_refused(sbm: gc.Graph) -> None:
    """Edge-wise results may feed only edge-wise ops and propagation weights (GAT), not T ops (max
    aggregation) or a propagation's features."""

    class EdgeFeatures(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, g, x):
            return self.lin(ops.aggregate(g, ops.gather_src(g, x), "sum"))

    torch.manual_seed(0)
    for model in (gc.nn.GraphSAGE(6, 5, 3, aggr="max"), EdgeFeatures()):
        with pytest.raises(PlanningError, match="edge-wise op"):
            gc.plan(model.to(DT), sbm, 2, strategy="tensor")


def test_output_in_columns_is_gathered_back_to_rows(sbm: gc.Graph) -> None:
    class EndsWithPropagation(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, g, x):
            return ops.propagate(g, self.lin(x), norm="gcn", add_self_loops=True)

    torch.manual_seed(0)
    model = EndsWithPropagation().to(DT)
    p = gc.plan(model, sbm, 3, strategy="tensor")
    last = [str(i) for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    assert last[1] == "A2A propagate c0 cols->rows" and last[2] == "A2A grad propagate c0 cols->rows"
    check_plan(model, sbm, 3, strategy="tensor", rtol=1e-9, atol=1e-11, timeout=60)


def test_batchnorm_is_refused_under_exact(sbm: gc.Graph) -> None:
    class WithBatchNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = gc.nn.GCNConv(6, 4)
            self.bn = torch.nn.BatchNorm1d(4)
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, g, x):
            return self.lin(torch.relu(self.bn(self.conv(g, x))))

    with pytest.raises(PlanningError, match="not exact"):
        gc.plan(WithBatchNorm().to(DT), sbm, 2, strategy="tensor")
    relaxed = gc.plan(WithBatchNorm().to(DT), sbm, 2, strategy="tensor", semantics="relaxed")
    assert relaxed.relaxations


# --------------------------------------------------------------------------- planner
def test_planner_considers_tensor(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, "4xA5000")
    strategies = {e.candidate.strategy for e in p.search.ranked}
    assert {"data", "tensor", "mop"} <= strategies
    assert p.prediction.step_time == min(e.step_time for e in p.search.ranked)


def test_tensor_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-papers100M")
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GCN(128, 128, 172, num_layers=3), stats, "8x8xA100-ib200", strategy="tensor")
    assert p.program is None and p.prediction.step_time > 0
    assert p.ranks[0].sizes.all_nodes == stats.num_nodes


# --------------------------------------------------------------------------- decoupled (NeutronTP §4.1)
@pytest.mark.parametrize("layers", [2, 4, 8])
def test_decoupled_tensor_has_four_collectives_per_step(sbm: gc.Graph, layers: int) -> None:
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 5, 3, num_layers=layers, dropout=0.5).to(DT)
    p = gc.plan(model, sbm, 3, strategy="tensor", decouple=True, semantics="relaxed")
    a2a = [i for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    assert len(a2a) == 4 and [i.grad for i in a2a] == [False, False, True, True]
    assert p.relaxations and "decoupled" in p.relaxations[0] and p.semantics == "relaxed"


def test_decoupled_tensor_equals_the_decoupled_model_on_one_rank(sbm: gc.Graph) -> None:
    """n ranks train the decoupled model exactly as one rank does (the decoupled single-device reference)."""
    results = []
    for n in (1, 3):
        torch.manual_seed(0)
        model = gc.nn.GCN(6, 5, 3, num_layers=2, dropout=0.5).to(DT)
        p = gc.plan(model, sbm, n, strategy="tensor", decouple=True, semantics="relaxed")
        results.append(p.run(epochs=1, seed=0, capture=True, update_model=False, timeout=60))
    one, three = results
    assert_same_step(three, one)


def test_decoupling_a_nonlinear_model_is_refused_under_exact(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanningError, match="decoupling changes this model"):
        gc.plan(gc.nn.GCN(6, 5, 3).to(DT), sbm, 2, strategy="tensor", decouple=True)
    # the planner never proposes it under exact semantics
    p = gc.plan(gc.nn.GCN(6, 5, 3).to(DT), sbm, "2xA5000")
    assert all(not e.candidate.options.get("decouple") for e in p.search.ranked + p.search.rejected)


# --------------------------------------------------------------------------- chunked (NeutronTP §4.2)
CHUNKED_MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    **{k: MODELS[k] for k in ("gcn", "sage", "gin", "gcnii", "gcn_dropout", "gcnii_dropout")},
    # chained propagations: each propagation of the chain is a stage of its own reading every chunk
    "sgc": lambda f, c: gc.nn.SGC(f, c, K=2),
    "appnp": lambda f, c: gc.nn.APPNP(f, 5, c, K=3, dropout=0.0),
}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(CHUNKED_MODELS)), ranks=st.integers(1, 4),
       chunks=st.integers(2, 5), recompute=st.booleans())
def test_chunked_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, chunks: int,
                                                recompute: bool) -> None:
    """Chunk-level all-to-alls, every rank owning a slice of every chunk (empty slices included)."""
    chunks = min(chunks, g.num_nodes)
    check_plan(seeded_model(CHUNKED_MODELS[name], g), g, ranks, strategy="tensor", chunks=chunks, recompute=recompute,
               rtol=1e-9, atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", sorted(CHUNKED_MODELS))
def test_chunked_every_model_on_three_ranks(sbm: gc.Graph, name: str) -> None:
    check_plan(seeded_model(CHUNKED_MODELS[name], sbm), sbm, 3, strategy="tensor", chunks=4, rtol=1e-9, atol=1e-11,
               timeout=60)


@pytest.mark.parametrize("chunks", [2, 4, 7])
def test_chunked_moves_the_unchunked_bytes(chunks: int) -> None:
    """§4.2.2 deduplication: a chunk's slices cross once however many chunks read them, so the step
    moves NeutronTP's closed form, what the whole-graph all-to-alls move; measured bytes equal the
    plan's."""
    g = labelled(gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=8, seed=2),
                 num_classes=8, num_features=6)
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 8, 8, num_layers=2, dropout=0.0).to(DT)
    for n in (2, 4):
        whole = gc.plan(model, g, n, strategy="tensor", chunks=1)
        cut = gc.plan(model, g, n, strategy="tensor", chunks=chunks)
        ring = 2 * (n - 1) * cut.info["params"] * 8 // n
        conversions = sum(cut.predictions["bytes_sent"]) - n * ring
        assert conversions == formulas.comm_tensor(120, 8, 2, num_workers=n, elsize=8)
        assert sum(cut.predictions["bytes_sent"]) == sum(whole.predictions["bytes_sent"])
        a2a = [i for i in cut.ranks[0].instructions if isinstance(i, AllToAll)]
        # 2 layers x (split + gather) x forward/backward, one per chunk
        assert len(a2a) == 8 * chunks and sorted({i.chunk for i in a2a}) == list(range(chunks))
    res = cut.run(epochs=1, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == cut.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == cut.predictions["bytes_received"]


def test_chunked_schedule_waits_for_read_chunks_and_overlaps() -> None:
    """On a path the propagation of chunk j reads chunks j-1..j+1 only: it starts as soon as their
    splits are posted, and each chunk's all-to-all is followed by another chunk's task before its
    first reader (the collective runs while that task computes)."""
    n = 60
    src = torch.arange(n - 1)
    ei = torch.cat([torch.stack([src, src + 1]), torch.stack([src + 1, src])], dim=1)
    g = labelled(gc.Graph.from_edge_index(ei, num_nodes=n), num_features=6)
    p = gc.plan(model_for("gcn", g), g, 2, strategy="tensor", chunks=6)
    prog = [str(i) for i in p.ranks[0].instructions]
    split = {k: prog.index(f"A2A convs_0_lin c{k} rows->cols") for k in range(6)}
    agg = {k: prog.index(f"F1c{k}") for k in range(6)}
    for j in range(6):
        assert all(split[k] < agg[j] for k in range(max(j - 1, 0), min(j + 1, 5) + 1))
    assert agg[0] < split[3]  # chunk 0 is aggregated before chunk 3's split: a pipeline, not two phases
    stage_of = {o: s.index for s in p.ranks[0].stages for o in s.inputs}
    forward = [i for i in p.ranks[0].instructions if not getattr(i, "grad", False)]
    for a, nxt in zip(forward, forward[1:]):
        if isinstance(a, AllToAll) and isinstance(nxt, Forward) and a.chunk < 5:
            assert not (stage_of.get(a.output) == nxt.stage and nxt.chunk == a.chunk), f"{a} then {nxt}"
    assert p.info["pipeline_lag"] == 1


def test_chunked_decoupled_equals_the_decoupled_model_on_one_rank(sbm: gc.Graph) -> None:
    """NeutronTP Algorithm 1 (decoupled + chunked) trains what the decoupled model trains on one rank."""
    results = []
    for n, chunks in ((1, 1), (3, 4)):
        torch.manual_seed(0)
        model = gc.nn.GCN(6, 5, 3, num_layers=3, dropout=0.5).to(DT)
        p = gc.plan(model, sbm, n, strategy="tensor", decouple=True, semantics="relaxed", chunks=chunks)
        results.append(p.run(epochs=1, seed=0, capture=True, update_model=False, timeout=60))
    one, cut = results
    assert_same_step(cut, one)


def test_chunked_refusals(sbm: gc.Graph) -> None:
    with pytest.raises(PlanningError, match="edge-wise op .* use chunks=1"):
        gc.plan(model_for("gat", sbm), sbm, 2, strategy="tensor", chunks=2)
    # with attention dropout: the same reason, not the dropout's row space (named before any pass)
    gat = gc.nn.GAT(sbm.num_features, 4, sbm.num_classes, heads=2, dropout=0.6).to(DT)
    with pytest.raises(PlanningError, match="edge-wise op 'edge_attention' .* use chunks=1"):
        gc.plan(gat, sbm, 2, strategy="tensor", chunks=2)
    with pytest.raises(PlanningError, match="chunks must be a positive integer"):
        from gnncompile.passes.tensor import TensorOptions
        TensorOptions(chunks=0)
    with pytest.raises(PlanningError, match="chunks must be in 1..120"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="tensor", chunks=121)


def test_chunked_plan_json_round_trip(sbm: gc.Graph, tmp_path) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 2, strategy="tensor", chunks=3)
    p.save(tmp_path / "plan.json")
    q = gc.load_plan(tmp_path / "plan.json", model_for("gcn", sbm), sbm)
    assert [dp.instructions for dp in q.ranks] == [dp.instructions for dp in p.ranks]
    assert q.options["chunks"] == 3


def test_chunked_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-papers100M")
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GCN(128, 128, 172, num_layers=3), stats, "8x8xA100-ib200", strategy="tensor", chunks=4)
    assert p.program is None and p.prediction.step_time > 0 and p.ranks[0].sizes.chunks == 4


def test_chunked_all_to_alls_overlap_in_the_simulation() -> None:
    """The simulator runs posted all-to-alls as the runtime does: the next chunk's Forward starts
    before the previous chunk's split has ended, and only a reader waits for it; on ogbn-products
    (4 x A5000) that hides enough transfer time for the chunked plan to be predicted faster."""
    stats = gc.datasets.stats("ogbn-products")
    torch.manual_seed(0)
    model = gc.nn.GCN(stats.num_features, 256, stats.num_classes, num_layers=3)
    whole = gc.plan(model, stats, "4xA5000", strategy="tensor", chunks=1, verify=False)
    cut = gc.plan(model, stats, "4xA5000", strategy="tensor", chunks=4, verify=False)
    assert cut.prediction.step_time < whole.prediction.step_time
    events = cut.prediction.simulation.ranks[0].events
    forwards = [e for e in events if isinstance(e.instruction, Forward)]
    overlapped = []
    for a in events:
        if isinstance(a.instruction, AllToAll):
            b = next((f for f in forwards if f.index > a.index), None)  # the next Forward in program order
            if b is not None and b.start < a.end:
                overlapped.append((a, b))
    assert overlapped
    for a, b in overlapped:  # the overlapping Forward does not read what the all-to-all writes
        assert a.instruction.output not in cut.ranks[0].stages[b.instruction.stage].inputs or \
            b.instruction.chunk != a.instruction.chunk


def test_planner_takes_the_chunked_plan_under_a_memory_cap() -> None:
    """A device capacity between the chunked and the whole-graph plan's *predicted* peak: the
    planner rejects the whole-graph plan and returns a chunked one, which trains. (Measured peaks
    do not always follow the prediction at this size: benchmarks/RESULTS.md, "Tensor strategy:
    chunk pipeline".) Without dropout (a replicated dropout mask is drawn whole on every rank and
    kept for the step, which chunking does not shrink, predicted and measured: "Memory
    predictions") and with hidden 256, so the activations chunking splits outweigh the chunks'
    topology (each chunk graph holds its transposed structure; the whole symmetric graph does not)."""
    g = gc.datasets.synthetic("sbm", num_nodes=3000, avg_degree=10, num_features=32, num_classes=4, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(32, 256, 4, num_layers=2, dropout=0.0)
    base = gc.Cluster.parse("4xA5000")
    whole = gc.plan(copy.deepcopy(model), g, base, strategy="tensor", chunks=1, recompute=False)
    cut = gc.plan(copy.deepcopy(model), g, base, strategy="tensor", chunks=8, recompute=False)
    small, large = max(cut.prediction.peak_memory), max(whole.prediction.peak_memory)
    assert small < large
    capped = dataclasses.replace(base, device=dataclasses.replace(base.device, memory=(small + large) // 2),
                                 name="capped")
    chosen = gc.plan(copy.deepcopy(model), g, capped, strategy="tensor", recompute=False)
    assert chosen.options["chunks"] > 1 and max(chosen.prediction.peak_memory) <= capped.device.memory
    assert any(e.candidate.options["chunks"] == 1 and "does not fit" in e.rejected for e in chosen.search.rejected)
    res = chosen.run(epochs=2, timeout=120)
    assert all(math.isfinite(x) for x in res.history.loss)
    assert [r.bytes_sent for r in res.ranks] == chosen.predictions["bytes_sent"]
