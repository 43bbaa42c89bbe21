"""The ``layer`` strategy (GNNPipe, exact mode): runs of consecutive layers on different ranks, chunks
pipelined; one step equals single-device training."""

from __future__ import annotations

import copy
import math
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import PlanningError
from gnncompile.ir.plan import Recv, Send
from gnncompile.passes.layer import place_layers
from gnncompile.testing import check_plan
from graph_strategies import DT, sbm_graph, seeded_model, small_graphs

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcn3": lambda f, c: gc.nn.GCN(f, 4, c, num_layers=3, dropout=0.0),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    # its max saves its own output, which ends a stage that Free releases
    "sage_max": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0, aggr="max"),
    "gcnii8": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=8, dropout=0.5),
    "resgcn": lambda f, c: gc.nn.ResGCN(f, 6, c, num_layers=3, norm="layer"),
}


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(60)


@pytest.mark.parametrize("name", ["gcn", "sage", "sage_max", "gcnii8", "resgcn"])
def test_four_ranks_one_step_matches_single_device(sbm: gc.Graph, name: str) -> None:
    res = check_plan(seeded_model(MODELS[name], sbm), sbm, 4, strategy="layer", rtol=1e-9, atol=1e-11,
                     timeout=120, device="cpu")
    plan = res.plan
    assert plan.strategy == "layer" and plan.semantics == "exact" and not plan.relaxations
    assert plan.options["chunks"] == 16  # 4 per stage by default
    # measured bytes are the plan's prediction, rank by rank
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == plan.predictions["bytes_received"]
    # every rank runs a contiguous run of the tasks, in order
    runs = [sorted(s.index for s in dp.stages) for dp in plan.ranks]
    assert [s for run in runs for s in run] == list(range(len(plan.program[0].modules)))
    assert all(run == list(range(run[0], run[-1] + 1)) for run in runs)


#: models whose recomputed segments have several outputs (a tuple, read by getitem), one of them
#: read by a later task than the other
RECOMPUTED: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.5),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=4, dropout=0.5),
    "resgcn": MODELS["resgcn"],
}


@pytest.mark.parametrize("ranks, chunks", [(2, 1), (2, 4), (4, None)])
@pytest.mark.parametrize("name", sorted(RECOMPUTED))
def test_recompute_one_step_matches_single_device(sbm: gc.Graph, name: str, ranks: int, chunks: int) -> None:
    """``recompute=True``: a segment's tuple of outputs stays in the task computing it (its elements
    cross), so the option the strategy declares plans and one step is exact."""
    res = check_plan(seeded_model(RECOMPUTED[name], sbm), sbm, ranks, strategy="layer", recompute=True,
                     chunks=chunks, rtol=1e-9, atol=1e-11, timeout=120, device="cpu")
    plan = res.plan
    ops = [o for dp in plan.ranks for s in dp.stages for o in s.ops]
    assert any(o.startswith("recompute_") for o in ops)
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == plan.predictions["bytes_received"]


def test_recompute_trains_and_evaluates_as_single_device(sbm: gc.Graph) -> None:
    """Several epochs of GraphSAGE with ``recompute=True`` on 4 ranks: the losses and the accuracies
    (the evaluation model's ops run on the ranks holding their parameters) are ``gc.train``'s."""
    model = seeded_model(RECOMPUTED["sage"], sbm)
    ref = gc.train(copy.deepcopy(model), sbm, epochs=3, seed=0, lr=0.05, verbose=False)
    plan = gc.plan(copy.deepcopy(model), sbm, 4, strategy="layer", recompute=True, chunks=4)
    got = plan.run(epochs=3, seed=0, lr=0.05, timeout=60, device="cpu").history
    assert got.loss == pytest.approx(ref.loss, rel=1e-9)
    assert (got.train_acc, got.val_acc, got.test_acc) == (ref.train_acc, ref.val_acc, ref.test_acc)


def test_recompute_without_tuples_keeps_the_sunk_ops(sbm: gc.Graph) -> None:
    """GCN's recomputed segments have one output each: the same values cross as without recomputation."""
    gcn = gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 2, strategy="layer", chunks=4, recompute=True)
    assert any(o.startswith("recompute_") for dp in gcn.ranks for s in dp.stages for o in s.ops)
    plain = gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 2, strategy="layer", chunks=4)
    assert gcn.predictions["bytes_sent"] == plain.predictions["bytes_sent"]


