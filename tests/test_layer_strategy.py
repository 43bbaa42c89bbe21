"""The ``layer`` strategy (GNNPipe, exact mode): runs of consecutive layers on different ranks, chunks
pipelined; one step equals single-device training."""

from __future__ import annotations

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
    "gcnii8": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=8, dropout=0.5),
    "resgcn": lambda f, c: gc.nn.ResGCN(f, 6, c, num_layers=3, norm="layer"),
}


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(60)


@pytest.mark.parametrize("name", ["gcn", "sage", "gcnii8", "resgcn"])
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
    with pytest.raises(PlanningError, match="5 ranks but the model has 4 tasks"):
        place_layers({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}, 5)


def test_refusals(sbm: gc.Graph) -> None:
    with pytest.raises(PlanningError, match="at least 2 ranks"):
        gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 1, strategy="layer")
    with pytest.raises(PlanningError, match="tasks"):
        gc.plan(seeded_model(MODELS["gcn"], sbm), sbm, 8, strategy="layer")


def test_the_planner_considers_layer(sbm: gc.Graph) -> None:
    p = gc.plan(seeded_model(MODELS["gcn3"], sbm), sbm, "4xA5000")
    assert "layer" in {e.candidate.strategy for e in p.search.ranked}


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


def test_metis_chunks_refuse_edge_space_dropout(sbm: gc.Graph) -> None:
    gat = seeded_model(lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.5), sbm)
    with pytest.raises(PlanningError, match="dropout"):
        gc.plan(gat, sbm, 2, strategy="layer", chunking="metis")
