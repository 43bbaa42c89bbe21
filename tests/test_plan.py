"""Plans as data and the plan verifier.

Instructions print in their short forms and round-trip through dicts and JSON; plans round-trip
through ``save``/``load`` and print a per-rank table. Hand-built valid plans (data-parallel halo
exchange, GPipe pipeline, all-to-all) pass ``verify_plan`` with the expected dry run and
communication volume; plans corrupted on purpose are rejected with a VerificationError naming the
fault.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gnncompile.errors import VerificationError
from gnncompile.ir.plan import (
    INSTRUCTIONS,
    AllGather,
    AllReduce,
    AllToAll,
    Backward,
    DevicePlan,
    Forward,
    Free,
    HaloExchange,
    Instruction,
    OptimizerStep,
    Plan,
    Recompute,
    Recv,
    ReduceScatter,
    Send,
    StageSpec,
    read_plan,
)
from gnncompile.ir.verify_plan import PlanReport, verify_plan

F, B, OPT = Forward, Backward, OptimizerStep()
PAIR = (0, 1)
F32 = 4  # bytes per float32 element


# --------------------------------------------------------------------------- plan builders
def halo(value: str, rank: int, *, grad: bool = False, rows: tuple[int, int] = (5, 3), width: int = 16) -> HaloExchange:
    """Halo exchange of ``value`` over ranks (0, 1): rank 0 sends ``rows[0]`` rows, rank 1 ``rows[1]``."""
    out, into = rows if rank == 0 else rows[::-1]
    other = 1 - rank
    return HaloExchange(value, 0, PAIR, tuple(out if m == other else 0 for m in PAIR),
                        tuple(into if m == other else 0 for m in PAIR), width, grad=grad)


def halo_plan(num_stages: int = 2) -> Plan:
    """Data parallel over 2 ranks: stages split by halo exchanges, e.g. for 2 stages on each rank
    ``F0c0 HALO h0 c0 F1c0 B1c0 HALO^T grad h0 c0 B0c0 AR grads OPT``."""
    ranks = []
    for r in PAIR:
        stages = tuple(StageSpec(k, ("g", "x") if k == 0 else ("g", f"h{k - 1}@halo"),
                                 (f"h{k}",) if k < num_stages - 1 else ("logits",), (f"op{k}",), kinds="T1 P1")
                       for k in range(num_stages))
        fwd: list[Instruction] = [F(0)]
        bwd: list[Instruction] = [B(num_stages - 1)]
        for k in range(1, num_stages):
            fwd += [halo(f"h{k - 1}", r), F(k)]
        for k in reversed(range(1, num_stages)):
            bwd += [halo(f"h{k - 1}", r, grad=True), B(k - 1)]
        ranks.append(DevicePlan(r, stages, tuple(fwd + bwd + [AllReduce("grads", PAIR, numel=100), OPT])))
    return Plan("data", "exact", {"partitioner": "metis"}, "2 x cpu", ranks,
                info={"graph": "toy", "model": "GCN"}, predictions={"bytes_sent": [1.0, 2.0]})


SHAPES = {0: (10, 16), 1: (6, 16)}  # the two chunks of h


def pipeline_plan() -> Plan:
    """GPipe over 2 ranks and 2 chunks: stage 0 (x -> h) on rank 0, stage 1 (h -> logits) on rank 1."""
    r0 = (F(0, 0), Send("h", 0, 1, SHAPES[0]), F(0, 1), Send("h", 1, 1, SHAPES[1]),
          Recv("h", 1, 1, SHAPES[1], grad=True), B(0, 1), Recv("h", 0, 1, SHAPES[0], grad=True), B(0, 0), OPT)
    r1 = (Recv("h", 0, 0, SHAPES[0]), F(1, 0), Recv("h", 1, 0, SHAPES[1]), F(1, 1),
          B(1, 1), Send("h", 1, 0, SHAPES[1], grad=True), B(1, 0), Send("h", 0, 0, SHAPES[0], grad=True), OPT)
    return Plan("layer", "exact", {"chunks": 2}, "2 x cpu", [
        DevicePlan(0, (StageSpec(0, ("g", "x"), ("h",), ("lin",)),), r0),
        DevicePlan(1, (StageSpec(1, ("g", "h"), ("logits",), ("prop",)),), r1)], schedule="gpipe")


def a2a(rank: int, *, grad: bool = False) -> AllToAll:
    """rows -> cols all-to-all of h over (0, 1); rank 0 holds 6 rows, rank 1 holds 4; 8 columns each."""
    rows = (6, 4)[rank]
    return AllToAll("h", 0, PAIR, "rows", "cols", send_shapes=((rows, 8), (rows, 8)),
                    recv_shapes=((6, 8), (4, 8)), grad=grad)


def a2a_plan() -> Plan:
    """Tensor-parallel style: stage 0 writes h by rows, stage 1 reads it by columns."""
    stages = (StageSpec(0, ("x",), ("h",), ("lin",)), StageSpec(1, ("g", "h@cols"), ("logits",), ("prop",)))
    return Plan("tensor", "exact", {}, "2 x cpu", [
        DevicePlan(r, stages, (F(0), a2a(r), F(1), B(1), a2a(r, grad=True), B(0), OPT)) for r in PAIR])


def edit(plan: Plan, rank: int, instructions: Any = None, stages: Any = None) -> Plan:
    """A copy of ``plan`` with rank ``rank``'s instructions and/or stages replaced."""
    ranks = list(plan.ranks)
    dp = ranks[rank]
    ranks[rank] = dataclasses.replace(dp, instructions=tuple(dp.instructions if instructions is None else instructions),
                                      stages=dp.stages if stages is None else tuple(stages))
    return dataclasses.replace(plan, ranks=ranks)