def test_a_tuple_crossing_tasks_is_named_as_such(sbm: gc.Graph) -> None:
    """Split with sinking, GraphSAGE's recomputed segment would cross tasks as a tuple: the refusal
    says so (not "one value per edge")."""
    from gnncompile.passes.chunked import pipeline_sources
    from gnncompile.passes.layer import layer_decisions
    from gnncompile.passes.lower import split_stages
    from gnncompile.passes.recompute import insert_recomputation

    tp = insert_recomputation(gc.trace(seeded_model(RECOMPUTED["sage"], sbm), sbm, training=True))
    staged = split_stages(tp, layer_decisions(tp))
    labels = {s.index: ("cols" if "P" in s.kinds else "rows") for s in staged.stages}
    with pytest.raises(PlanningError, match=r"'recompute_0' .* is a tuple of several values") as err:
        pipeline_sources(tp, staged, labels, "layer")
    assert "per edge" not in str(err.value)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), ranks=st.integers(2, 3), chunks=st.integers(1, 4))
def test_one_step_matches_single_device(g: gc.Graph, ranks: int, chunks: int) -> None:
    check_plan(seeded_model(MODELS["gcn3"], g), g, ranks, strategy="layer", chunks=min(chunks, g.num_nodes),
               rtol=1e-9, atol=1e-11, timeout=60, device="cpu")


def test_only_the_stage_boundaries_cross_ranks(sbm: gc.Graph) -> None:
    """GCN-2 on 2 ranks: the one value crossing is the hidden state (forward) and its gradient
    (backward), each vertex's row once per direction: 2 N H elements, whatever the graph."""
    plan = gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 2, strategy="layer", chunks=4)
    crossing = {i.value for dp in plan.ranks for i in dp.instructions if isinstance(i, (Send, Recv))}
    assert len(crossing) == 1
    v = crossing.pop()
    width = next(i.shape[-1] for i in plan.ranks[0].instructions if isinstance(i, Send))
    total = sum(plan.predictions["bytes_sent"])
    assert total == 2 * sbm.num_nodes * width * torch.finfo(DT).bits // 8, v


def test_placement_balances_contiguous_runs() -> None:
    place = place_layers({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}, 2)
    assert place.stage_group == {0: 0, 1: 0, 2: 0, 3: 1}
    assert [g.members for g in place.groups] == [(0,), (1,)]
    with pytest.raises(PlanningError, match="5 pipeline stages but the model has 4 tasks"):
        place_layers({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}, 5)
    hybrid = place_layers({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}, 2, group_size=3)
    assert [(g.members, g.layout) for g in hybrid.groups] == [((0, 1, 2), "chunks"), ((3, 4, 5), "chunks")]


def test_refusals(sbm: gc.Graph) -> None:
    with pytest.raises(PlanningError, match="at least 2 ranks"):
        gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 1, strategy="layer")
    with pytest.raises(PlanningError, match="tasks"):
        gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 8, strategy="layer")


def test_the_planner_considers_layer(sbm: gc.Graph) -> None:
    p = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, "4xA5000")
    assert "layer" in {e.candidate.strategy for e in p.search.ranked}
    # stage counts (one per rank, GNNPipe's hybrid) and chunk counts are searched
    layer = [e.candidate.options for e in p.search.ranked + p.search.rejected if e.candidate.strategy == "layer"]
    assert {(o["stages"], o["chunks"]) for o in layer} == {(None, None), (None, 8), (2, None), (2, 8)}
    # explain states GNNPipe's rule with the plans' own numbers
    rule = next(line for line in p.search.why() if "GNNPipe's rule" in line)
    data = next(e for e in p.search.ranked if e.candidate.strategy == "data")
    alpha = data.plan.info["partition"]["replication_factor"] - 1
    assert f"alpha_g = {alpha:.2f}" in rule and "L = 3 propagations, S_p = 4" in rule
    assert rule.rstrip(")").endswith(("so data", "so layer")) or "the rule leaves out" in rule


def test_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-products")
    m = gc.nn.GCNII(stats.num_features, 64, stats.num_classes, num_layers=16)
    plan = gc.plan(m, stats, "4xA100", strategy="layer")
    assert plan.options["chunks"] == 16 and plan.prediction.step_time > 0
    assert len({g for g in plan.info["groups"]}) == 4


