"""Release stored values early: ``Free(value, chunk)`` after a value's last use on its rank.

Without ``Free`` a rank keeps every value it stored (stage outputs, received values, collective
outputs) until the end of the step. In a chunk pipeline (the ``task`` strategy) that doubles every
cross-task tensor: the producer keeps the stage output it sent, the consumer keeps its copy. This
pass inserts ``Free(v, c)`` into each rank's instruction list at the first point where

1. no local instruction reads ``(v, c)`` any more in the forward direction (the ``reads`` of
   :mod:`gnncompile.ir.dataflow`: ``Forward`` / ``Recompute`` reading it, a forward ``Send`` or
   collective of it; a Backward's ``saved`` values are its autograd graph's), and
2. every forward ``Send`` of ``(v, c)`` has *provably* completed: the send buffer aliases the value
   (a send of whole rows is not copied), and gloo's ``isend`` completes only when the receiver has
   posted its receive, so the buffer may not be released before. The executor waits for those
   sends at the ``Free``; the position makes the wait return at once. A send ``S`` from ``A`` to
   ``B`` has completed once ``A`` received a message from ``B`` that ``B`` sent after its receive
   matching ``S`` (``B`` runs its list in order, and that receive returns only when ``S``'s data
   arrived). Messages match first-in first-out per ordered pair of ranks (as
   :func:`~gnncompile.ir.verify_plan.verify_plan` checks); a send with no such later message keeps
   its value until the step's end, as before.

The executor, at ``Free``, drops its references to the value and, for a stage output kept only as
the root of its stage's backward, releases the output's storage while keeping its autograd node
(Megatron-LM's ``deallocate_output_tensor``; the backward then passes the output's gradient to the
autograd engine without the shape check, see ``runtime.executor._run_backward``). Results are
unchanged: nothing reads a freed value's data afterwards (``verify_plan`` rejects a plan that does).

Not freed: plan inputs (chunk-independent, resident), the model's output (the loss reads it), values
some stage reads as a previous step's copy (relaxed cached reads keep them for the next step
anyway), and gradients (a gradient leaves the store when its backward consumes it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

from ..ir.dataflow import effects
from ..ir.plan import DevicePlan, Free, Instruction
from ..ir.rules import rule

__all__ = ["insert_frees", "send_completions"]


def send_completions(programs: dict[int, tuple[Instruction, ...]]) -> dict[tuple[int, int], int]:
    """For each ``Send`` (``(rank, index)``), the index of the first instruction on the sending rank
    after which the send has certainly completed (the receive of a message its peer sent after
    receiving it); sends with no such instruction are absent.

    ``programs``: rank -> instruction list of one step, every rank of the plan. Sends and receives
    match in order per ordered pair of ranks, grad and value messages alike (one channel per pair).
    """
    # position of the k-th message from a to b in a's list (Send) and in b's list (Recv)
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, prog in programs.items():
        for i, inst in enumerate(prog):
            side = rule(inst).side
            if side == "send":
                sends.setdefault((r, inst.peer), []).append(i)
            elif side == "recv":
                recvs.setdefault((inst.peer, r), []).append(i)
    out: dict[tuple[int, int], int] = {}
    for (a, b), positions in sends.items():
        matched = recvs.get((a, b), [])
        back_sends = sends.get((b, a), [])     # b's sends to a, in order, and
        back_recvs = recvs.get((b, a), [])     # where a receives them
        for k, i in enumerate(positions):
            if k >= len(matched):  # unmatched send: verify_plan reports it; nothing is certain here
                continue
            received_at = matched[k]
            for m, j in enumerate(back_sends):
                # b's m-th message to a leaves after b received S; a gets it at back_recvs[m]
                if j > received_at and m < len(back_recvs) and back_recvs[m] > i:
                    out[a, i] = back_recvs[m]
                    break
    return out


def insert_frees(ranks: list[DevicePlan], keep: Iterable[str] = ()) -> list[DevicePlan]:
    """``ranks`` with ``Free`` instructions inserted (see the module docstring); ``keep``: value
    names never freed (the plan inputs and the model's output). Instruction lists that already
    contain a ``Free`` are returned unchanged (the pass is idempotent).

    Each ``Free`` goes right after the later of the value's last forward read and the completion
    points of its sends, and before the step's ``OptimizerStep`` (which waits for every send, and
    after which the step ends); a value that would be freed only there is left to the end of the step.
    """
    keep = set(keep)
    programs = {dp.rank: tuple(dp.instructions) for dp in ranks}
    done = send_completions(programs)
    out = []
    for dp in ranks:
        prog = programs[dp.rank]
        if any(rule(inst).kind == "memory" for inst in prog):
            out.append(dp)
            continue
        stages = {s.index: s for s in dp.stages}
        stale = {v for s in dp.stages for v, _ in s.stale}
        end: Optional[int] = next((i for i, inst in enumerate(prog) if rule(inst).kind == "optimizer"), None)
        limit = len(prog) if end is None else end
        until: dict[tuple[str, int], int] = {}  # (value, chunk) -> index after which it may go
        for i, inst in enumerate(prog[:limit]):
            eff = effects(inst, stages)
            for key in eff.writes:
                if key[0] not in keep and key[0] not in stale:
                    until.setdefault(key, i)
            for key in eff.reads:
                if key in until:
                    # a Send's buffer aliases the value until the send has completed
                    until[key] = max(until[key], done.get((dp.rank, i), limit) if rule(inst).side == "send" else i)
        after: dict[int, list[Free]] = {}
        for (v, c), i in until.items():
            if i < limit:
                after.setdefault(i, []).append(Free(v, c))
        if not after:
            out.append(dp)
            continue
        new: list[Instruction] = []
        for i, inst in enumerate(prog):
            new.append(inst)
            new.extend(sorted(after.get(i, ()), key=lambda f: (f.chunk, f.value)))
        out.append(replace(dp, instructions=tuple(new)))
    return out
