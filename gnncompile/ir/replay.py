"""`replay(plan, seconds)`: the one multi-rank replay engine of plans, and its deadlock error.

Both the verifier's dry run (:func:`gnncompile.ir.verify_plan.verify_plan`, unit costs) and the
simulator (:func:`gnncompile.cost_models.simulate.simulate`, a cost model's costs) replay a plan
here: all ranks' instruction lists together, given how long each instruction runs
(``seconds(rank, index)``). The result is one :class:`ReplayEvent` per instruction, or one
:class:`~gnncompile.errors.VerificationError`.

Semantics
---------
- Every rank issues its instructions in program order on in-order *queues*. By default
  (``overlap=False``) a rank runs one instruction at a time (blocking collectives, as the runtime
  does), except posted instructions (the rule's ``posted``: all-to-alls), which the runtime posts
  without waiting: they run in order on a queue of their own, and the instructions depending on them
  (data dependencies, below) wait for them. With ``overlap=True`` each instruction runs on its
  ``stream(rank, index)``, each stream an in-order queue: an instruction starts when its stream is
  free and the instructions of the same rank it depends on have finished.
- Rendezvous (the rules of :mod:`gnncompile.ir.rules`: ``kind``, ``side``, ``signature``): a Send
  is eager (the runtime's ``isend``): it runs for its seconds as soon as it is ready. The k-th Send
  from r to q matches the k-th Recv on q from r, which ends (taking no time of its own) at the later
  of its ready time and the Send's end. The k-th collective over a group on each member is the same
  collective (the members must agree in its ``signature``); it starts when every member is ready
  and ends on all at ``start + max`` of the members' seconds.
- Data dependencies (with ``overlap=True``, or for a plan with posted instructions), per rank, from
  the effects table of :mod:`gnncompile.ir.dataflow` (``(value, chunk)`` pairs; the plan inputs,
  ``plan.info["inputs"]`` or ``g``/``x``, are there at time 0): an instruction waits for the last
  write of each value it reads (a Send/Recv its ``local`` name), including the ``saved`` values of a
  Backward (so it follows its Forward); for every contribution issued before it to each gradient it
  reads; ``AR v`` reads and rewrites ``v`` on every chunk written so far; ``AR grads`` waits for the
  Backwards since the previous ``AR grads`` (and that one). Free waits for the write and every read of its value since (but a posted instruction's,
  which copied its input when it was posted); OPT waits for every earlier instruction and every later
  instruction waits for it.
- If no rank can advance while some have instructions left, the :func:`deadlock` error lists every
  blocked instruction (the head of each of its rank's queues that cannot start), its rank and step,
  and whom it waits for, with the instruction windows of the first few.

The replay is a single pass over a dependency graph (no contention besides the in-order queues, so
start times follow from end times): O(instructions + dependencies + group sizes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Hashable, NamedTuple, Optional, Sequence

from ..errors import VerificationError
from .dataflow import effects
from .plan import DevicePlan, Plan
from .rules import InstructionRule, channel, rule

__all__ = ["ReplayEvent", "replay", "dependencies", "deadlock", "instruction_window", "WINDOW", "WHOLE_RANK"]

#: Instructions shown on each side of the faulty one in an error.
WINDOW = 3
#: Instructions shown when an error concerns a whole rank.
WHOLE_RANK = 40
#: How many blocked instructions a deadlock error shows the windows of.
DEADLOCK_WINDOWS = 4


class ReplayEvent(NamedTuple):
    """Instruction ``index`` of ``rank`` ran on ``stream`` from ``start`` to ``end``; it was ready on
    its side at ``ready`` (``start - ready`` was spent waiting for partners)."""

    rank: int
    index: int
    stream: str
    ready: float
    start: float
    end: float


# --------------------------------------------------------------------------- errors
def instruction_window(dp: DevicePlan, index: Optional[int]) -> str:
    """Rank ``dp``'s instructions around ``index`` (marked ``>>``; ``WINDOW`` each side); the first
    ``WHOLE_RANK`` of them when ``index`` is None. Every plan error shows its sites this way."""
    insts = dp.instructions
    lo, hi = (0, min(len(insts), WHOLE_RANK)) if index is None else \
        (max(0, index - WINDOW), min(len(insts), index + WINDOW + 1))
    lines = [f"  rank {dp.rank}:" + ("" if insts else " (no instructions)")]
    if lo > 0:
        lines.append("          ...")
    lines += [f"    {'>>' if k == index else '  '} {k:>4}  {insts[k]}" for k in range(lo, hi)]
    if hi < len(insts):
        lines.append(f"          ... ({len(insts) - hi} more)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- dependencies
def dependencies(dp: DevicePlan, inputs: frozenset[str], queues: Sequence[str],
                  rules: Optional[Sequence[InstructionRule]] = None) -> list[set[int]]:
    """Per instruction of ``dp``, the earlier instructions of the rank it depends on: the effects of
    :mod:`gnncompile.ir.dataflow` with the replay's policy (module docstring). ``queues[i]``: the
    in-order queue instruction i runs on; ``rules``: the instructions' rules (looked up if None)."""
    if rules is None:
        rules = [rule(inst) for inst in dp.instructions]
    stages = {s.index: s for s in dp.stages}
    writer: dict[tuple[str, int], int] = {}
    readers: dict[tuple[str, int], list[int]] = defaultdict(list)
    chunks_of: dict[str, set[int]] = defaultdict(set)
    grad_writers: dict[tuple[str, int], list[int]] = defaultdict(list)
    accumulated: list[int] = []  # Backwards since the last `AR grads` (and that one)
    last_on: dict[str, int] = {}
    barrier: Optional[int] = None
    out: list[set[int]] = []

    def read(deps: set[int], i: int, v: str, c: int) -> None:
        if v in inputs:
            return
        w = writer.get((v, c))
        if w is not None:
            deps.add(w)
        readers[v, c].append(i)

    def write(i: int, v: str, c: int) -> None:
        writer[v, c] = i
        readers.pop((v, c), None)
        chunks_of[v].add(c)

    for i, inst in enumerate(dp.instructions):
        try:
            eff = effects(inst, stages)
        except KeyError:  # a Forward/Backward/Recompute of a stage the rank lacks
            raise VerificationError(
                f"rank {dp.rank} step {i} `{inst}`: rank {dp.rank} has no stage {inst.stage}") from None
        deps: set[int] = set()
        for v, c in eff.reads + eff.saved:
            read(deps, i, v, c)
        for key in eff.grad_reads:
            deps.update(grad_writers.get(key, ()))
        for v in eff.reduced:
            if v not in inputs:
                for c in sorted(chunks_of[v]):
                    read(deps, i, v, c)
                    write(i, v, c)
        for v, c in eff.writes:
            write(i, v, c)
        for key in eff.grad_writes:
            grad_writers[key].append(i)
        for key in eff.frees:
            if key in writer:
                deps.add(writer.pop(key))
            # a posted instruction packs its input into a send buffer of its own when it is posted:
            # freeing the input does not wait for the transfer
            deps.update(j for j in readers.pop(key, ()) if not rules[j].posted)
        if eff.params == "accumulate":
            accumulated.append(i)
        elif eff.params == "reduce":
            deps.update(accumulated)
            accumulated = [i]  # a later `AR grads` waits for this one (and so for these Backwards)
        elif eff.params == "update":
            deps.update(last_on.values())  # queues are in order: their last instructions end last
        if barrier is not None:
            deps.add(barrier)
        if eff.params == "update":
            barrier = i
        deps.discard(i)
        out.append(deps)
        last_on[queues[i]] = i
    return out