# --------------------------------------------------------------------------- relaxed: historical embeddings
def test_history_with_one_chunk_is_exact(sbm: gc.Graph) -> None:
    """With one chunk no chunk is computed later than its reader: nothing comes from history."""
    res = check_plan(seeded_model(MODELS["gcn3"], sbm), sbm, 3, strategy="layer", chunks=1, history=True,
                     semantics="relaxed", rtol=1e-9, atol=1e-11, timeout=60, device="cpu")
    assert not res.plan.relaxations


def test_history_reads_later_chunks_stale_and_overlaps_the_stages(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["gcn3"], sbm)
    exact = gc.plan(model, sbm, 2, strategy="layer", chunks=4)
    plan = gc.plan(model, sbm, 2, strategy="layer", chunks=4, history=True, semantics="relaxed")
    assert plan.semantics == "relaxed" and "historical embeddings" in plan.relaxations[0]
    stale_stages = [s for dp in plan.ranks for s in dp.stages if s.stale]
    assert stale_stages
    for s in stale_stages:
        for name, stale in s.stale:
            fresh = dict(s.reads)[name]
            for j in range(4):  # earlier chunks fresh, later ones from history
                assert all(k <= j for k in fresh[j]) and all(k > j for k in stale[j])
    # the second rank's first propagation no longer waits for the first rank's last chunk
    second = plan.info["groups"]
    first_on_1 = min(s.index for s in plan.ranks[1].stages)
    last_on_0 = max(s.index for s in plan.ranks[0].stages)
    order, order_exact = plan.info["task_order"], exact.info["task_order"]
    assert order.index(f"F{first_on_1}c0") < order.index(f"F{last_on_0}c3"), second
    assert order_exact.index(f"F{first_on_1}c0") > order_exact.index(f"F{last_on_0}c3")
    with pytest.raises(PlanningError, match="semantics='relaxed'"):
        gc.plan(model, sbm, 2, strategy="layer", history=True)
    with pytest.raises(PlanningError, match="history_refresh applies to history=True"):
        gc.plan(model, sbm, 2, strategy="layer", history=False, history_refresh=2, semantics="relaxed")


def test_history_refresh_keeps_the_copies(sbm: gc.Graph) -> None:
    """Step 0 reads zeros for later chunks either way; step 1 reads step 0's copies when refreshed
    every step, still zeros when refreshed every 2 steps (stored at step 2 first)."""
    def losses(**kw: object) -> list[float]:
        plan = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 2, strategy="layer", chunks=4, history=True,
                       semantics="relaxed", **kw)
        return plan.run(epochs=3, seed=0, timeout=60, device="cpu").history.loss

    every, second = losses(), losses(history_refresh=2)
    assert every[0] == second[0]
    assert every[1] != second[1]
    assert all(torch.isfinite(torch.tensor(every + second)))


def test_gcnii_sends_x0_once_per_rank_not_one_product_per_layer(sbm: gc.Graph) -> None:
    """GCNII's ``alpha * x0`` sinks beside its layer: rank 0 sends the hidden state to rank 1 and
    ``x0`` to each later rank, one message per chunk each, whatever the depth."""
    for layers in (4, 8):
        plan = gc.plan(seeded_model(lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=layers, dropout=0.0), sbm), sbm,
                       4, strategy="layer", chunks=2)
        sent = {(i.peer, i.value) for i in plan.ranks[0].instructions if isinstance(i, Send) and not i.grad}
        per_peer = {peer: sum(1 for p, _ in sent if p == peer) for peer, _ in sent}
        assert set(per_peer) == {1, 2, 3} and max(per_peer.values()) <= 2, sent
        assert len({v for _, v in sent}) == 2  # x0 and the first hidden state


@pytest.mark.parametrize("name", ["gcn3", "sage"])
def test_sparse_features(sbm: gc.Graph, name: str) -> None:
    """Sparse input features stay sparse: a T op or a propagation reads its chunks' rows of them."""
    sparse = sbm.replace(x=sbm.x.to_sparse_csr())
    check_plan(seeded_model(MODELS[name], sbm), sparse, 2, strategy="layer", rtol=1e-9, atol=1e-11, timeout=60, device="cpu")