def insts(plan: Plan, rank: int) -> list[Instruction]:
    return list(plan.ranks[rank].instructions)


# --------------------------------------------------------------------------- string forms
@pytest.mark.parametrize("inst, text", [
    (F(0, 3), "F0c3"),
    (B(1, 0), "B1c0"),
    (Recompute(1, 3), "R1c3"),
    (Send("h1", 0, 2), "SEND h1 c0 ->2"),
    (Recv("h1", 0, 1, grad=True), "RECV grad h1 c0 <-1"),
    (halo("h1", 0), "HALO h1 c0"),
    (halo("h1", 0, grad=True), "HALO^T grad h1 c0"),
    (AllToAll("h2", 0, PAIR, "rows", "cols"), "A2A h2 c0 rows->cols"),
    (AllGather("h", 1, PAIR), "AG h c1"),
    (ReduceScatter("h", 0, PAIR, grad=True), "RS grad h c0"),
    (AllReduce("grads", PAIR), "AR grads"),
    (Free("h1", 0), "FREE h1 c0"),
    (OPT, "OPT"),
])
def test_instruction_str(inst: Instruction, text: str) -> None:
    assert str(inst) == text


def test_collective_outputs() -> None:
    assert halo("h1", 0).output == "h1@halo"
    assert AllToAll("h2", 0, PAIR, "rows", "cols").output == "h2@cols"
    assert AllGather("h", 0, PAIR).output == "h@gathered"
    assert ReduceScatter("h", 0, PAIR).output == "h@scattered"


# --------------------------------------------------------------------------- (de)serialization
_NAMES = st.text(alphabet="abcdefgh_@0123456789", min_size=1, max_size=6)


def _strategy(hint: Any) -> st.SearchStrategy:
    """Values of a field annotated ``hint`` (int, str, bool, tuples of them)."""
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(0, 1 << 20)
    if hint is str:
        return _NAMES
    return st.lists(_strategy(typing.get_args(hint)[0]), max_size=4).map(tuple)


