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