# --------------------------------------------------------------------------- METIS chunks
@pytest.mark.parametrize("name", ["gcn", "gcnii8"])
def test_metis_chunks_are_exact(sbm: gc.Graph, name: str) -> None:
    """GNNPipe's locality-aware chunks renumber the vertices part by part; features, replicated
    dropout masks and scored rows keep the original ids, so one step still equals single-device."""
    res = check_plan(seeded_model(MODELS[name], sbm), sbm, 4, strategy="layer", chunking="metis", rtol=1e-9,
                     atol=1e-11, timeout=120, device="cpu")
    assert res.plan.info["chunking"] == "metis" and sum(res.plan.info["chunk_rows"]) == sbm.num_nodes
    assert [r.bytes_sent for r in res.ranks] == res.plan.predictions["bytes_sent"]


def test_metis_chunks_read_fewer_chunks(sbm: gc.Graph) -> None:
    """On a graph with communities, METIS chunks keep most in-edges inside: a chunk's propagation
    reads fewer other chunks than with contiguous ranges of (shuffled) ids."""
    model = seeded_model(MODELS["gcn"], sbm)

    def reads(**kw: object) -> int:
        plan = gc.plan(model, sbm, 2, strategy="layer", chunks=6, **kw)
        return sum(len(r) for dp in plan.ranks for s in dp.stages for _, rd in s.reads for r in rd)

    assert reads(chunking="metis") < reads(chunking="contiguous")


@pytest.mark.parametrize("gpus,options", [(2, dict(chunking="metis")), (4, dict(stages=2)),
                                          (4, dict(stages=2, chunking="metis"))], ids=["metis", "hybrid", "hybrid-metis"])
def test_reordered_chunks_replicate_attention_dropout(sbm: gc.Graph, gpus: int, options: dict) -> None:
    """METIS chunks and hybrid stages renumber the vertices, and with them the edges: a chunk's
    attention-dropout entries are looked up by the original edge ids (and self loops by the
    original vertex ids), so a GAT with attention dropout is exact. They were refused."""
    gat = seeded_model(lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.5), sbm)
    res = check_plan(gat, sbm, gpus, strategy="layer", rtol=1e-9, atol=1e-11, timeout=120, device="cpu", **options)
    assert res.plan.semantics == "exact" and res.plan.info["chunking"] == options.get("chunking", "contiguous")
    assert [r.bytes_sent for r in res.ranks] == res.plan.predictions["bytes_sent"]


def _seed_drawing(order: list[int], chunks: int) -> int:
    """A plan seed whose chunk shuffling draws ``order`` in step 0."""
    from gnncompile.graph.regroup import ChunkRegrouping

    g = gc.datasets.synthetic("sbm", num_nodes=chunks, avg_degree=1, num_features=1, num_classes=1, seed=0)
    bounds = tuple(range(chunks + 1))
    return next(s for s in range(100) if ChunkRegrouping(g, bounds, bounds, s).chunk_order(0).tolist() == order)


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_chunk_shuffling_processes_the_chunks_in_the_drawn_order(sbm: gc.Graph, order: list[int]) -> None:
    """GNNPipe's chunk shuffling: a step processes the chunks in its drawn order, so step 0 of a
    shuffled plan whose draw is ``order`` is step 0 of the unshuffled plan on the graph with its
    chunks renumbered in that order (zeros from history either way)."""
    seed = _seed_drawing(order, 2)
    half = sbm.num_nodes // 2
    perm = torch.cat([torch.arange(c * half, (c + 1) * half) for c in order])
    shuffled = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 2, strategy="layer", chunks=2, history=True,
                       shuffle=True, seed=seed, semantics="relaxed")
    assert "chunk shuffling" in shuffled.relaxations[0]
    plain = gc.plan(seeded_model(MODELS["gcn3"], sbm), gc.graph.reorder.permute(sbm, perm), 2, strategy="layer",
                    chunks=2, history=True, semantics="relaxed")
    a = shuffled.run(epochs=1, seed=0, timeout=60, device="cpu").history.loss
    b = plain.run(epochs=1, seed=0, timeout=60, device="cpu").history.loss
    assert a[0] == pytest.approx(b[0], rel=1e-12, abs=0)
    # every slot reads every slot: the earlier fresh, the later ones from history
    stale = [dict(s.stale) for dp in shuffled.ranks for s in dp.stages if s.stale]
    assert stale and all(per[0] == (1,) and per[1] == () for d in stale for per in d.values())


