"""Memory of the ``task`` strategy: ``Free`` placement, the runtime's release of freed values, and
the cost model's walk over it.

A task plan frees each stored value after its last forward read and after its sends provably
completed (:mod:`gnncompile.passes.free`); the executor drops the value and releases a sent stage
output's storage while its autograd node stays for the backward. Releasing must change no result
(bit for bit) and must lower the measured peak of a propagation rank by at least the bytes of the
outputs it sent.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import gnncompile as gc
from gnncompile.ir.plan import Backward, DevicePlan, Forward, Free, Instruction, OptimizerStep, Recv, Send
from gnncompile.ir.verify_plan import verify_plan
from gnncompile.passes.free import insert_frees, send_completions
from graph_strategies import sbm_graph, seeded_model


# --------------------------------------------------------------------------- send completion
def test_a_send_completes_when_the_peer_answers_after_receiving_it() -> None:
    # A sends x, then receives y, which B sends only after receiving x: x is complete at A's step 1
    a = (Send("x", 0, 1, (2, 3)), Recv("y", 0, 1, (2, 3)))
    b = (Recv("x", 0, 0, (2, 3)), Send("y", 0, 0, (2, 3)))
    assert send_completions({0: a, 1: b}) == {(0, 0): 1}


def test_a_send_answered_before_it_is_received_has_no_completion_point() -> None:
    # B sends y before it receives x: A's receipt of y proves nothing about x
    a = (Send("x", 0, 1, (2, 3)), Recv("y", 0, 1, (2, 3)))
    b = (Send("y", 0, 0, (2, 3)), Recv("x", 0, 0, (2, 3)))
    assert (0, 0) not in send_completions({0: a, 1: b})


def test_messages_match_in_order_per_pair() -> None:
    # A sends x0 and x1; B answers after receiving x0 only: x1 stays open
    a = (Send("x", 0, 1, (1,)), Send("x", 1, 1, (1,)), Recv("y", 0, 1, (1,)))
    b = (Recv("x", 0, 0, (1,)), Send("y", 0, 0, (1,)), Recv("x", 1, 0, (1,)))
    done = send_completions({0: a, 1: b})
    assert done.get((0, 0)) == 2 and (0, 1) not in done


# --------------------------------------------------------------------------- placement in task plans
@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(90)


def _reads(inst: Instruction, stages: dict) -> set[tuple[str, int]]:
    if isinstance(inst, Forward):
        st = stages[inst.stage]
        return {(v, k) for v in st.inputs for k in st.chunks_read(v, inst.chunk)}
    if isinstance(inst, Send) and not inst.grad:
        return {(inst.name, inst.chunk)}
    return set()


@pytest.mark.parametrize("ranks, chunks", [(2, 3), (4, 4), (7, 6)])
def test_frees_follow_the_last_read_and_a_completion_witness(sbm: gc.Graph, ranks: int, chunks: int) -> None:
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 5, c, num_layers=3, dropout=0.5), sbm)
    plan = gc.plan(model, sbm, ranks, strategy="task", chunks=chunks)
    verify_plan(plan)
    frees = 0
    for dp in plan.ranks:
        stages = {s.index: s for s in dp.stages}
        prog = dp.instructions
        opt = next(i for i, inst in enumerate(prog) if isinstance(inst, OptimizerStep))
        for j, inst in enumerate(prog):
            if not isinstance(inst, Free):
                continue
            frees += 1
            key = (inst.value, inst.chunk)
            assert j < opt
            assert not any(key in _reads(later, stages) for later in prog[j + 1:]), f"rank {dp.rank}: {inst}"
            for i, s in enumerate(prog[:j]):
                if isinstance(s, Send) and not s.grad and (s.name, s.chunk) == key:
                    # a message from the same peer arrives between the send and the free
                    assert any(isinstance(r, Recv) and r.peer == s.peer for r in prog[i + 1:j]), \
                        f"rank {dp.rank}: {inst} without a completion witness for {s}"
    assert frees > 0
    # every stage output a rank sends to another task is freed on the sender before the step ends
    sent = {(dp.rank, s.name, s.chunk) for dp in plan.ranks for s in dp.instructions
            if isinstance(s, Send) and not s.grad}
    freed = {(dp.rank, f.value, f.chunk) for dp in plan.ranks for f in dp.instructions if isinstance(f, Free)}
    assert len(sent & freed) >= len(sent) // 2


def test_insert_frees_is_idempotent(sbm: gc.Graph) -> None:
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.0), sbm)
    plan = gc.plan(model, sbm, 4, strategy="task", chunks=4)
    again = insert_frees(list(plan.ranks), keep={"g", "x"})
    assert [dp.instructions for dp in again] == [dp.instructions for dp in plan.ranks]


# --------------------------------------------------------------------------- the runtime's release
def _without_frees(plan: gc.Plan) -> gc.Plan:
    """``plan`` with its Free instructions removed (the runtime then keeps every value to the step's end)."""
    bare = copy.copy(plan)
    bare.ranks = [dataclasses.replace(dp, instructions=tuple(i for i in dp.instructions if not isinstance(i, Free)))
                  for dp in plan.ranks]
    bare.program = [dataclasses.replace(p, instructions=tuple(i for i in p.instructions if not isinstance(i, Free)))
                    for p in plan.program]
    return bare


def _released_output_bytes(dp: DevicePlan) -> int:
    """Bytes of the stage outputs ``dp`` sends whole and frees before its first backward: from the
    plan's shapes (a Send of a whole chunk carries the output's shape)."""
    prog = dp.instructions
    outputs = {o for s in dp.stages for o in s.outputs}
    first_backward = next(i for i, inst in enumerate(prog) if isinstance(inst, Backward))
    freed_early = {(f.value, f.chunk) for f in prog[:first_backward] if isinstance(f, Free)}
    total = 0
    for s in prog:
        if isinstance(s, Send) and not s.grad and s.name in outputs and (s.name, s.chunk) in freed_early:
            total += int(torch.Size(s.shape).numel()) * torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
    return total


def test_release_lowers_the_measured_peak_and_changes_no_result() -> None:
    g = gc.datasets.synthetic("rmat", num_nodes=4096, avg_degree=8, num_features=32, num_classes=4, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2, dropout=0.5)
    plan = gc.plan(copy.deepcopy(model), g, 4, strategy="task", chunks=4)
    bare = _without_frees(plan)
    verify_plan(bare)
    with_free = plan.run(epochs=1, capture=True, update_model=False, timeout=120)
    without = bare.run(epochs=1, capture=True, update_model=False, timeout=120)
    # bit for bit the same step
    assert with_free.history.loss == without.history.loss
    assert torch.equal(with_free.captured["logits"], without.captured["logits"])
    for name, grad in without.captured["grads"].items():
        other = with_free.captured["grads"][name]
        assert (grad is None and other is None) or torch.equal(grad, other), name
    # the first propagation's rank peaks in its backward, where the outputs it sent are gone
    p_ranks = [dp for dp in plan.ranks if any(s.kinds.startswith("P") for s in dp.stages)]
    dp = max(p_ranks, key=_released_output_bytes)
    released, r = _released_output_bytes(dp), dp.rank
    assert released >= 4096 * 64 * 4  # the hidden layer's rows, every chunk
    assert without.ranks[r].peak_memory - with_free.ranks[r].peak_memory >= released, \
        (r, without.ranks[r].peak_memory, with_free.ranks[r].peak_memory, released)
    # the cost model's walk follows the plan's frees: its peak above the resident data (the first
    # step also allocates gradients and Adam's moments) tracks the measured one
    pred = plan.prediction
    above = [p - (st.total - st.gradients - st.optimizer) for p, st in zip(pred.peak_memory, pred.static)]
    measured = [rr.peak_memory for rr in with_free.ranks]
    assert 0.7 * measured[r] <= above[r] <= 1.3 * measured[r], (r, above, measured)
    assert 0.6 * sum(measured) <= sum(above) <= 1.3 * sum(measured), (above, measured)
