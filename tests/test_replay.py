"""The plan replay engine (gnncompile.ir.replay): timings worked out by hand, and the verifier's dry run
and the simulator being the same replay (same rounds under unit costs, same deadlock error)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from gnncompile.cost_models.simulate import Cost, simulate
from gnncompile.errors import VerificationError
from gnncompile.ir.plan import AllReduce, DevicePlan, Forward, Instruction, OptimizerStep, Plan, Recv, Send, StageSpec
from gnncompile.ir.replay import ReplayEvent, replay
from gnncompile.ir.verify_plan import verify_plan
from test_plan import a2a_plan, halo_plan, pipeline_plan

F, OPT = Forward, OptimizerStep


def plan_of(*ranks: tuple[Instruction, ...], stages: tuple[StageSpec, ...] = ()) -> Plan:
    return Plan("test", "exact", {}, "cpu", [DevicePlan(r, stages, insts) for r, insts in enumerate(ranks)])


def unit(rank: int, inst: Instruction) -> Cost:
    return Cost(1.0)


def rounds(events: list[list], start: str = "start") -> list[list[tuple[int, int]]]:
    """Sites grouped by start time, by rank then index (PlanReport.steps' definition)."""
    by: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for row in events:
        for e in row:
            by[getattr(e, start)].append((e.rank, e.index))
    return [by[t] for t in sorted(by)]


def test_eager_send_instant_recv_and_collective_at_the_slowest_member() -> None:
    group = (0, 1)
    plan = plan_of((F(0), Send("h", 0, 1), AllReduce("grads", group, numel=8)),
                   (Recv("h", 0, 0), AllReduce("grads", group, numel=8)),
                   stages=(StageSpec(0, ("x",), ("h",), ("lin",)),))
    seconds = {(0, 0): 3.0, (0, 1): 1.0, (0, 2): 1.0, (1, 0): 5.0, (1, 1): 2.0}
    events = replay(plan, lambda r, i: seconds[r, i], stream=lambda r, i: "comm" if i else "compute")
    # F [0,3]; SEND [3,4]; the RECV, ready at 0, ends with the SEND at 4 and takes no time of its own
    # (its 5 s are ignored); AR ready on both at 4, runs max(1, 2) = 2 s on both
    assert events == [
        [ReplayEvent(0, 0, "compute", 0.0, 0.0, 3.0), ReplayEvent(0, 1, "comm", 3.0, 3.0, 4.0),
         ReplayEvent(0, 2, "comm", 4.0, 4.0, 6.0)],
        [ReplayEvent(1, 0, "compute", 0.0, 4.0, 4.0), ReplayEvent(1, 1, "comm", 4.0, 4.0, 6.0)],
    ]


@pytest.mark.parametrize("make", [pipeline_plan, a2a_plan, halo_plan])
def test_dry_run_is_the_unit_cost_simulation(make) -> None:
    plan = make()
    report = verify_plan(plan)
    sim = simulate(plan, unit)
    assert report.steps == rounds([r.events for r in sim.ranks])
    assert report.steps == rounds(replay(plan, lambda r, i: 1.0))
    assert report.num_rounds == len(report.steps) and sorted(report.order) == sorted(
        (dp.rank, i) for dp in plan.ranks for i in range(len(dp.instructions)))


def test_verifier_and_simulator_raise_the_same_deadlock() -> None:
    groups = {0: ((0, 1), (0, 2)), 1: ((1, 2), (0, 1)), 2: ((0, 2), (1, 2))}
    plan = plan_of(*(tuple(AllReduce("grads", g, numel=8) for g in groups[r]) + (OPT(),) for r in range(3)))
    with pytest.raises(VerificationError) as verified:
        verify_plan(plan)
    with pytest.raises(VerificationError) as simulated:
        simulate(plan, unit)
    msg = str(verified.value)
    assert msg == str(simulated.value)
    assert msg.splitlines()[:4] == [
        "deadlock: no rank can advance after 0 of 9 instructions completed",
        "  rank 0 at step 0 `AR grads` waits for group (0, 1): rank 1, which is at step 0 `AR grads` over group (1, 2)",
        "  rank 1 at step 0 `AR grads` waits for group (1, 2): rank 2, which is at step 0 `AR grads` over group (0, 2)",
        "  rank 2 at step 0 `AR grads` waits for group (0, 2): rank 0, which is at step 0 `AR grads` over group (0, 1)",
    ]
    assert "  rank 2:\n    >>    0  AR grads" in msg


def test_deadlock_names_a_wait_for_the_ranks_own_step() -> None:
    # overlapped streams: rank 0's Forward needs what its stuck RECV receives
    stages = (StageSpec(0, ("a",), ("h",), ("lin",)),)
    plan = plan_of((Recv("a", 0, 1), F(0), Send("b", 0, 1)), (Recv("b", 0, 0), Send("a", 0, 0)), stages=stages)
    comm = {"SEND", "RECV"}
    with pytest.raises(VerificationError) as e:
        replay(plan, lambda r, i: 1.0, overlap=True,
               stream=lambda r, i: "comm" if plan.ranks[r].instructions[i].kind in comm else "compute")
    assert str(e.value).splitlines()[:4] == [
        "deadlock: no rank can advance after 0 of 5 instructions completed",
        "  rank 0 at step 0 `RECV a c0 <-1` waits for a SEND from rank 1, which is at step 0 `RECV b c0 <-0`",
        "  rank 0 at step 1 `F0c0` waits for its own step 0 `RECV a c0 <-1`",
        "  rank 1 at step 0 `RECV b c0 <-0` waits for a SEND from rank 0, which is at step 0 `RECV a c0 <-1`",
    ]
