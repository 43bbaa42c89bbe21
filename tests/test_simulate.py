"""The plan simulator on small hand-built plans whose timelines are worked out by hand."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import pytest

from gnncompile.cost_models.simulate import Cost, Simulation, simulate
from gnncompile.errors import VerificationError
from gnncompile.ir.plan import (
    AllReduce,
    Backward,
    DevicePlan,
    Forward,
    HaloExchange,
    Instruction,
    OptimizerStep,
    Plan,
    Recv,
    Send,
    StageSpec,
)
from gnncompile.ir.verify_plan import verify_plan

F, B, OPT = Forward, Backward, OptimizerStep
COMM = {"SEND", "RECV", "HALO", "A2A", "AG", "RS", "AR"}


def make_plan(ranks: Sequence[Sequence[Instruction]], stages: Optional[Sequence[Sequence[StageSpec]]] = None,
              chunks: int = 1) -> Plan:
    stages = stages or [(StageSpec(index=0, inputs=("x",), outputs=("h",), ops=("h",)),)] * len(ranks)
    return Plan(strategy="test", semantics="exact", options={"chunks": chunks}, cluster="test",
                ranks=[DevicePlan(rank=r, stages=tuple(stages[r]), instructions=tuple(insts))
                       for r, insts in enumerate(ranks)])


def table(durations: dict, default: float = 0.0, **extra: Cost):
    """A cost function: ``durations`` by ``str(instruction)`` or ``(rank, str(instruction))``."""
    def cost(rank: int, inst: Instruction) -> Cost:
        label = str(inst)
        if (rank, label) in extra or label in extra:
            return extra.get((rank, label), extra.get(label))
        sec = durations.get((rank, label), durations.get(label, default))
        return Cost(sec, "comm" if inst.kind in COMM else "compute")
    return cost


def test_single_rank_sequential() -> None:
    plan = make_plan([[F(0), B(0), OPT()]])
    sim = simulate(plan, table({"F0c0": 1.0, "B0c0": 2.0, "OPT": 0.5}))
    assert sim.step_time == 3.5
    (r,) = sim.ranks
    assert (r.compute, r.comm, r.wait, r.idle) == (3.5, 0.0, 0.0, 0.0)
    assert [(e.label, e.start, e.end) for e in r.events] == [("F0c0", 0, 1), ("B0c0", 1, 3), ("OPT", 3, 3.5)]
    assert sim.bubble_fraction == 0.0 and sim.critical_rank == 0
    assert sim.time_by_kind() == {"F": 1.0, "B": 2.0, "OPT": 0.5}
    assert "rank" in sim.summary() and "3500.000" in sim.summary()


def two_stage_pipeline() -> Plan:
    s0 = (StageSpec(index=0, inputs=("x",), outputs=("h",), ops=("h",)),)
    s1 = (StageSpec(index=1, inputs=("h",), outputs=("out",), ops=("out",)),)
    r0 = [F(0, 0), Send("h", 0, 1), F(0, 1), Send("h", 1, 1),
          Recv("h", 0, 1, grad=True), B(0, 0), Recv("h", 1, 1, grad=True), B(0, 1), OPT()]
    r1 = [Recv("h", 0, 0), F(1, 0), Recv("h", 1, 0), F(1, 1),
          B(1, 0), Send("h", 0, 0, grad=True), B(1, 1), Send("h", 1, 0, grad=True), OPT()]
    return make_plan([r0, r1], [s0, s1], chunks=2)


def test_two_stage_pipeline() -> None:
    plan = two_stage_pipeline()
    verify_plan(plan)
    cost = table({"F0c0": 1, "F0c1": 1, "F1c0": 1, "F1c1": 1, "B0c0": 2, "B0c1": 2, "B1c0": 2, "B1c1": 2,
                  "OPT": 0.5}, default=0.5)  # every send/recv 0.5 s
    sim = simulate(plan, cost)
    # eager sends: a Send runs its 0.5 s when ready; its Recv ends when the data is there (0 s itself)
    # r0: F[0,1] S[1,1.5] F[1.5,2.5] S[2.5,3] R(ready 3)[6.5,6.5] B[6.5,8.5] R(ready 8.5)[9,9] B[9,11] OPT[11,11.5]
    # r1: R(ready 0)[1.5,1.5] F[1.5,2.5] R(ready 2.5)[3,3] F[3,4] B[4,6] S[6,6.5] B[6.5,8.5] S[8.5,9] OPT[9,9.5]
    assert sim.step_time == 11.5
    r0, r1 = sim.ranks
    assert r1.wait == 2.0  # the initial bubble (F0c0 and its send on rank 0), then chunk 1's send
    assert r1.events[0].wait_start == 0.0 and r1.events[0].start == 1.5
    assert r0.wait == 4.0  # 3 -> 6.5: waiting for the gradient of chunk 0; 8.5 -> 9 for chunk 1's
    assert (r0.compute, r0.comm, r0.idle) == (6.5, 1.0, 4.0)
    assert (r1.compute, r1.comm, r1.idle) == (6.5, 1.0, 4.0)
    assert r0.events[-1].end == 11.5 and r1.events[-1].end == 9.5
    assert sim.critical_rank == 0
    assert sim.bubble_fraction == pytest.approx(8.0 / 23.0)
    assert sim.wait_fraction == pytest.approx(6.0 / 23.0)
    # every receive ends when its send does (or later, when it was posted later)
    sends = [e for e in r0.events if e.kind == "SEND"] + [e for e in r1.events if e.kind == "SEND"]
    recvs = [e for e in r1.events if e.kind == "RECV"] + [e for e in r0.events if e.kind == "RECV"]
    assert [r.end for r in recvs] == [max(s.end, r.wait_start) for s, r in zip(sends, recvs)]


def test_all_reduce_waits_for_slowest() -> None:
    group = (0, 1, 2)
    plan = make_plan([[F(0), AllReduce("grads", group)]] * 3)
    cost = table({(0, "F0c0"): 1.0, (1, "F0c0"): 2.0, (2, "F0c0"): 3.0,
                  (0, "AR grads"): 0.5, (1, "AR grads"): 0.7, (2, "AR grads"): 0.5})
    sim = simulate(plan, cost)
    assert sim.step_time == pytest.approx(3.7)
    assert [r.wait for r in sim.ranks] == [2.0, 1.0, 0.0]
    for r in sim.ranks:
        ar = r.events[1]
        assert (ar.start, ar.end) == (3.0, pytest.approx(3.7))
        assert r.comm == pytest.approx(0.7)
    assert sim.critical_rank == 2


def halo_plan() -> Plan:
    stages = (StageSpec(index=0, inputs=("x",), outputs=("a",), ops=("a",)),
              StageSpec(index=1, inputs=("x",), outputs=("b",), ops=("b",)),
              StageSpec(index=2, inputs=("a@halo", "b"), outputs=("o",), ops=("o",)))
    halo = HaloExchange("a", 0, (0, 1), send_rows=(0, 4), recv_rows=(0, 4), width=8)
    halo1 = HaloExchange("a", 0, (0, 1), send_rows=(4, 0), recv_rows=(4, 0), width=8)
    return make_plan([[F(0), halo, F(1), F(2)], [F(0), halo1, F(1), F(2)]], [stages, stages])


def test_overlap_halo_with_independent_forward() -> None:
    plan = halo_plan()
    cost = table({"F0c0": 1.0, "HALO a c0": 2.0, "F1c0": 1.5, "F2c0": 1.0})
    serial = simulate(plan, cost)
    assert serial.step_time == 5.5
    sim = simulate(plan, cost, overlap=True)
    # F0 [0,1]; HALO on comm [1,3] alongside F1 on compute [1,2.5]; F2 needs a@halo and b: [3,4]
    assert sim.step_time == 4.0 < serial.step_time
    for r in sim.ranks:
        assert [(e.label, e.stream, e.start, e.end) for e in r.events] == [
            ("F0c0", "compute", 0, 1), ("HALO a c0", "comm", 1, 3), ("F1c0", "compute", 1, 2.5), ("F2c0", "compute", 3, 4)]
        assert (r.compute, r.comm, r.wait, r.idle) == (3.5, 2.0, 0.0, 0.0)


def test_overlap_compute_does_not_wait_for_unrelated_comm() -> None:
    # rank 0's RECV blocks its comm stream until rank 1 sends at t=5, but its Forward runs at once
    stages = (StageSpec(index=0, inputs=("x",), outputs=("h",), ops=("h",)),
              StageSpec(index=1, inputs=("y",), outputs=("z",), ops=("z",)))
    producer = (StageSpec(index=0, inputs=("x",), outputs=("y",), ops=("y",)),)
    plan = make_plan([[Recv("y", 0, 1), F(0), F(1)], [F(0), Send("y", 0, 0)]], [stages, producer])
    cost = table({(0, "F0c0"): 1.0, (0, "F1c0"): 1.0, (1, "F0c0"): 5.0}, default=0.5)
    sim = simulate(plan, cost, overlap=True)
    r0 = sim.ranks[0]
    assert [(e.label, e.start, e.end) for e in r0.events] == [("RECV y c0 <-1", 5.5, 5.5), ("F0c0", 0, 1),
                                                               ("F1c0", 5.5, 6.5)]
    assert r0.wait == 5.5 and sim.step_time == 6.5  # the RECV waits until the SEND ends at 5.5
    assert simulate(plan, cost).step_time == 7.5  # serial: RECV [5,5.5] F [5.5,6.5] F [6.5,7.5]


def test_memory_peak_and_curve() -> None:
    stages = (StageSpec(index=0, inputs=("x",), outputs=("h",), ops=("h",)),
              StageSpec(index=1, inputs=("h",), outputs=("o",), ops=("o",)))
    plan = make_plan([[F(0), F(1), B(1), B(0)]], [stages])
    costs = {"F0c0": Cost(1, alloc=50), "F1c0": Cost(1, alloc=30), "B1c0": Cost(1, alloc=10, free=40),
             "B0c0": Cost(1, free=50)}
    sim = simulate(plan, lambda r, i: costs[str(i)], base_memory=[100])
    (r,) = sim.ranks
    assert r.peak_memory == 190
    assert r.memory_curve == [(0, 100), (0, 150), (1, 180), (2, 190), (3, 150), (4, 100)]
    assert simulate(plan, lambda r, i: costs[str(i)]).ranks[0].peak_memory == 90
    with pytest.raises(ValueError, match="base_memory"):
        simulate(plan, lambda r, i: costs[str(i)], base_memory=[0, 0])


def test_zero_duration_alloc_counts_in_peak() -> None:
    plan = make_plan([[F(0), OPT()]])
    costs = {"F0c0": Cost(0, alloc=64, free=64), "OPT": Cost(1, alloc=8, free=8)}
    r = simulate(plan, lambda r, i: costs[str(i)]).ranks[0]
    assert r.peak_memory == 64 and r.memory_curve[-1] == (1, 0)


def test_a_release_drops_right_after_the_allocation() -> None:
    """``Cost.release``: bytes freed as soon as the instruction has allocated (a posted exchange's
    copies), before anything that starts later; ``free`` waits for the instruction's end."""
    stages = (StageSpec(index=0, inputs=("x",), outputs=("h",), ops=("h",)),
              StageSpec(index=1, inputs=("h",), outputs=("o",), ops=("o",)))
    plan = make_plan([[F(0), F(1)]], [stages])
    costs = {"F0c0": Cost(2, alloc=50, release=30, free=20), "F1c0": Cost(1, alloc=10)}
    r = simulate(plan, lambda r, i: costs[str(i)], base_memory=[100]).ranks[0]
    assert r.memory_curve == [(0, 100), (0, 150), (0, 120), (2, 100), (2, 110)]
    assert r.peak_memory == 150
    with pytest.raises(ValueError, match="release"):
        Cost(1, release=-1)