def _instances(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: _strategy(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", list(INSTRUCTIONS.values()), ids=list(INSTRUCTIONS))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_instruction_dict_round_trip(cls: type, data: st.DataObject) -> None:
    inst = data.draw(_instances(cls))
    d = inst.to_dict()
    assert d["op"] == cls.__name__
    assert json.loads(json.dumps(d)) == d  # plain JSON data: lists, not tuples, at every depth
    assert Instruction.from_dict(d) == inst
    assert Instruction.from_dict(json.loads(json.dumps(d))) == inst


@pytest.mark.parametrize("build", [halo_plan, pipeline_plan, a2a_plan])
def test_plan_save_load_round_trip(build: Any, tmp_path: Path) -> None:
    plan = build()
    path = plan.save(tmp_path / "plan.json")
    loaded = read_plan(path)
    assert loaded == plan
    assert loaded.program is None
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert verify_plan(loaded).instructions == verify_plan(plan).instructions


def test_print_plan_shows_the_rank_table() -> None:
    text = str(halo_plan())
    lines = text.splitlines()
    assert lines[0].startswith("Plan: strategy=data semantics=exact ranks=2")
    assert "stage 1 [T1 P1]: (g, h0@halo) -> (logits)" in text
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    assert lines[head].split() == ["step", "ranks", "0-1"]  # both ranks' lists print the same: one column
    assert lines[head + 2].split() == ["0", "F0c0"]
    assert lines[head + 5].split() == ["3", "B1c0"]
    assert "HALO^T grad h0 c0" in lines[head + 6]
    pipeline = str(pipeline_plan()).splitlines()
    head = next(i for i, line in enumerate(pipeline) if line.split()[:1] == ["step"])
    assert pipeline[head].split() == ["step", "rank", "0", "rank", "1"]
    assert pipeline[head + 2].split() == ["0", "F0c0", "RECV", "h", "c0", "<-0"]


def _malformed(d: dict) -> list[tuple[str, Any]]:
    """(what, data) pairs, each a corruption of the plan data ``d``."""
    def changed(fn: Any) -> dict:
        c = json.loads(json.dumps(d))
        fn(c)
        return c

    return [
        ("format", changed(lambda c: c.update(format=99))),
        ("format", changed(lambda c: c.pop("format"))),
        ("ranks", changed(lambda c: c.pop("ranks"))),
        ("unknown instruction", changed(lambda c: c["ranks"][0]["instructions"][0].update(op="Jump"))),
        ("unknown field", changed(lambda c: c["ranks"][0]["instructions"][0].update(stages=3))),
        ("malformed Send", changed(lambda c: c["ranks"][0]["instructions"][1].pop("peer"))),
        ("malformed instruction", changed(lambda c: c["ranks"][0]["instructions"].append("F0c0"))),
        ("malformed stage", changed(lambda c: c["ranks"][0]["stages"][0].update(colour="red"))),
        ("malformed rank", changed(lambda c: c["ranks"].append(7))),
        ("lacks the field 'instructions'", changed(lambda c: c["ranks"][1].pop("instructions"))),
        ("must be an object", [d]),
        # hand-edited fields of the wrong type were raw AttributeErrors (or, printed, a ValueError)
        ("schedule must be an object", changed(lambda c: c.update(schedule=[1, 2]))),
        ("schedule must be an object", changed(lambda c: c.update(schedule=3))),
        ("options must be an object", changed(lambda c: c.update(options=[1]))),
        ("options must be an object", changed(lambda c: c.update(options=None))),
        ("info must be an object", changed(lambda c: c.update(info=[1]))),
        ("predictions must be an object", changed(lambda c: c.update(predictions=[1]))),
        ("cluster must be a string", changed(lambda c: c.update(cluster=5))),
        ("ranks must be a non-empty list", changed(lambda c: c.update(ranks=[]))),
        ("ranks must be a non-empty list", changed(lambda c: c.update(ranks={"0": {}}))),
        ("sizes must be an object", changed(lambda c: c["ranks"][0].update(sizes=[1, 2]))),
    ]


@pytest.mark.parametrize("what, data", _malformed(pipeline_plan().to_dict()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_malformed_plan_data_is_rejected(what: str, data: Any) -> None:
    with pytest.raises(VerificationError, match=what):
        Plan.from_dict(data)


def test_read_plan_of_a_file_that_is_not_text_is_a_planning_error(tmp_path: Path) -> None:
    """A binary file given as a plan (a picture, a checkpoint) raised UnicodeDecodeError."""
    from gnncompile.errors import PlanningError

    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(PlanningError, match="cannot read plan file .*not UTF-8 text"):
        read_plan(path)


def test_sampled_plan_data_round_trips_equal(tmp_path: Path) -> None:
    """A sampled plan's ``fanouts`` option is a tuple; read back from JSON it was a list, so the
    data read back (``read_plan``, ``gc.load_plan(path)``) no longer equalled the saved plan."""
    import torch

    import gnncompile as gc

    graph = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=4, num_features=6, num_classes=3, seed=0)
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GraphSAGE(6, 8, 3), graph, gpus=2, strategy="split", batch_size=32, fanouts=[3, 2])
    loaded = read_plan(plan.save(tmp_path / "plan.json"))
    assert loaded.options["fanouts"] == (3, 2)
    assert loaded == plan and gc.load_plan(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("data", [{"format": "gnncompile.cluster", "device": {}, "intra": {}},
                                  {"dataset": "cora", "loss": [1.0]}, {}])
def test_a_file_that_holds_no_plan_is_not_called_another_format(data: dict, tmp_path: Path) -> None:
    """A calibration profile or a ``--json`` history given as a plan was refused as "plan format
    'gnncompile.cluster' (or None) is not supported": a version mismatch, which it is not."""
    path = tmp_path / "other.json"
    path.write_text(json.dumps(data))
    with pytest.raises(VerificationError, match=r"not plan data: it has no strategy or ranks field") as info:
        read_plan(path)
    assert "format" not in str(info.value).split("(")[0]


def test_load_rejects_unknown_format_version(tmp_path: Path) -> None:
    d = halo_plan().to_dict()
    d["format"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(VerificationError, match="plan format 2 is not supported"):
        read_plan(path)


# --------------------------------------------------------------------------- valid plans
@pytest.mark.parametrize("num_stages", [2, 3])
def test_halo_plan_verifies(num_stages: int) -> None:
    plan = halo_plan(num_stages)
    report = verify_plan(plan)
    assert isinstance(report, PlanReport)
    n = 4 * num_stages  # F and B per stage, a forward and a backward halo between stages, AR, OPT
    assert report.instructions == [n, n]
    assert sorted(report.order) == sorted((r, i) for r in PAIR for i in range(n))
    halos = (num_stages - 1) * (5 + 3) * 16 * F32  # each halo pair moves 5 rows one way and 3 the other
    ring = 2 * (2 - 1) / 2 * 100 * F32
    assert report.bytes_sent == [halos + ring] * 2
    assert report.bytes_recv == [halos + ring] * 2
    assert "plan verified: 2 ranks" in str(report)


def test_halo_volume_direction() -> None:
    """A forward halo exchange sends ``send_rows``; its grad=True transpose sends ``recv_rows``."""
    stages = (StageSpec(0, ("g", "x@halo"), ("logits",), ("prop",)),)
    plan = Plan("data", "exact", {}, "cpu",
                [DevicePlan(r, stages, (halo("x", r, width=2), F(0), B(0), OPT)) for r in PAIR])
    report = verify_plan(plan)
    assert report.bytes_sent == [5 * 2 * F32, 3 * 2 * F32]
    assert report.bytes_recv == [3 * 2 * F32, 5 * 2 * F32]

    stages = (StageSpec(0, ("x",), ("h",), ("lin",)), StageSpec(1, ("g", "h@halo"), ("logits",), ("prop",)))
    plan = Plan("data", "exact", {}, "cpu", [DevicePlan(r, stages, (F(0), halo("h", r, width=2), F(1), B(1),
                                                                      halo("h", r, grad=True, width=2), B(0), OPT))
                                             for r in PAIR])
    assert verify_plan(plan).bytes_sent == [(5 + 3) * 2 * F32] * 2


def test_pipeline_plan_verifies_with_its_dry_run() -> None:
    report = verify_plan(pipeline_plan())
    assert report.instructions == [9, 9]
    # unit-cost replay, steps[t] = what starts at time t. Rank 0: F0c0 [0,1] SEND h c0 [1,2] F0c1 [2,3]
    # SEND h c1 [3,4]; rank 1: RECV h c0 at 2 (when its SEND ended, taking no time) F1c0 [2,3], RECV h c1
    # at 4, F1c1 B1c1 SEND grad h c1 [6,7] B1c0 SEND grad h c0 [8,9] OPT; rank 0's gradient RECVs end
    # with those SENDs, at 7 (then B0c1) and 9 (then B0c0 and OPT at 10)
    assert report.steps == [
        [(0, 0)], [(0, 1)], [(0, 2), (1, 0), (1, 1)], [(0, 3)], [(1, 2), (1, 3)], [(1, 4)], [(1, 5)],
        [(0, 4), (0, 5), (1, 6)], [(1, 7)], [(0, 6), (0, 7), (1, 8)], [(0, 8)],
    ]
    assert report.num_rounds == 11
    assert report.order[:5] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    moved = (10 + 6) * 16 * F32  # h of both chunks one way, its gradient back
    assert report.bytes_sent == [moved, moved]
    assert report.bytes_recv == [moved, moved]


def test_a2a_plan_verifies_and_counts_shapes() -> None:
    report = verify_plan(a2a_plan())
    # rank 0 sends its 6 rows x 8 columns to rank 1 and receives rank 1's 4 x 8 (and back for the grad)
    assert report.bytes_sent == [(6 + 4) * 8 * F32, (4 + 6) * 8 * F32]


def test_gather_and_reduce_scatter_volume() -> None:
    g3 = (0, 1, 2)
    stages = (StageSpec(0, ("x",), ("h",), ("lin",)), StageSpec(1, ("g", "h@gathered"), ("s",), ("prop",)),
              StageSpec(2, ("s@scattered",), ("logits",), ("lin2",)))
    prog = (F(0), AllGather("h", 0, g3, (30, 4), dtype="bfloat16"), F(1), ReduceScatter("s", 0, g3, (30, 4)), F(2),
            B(2), ReduceScatter("s", 0, g3, (30, 4), grad=True), B(1),
            AllGather("h", 0, g3, (30, 4), dtype="bfloat16", grad=True), B(0), OPT)
    report = verify_plan(Plan("tensor", "exact", {}, "cpu", [DevicePlan(r, stages, prog) for r in g3]))
    expected = 2 * (2 / 3 * 120 * 2) + 2 * (2 / 3 * 120 * F32)
    assert report.bytes_sent == pytest.approx([expected] * 3)
    assert report.bytes_recv == pytest.approx([expected] * 3)


def test_recompute_and_free_are_accepted() -> None:
    plan = pipeline_plan()
    r0 = insts(plan, 0)
    r0.insert(2, Free("h", 0))               # after SEND h c0: h c0 is not stored ...
    r0.insert(r0.index(B(0, 0)), Recompute(0, 0))  # ... until it is recomputed for the backward
    r0.insert(r0.index(B(0, 0)) + 1, Free("h", 0))
    verify_plan(edit(plan, 0, r0))


def test_custom_inputs() -> None:
    plan = pipeline_plan()
    with pytest.raises(VerificationError, match="needs x c0, which is not available"):
        verify_plan(plan, inputs=("g",))
    stages = (StageSpec(0, ("g", "feat"), ("h",), ("lin",)),)
    verify_plan(edit(plan, 0, stages=stages), inputs=("g", "feat"))


# --------------------------------------------------------------------------- corruptions
def test_missing_recv() -> None:
    plan = pipeline_plan()
    r1 = [i for i in insts(plan, 1) if i != Recv("h", 1, 0, SHAPES[1])]
    with pytest.raises(VerificationError, match=r"rank 0 step 3 `SEND h c1 ->1` has no matching RECV on rank 1") as e:
        verify_plan(edit(plan, 1, r1))
    assert ">>    3  SEND h c1 ->1" in str(e.value)


def test_send_recv_shape_mismatch() -> None:
    plan = pipeline_plan()
    r1 = insts(plan, 1)
    r1[0] = Recv("h", 0, 0, (10, 17))
    with pytest.raises(VerificationError, match=r"SEND/RECV mismatch.*shape \(10, 16\) on the SEND vs \(10, 17\) on the RECV") as e:
        verify_plan(edit(plan, 1, r1))
    assert "rank 0 step 1 `SEND h c0 ->1`" in str(e.value) and "rank 1 step 0 `RECV h c0 <-0`" in str(e.value)


def test_collectives_in_different_orders() -> None:
    plan = halo_plan()
    r1 = insts(plan, 1)  # F0c0 HALO h0 c0 F1c0 B1c0 HALO^T grad h0 c0 B0c0 AR grads OPT
    r1[4:7] = [r1[6], r1[4], r1[5]]  # AR before the transposed halo: fine for rank 1 alone
    with pytest.raises(VerificationError, match=r"collective order mismatch over group \(0, 1\): collective #1 is "
                                                r"`HALO\^T grad h0 c0` \(step 4\) on rank 0 but `AR grads` \(step 4\) on rank 1"):
        verify_plan(edit(plan, 1, r1))


def test_collective_content_mismatch() -> None:
    plan = halo_plan()
    r1 = insts(plan, 1)
    r1[-2] = AllReduce("grads", PAIR, numel=99)
    with pytest.raises(VerificationError, match=r"collective mismatch over group \(0, 1\).*numel 100 vs 99"):
        verify_plan(edit(plan, 1, r1))
    r1 = insts(plan, 1)[:-2] + [OPT]
    with pytest.raises(VerificationError, match=r"collective mismatch .* collective #2 is `AR grads` \(step 6\) on rank 0 "
                                                r"but missing on rank 1 \(it issues 2 collective\(s\) over this group\)"):
        verify_plan(edit(plan, 1, r1))


def test_forward_twice() -> None:
    plan = halo_plan()
    r0 = insts(plan, 0)
    r0.insert(1, F(0))
    with pytest.raises(VerificationError, match=r"rank 0 step 1 `F0c0`: stage 0 runs its Forward on chunk 0 twice \(first at step 0\)"):
        verify_plan(edit(plan, 0, r0))


def test_backward_before_forward() -> None:
    plan = pipeline_plan()
    r0 = insts(plan, 0)
    r0.remove(B(0, 0))
    with pytest.raises(VerificationError, match=r"rank 0 step 0 `B0c0`: Backward before its Forward F0c0"):
        verify_plan(edit(plan, 0, [B(0, 0)] + r0))


def test_missing_backward_points_at_its_forward() -> None:
    plan = pipeline_plan()
    with pytest.raises(VerificationError, match=r"rank 0 step 0 `F0c0`: no Backward B0c0 for this Forward"):
        verify_plan(edit(plan, 0, [i for i in insts(plan, 0) if i != B(0, 0)]))


def test_missing_opt() -> None:
    plan = halo_plan()
    with pytest.raises(VerificationError, match=r"rank 1: no optimizer step \(OPT\)") as e:
        verify_plan(edit(plan, 1, insts(plan, 1)[:-1]))
    assert "rank 1:\n" in str(e.value)  # the whole instruction list is shown


def test_opt_ordering() -> None:
    plan = halo_plan()
    r0 = insts(plan, 0)
    with pytest.raises(VerificationError, match=r"Backward after the optimizer step \(OPT at step 3\)"):
        verify_plan(edit(plan, 0, r0[:3] + [OPT] + [i for i in r0[3:] if i != OPT]))
    with pytest.raises(VerificationError, match=r"gradient all-reduce after the optimizer step"):
        verify_plan(edit(plan, 0, r0[:-2] + [OPT, r0[-2]]))
    with pytest.raises(VerificationError, match=r"second optimizer step \(first OPT at step 7\)"):
        verify_plan(edit(plan, 0, r0 + [OPT]))


def test_recompute_outside_its_window() -> None:
    plan = pipeline_plan()
    r0 = insts(plan, 0)
    with pytest.raises(VerificationError, match=r"`R0c1`: Recompute must come between F0c1 and B0c1"):
        verify_plan(edit(plan, 0, [F(0, 0), Recompute(0, 1)] + r0[1:]))


def test_use_of_freed_value() -> None:
    plan = halo_plan()
    r0 = insts(plan, 0)
    r0.insert(1, Free("h0", 0))
    with pytest.raises(VerificationError, match=r"rank 0 step 2 `HALO h0 c0`: needs h0 c0, which is not available: "
                                                r"it was freed at step 1"):
        verify_plan(edit(plan, 0, r0))
    with pytest.raises(VerificationError, match=r"`FREE h0 c0`: needs h0 c0, .* freed at step 1"):
        verify_plan(edit(plan, 0, r0[:2] + [Free("h0", 0)] + r0[2:]))


def test_stage_input_never_produced() -> None:
    plan = halo_plan()
    stages = list(plan.ranks[0].stages)
    stages[1] = dataclasses.replace(stages[1], inputs=("g", "h9"))
    with pytest.raises(VerificationError, match=r"rank 0 step 2 `F1c0`: needs h9 c0, which is not available: "
                                                r"it is never produced on rank 0"):
        verify_plan(edit(plan, 0, stages=stages))


def test_value_used_before_it_is_received() -> None:
    plan = pipeline_plan()
    r1 = insts(plan, 1)
    r1[2], r1[3] = r1[3], r1[2]  # F1c1 before RECV h c1
    with pytest.raises(VerificationError, match=r"`F1c1`: needs h c1, which is not available: it is produced only later, at step 3"):
        verify_plan(edit(plan, 1, r1))


def test_backward_before_its_gradient_arrives() -> None:
    plan = pipeline_plan()
    r0 = insts(plan, 0)
    r0[4], r0[5] = r0[5], r0[4]  # B0c1 before RECV grad h c1
    with pytest.raises(VerificationError, match=r"rank 0 step 4 `B0c1`: needs the gradient of h c1, which is not complete "
                                                r"yet: it still waits for `RECV grad h c1 <-1` \(step 5\)"):
        verify_plan(edit(plan, 0, r0))
    plan = halo_plan()
    r0 = insts(plan, 0)  # F0c0 HALO h0 c0 F1c0 B1c0 HALO^T grad h0 c0 B0c0 AR grads OPT
    r0[3], r0[4] = r0[4], r0[3]  # transposed halo before the backward producing its gradient
    with pytest.raises(VerificationError, match=r"`HALO\^T grad h0 c0`: needs the gradient of h0@halo c0, .* waits for B1c0"):
        verify_plan(edit(plan, 0, r0))


def test_deadlock_names_both_ranks() -> None:
    plan = pipeline_plan()
    # rank 0 waits for the gradient of chunk 1 before sending any activation: both ranks block in RECV
    r0 = [F(0, 0), F(0, 1), Recv("h", 1, 1, SHAPES[1], grad=True), Send("h", 0, 1, SHAPES[0]),
          Send("h", 1, 1, SHAPES[1]), B(0, 1), Recv("h", 0, 1, SHAPES[0], grad=True), B(0, 0), OPT]
    with pytest.raises(VerificationError) as e:
        verify_plan(edit(plan, 0, r0))
    msg = str(e.value)
    assert msg.startswith("deadlock: no rank can advance after 2 of 18 instructions completed")
    assert "rank 0 at step 2 `RECV grad h c1 <-1` waits for a SEND from rank 1, which is at step 0 `RECV h c0 <-0`" in msg
    assert "rank 1 at step 0 `RECV h c0 <-0` waits for a SEND from rank 0, which is at step 2 `RECV grad h c1 <-1`" in msg


def test_collective_deadlock_over_overlapping_groups() -> None:
    groups = {0: ((0, 1), (0, 2)), 1: ((1, 2), (0, 1)), 2: ((0, 2), (1, 2))}
    plan = Plan("data", "exact", {}, "cpu", [
        DevicePlan(r, (), tuple(AllReduce("grads", g, numel=8) for g in groups[r]) + (OPT,)) for r in range(3)])
    with pytest.raises(VerificationError) as e:
        verify_plan(plan)
    msg = str(e.value)
    assert "deadlock" in msg
    assert "rank 0 at step 0 `AR grads` waits for group (0, 1): rank 1, which is at step 0 `AR grads` over group (1, 2)" in msg
    assert "rank 2 at step 0 `AR grads` waits for group (0, 2): rank 0, which is at step 0 `AR grads` over group (0, 1)" in msg


def test_halo_row_count_mismatch() -> None:
    plan = halo_plan()
    r1 = insts(plan, 1)
    r1[1] = dataclasses.replace(r1[1], recv_rows=(4, 0))
    with pytest.raises(VerificationError, match=r"halo row counts disagree: rank 0 step 1 `HALO h0 c0` sends 5 to rank 1, "
                                                r"rank 1 step 1 `HALO h0 c0` expects 4 from rank 0"):
        verify_plan(edit(plan, 1, r1))


def test_a2a_shape_mismatch() -> None:
    plan = a2a_plan()
    r1 = insts(plan, 1)
    r1[1] = dataclasses.replace(r1[1], recv_shapes=((5, 8), (4, 8)))
    with pytest.raises(VerificationError, match=r"all-to-all shapes disagree: .* sends \(6, 8\) to rank 1, .* expects \(5, 8\)"):
        verify_plan(edit(plan, 1, r1))


@pytest.mark.parametrize("rank, index, inst, what", [
    (0, 1, Send("h", 0, 0, SHAPES[0]), "rank 0 cannot send to itself"),
    (0, 1, Send("h", 0, 5, SHAPES[0]), "peer 5 is not a rank of this 2-rank plan"),
    (0, 0, F(3, 0), r"stage 3 is not one of rank 0's stages \[0\]"),
    (0, 0, F(0, 2), r"chunk 2 is outside the plan's chunks 0..1"),
    (0, 1, Send("h", 0, 1, SHAPES[0], dtype="float31"), "unknown dtype 'float31'"),
    (0, 1, Send("h", 0, 1, (10, -1)), "negative dimensions"),
    (0, 0, F("0", 0), "field 'stage' is '0', expected int"),
    (0, 1, AllReduce("grads", (1,)), r"group \(1,\), which does not include it"),
    (0, 1, AllReduce("grads", (1, 0)), r"group \(1, 0\) must be non-empty, sorted and without duplicates"),
    (0, 1, AllReduce("grads", (0, 2)), r"group \(0, 2\) names ranks outside 0..1"),
    (0, 1, HaloExchange("h", 0, PAIR, (1, 2), (0, 2), 4), r"entry 0 \(rank 0\) must be 0"),
    (0, 1, HaloExchange("h", 0, PAIR, (0,), (0, 2), 4), "one entry per member"),
])
def test_structural_faults(rank: int, index: int, inst: Instruction, what: str) -> None:
    plan = pipeline_plan()
    prog = insts(plan, rank)
    prog[index] = inst
    with pytest.raises(VerificationError, match=what) as e:
        verify_plan(edit(plan, rank, prog))
    assert f">> {index:>4}  {inst}" in str(e.value)


def test_rank_numbering_and_stage_tables() -> None:
    plan = pipeline_plan()
    with pytest.raises(VerificationError, match="position 0 holds rank 1"):
        verify_plan(dataclasses.replace(plan, ranks=plan.ranks[::-1]))
    twice = plan.ranks[0].stages * 2
    with pytest.raises(VerificationError, match="two stages have index 0"):
        verify_plan(edit(plan, 0, stages=twice))
    with pytest.raises(VerificationError, match="'chunks' must be a positive int"):
        verify_plan(dataclasses.replace(plan, options={"chunks": 0}))


# --------------------------------------------------------------------------- printing many ranks (issue 18)
def ring_plan(num_ranks: int, *, same: bool = True) -> Plan:
    """A data-parallel-like plan over ``num_ranks`` ranks: every rank's list prints the same, except,
    with ``same=False``, a SEND/RECV pair to its neighbours that names the peer."""
    group = tuple(range(num_ranks))
    stages = (StageSpec(0, ("g", "x"), ("logits",), ("op0",), kinds="T1 P1"),)
    ranks = []
    for r in group:
        body: list[Instruction] = [F(0)]
        if not same:
            body += [Send("h", 0, (r + 1) % num_ranks, (4, 4)), Recv("h", 0, (r - 1) % num_ranks, (4, 4))]
        body += [B(0), AllReduce("grads", group, numel=10), OPT]
        ranks.append(DevicePlan(r, stages, tuple(body)))
    return Plan("data", "exact", {}, f"{num_ranks} x cpu", ranks,
                predictions={"bytes_sent": [100.0] * (num_ranks - 1) + [50.0]})


def test_identical_ranks_share_one_column() -> None:
    """64 ranks printed 418 lines up to 2,310 characters wide; ranks whose lists print the same are
    now one column, and the per-rank predictions one row per run of equal values."""
    text = str(ring_plan(64))
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    assert lines[head].split() == ["step", "ranks", "0-63"]
    assert lines[head + 2].split() == ["0", "F0c0"] and lines[head + 5].split() == ["3", "OPT"]
    assert max(len(line) for line in lines) <= 120
    assert len(lines) < 30
    pred = lines.index("  predicted per training step:")
    assert lines[pred + 2].split() == ["0-62", "100", "B"] and lines[pred + 3].split() == ["63", "50", "B"]


def test_wide_plans_continue_in_blocks_of_columns() -> None:
    """Ranks that differ (peers named in SEND/RECV) stay separate columns, cut into blocks that fit
    the width, each block with its step column; every rank appears exactly once."""
    plan = ring_plan(64, same=False)
    table = plan.instruction_table(width=120)
    assert max(len(line) for line in table) <= 120
    heads = [line.split() for line in table if line.split()[:1] == ["step"]]
    assert len(heads) > 1
    ranks = [int(x) for h in heads for x in h[1:] if x.isdigit()]
    assert sorted(ranks) == list(range(64))
    assert "SEND h c0 ->1" in "\n".join(table) and "RECV h c0 <-63" in "\n".join(table)


def test_each_block_of_columns_has_only_its_own_steps() -> None:
    """Ranks 0-3 of ``--gpus 2x4xA5000-ib200`` (41 steps) ended in blank rows 41-43, the length of
    ranks 4-7's list in the block below."""
    long_ranks = tuple(OPT if k == 9 else F(0, k) for k in range(10))
    plan = dataclasses.replace(pipeline_plan(), ranks=[DevicePlan(0, (), (F(0, 0), OPT)), DevicePlan(1, (), long_ranks)])
    table = plan.instruction_table(width=12)  # one column per block
    heads = [i for i, line in enumerate(table) if line.split()[:1] == ["step"]]
    assert [table[i].split() for i in heads] == [["step", "rank", "0"], ["step", "rank", "1"]]
    first = table[heads[0] + 2:heads[1] - 1]
    assert [line.split() for line in first] == [["0", "F0c0"], ["1", "OPT"]]
    assert [line.split()[0] for line in table[heads[1] + 2:]] == [str(k) for k in range(10)]
    both = plan.instruction_table()  # one block: the shorter column is blank below its end
    assert len(both) == 2 + 10 and both[-1].split() == ["9", "OPT"]


def test_schedule_says_chunk_or_chunks() -> None:
    from gnncompile.ir.plan import Schedule

    assert str(Schedule("chunk pipeline", 1, "list-scheduled")) == "chunk pipeline (1 chunk, list-scheduled)"
    assert str(Schedule("chunk pipeline", 4)) == "chunk pipeline (4 chunks)"


def test_plan_repr_is_one_line_and_pretty_prints_the_table() -> None:
    """``repr(plan)`` was a ~29 KB dataclass dump (what a notebook shows for a plan)."""
    plan = halo_plan()
    text = repr(plan)
    assert text == "<Plan data on 2 ranks, exact, schedule sequential; options: partitioner='metis'>"
    predicted = dataclasses.replace(plan, prediction=type("P", (), {"step_time": 4.1e-3, "max_peak_memory": 3 << 20})())
    assert repr(predicted).endswith("; predicted step 4.1 ms, peak memory 3.00 MiB (largest rank)>")

    class Printer:
        def __init__(self) -> None:
            self.out = ""

        def text(self, value: str) -> None:
            self.out += value

    printer = Printer()
    plan._repr_pretty_(printer, cycle=False)
    assert printer.out == str(plan)


def test_a_plan_from_statistics_prints_unknown_degrees_as_unknown() -> None:
    """``deg mean=14.55 max=-1 skew=nan``: -1 and NaN are how GraphStats stores "not known"."""
    import torch

    import gnncompile as gc
    from gnncompile.graph.core import GraphStats

    stats = GraphStats(num_nodes=10_000, num_edges=100_000, num_features=16, num_classes=4, name="big")
    assert str(stats) == "big: |V|=10,000 |E|=100,000 d=16 classes=4 deg mean=10.00 max=? skew=?"
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GCN(16, 8, 4, num_layers=2), stats, gpus=2, strategy="data")
    assert "  graph: big: |V|=10,000 |E|=100,000 d=16 classes=4 deg mean=10.00 max=? skew=?" in str(plan).splitlines()
    known = GraphStats(num_nodes=3, num_edges=0, num_features=1, num_classes=1, degree_max=0, degree_skew=0.0)
    assert str(known).endswith("deg mean=0.00 max=0 skew=0.00")
    assert "max=168 skew=15.27" in str(GraphStats(2708, 10556, 1433, 7, 3.9, 168, 15.27))


@pytest.mark.parametrize("ranks, label", [([5], "rank 5"), ([0, 1, 2, 3], "ranks 0-3"), ([0, 1, 2, 3, 8], "ranks 0-3,8"),
                                          ([1, 3, 5], "ranks 1,3,5")])
def test_rank_label(ranks: list[int], label: str) -> None:
    from gnncompile.ir.plan import rank_label

    assert rank_label(ranks) == label


def test_plan_differences_name_the_fields() -> None:
    """``gnncompile.load_plan`` of a plan for another model or graph said "rank 0 differs" and printed two
    identical lists (the instructions print the same; the stages' costs or exchange sizes differ)."""
    from gnncompile.ir.plan import plan_differences

    saved = halo_plan()
    other = edit(saved, 0, instructions=[halo("h0", 0, rows=(7, 3)) if isinstance(i, HaloExchange) and not i.grad else i
                                         for i in saved.ranks[0].instructions])
    diffs = plan_differences(saved, other)
    assert diffs == ["rank 0 instruction 1 HALO h0 c0 send_rows: saved (0, 5), rebuilt (0, 7)"]
    assert plan_differences(saved, saved) == []
    renamed = dataclasses.replace(other, info={**saved.info, "model": "GAT"})
    assert plan_differences(saved, renamed)[0] == "model: saved 'GCN', rebuilt 'GAT'"


# --------------------------------------------------------------------------- runnable plans: gc.Plan, load_plan
def test_ir_plan_is_data_only() -> None:
    """The IR's plan has no behaviour that needs the layers above it; gc.Plan adds it."""
    import gnncompile as gc

    for name in ("run", "explain", "explanation", "timeline", "memory_plot", "memory_plot_data", "load"):
        assert not hasattr(Plan, name), name
        assert hasattr(gc.Plan, name), name
    assert issubclass(gc.Plan, Plan)


def test_runnable_keeps_every_field_and_equals_the_data() -> None:
    from gnncompile.api import runnable

    import gnncompile as gc

    data = dataclasses.replace(halo_plan(), program=["programs"], search="search", prediction="prediction",
                               last_run="run")
    values = {f.name: getattr(data, f.name) for f in dataclasses.fields(Plan)}
    plan = runnable(data)
    assert plan is data and type(plan) is gc.Plan       # converted in place: references to it see gc.Plan
    for name, value in values.items():
        assert getattr(plan, name) is value, name
    assert runnable(plan) is plan
    assert plan == halo_plan() and halo_plan() == plan   # equal data, whichever class
    assert plan != dataclasses.replace(halo_plan(), strategy="tensor")

    class Annotated(Plan):
        pass

    other = Annotated(**{f.name: getattr(halo_plan(), f.name) for f in dataclasses.fields(Plan)})
    copied = runnable(other)
    assert type(copied) is gc.Plan and copied is not other and copied == other


def test_load_plan_without_model_gives_the_data(tmp_path: Path) -> None:
    import gnncompile as gc
    from gnncompile.errors import PlanningError

    plan = halo_plan()
    path = plan.save(tmp_path / "plan.json")
    loaded = gc.load_plan(path)
    assert isinstance(loaded, gc.Plan) and loaded == plan and loaded.program is None
    with pytest.raises(PlanningError, match=r"gnncompile\.load_plan\(path, model, graph\)"):
        loaded.run(epochs=1)
    with pytest.raises(PlanningError, match="pass both model and graph"):
        gc.load_plan(path, model=object())
    with pytest.raises(PlanningError, match="cannot read plan file"):
        gc.load_plan(tmp_path / "absent.json")


@pytest.mark.parametrize("edit", [{"gpus": 3}, {"model": 1}, {"graph": 1}, {"verify": False}, {"overlap": True},
                                  {"devices": "any"}])
def test_load_plan_refuses_options_that_are_not_recorded_decisions(edit: dict, tmp_path: Path) -> None:
    """A hand-edited plan file whose options held ``gnncompile.plan``'s own arguments raised a raw
    TypeError (``got multiple values for argument 'model'``) or was used with them (``verify=False``
    planned again without the verifier)."""
    import torch

    import gnncompile as gc

    graph = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=4, num_features=6, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 8, 3)
    data = gc.plan(model, graph, gpus=2, strategy="data", partitioner="random").to_dict()
    data["options"].update(edit)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(VerificationError, match=f"options hold {next(iter(edit))}, which a plan does not record"):
        gc.load_plan(path, model, graph)


def test_a_loaded_plan_without_prediction_names_a_fix_that_exists(tmp_path: Path) -> None:
    """``timeline`` and ``memory_plot`` of a plan read without its model told the user to call
    ``gnncompile.cost_models.predict``, which does not exist (AttributeError); the fix it names works."""
    import re

    import gnncompile as gc
    from gnncompile.cost_models.hardware import Cluster
    from gnncompile.errors import PlanningError

    loaded = gc.load_plan(halo_plan().save(tmp_path / "plan.json"))
    for draw in (loaded.timeline, loaded.memory_plot):
        with pytest.raises(PlanningError, match=r"plan\.prediction = gnncompile\.cost_models\.model\.predict") as info:
            draw(tmp_path / "t.png")
    call = re.search(r"(gnncompile[\w.]+)\(plan, cluster\)", str(info.value)).group(1)
    module, name = call.rsplit(".", 1)
    predict = getattr(__import__(module, fromlist=[name]), name)
    loaded.prediction = predict(loaded, Cluster.parse("2xA100"))
    assert loaded.timeline(tmp_path / "t.png").exists() and loaded.memory_plot(tmp_path / "m.png").exists()


def test_load_plan_rebuilds_a_runnable_plan_and_plan_load_is_its_deprecated_alias(tmp_path: Path) -> None:
    import torch

    import gnncompile as gc

    graph = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=4, num_features=6, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 8, 3, num_layers=2)
    plan = gc.plan(model, graph, gpus=2, strategy="data", partitioner="random")
    assert isinstance(plan, gc.Plan)                                      # gc.plan returns the runnable plan
    path = plan.save(tmp_path / "plan.json")
    rebuilt = gc.load_plan(path, model, graph)
    assert isinstance(rebuilt, gc.Plan) and rebuilt.program is not None
    assert rebuilt == plan
    with pytest.warns(DeprecationWarning, match="use gnncompile.load_plan"):
        alias = gc.Plan.load(path, model, graph)
    assert isinstance(alias, gc.Plan) and alias == rebuilt and alias.program is not None
    with pytest.warns(DeprecationWarning):
        assert gc.Plan.load(path) == plan
    # rebuilt for the devices it was planned for, not as many local ranks
    gpu = gc.plan(model, graph, gpus="2x2xA100-ib200", strategy="data", partitioner="random")
    again = gc.load_plan(gpu.save(tmp_path / "gpu.json"), model, graph)
    assert again.cluster == gpu.cluster and "A100" in again.cluster and str(again) == str(gpu)


def test_save_replaces_a_plan_file_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails midway leaves the previous plan file whole and no temporary file behind (it
    was truncated first: ``Path.write_text``); a link's target is replaced and the link kept."""
    import gnncompile.paths as paths

    plan = halo_plan()
    path = plan.save(tmp_path / "plan.json")
    before = path.read_text()

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paths.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        plan.save(path)
    monkeypatch.undo()
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert read_plan(plan.save(link)) == plan and link.is_symlink()
