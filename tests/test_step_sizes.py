"""Per-step sizes (:class:`~gnncompile.ir.plan.StepSize`): sizes that change every step, named and
bounded, in plans, the verifier and the runtime."""

from __future__ import annotations

import dataclasses
import json
import pickle
from typing import Any

import pytest
import torch

import gnncompile as gc
from gnncompile.errors import RuntimeFailure, VerificationError
from gnncompile.ir.plan import Instruction, Recv, Send, StepSize, read_plan, resolve_shape
from gnncompile.ir.verify_plan import verify_plan
from graph_strategies import sbm_graph, seeded_model
from test_plan import PAIR, SHAPES, edit, pipeline_plan


def test_a_step_size_is_its_bound_and_its_name() -> None:
    n = StepSize("rows_c0", 8)
    assert int(n) == 8 and n.bound == 8 and n + 1 == 9 and n * 4 == 32
    assert n == StepSize("rows_c0", 8) and hash(n) == hash(StepSize("rows_c0", 8))
    assert n != StepSize("rows_c1", 8) and n != StepSize("rows_c0", 9)
    assert n != 8 and 8 != n  # never a fixed size
    assert str(n) == "rows_c0<=8"
    assert pickle.loads(pickle.dumps(n)) == n
    with pytest.raises(VerificationError, match="bound"):
        StepSize("a", -1)
    with pytest.raises(VerificationError, match="name"):
        StepSize("", 3)


def test_instructions_with_step_sizes_round_trip_through_json() -> None:
    for inst in (Send("h", 0, 1, (StepSize("n", 8), 4)),
                 gc.ir.plan.AllToAll("h", 0, PAIR, "rows", "cols", send_shapes=((StepSize("a", 3), 2), (3, 2)),
                                     recv_shapes=((StepSize("a", 3), 2), (5, 2)))):
        back = Instruction.from_dict(json.loads(json.dumps(inst.to_dict())))
        assert back == inst
        shapes = [back.shape] if isinstance(back, Send) else [*back.send_shapes, *back.recv_shapes]
        assert any(isinstance(d, StepSize) for s in shapes for d in s)


def test_resolve_shape() -> None:
    shape = (StepSize("n", 8), 4)
    assert resolve_shape(shape, {"n": 5}) == (5, 4)
    assert resolve_shape((3, 4), {}) == (3, 4)
    with pytest.raises(VerificationError, match="'n' has no value"):
        resolve_shape(shape, {"m": 1})
    with pytest.raises(VerificationError, match="'n' is 9 this step, outside its bound 0..8"):
        resolve_shape(shape, {"n": 9})


def _sized_pipeline(recv_name: str = "n0") -> Any:
    """The verifier's 2-rank pipeline with chunk 0's message rows a per-step size (bound 10)."""
    plan = pipeline_plan()
    rows, width = SHAPES[0]

    def sized(inst: Instruction, name: str) -> Instruction:
        if isinstance(inst, (Send, Recv)) and inst.chunk == 0:
            return dataclasses.replace(inst, shape=(StepSize(name, rows), width))
        return inst

    plan = edit(plan, 0, [sized(i, "n0") for i in plan.ranks[0].instructions])
    return edit(plan, 1, [sized(i, recv_name) for i in plan.ranks[1].instructions])


def test_verifier_accepts_matching_step_sizes_and_counts_their_bounds(tmp_path) -> None:
    plan = _sized_pipeline()
    report = verify_plan(plan)
    assert report.bytes_sent == verify_plan(pipeline_plan()).bytes_sent  # the bound is the fixed size here
    path = tmp_path / "p.json"
    plan.save(path)
    back = read_plan(path)
    assert back.ranks[0].instructions[1].shape[0] == StepSize("n0", SHAPES[0][0])
    assert verify_plan(back).bytes_sent == report.bytes_sent


def test_verifier_refuses_mismatched_step_sizes() -> None:
    with pytest.raises(VerificationError, match="n1<=10|n0<=10"):
        verify_plan(_sized_pipeline(recv_name="n1"))


def test_verifier_refuses_a_step_size_outside_shapes() -> None:
    plan = pipeline_plan()
    bad = [dataclasses.replace(i, peer=StepSize("p", 1)) if isinstance(i, Send) else i
           for i in plan.ranks[0].instructions]
    with pytest.raises(VerificationError, match="field 'peer' holds a per-step size"):
        verify_plan(edit(plan, 0, bad))


# --------------------------------------------------------------------------- the runtime resolves them
def _with_step_sizes(plan: Any, slack: int, actual: int = 0) -> dict[int, dict[str, int]]:
    """Rewrite every Send/Recv of ``plan``'s programs to carry its rows as a per-step size of bound
    ``rows + slack``; each rank's step sizes are the real rows plus ``actual``."""
    sizes: dict[int, dict[str, int]] = {p.rank: {} for p in plan.program}
    for p in plan.program:
        def sized(inst: Instruction) -> Instruction:
            if not isinstance(inst, (Send, Recv)) or not inst.shape:
                return inst
            src, dst = (p.rank, inst.peer) if isinstance(inst, Send) else (inst.peer, p.rank)
            name = f"{inst.value}.c{inst.chunk}.{'b' if inst.grad else 'f'}.{src}>{dst}"
            rows = int(inst.shape[0])
            sizes[p.rank][name] = rows + actual
            return dataclasses.replace(inst, shape=(StepSize(name, rows + slack), *inst.shape[1:]))
        p.instructions = tuple(sized(i) for i in p.instructions)
        p.step.step_sizes = sizes[p.rank]
    return sizes


@pytest.fixture(scope="module")
def task_plan_args() -> tuple:
    g = sbm_graph(40)
    return g, (lambda: seeded_model(lambda f, c: gc.nn.GCN(f, 8, c, num_layers=2, dropout=0.0), g))


def test_runtime_resolves_step_sizes_each_step(task_plan_args: tuple) -> None:
    g, model = task_plan_args
    want = gc.plan(model(), g, 2, strategy="task", chunks=2).run(epochs=1, seed=0, capture=True, device="cpu")
    plan = gc.plan(model(), g, 2, strategy="task", chunks=2)
    sizes = _with_step_sizes(plan, slack=3)
    assert any(sizes.values())
    got = plan.run(epochs=1, seed=0, capture=True, device="cpu")
    assert got.history.loss == want.history.loss
    torch.testing.assert_close(got.captured["logits"], want.captured["logits"], rtol=0, atol=0)


def test_runtime_refuses_a_step_size_over_its_bound(task_plan_args: tuple) -> None:
    g, model = task_plan_args
    plan = gc.plan(model(), g, 2, strategy="task", chunks=2)
    _with_step_sizes(plan, slack=0, actual=1)
    with pytest.raises(RuntimeFailure, match="outside its bound"):
        plan.run(epochs=1, seed=0, device="cpu", timeout=60)