def test_deadlock_receives_first() -> None:
    plan = make_plan([[Recv("h", 0, 1), Send("a", 0, 1)], [Recv("a", 0, 0), Send("h", 0, 0)]])
    with pytest.raises(VerificationError) as e:
        simulate(plan, table({}, default=1.0))
    msg = str(e.value)
    assert msg.startswith("deadlock: no rank can advance after 0 of 4 instructions completed")
    assert "rank 0 at step 0 `RECV h c0 <-1` waits for a SEND from rank 1, which is at step 0 `RECV a c0 <-0`" in msg
    assert "rank 1 at step 0 `RECV a c0 <-0` waits for a SEND from rank 0, which is at step 0 `RECV h c0 <-1`" in msg
    assert ">>    0  RECV h c0 <-1" in msg
    with pytest.raises(VerificationError) as e:
        simulate(plan, table({}, default=1.0), overlap=True)
    assert str(e.value) == msg  # both RECVs on the comm stream: the same blocked sites


def test_deadlock_collective_order_mismatch() -> None:
    g = (0, 1)
    plan = make_plan([[F(0), AllReduce("a", g), AllReduce("b", g)], [F(0), AllReduce("b", g), AllReduce("a", g)]])
    with pytest.raises(VerificationError) as e:
        simulate(plan, table({}, default=1.0))
    msg = str(e.value)
    assert "after 2 of 6" in msg
    assert "rank 0 at step 1 `AR a` waits for group (0, 1): rank 1, which is at step 1 `AR b` over group (0, 1)" in msg
    assert "rank 1 at step 1 `AR b` waits for group (0, 1): rank 0, which is at step 1 `AR a`" in msg