# --------------------------------------------------------------------------- engine
def replay(plan: Plan, seconds: Callable[[int, int], float], *,
           stream: Optional[Callable[[int, int], str]] = None, overlap: bool = False) -> list[list[ReplayEvent]]:
    """Replay one training step of ``plan`` on all ranks (semantics: module docstring).

    ``seconds(rank, index)``: how long instruction ``index`` of ``rank`` runs (finite, >= 0; a Recv's
    is ignored), called once per instruction. ``stream(rank, index)``: the stream it runs on (default
    ``"compute"``), an in-order queue of its own with ``overlap=True``, only a label otherwise.
    Returns per rank its :class:`ReplayEvent` s in program order. Raises
    :class:`~gnncompile.errors.VerificationError` for a peer or group that is not of the plan, an
    unmatched Send or Recv, or a deadlock (:func:`deadlock`).
    """
    n = plan.num_ranks
    progs = [dp.instructions for dp in plan.ranks]
    rules = [[rule(inst) for inst in p] for p in progs]
    durations = [[seconds(r, i) for i in range(len(p))] for r, p in enumerate(progs)]
    streams = [[stream(r, i) for i in range(len(p))] if stream is not None else ["compute"] * len(p)
               for r, p in enumerate(progs)]

    # in-order queues: the streams, or the whole rank (with the posted instructions on their own)
    posted = not overlap and any(rl.posted for row in rules for rl in row)
    queues = streams if overlap else [["posted" if rl.posted else "rank" for rl in row] for row in rules]
    prev: list[list[int]] = []
    nxt: list[list[int]] = []
    heads: list[list[int]] = []
    for q in queues:
        if len(set(q)) <= 1:  # one queue: program order
            prev.append(list(range(-1, len(q) - 1)))
            nxt.append(list(range(1, len(q))) + [-1] if q else [])
            heads.append([0] if q else [])
            continue
        pr, nx = [-1] * len(q), [-1] * len(q)
        last: dict[str, int] = {}
        for i, name in enumerate(q):
            if name in last:
                pr[i], nx[last[name]] = last[name], i
            last[name] = i
        prev.append(pr)
        nxt.append(nx)
        heads.append([i for i in range(len(q)) if pr[i] < 0])

    # data dependencies
    if overlap or posted:
        names = plan.info.get("inputs", ("g", "x"))
        inputs = frozenset((names,) if isinstance(names, str) else names)
        deps: list[list[set[int]]] = [dependencies(dp, inputs, queues[r], rules[r])
                                      for r, dp in enumerate(plan.ranks)]
        dependents: list[list[list[int]]] = [[[] for _ in p] for p in progs]
        for r, row in enumerate(deps):
            for i, d in enumerate(row):
                for j in d:
                    dependents[r][j].append(i)
    else:  # no data dependencies: one shared empty set and list (never mutated)
        deps = [[set()] * len(p) for p in progs]
        dependents = [[[]] * len(p) for p in progs]
    missing = [[len(d) for d in row] for row in deps]

    # rendezvous: key -> {rank: index}, the ranks expected there
    key_of: list[list[Optional[Hashable]]] = [[None] * len(p) for p in progs]
    sites: dict[Hashable, dict[int, int]] = defaultdict(dict)
    expected: dict[Hashable, tuple[int, ...]] = {}
    counts: dict[Hashable, int] = defaultdict(int)
    valid_groups: dict[tuple[int, ...], frozenset[int]] = {}  # a group's members (empty: not a valid group)
    for r, prog in enumerate(progs):
        for i, inst in enumerate(prog):
            rl = rules[r][i]
            if rl.kind == "p2p":
                if not (0 <= inst.peer < n) or inst.peer == r:
                    raise VerificationError(f"rank {r} step {i} `{inst}`: peer {inst.peer} is not another rank "
                                            f"of this {n}-rank plan")
                pair = channel(inst, r)
                k = counts[rl.side, pair]
                counts[rl.side, pair] = k + 1
                key: Hashable = ("p2p", pair, k)
                expected[key] = pair
            elif rl.kind == "collective":
                group = tuple(inst.group)
                members = valid_groups.get(group)
                if members is None:  # checked once per group (every member's instructions name it)
                    ok = all(0 <= m < n for m in group) and len(set(group)) == len(group)
                    members = valid_groups[group] = frozenset(group) if ok else frozenset()
                if r not in members:
                    raise VerificationError(f"rank {r} step {i} `{inst}`: group {group} must hold distinct ranks "
                                            f"of this {n}-rank plan, including rank {r}")
                k = counts["coll", group, r]
                counts["coll", group, r] = k + 1
                key = ("coll", group, k)
                expected[key] = group
            else:
                continue
            key_of[r][i] = key
            sites[key][r] = i

    for key, at in sites.items():
        if key[0] == "p2p" and len(at) < 2:
            (r, i), = at.items()
            inst = progs[r][i]
            other = "RECV on" if rules[r][i].side == "send" else "SEND from"
            raise VerificationError(f"rank {r} step {i} `{inst}` has no matching {other} rank {inst.peer}\n"
                                    + instruction_window(plan.ranks[r], i))

    # event loop over the dependency graph
    ready: list[list[Optional[float]]] = [[None] * len(p) for p in progs]
    start: list[list[float]] = [[math.nan] * len(p) for p in progs]
    end: list[list[Optional[float]]] = [[None] * len(p) for p in progs]
    pred_done = [[False] * len(p) for p in progs]
    arrived: dict[Hashable, list] = {}  # key -> [count, latest ready time]
    sent_end: dict[Hashable, float] = {}  # p2p key -> when its Send ended
    recv_waiting: dict[Hashable, tuple[int, int, float]] = {}  # p2p key -> the Recv waiting for it
    done = 0
    todo: list[tuple[int, int]] = []

    def finish(r: int, i: int, s: float, e: float) -> None:
        nonlocal done
        start[r][i], end[r][i] = s, e
        done += 1
        j = nxt[r][i]
        if j >= 0:
            pred_done[r][j] = True
            todo.append((r, j))
        for d in dependents[r][i]:
            missing[r][d] -= 1
            if not missing[r][d]:
                todo.append((r, d))

    for r, hs in enumerate(heads):
        for i in hs:
            pred_done[r][i] = True
            todo.append((r, i))
    while todo:
        r, i = todo.pop()
        if ready[r][i] is not None or missing[r][i] or not pred_done[r][i]:
            continue
        p = prev[r][i]
        t = end[r][p] if p >= 0 else 0.0
        for d in deps[r][i]:
            t = max(t, end[r][d])
        ready[r][i] = t
        key = key_of[r][i]
        if key is None:
            finish(r, i, t, t + durations[r][i])
            continue
        if key[0] == "p2p":
            if rules[r][i].side == "send":
                e = t + durations[r][i]
                finish(r, i, t, e)
                sent_end[key] = e
                waiting = recv_waiting.pop(key, None)
                if waiting is not None:
                    q, j, tq = waiting
                    finish(q, j, max(tq, e), max(tq, e))
            elif key in sent_end:
                e = max(t, sent_end[key])
                finish(r, i, e, e)
            else:
                recv_waiting[key] = (r, i, t)
            continue
        a = arrived.setdefault(key, [0, 0.0])
        a[0] += 1
        a[1] = max(a[1], t)
        members = sites[key]
        if a[0] == len(expected[key]) and \
                len({rules[m][j].signature(progs[m][j]) for m, j in members.items()}) == 1:
            e = a[1] + max(durations[m][j] for m, j in members.items())
            for m, j in members.items():
                finish(m, j, a[1], e)

    total = sum(len(p) for p in progs)
    if done < total:
        raise deadlock(plan, queues, deps, ready, end, key_of, sites, expected)
    return [[ReplayEvent(r, i, streams[r][i], ready[r][i], start[r][i], end[r][i]) for i in range(len(p))]
            for r, p in enumerate(progs)]