def test_chunk_shuffling_draws_a_new_order_every_step(sbm: gc.Graph) -> None:
    losses = {}
    for shuffle in (False, True):
        plan = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 2, strategy="layer", chunks=4, history=True, shuffle=shuffle, seed=3,
                       semantics="relaxed")
        losses[shuffle] = plan.run(epochs=4, seed=0, timeout=60, device="cpu").history.loss
    assert losses[True] != losses[False]
    assert all(torch.isfinite(torch.tensor(losses[True])))
    with pytest.raises(PlanningError, match="shuffle applies to history=True"):
        gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 2, strategy="layer", history=False, shuffle=True,
                semantics="relaxed")


def test_historical_gradients_reach_the_next_step(sbm: gc.Graph) -> None:
    """Step 0 has no gradients from history; from step 1 on the stale readers' gradients of step 0
    are added (GNNPipe's ablation of its "no historical gradients")."""
    def losses(**kw: object) -> list[float]:
        plan = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 2, strategy="layer", chunks=4, history=True, semantics="relaxed", **kw)
        return plan.run(epochs=3, seed=0, timeout=60, device="cpu").history.loss

    dropped, kept = losses(), losses(historical_gradients=True)
    assert dropped[0] == kept[0] and dropped[1] == kept[1]  # step 1's loss is computed before its gradients
    assert dropped[2] != kept[2]


# --------------------------------------------------------------------------- hybrid layer x data (GNNPipe §3.5)
@pytest.mark.parametrize("name,stages,chunking", [("gcn3", 2, "contiguous"), ("gcnii8", 2, "metis"),
                                                  ("resgcn", 2, "contiguous"), ("sage", 1, "metis")])
def test_hybrid_one_step_matches_single_device(sbm: gc.Graph, name: str, stages: int, chunking: str) -> None:
    """``stages=S`` on 4 ranks: S groups of 4/S ranks, member i of every group runs partition i's
    chunks; chunks read across partitions come from the member running them. Exact."""
    res = check_plan(seeded_model(MODELS[name], sbm), sbm, 4, strategy="layer", stages=stages, chunks=8,
                     chunking=chunking, rtol=1e-9, atol=1e-11, timeout=120, device="cpu")
    plan = res.plan
    assert plan.info["stages"] == stages and plan.info["group_size"] == 4 // stages
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    groups = list(plan.info["groups"].values())
    assert len(groups) == stages and all(len(g) == 4 // stages for g in groups)
    for g in groups:  # a group's members run the same stages on disjoint chunks
        runs = [set(dict.fromkeys(i.chunk for i in plan.ranks[r].instructions if type(i).__name__ == "Forward"))
                for r in g]
        assert {s.index for s in plan.ranks[g[0]].stages} == {s.index for s in plan.ranks[g[-1]].stages}
        assert all(not (a & b) for i, a in enumerate(runs) for b in runs[i + 1:])


def _two_components(g: gc.Graph) -> gc.Graph:
    """``g`` without the edges between its two halves (the halves are its connected parts)."""
    half = g.num_nodes // 2
    dst, src = g.dst, g.indices
    keep = (dst < half) == (src < half)
    indptr = torch.zeros(g.num_nodes + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst[keep], minlength=g.num_nodes), 0, out=indptr[1:])
    return g.replace(indptr=indptr, indices=src[keep])


def test_hybrid_bytes_are_the_formula_without_cut_edges(sbm: gc.Graph) -> None:
    """GNNPipe §3.5: ``2 alpha_h L N H + 2 (S - 1) N H``. With two partitions and no edge between
    them (alpha_h = 0) a GCN-2 on 2 stages x 2 partitions sends only the stage boundary."""
    g = _two_components(sbm)
    plan = gc.plan(seeded_model(MODELS["gcn"], g), g, 4, strategy="layer", stages=2, chunks=4)
    width = next(i.shape[-1] for dp in plan.ranks for i in dp.instructions if isinstance(i, Send))
    expected = gc.cost_models.formulas.comm_layer_hybrid(0, 2, g.num_nodes, width, 2, elsize=8)

    def activation_bytes(p: gc.Plan) -> int:  # the formula leaves out the groups' gradient all-reduce
        return sum(math.prod(i.shape) * 8 for dp in p.ranks for i in dp.instructions if isinstance(i, Send))

    assert activation_bytes(plan) == expected
    # with the cut edges back, the partitions exchange the chunks their in-edges read
    assert activation_bytes(gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 4, strategy="layer", stages=2,
                                    chunks=4)) > expected


