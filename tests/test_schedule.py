"""The one list scheduler and the communication passes of :mod:`gnncompile.passes.schedule`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc

from gnncompile.errors import PlanningError
from graph_strategies import sbm_graph
from gnncompile.ir.plan import Backward, Forward, HaloExchange, Instruction
from gnncompile.passes.data import data_decisions
from gnncompile.passes.lower import Conversion, split_stages
from gnncompile.passes.schedule import compute_deps, insert_collectives, list_schedule, rank_orders


@pytest.fixture(scope="module")
def graph() -> gc.Graph:
    return sbm_graph(60)


def _staged(graph: gc.Graph, layers: int):
    torch.manual_seed(0)
    tp = gc.trace(gc.nn.GCN(6, 8, 3, num_layers=layers, dropout=0.0).double(), graph)
    return split_stages(tp, data_decisions(tp))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_unchunked_single_group_is_forwards_then_backwards_in_reverse(graph: gc.Graph, layers: int) -> None:
    staged = _staged(graph, layers)
    S = len(staged.stages)
    assert S == layers + 1  # a stage boundary at every halo exchange
    order = [t for _, t in list_schedule(compute_deps(staged))]
    assert order == [Forward(s) for s in range(S)] + [Backward(s) for s in reversed(range(S))]
    assert [t for _, t in list_schedule(compute_deps(staged, training=False))] == [Forward(s) for s in range(S)]


def test_collectives_follow_producer_and_gradients_follow_last_reader(graph: gc.Graph) -> None:
    staged = _staged(graph, 2)

    def convert(c: Conversion, chunk: int, grad: bool) -> list[Instruction]:
        return [HaloExchange(c.value, chunk, (0,), (0,), (0,), 1, grad=grad)]

    prog = insert_collectives(staged, list_schedule(compute_deps(staged)), convert)
    text = [("H'" if isinstance(i, HaloExchange) and i.grad else "H" if isinstance(i, HaloExchange) else str(i))
            for i in prog]
    assert text == ["F0c0", "H", "F1c0", "H", "F2c0", "B2c0", "H'", "B1c0", "H'", "B0c0"]
    halos = [i for i in prog if isinstance(i, HaloExchange)]
    # forward in the order found, gradients in reverse
    assert [h.value for h in halos[:2]] == [c.value for c in staged.conversions]
    assert [h.value for h in halos[2:]] == [c.value for c in reversed(staged.conversions)]


def test_list_schedule_one_resource_serializes_and_respects_costs() -> None:
    deps = {Forward(0, 0): set(), Forward(0, 1): set(), Forward(1, 0): {Forward(0, 0)}}
    order = list_schedule(deps, cost={Forward(0, 0): 2.0})
    assert order == [(0.0, Forward(0, 0)), (2.0, Forward(1, 0)), (3.0, Forward(0, 1))]


def test_list_schedule_delay_lets_another_task_in() -> None:
    # with a delay between stage 0 and stage 1, chunk 1's stage 0 runs while chunk 0's data travels
    deps = {Forward(0, 0): set(), Forward(0, 1): set(), Forward(1, 0): {Forward(0, 0)}, Forward(1, 1): {Forward(0, 1)}}
    order = [str(t) for _, t in list_schedule(deps, delay=lambda d, t: 1.0)]
    assert order == ["F0c0", "F0c1", "F1c0", "F1c1"]
    assert [str(t) for _, t in list_schedule(deps)] == ["F0c0", "F1c0", "F0c1", "F1c1"]


def test_list_schedule_refuses_unknown_dependencies() -> None:
    with pytest.raises(PlanningError, match="not a task of the step"):
        list_schedule({Forward(1, 0): {Forward(0, 0)}})


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 4), chunks=st.integers(1, 4), groups=st.integers(1, 3), seed=st.integers(0, 99))
def test_list_schedule_is_a_valid_schedule(stages: int, chunks: int, groups: int, seed: int) -> None:
    """Chain of stages per chunk, stage s on resource s % groups, random costs: every task starts after
    its dependencies end and no two tasks overlap on one resource."""
    rng = torch.Generator().manual_seed(seed)
    deps: dict = {}
    for k in range(chunks):
        for s in range(stages):
            deps[Forward(s, k)] = {Forward(s - 1, k)} if s else set()
        for s in range(stages):
            deps[Backward(s, k)] = {Forward(s, k)} | ({Backward(s + 1, k)} if s + 1 < stages else set())
    cost = {t: float(torch.randint(1, 5, (1,), generator=rng)) for t in deps}
    order = list_schedule(deps, lambda t: t.stage % groups, cost)
    assert sorted(map(str, (t for _, t in order))) == sorted(map(str, deps))
    start = {t: s for s, t in order}
    for t, ds in deps.items():
        for d in ds:
            assert start[t] >= start[d] + cost[d]
    busy: dict = {}
    for s, t in order:
        busy.setdefault(t.stage % groups, []).append((s, s + cost[t]))
    for spans in busy.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    per_rank = rank_orders(order, lambda t: [t.stage % groups])
    assert sum(map(len, per_rank.values())) == len(deps)


def test_a_step_posting_more_messages_than_the_planner_simulates_is_refused(monkeypatch) -> None:
    """The planner materializes and simulates every message of a candidate's step; a step over
    schedule.MAX_MESSAGES is a PlanningError naming the budget (the search records it as the
    candidate's rejection), not minutes of work or an exhausted host."""
    import gnncompile as gc
    from gnncompile.errors import PlanningError
    from gnncompile.passes import schedule

    g = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=6, num_features=8, num_classes=3, seed=0)
    model = gc.nn.GCN(8, 8, 3, num_layers=2)
    plan = gc.plan(model, g, gpus=4, strategy="mop", chunks=4)
    sends = sum(type(i).__name__ == "Send" for dp in plan.ranks for i in dp.instructions)
    monkeypatch.setattr(schedule, "MAX_MESSAGES", sends - 1)
    with pytest.raises(PlanningError, match=f"more than {sends - 1:,} point-to-point messages"):
        gc.plan(model, g, gpus=4, strategy="mop", chunks=4)
    monkeypatch.setattr(schedule, "MAX_MESSAGES", sends)
    gc.plan(model, g, gpus=4, strategy="mop", chunks=4)