# --------------------------------------------------------------------------- deadlock
def deadlock(plan: Plan, queues: Sequence[Sequence[str]], deps: Sequence[Sequence[set[int]]],
             ready: Sequence[Sequence[Optional[float]]], end: Sequence[Sequence[Optional[float]]],
             key_of: Sequence[Sequence[Optional[Hashable]]], sites: dict[Hashable, dict[int, int]],
             expected: dict[Hashable, tuple[int, ...]]) -> VerificationError:
    """The one deadlock error of plans, from the state of a stuck :func:`replay`.

    The first line counts the instructions completed; then one line per blocked instruction (the
    first unfinished one of each queue of each rank, by rank and step): ``rank r at step i `inst```
    and what it waits for: ``a SEND from rank q, <q's state>`` (a Recv), ``group G: rank m, <m's
    state>; ...`` (a collective, the members not yet at it), ``its own step d `inst``` (a data
    dependency) or ``its stream``. A rank's state is ``which is at step k `inst``` (its first
    unfinished instruction on the queue of the awaited one; ``over group G`` for a collective) or
    ``which has finished its instructions``, with ``(no matching instruction)`` or ``(a different
    one)`` (a collective disagreeing in its signature) where so. Then the instruction windows of the
    first :data:`DEADLOCK_WINDOWS` blocked instructions.
    """
    progs = [dp.instructions for dp in plan.ranks]
    done = sum(e is not None for row in end for e in row)
    total = sum(len(p) for p in progs)

    def head(q: int, queue: str) -> Optional[int]:
        return next((k for k, s in enumerate(queues[q]) if s == queue and end[q][k] is None), None)

    def state(q: int, k: Optional[int]) -> str:
        if k is None:
            return "which has finished its instructions"
        inst = progs[q][k]
        group = f" over group {tuple(inst.group)}" if rule(inst).kind == "collective" else ""
        return f"which is at step {k} `{inst}`{group}"

    lines, shown = [], []
    for r, prog in enumerate(progs):
        for i in sorted({k for k in (head(r, s) for s in dict.fromkeys(queues[r])) if k is not None}):
            inst = prog[i]
            rl = rule(inst)
            if ready[r][i] is None:  # waits for its own queue or data
                d = min((k for k in deps[r][i] if end[r][k] is None), default=None)
                waits = f"its own step {d} `{prog[d]}`" if d is not None else "its stream"
            else:
                key = key_of[r][i]
                mine = rl.signature(inst)
                others = []
                for m in expected[key]:
                    j = sites[key].get(m)
                    if m == r or (j is not None and ready[m][j] is not None and rule(progs[m][j]).signature(
                            progs[m][j]) == mine):
                        continue
                    where = state(m, head(m, queues[m][j]) if j is not None else
                                  next((k for k in range(len(progs[m])) if end[m][k] is None), None))
                    why = " (no matching instruction)" if j is None else \
                        " (a different one)" if ready[m][j] is not None else ""
                    others.append(f"rank {m}, {where}{why}")
                waits = (f"a SEND from {'; '.join(others)}" if rl.kind == "p2p" else
                         f"group {tuple(inst.group)}: " + "; ".join(others))
            lines.append(f"  rank {r} at step {i} `{inst}` waits for {waits}")
            shown.append((r, i))
    windows = [instruction_window(plan.ranks[r], i) for r, i in shown[:DEADLOCK_WINDOWS]]
    return VerificationError("\n".join([f"deadlock: no rank can advance after {done} of {total} instructions "
                                        f"completed"] + lines + windows))
