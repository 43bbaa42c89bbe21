"""The dataflow table (:mod:`gnncompile.ir.dataflow`) and its three users: the plan verifier's
use-before-definition check, the simulator's dependencies and ``insert_frees``' placement agree with
it on every instruction of real plans of each strategy."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest

import gnncompile as gc
from gnncompile.errors import VerificationError
from gnncompile.ir.dataflow import RULES, Effects, effects, stage_reads
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
    Recompute,
    Recv,
    ReduceScatter,
    Send,
    StageSpec,
)
from gnncompile.ir.replay import dependencies
from gnncompile.ir.verify_plan import _check_dataflow
from gnncompile.passes.free import insert_frees
from graph_strategies import sbm_graph, seeded_model

# stage 1 reads h (chunk 1 reads chunks 1 and 0) and, from the previous step, chunk 1 of s
STAGES = {0: StageSpec(0, ("x",), ("h",), ("lin",)),
          1: StageSpec(1, ("h", "s", "h"), ("o", "p"), ("prop",), reads=(("h", ((0,), (1, 0))),),
                       stale=(("s", ((1,), ())),))}
G = (0, 1)


# --------------------------------------------------------------------------- the table
def test_every_instruction_class_has_a_rule() -> None:
    assert set(RULES) == set(INSTRUCTIONS.values())


def test_an_instruction_class_without_a_rule_is_a_type_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Custom(Instruction):
        pass

    with pytest.raises(TypeError, match="no dataflow rule for instruction type Custom"):
        effects(Custom(), STAGES)


def test_a_missing_stage_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        effects(Forward(7, 0), STAGES)


@pytest.mark.parametrize("inst, expected", [
    (Forward(0, 1), Effects(reads=(("x", 1),), writes=(("h", 1),))),
    # cross-chunk reads in chunks_read order, each input once; stale reads are not the step's dataflow
    (Forward(1, 1), Effects(reads=(("h", 1), ("h", 0), ("s", 1)), writes=(("o", 1), ("p", 1)))),
    (Recompute(1, 1), Effects(reads=(("h", 1), ("h", 0), ("s", 1)), writes=(("o", 1), ("p", 1)))),
    (Backward(1, 1), Effects(saved=(("o", 1), ("p", 1), ("h", 1), ("h", 0), ("s", 1)),
                             grad_reads=(("o", 1), ("p", 1)), grad_writes=(("h", 1), ("h", 0), ("s", 1)),
                             params="accumulate")),
    (Send("h", 2, 1), Effects(reads=(("h", 2),))),
    (Send("h", 2, 1, grad=True, local="h@cols"), Effects(grad_reads=(("h@cols", 2),))),
    (Recv("h", 2, 1, local="h@cols"), Effects(writes=(("h@cols", 2),))),
    (Recv("h", 2, 1, grad=True), Effects(grad_writes=(("h", 2),))),
    (HaloExchange("h", 1, G, (0, 2), (0, 3), 4), Effects(reads=(("h", 1),), writes=(("h@halo", 1),))),
    (HaloExchange("h", 1, G, (0, 2), (0, 3), 4, grad=True),
     Effects(grad_reads=(("h@halo", 1),), grad_writes=(("h", 1),))),
    (AllToAll("h", 0, G, "rows", "cols"), Effects(reads=(("h", 0),), writes=(("h@cols", 0),))),
    (AllToAll("h", 0, G, "rows", "cols", grad=True), Effects(grad_reads=(("h@cols", 0),), grad_writes=(("h", 0),))),
    (AllGather("h", 0, G), Effects(reads=(("h", 0),), writes=(("h@gathered", 0),))),
    (ReduceScatter("h", 0, G, grad=True), Effects(grad_reads=(("h@scattered", 0),), grad_writes=(("h", 0),))),
    (AllReduce("grads", G), Effects(params="reduce")),
    (AllReduce("h", G), Effects(reduced=("h",))),
    (Free("h", 3), Effects(frees=(("h", 3),))),
    (OptimizerStep(), Effects(params="update")),
])
def test_rules(inst: Instruction, expected: Effects) -> None:
    assert effects(inst, STAGES) == expected


def test_stage_reads() -> None:
    assert stage_reads(STAGES[1], 0) == (("h", 0), ("s", 0))


# --------------------------------------------------------------------------- the users, on real plans
@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(90)


PLANS: dict[str, tuple[int, dict[str, Any]]] = {
    "data": (3, dict(strategy="data")),
    "tensor": (3, dict(strategy="tensor", chunks=1)),
    "tensor-chunks": (3, dict(strategy="tensor", chunks=4)),
    "mop": (3, dict(strategy="mop", chunks=3, sparse_ranks=1)),
    "task": (4, dict(strategy="task", chunks=4)),
    "task-cached": (2, dict(strategy="task", chunks=4, dependencies="cached", semantics="relaxed")),
}


@pytest.fixture(scope="module", params=sorted(PLANS))
def plan(request: pytest.FixtureRequest, sbm: gc.Graph) -> gc.Plan:
    ranks, options = PLANS[request.param]
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 5, c, num_layers=3, dropout=0.5), sbm)
    return gc.plan(model, sbm, ranks, **options)


def _inputs(plan: gc.Plan) -> frozenset[str]:
    return frozenset(plan.info.get("inputs", ("g", "x")))


def _table(dp: DevicePlan) -> list[Effects]:
    stages = {s.index: s for s in dp.stages}
    return [effects(inst, stages) for inst in dp.instructions]


def _first_unavailable(table: list[Effects], inputs: frozenset[str]) -> Optional[tuple[int, tuple[str, int]]]:
    """The first step, and the value, that reads or frees a value that is not stored then, per the table."""
    stored: set[tuple[str, int]] = set()
    for i, eff in enumerate(table):
        missing = [key for key in eff.reads + eff.frees if key[0] not in inputs and key not in stored]
        if missing:
            return i, missing[0]
        stored = (stored - set(eff.frees)) | set(eff.writes)
    return None


def test_the_verifier_reads_what_the_table_says(plan: gc.Plan) -> None:
    """With any one instruction that stores values dropped, the verifier rejects the first step that
    reads or frees a value the table says is not stored then (and accepts the rest)."""
    inputs, chunks, output = _inputs(plan), plan.options.get("chunks", 1), plan.info.get("output")
    for dp in plan.ranks:
        _check_dataflow(dp, inputs, chunks, output)
        table = _table(dp)
        for w, eff in enumerate(table):
            if not eff.writes:
                continue
            cut = dataclasses.replace(dp, instructions=dp.instructions[:w] + dp.instructions[w + 1:])
            first = _first_unavailable(table[:w] + table[w + 1:], inputs)
            if first is None:
                _check_dataflow(cut, inputs, chunks, output)
                continue
            (step, (v, c)) = first
            with pytest.raises(VerificationError) as err:
                _check_dataflow(cut, inputs, chunks, output)
            head = str(err.value).splitlines()[0]
            assert head.startswith(f"rank {dp.rank} step {step} `{cut.instructions[step]}`: needs {v} c{c}, "
                                   "which is not available"), head


def test_the_simulator_depends_on_what_the_table_says(plan: gc.Plan) -> None:
    """Each dependency relates two instructions through the table, and each value read (saved
    values included) depends on its last write, each gradient read on every contribution before it."""
    inputs = _inputs(plan)
    for dp in plan.ranks:
        streams = ["comm" if inst.communicates else "compute" for inst in dp.instructions]
        deps = dependencies(dp, inputs, streams)
        table = _table(dp)
        for i, eff in enumerate(table):
            used = {key for key in eff.reads + eff.saved + eff.frees if key[0] not in inputs}
            for j in deps[i]:
                before = table[j]
                assert j < i
                assert (used & set(before.writes) or set(eff.frees) & set(before.reads + before.saved)
                        or set(eff.grad_reads) & set(before.grad_writes)
                        or (eff.params == "reduce" and before.params in ("accumulate", "reduce"))
                        or "update" in (eff.params, before.params)), (dp.rank, i, j)
            for key in used - set(eff.frees):
                last = max((j for j in range(i) if key in table[j].writes), default=None)
                freed = last is not None and any(key in table[j].frees for j in range(last + 1, i))
                assert last is None or freed or last in deps[i], (dp.rank, i, key)
            for key in eff.grad_reads:
                assert {j for j in range(i) if key in table[j].grad_writes} <= deps[i], (dp.rank, i, key)


def test_frees_follow_the_last_read_in_the_table(plan: gc.Plan) -> None:
    """Every Free that ``insert_frees`` places drops a value the table says was written, after its
    last read in the table: right after a read or write of it or after a receive that completes a
    send of it."""
    bare = [dataclasses.replace(dp, instructions=tuple(i for i in dp.instructions if not isinstance(i, Free)))
            for dp in plan.ranks]
    for dp in insert_frees(bare, keep=_inputs(plan) | {plan.info.get("output")}):
        table = _table(dp)
        for j, inst in enumerate(dp.instructions):
            if not isinstance(inst, Free):
                continue
            key = (inst.value, inst.chunk)
            p = max(k for k in range(j) if not isinstance(dp.instructions[k], Free))
            assert any(key in table[k].writes for k in range(p + 1))
            sent = any(isinstance(dp.instructions[k], Send) and key in table[k].reads for k in range(p))
            assert key in table[p].reads + table[p].writes or (isinstance(dp.instructions[p], Recv) and sent)
            assert not any(key in e.reads for e in table[j + 1:]), (dp.rank, inst)