def test_hybrid_degenerates(sbm: gc.Graph) -> None:
    """One rank per stage is the pure layer plan; the group size must divide the ranks and the
    chunks; chunk shuffling is refused across partitions."""
    model = seeded_model(MODELS["gcn3"], sbm)
    a = gc.plan(model, sbm, 2, strategy="layer", chunks=4)
    b = gc.plan(model, sbm, 2, strategy="layer", chunks=4, stages=2)
    assert [dp.instructions for dp in a.ranks] == [dp.instructions for dp in b.ranks]
    with pytest.raises(PlanningError, match="cannot form 3 equal stage groups"):
        gc.plan(model, sbm, 4, strategy="layer", stages=3)
    with pytest.raises(PlanningError, match="cannot be dealt evenly"):
        gc.plan(model, sbm, 4, strategy="layer", stages=2, chunks=5)
    with pytest.raises(PlanningError, match="chunk shuffling with the hybrid"):
        gc.plan(model, sbm, 4, strategy="layer", stages=2, history=True, shuffle=True, semantics="relaxed")


def test_hybrid_with_history_runs(sbm: gc.Graph) -> None:
    plan = gc.plan(seeded_model(MODELS["gcnii8"], sbm), sbm, 4, strategy="layer", stages=2, chunks=8,
                   history=True, semantics="relaxed")
    res = plan.run(epochs=3, seed=0, timeout=120, device="cpu")
    assert all(torch.isfinite(torch.tensor(res.history.loss)))
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]


def test_one_f_one_b_interleaves_where_dependencies_allow(sbm: gc.Graph) -> None:
    """1F1B runs a ready backward before a ready forward: the last rank of a GCN-3 pipeline (a
    propagation and the dense output layer) alternates once chunk 0's backward is ready, where
    GPipe's order runs every forward first; the step stays exact."""
    def compute(plan: gc.Plan, rank: int) -> list[str]:
        return [str(i) for i in plan.ranks[rank].instructions if type(i).__name__ in ("Forward", "Backward")]

    kw = dict(strategy="layer", chunks=4, history=True, semantics="relaxed")
    gpipe = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 3, **kw)
    res = check_plan(seeded_model(MODELS["gcn3"], sbm), sbm, 3, schedule="1f1b", rtol=1e-9, atol=1e-11, timeout=60,
                     device="cpu", **{**kw, "semantics": "exact", "history": False})
    f1b1 = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, 3, schedule="1f1b", **kw)
    assert "1F1B" in str(f1b1.schedule) and "1F1B" in str(res.plan.schedule)
    a, b = compute(gpipe, 2), compute(f1b1, 2)
    first_backward = lambda order: next(i for i, t in enumerate(order) if t.startswith("B"))  # noqa: E731
    last_forward = lambda order: max(i for i, t in enumerate(order) if t.startswith("F"))  # noqa: E731
    assert first_backward(a) > last_forward(a)
    assert first_backward(b) < last_forward(b)
    assert sorted(a) == sorted(b)


def test_history_memory_does_not_grow_with_the_chunks() -> None:
    """Each chunk's propagation reads a whole-width concatenation (fresh and historical chunks); a
    propagation keeps nothing of it for backward, so it is released after its last reader instead
    of living until the chunk's backward: the peak stays flat as the chunks multiply (it doubled
    from 4 to 16 chunks when every concatenation lived until backward)."""
    g = sbm_graph(400)
    peaks = {}
    for k in (4, 16):
        plan = gc.plan(seeded_model(lambda f, c: gc.nn.GCN(f, 64, c, num_layers=3, dropout=0.0), g), g, 2,
                       strategy="layer", chunks=k, history=True, semantics="relaxed")
        peaks[k] = [r.peak_memory for r in plan.run(epochs=1, seed=0, timeout=60, device="cpu").ranks]
    assert all(b < 1.25 * a for a, b in zip(peaks[4], peaks[16])), peaks