def test_deadlock_collective_cycle_across_groups() -> None:
    plan = make_plan([[AllReduce("a", (0, 1)), AllReduce("b", (0, 2))],
                      [AllReduce("c", (1, 2)), AllReduce("a", (0, 1))],
                      [AllReduce("b", (0, 2)), AllReduce("c", (1, 2))]])
    with pytest.raises(VerificationError) as e:
        simulate(plan, table({}, default=1.0))
    msg = str(e.value)
    for r in range(3):
        assert f"rank {r} at step 0" in msg
    assert "rank 0 at step 0 `AR a` waits for group (0, 1): rank 1, which is at step 0 `AR c` over group (1, 2)" in msg


def test_unmatched_send_is_an_error() -> None:
    plan = make_plan([[Send("h", 0, 1)], [F(0)]])
    with pytest.raises(VerificationError, match=r"rank 0 step 0 `SEND h c0 ->1` has no matching RECV on rank 1"):
        simulate(plan, table({}, default=1.0))


def gpipe_forward(S: int, C: int) -> Plan:
    """Forward-only GPipe: stage s on rank s, chunks streamed through blocking send/recv."""
    stages = [(StageSpec(index=s, inputs=(f"h{s - 1}" if s else "x",), outputs=(f"h{s}",), ops=(f"h{s}",)),)
              for s in range(S)]
    ranks = []
    for s in range(S):
        insts: list[Instruction] = []
        for c in range(C):
            if s:
                insts.append(Recv(f"h{s - 1}", c, s - 1))
            insts.append(F(s, c))
            if s < S - 1:
                insts.append(Send(f"h{s}", c, s + 1))
        ranks.append(insts)
    return make_plan(ranks, stages, chunks=C)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("S,C", [(4, 4), (3, 5), (1, 3)])
def test_gpipe_forward(S: int, C: int, overlap: bool) -> None:
    t_f = 2.0
    cost = lambda r, i: Cost(t_f) if i.kind == "F" else Cost(0.0, "comm")  # noqa: E731
    sim = simulate(gpipe_forward(S, C), cost, overlap=overlap)
    assert sim.step_time == (S + C - 1) * t_f
    assert sim.bubble_fraction == pytest.approx((S - 1) / (S + C - 1))
    for r in sim.ranks:
        assert r.compute == C * t_f and r.idle == (S - 1) * t_f
        if not overlap:  # (with overlap the receives are posted ahead and wait on the comm stream)
            assert r.wait == r.rank * t_f  # the leading bubble: waiting for the first chunk
    if not overlap:
        assert sim.wait_fraction == pytest.approx(S * (S - 1) / 2 / (S * (S + C - 1)))


def ring_plan(n: int, rounds: int) -> Plan:
    ranks = []
    for r in range(n):
        insts: list[Instruction] = []
        for k in range(rounds):
            send, recv = Send("h", k, (r + 1) % n), Recv("h", k, (r - 1) % n)
            insts += [F(0, k)] + ([send, recv] if r % 2 == 0 else [recv, send])
        insts += [AllReduce("grads", tuple(range(n))), OPT()]
        ranks.append(insts)
    return make_plan(ranks, chunks=rounds)


@pytest.mark.parametrize("overlap", [False, True])
def test_performance_64_ranks(overlap: bool) -> None:
    plan = ring_plan(64, 66)  # 200 instructions per rank
    assert all(len(dp.instructions) == 200 for dp in plan.ranks)
    cost = table({"F0c0": 1e-3, "AR grads": 5e-3}, default=1e-4)
    t0 = time.perf_counter()
    sim = simulate(plan, cost, overlap=overlap)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0
    assert sim.step_time > 0 and len(sim.ranks) == 64
    assert all(r.events[-1].end <= sim.step_time for r in sim.ranks)


def test_timeline_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    sim = simulate(two_stage_pipeline(), table({}, default=1.0))
    out = sim.timeline(tmp_path / "sim.png")
    assert out.exists() and out.stat().st_size > 0


def test_bad_cost_rejected() -> None:
    with pytest.raises(ValueError, match="stream"):
        Cost(1.0, stream="gpu")
    with pytest.raises(ValueError, match="seconds"):
        Cost(-1.0)
    with pytest.raises(TypeError, match="expected Cost"):
        simulate(make_plan([[F(0)]]), lambda r, i: 1.0)  # type: ignore[arg-type, return-value]


def test_empty_simulation_is_harmless() -> None:
    sim = simulate(make_plan([[]]), table({}))
    assert isinstance(sim, Simulation) and sim.step_time == 0.0 and sim.bubble_fraction == 0.0
