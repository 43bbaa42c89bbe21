"""Differentiable communication over ``torch.distributed``, with byte accounting per peer.

One code path for every backend (gloo on CPU, NCCL with one GPU per rank, gloo with ranks sharing
GPUs). The backends differ only in the process group and in *host staging*: the operations in
``Communicator.stage_through_host`` (:func:`host_staged_ops`: ``send``/``recv`` for gloo on CUDA
tensors, which gloo runs only on host memory) copy their tensors to host memory, communicate there
and copy the result back to the device; the rest hand device tensors to the library. Staging can be
forced for any operation on any device (tests run the staging path on the CPU).

Each conversion of the lowering has a forward half and a backward half here, used two ways:

- by the executor, which runs a plan's communication instructions one at a time (``HALO h1`` calls
  :meth:`Communicator.halo_forward`, ``HALO^T grad h1`` calls :meth:`Communicator.halo_backward`);
- as autograd functions (:func:`halo_exchange`, :func:`rows_to_cols`, :func:`cols_to_rows`,
  :func:`all_gather_rows`) that compose both halves, for code that wants the communication inside
  one differentiable expression.

Conversions: ``halo`` (rows -> rows + halo rows), ``rows_to_cols``/``cols_to_rows`` (the
all-to-all between vertex-sharded and feature-sharded layouts; the columns are the *last* dimension,
so ``[n, H, C]`` values split ``C``), ``all_gather_rows``/``reduce_scatter_rows`` (rows ->
replicated, whose backward sums the members' partial gradients and keeps each member's rows; and
the reverse), ``send``/``recv`` (between device groups), ``all_reduce_`` (replicated parameters'
gradients).

Byte accounting: :class:`CommStats` counts, per phase (``"train"``, ``"eval"``, ``"metrics"``)
and per peer, the bytes of the tensors this rank hands to the communication library. Point-to-point
and all-to-all traffic is exact. An all-reduce is counted as the ring algorithm moves it:
``2 (n - 1) / n * numel * element_size`` bytes sent to the next rank and received from the
previous one (the bandwidth-optimal volume every cost model uses; the library may pick another
algorithm on the wire). An all-gather or a reduce-scatter of a ``total``-byte (gathered) tensor is
counted likewise as the ring moves it: ``(n - 1) * total // n`` bytes to the next member and from
the previous one (:func:`gnncompile.cost_models.formulas.ring_allgather_bytes`), whatever the
members' row counts; it runs as one all-to-all.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..errors import ArgumentError

__all__ = ["CommStats", "Communicator", "Pending", "complete", "polls_by_default", "HaloSpec", "halo_exchange",
           "rows_to_cols", "cols_to_rows", "all_gather_rows", "reduce_scatter_rows", "offsets", "STAGEABLE_OPS",
           "host_staged_ops", "ProgressRecorder", "set_progress_recorder", "note_progress"]

_F = TypeVar("_F", bound=Callable[..., Any])


class ProgressRecorder(Protocol):
    """Where a rank records its progress, so that the process supervising it can tell, when a run
    stalls, which rank did not reach a communication the others wait in (the launcher installs
    one in each rank it starts: shared memory it reads). Every call must be cheap (microseconds)."""

    def begin(self, op: str) -> None:
        """This process enters communication ``op`` (``"all_reduce"``, ``"recv"``, ...), where it may block."""

    def end(self) -> None:
        """The communication entered last returned."""

    def where(self, text: str) -> None:
        """The program's own position, e.g. ``"step 3 instruction 7 (AR grads)"``."""


_recorder: Optional[ProgressRecorder] = None


def set_progress_recorder(recorder: Optional[ProgressRecorder]) -> None:
    """Record this process's communications (and :func:`note_progress` calls) in ``recorder`` (``None``: stop)."""
    global _recorder
    _recorder = recorder


def note_progress(where: str) -> None:
    """Record the program's position (e.g. ``"step 3 instruction 7 (AR grads)"``) for failure reports;
    a no-op unless a recorder is installed (ranks started by the launcher)."""
    if _recorder is not None:
        _recorder.where(where)


def _tracked(op: str) -> Callable[[_F], _F]:
    """Decorate a method that communicates (and may block) so that the installed
    :class:`ProgressRecorder` sees this process enter and leave it."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            recorder = _recorder
            if recorder is None:
                return method(*args, **kwargs)
            recorder.begin(op)
            try:
                return method(*args, **kwargs)
            finally:
                recorder.end()
        return tracked  # type: ignore[return-value]
    return wrap


#: the ``torch.distributed`` operations a :class:`Communicator` makes, by the names its staging uses:
#: ``send`` (``send``/``isend``), ``recv``, ``all_to_all`` (``all_to_all_single``: halo exchanges,
#: relayouts, and the all-gather and reduce-scatter of rows, which run as all-to-alls) and
#: ``all_reduce``
STAGEABLE_OPS = frozenset({"send", "recv", "all_to_all", "all_reduce"})


def host_staged_ops(backend: str, device_type: str) -> frozenset[str]:
    """The operations whose tensors must go through host memory for ``backend`` on ``device_type``.

    gloo on CUDA tensors (torch 2.11) runs ``all_reduce``, ``all_gather`` and ``all_to_all_single``
    but fails ``send``/``recv`` (and ``reduce_scatter``, which the communicator never calls: its
    reduce-scatter of rows is an all-to-all): those two are staged. NCCL, and gloo on the CPU,
    need none.
    """
    return frozenset({"send", "recv"}) if backend == "gloo" and device_type == "cuda" else frozenset()


def offsets(sizes: Sequence[int]) -> list[int]:
    """``[0, s0, s0 + s1, ...]``: where each rank's block starts, and the total last."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + int(n))
    return out


class _SendWork:
    """A posted send's work handle that keeps its buffer (``t``, or a host staging copy) alive until
    :meth:`wait`, which returns once the library let go of it (:func:`let_go`; ``held``: its
    reference count before it was posted)."""

    def __init__(self, work: Any, buffer: torch.Tensor, held: int) -> None:
        self._work, self._buffer, self._held = work, buffer, held

    @_tracked("wait for a send")
    def wait(self) -> bool:
        if self._work is None:
            return True
        done = self._work.wait()
        self._work = None
        let_go(self._buffer, self._held)
        self._buffer = None  # type: ignore[assignment]
        return done


_yield = getattr(os, "sched_yield", None)

#: How long :func:`complete` polls before it sleeps in the library's wait (seconds): longer than a
#: step's collectives take here (0.2-1 ms), short enough that ranks of jobs sharing the cores do not
#: spin away each other's time (the test suite's two workers: two property tests of multi-rank
#: plans took 51 s polling up to 50 ms, 23 s polling up to 2 ms, 20 s sleeping).
POLL_SECONDS = 0.002


def complete(work: Any, poll: bool = False) -> None:
    """Wait until the communication library's ``work`` has completed (raising its error, if any).

    ``poll``: first yield the core in a loop until ``work`` reports completion (for at most
    :data:`POLL_SECONDS`), then wait. A rank that sleeps in the library's wait lets its core go
    idle, and on a virtual machine waking an idle virtual CPU can take the host a millisecond; a
    yielding rank stays runnable but hands its core to any other runnable thread (a peer rank's
    computation, gloo's own threads). Measured here (2 cores, medians of steps), sleeping against
    polling up to 50 ms: cora's GCN step on 2 ranks 10-11 ms, 5 ms; on 4 ranks 20-25 ms, 10-15 ms;
    on 8 ranks 51, 38-41 ms; coauthor_physics on 4 ranks 116, 105 ms. Polling up to 2 ms (today's
    window) kept the cora gains: 4.7-4.9 ms on 2 ranks, 12-13 ms on 4. A wait longer than :data:`POLL_SECONDS` (a
    slow peer, another job on the cores, a failure the library reports at its timeout) sleeps.
    """
    if poll and _yield is not None:
        deadline = time.perf_counter() + POLL_SECONDS
        while not work.is_completed() and time.perf_counter() < deadline:
            _yield()
    work.wait()


#: the longest a rank waits for the communication library to let go of a completed exchange's
#: buffer (:func:`let_go`)
LET_GO_SECONDS = 0.005


def let_go(buf: Any, held: int) -> None:
    """Wait, yielding the core, until the communication library no longer references the CPU tensor
    ``buf`` of an exchange that completed and whose handle the caller dropped: until its reference
    count is back to ``held`` (taken before it was posted), for at most :data:`LET_GO_SECONDS`.

    gloo's worker thread drops its references to a work's tensors a moment after the work reports
    completion. A buffer whose last reference that thread drops is freed there: after the plan's
    ``Free``, and unseen by :class:`~gnncompile.runtime.memory.PeakMemory` (the profiler records the
    frees of the thread that measures), which then counts it as live to the end of the step."""
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or buf._use_count() <= held:
        return
    deadline = time.perf_counter() + LET_GO_SECONDS
    while buf._use_count() > held and time.perf_counter() < deadline:
        if _yield is not None:
            _yield()


def polls_by_default(backend: str, device: torch.device) -> bool:
    """Whether a rank waits for communication by polling (:func:`complete`): gloo on the CPU, where
    ``os.sched_yield`` exists (however many ranks share the cores: see :func:`complete`). NCCL
    and CUDA tensors wait on their streams."""
    return backend == "gloo" and device.type == "cpu" and _yield is not None


@_tracked("wait for a posted collective")
def _wait_posted(work: Any, poll: bool = False) -> None:
    complete(work, poll)


class Pending:
    """A posted collective: :meth:`wait` completes it (once) and returns its result.

    ``work``: the communication library's handle (``None``: nothing crossed, e.g. one rank);
    ``finish``: builds the result from the received buffer; ``keep``: the send buffer, held until
    the exchange completes (the library reads it in the background) and the library let go of it
    (:func:`let_go`; ``held``: its reference count before it was posted).
    """

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor], keep: Any = None, poll: bool = False,
                 held: int = 0) -> None:
        self._work, self._finish, self._keep, self._poll, self._held = work, finish, keep, poll, held
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                _wait_posted(self._work, self._poll)
                self._work = None
                let_go(self._keep, self._held)
            self._result = self._finish()
            self._work = self._finish = self._keep = None  # type: ignore[assignment]
        return self._result


@dataclass
class CommStats:
    """Bytes sent to / received from each peer, per phase."""

    sent: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    received: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, phase: str, peer: int, sent: int = 0, received: int = 0) -> None:
        if sent:
            self.sent[phase][peer] += int(sent)
        if received:
            self.received[phase][peer] += int(received)

    def total_sent(self, phase: Optional[str] = None) -> int:
        return sum(sum(d.values()) for p, d in self.sent.items() if phase is None or p == phase)

    def total_received(self, phase: Optional[str] = None) -> int:
        return sum(sum(d.values()) for p, d in self.received.items() if phase is None or p == phase)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": {p: dict(d) for p, d in self.sent.items()},
                "received": {p: dict(d) for p, d in self.received.items()}}


@dataclass(frozen=True)
class HaloSpec:
    """A rank's halo exchange lists: local rows to send to each rank, rows received from each."""

    send_index: tuple[torch.Tensor, ...]
    recv_count: tuple[int, ...]
    num_owned: int

    @property
    def send_count(self) -> list[int]:
        return [int(t.numel()) for t in self.send_index]

    @property
    def num_halo(self) -> int:
        return sum(self.recv_count)

    @functools.cached_property
    def send_rows(self) -> torch.Tensor:
        """Every row sent, in peer order (one index: the forward gathers them, the backward adds
        their gradients back); made once per spec."""
        return torch.cat(self.send_index) if self.send_index else torch.zeros(0, dtype=torch.long)


class Communicator:
    """This rank's communication: halo exchange, all-reduce, point-to-point, with accounting.

    ``group`` is the process group (``None``: the default group of all ranks). ``phase`` selects the
    :class:`CommStats` bucket that traffic is counted in. ``stage_through_host``: the operations
    (names from :data:`STAGEABLE_OPS`) whose tensors go through host memory: copied to a host
    buffer, communicated, and the received data copied back to the tensors' device (a copy even
    when that device is the CPU, so the staging path runs, and is tested, everywhere). Results,
    byte counts and the order of operations do not depend on it. ``poll``: wait for receives,
    all-to-alls and all-reduces by polling (:func:`complete`; the executor passes
    :func:`polls_by_default`).
    """

    def __init__(self, rank: int, world_size: int, group: Any = None,
                 stage_through_host: frozenset[str] | set[str] = frozenset(), poll: bool = False) -> None:
        unknown = sorted(set(stage_through_host) - STAGEABLE_OPS)
        if unknown:
            raise ArgumentError(f"stage_through_host: unknown operation(s) {unknown}; valid: {sorted(STAGEABLE_OPS)}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.stage_through_host = frozenset(stage_through_host)
        self.poll = poll
        self.stats = CommStats()
        self.phase = "train"
        #: ``(src, dst) -> process group`` for point-to-point messages from ``src`` to ``dst`` (empty:
        #: ``group``). Under NCCL a pair's sends and receives in one group share a communicator and a
        #: stream, so two ranks that each send before receiving from the other wait on each other;
        #: a group per direction lets both sends progress (:meth:`directional_groups`).
        self.p2p: dict[tuple[int, int], Any] = {}

    def directional_groups(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Create a two-rank process group per ``(src, dst)`` of ``pairs`` for the messages from
        ``src`` to ``dst`` (collective: every rank calls it with the same ``pairs``, in the same
        order)."""
        for src, dst in pairs:
            pg = dist.new_group(sorted((src, dst)))
            if self.rank in (src, dst):
                self.p2p[(src, dst)] = pg

    def _host(self, op: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or a host copy of it when ``op`` is staged."""
        return t.to("cpu", copy=True) if op in self.stage_through_host else t

    @_tracked("all_to_all")
    def _exchange(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                  group: Any = None, size: Optional[int] = None, async_op: bool = False,
                  out: Optional[torch.Tensor] = None) -> Any:
        """All-to-all of rows (``send_counts[q]`` rows to member ``q``), not counted; returns the
        received rows (into ``out``, contiguous rows of their shape, where given). With
        ``async_op`` the exchange is posted and a :class:`Pending` returned whose ``wait()`` gives
        them (on the device of ``send``, staged or not)."""
        tail = tuple(send.shape[1:])
        recv = send.new_empty((sum(recv_counts),) + tail) if out is None else out
        send = send.contiguous()
        finish = (lambda: recv)
        if (self.world_size if size is None else size) <= 1:
            if recv.numel():  # one rank: what it sends to itself is what it receives
                recv.copy_(send.reshape(recv.shape))
            return Pending(None, finish) if async_op else recv
        staged = "all_to_all" in self.stage_through_host
        send_buf = self._host("all_to_all", send)
        recv_buf = torch.empty(recv.shape, dtype=recv.dtype) if staged else recv
        if staged:

            def finish() -> torch.Tensor:
                return recv.copy_(recv_buf)

        def post() -> Any:
            return dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=list(recv_counts),
                                          input_split_sizes=list(send_counts),
                                          group=group if group is not None else self.group, async_op=True)

        if async_op:
            held = send_buf._use_count()
            return Pending(post(), finish, keep=send_buf, poll=self.poll, held=held)
        self._run(post, send_buf)
        return finish()

    def _all_to_all(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                    async_op: bool = False, out: Optional[torch.Tensor] = None) -> Any:
        out = self._exchange(send, send_counts, recv_counts, async_op=async_op, out=out)
        es = send.element_size() * math.prod(send.shape[1:])
        for q in range(self.world_size):
            if q != self.rank:
                self.stats.add(self.phase, q, sent=send_counts[q] * es, received=recv_counts[q] * es)
        return out

    def halo_forward(self, h: torch.Tensor, spec: HaloSpec) -> torch.Tensor:
        """``[n_owned, ...] -> [n_owned + n_halo, ...]``: this rank's rows, then the halo rows. A rank
        without halo rows (one rank alone) gets ``h`` itself (detached), not a copy. Holds one
        buffer of the rows it sends beside ``h`` and the result, which the halo rows are received into."""
        if h.shape[0] != spec.num_owned:
            raise RuntimeError(f"halo exchange: value has {h.shape[0]} rows, rank {self.rank} owns {spec.num_owned}")
        h = h.detach()
        send = h.index_select(0, spec.send_rows) if spec.send_rows.numel() else h[:0]
        n, halo = spec.num_owned, spec.num_halo
        if not halo:
            self._all_to_all(send, spec.send_count, spec.recv_count)
            return h
        out = h.new_empty((n + halo,) + tuple(h.shape[1:]))
        out[:n].copy_(h)
        self._all_to_all(send, spec.send_count, spec.recv_count, out=out[n:])
        return out

    def halo_backward(self, grad_ext: torch.Tensor, spec: HaloSpec) -> torch.Tensor:
        """Gradient of :meth:`halo_forward`: halo rows' gradients go back and add up at their owners.
        Where no rows are exchanged either way the gradient is ``grad_ext`` itself, not a copy."""
        n = spec.num_owned
        grad_ext = grad_ext.detach()
        back = self._all_to_all(grad_ext[n:], spec.recv_count, spec.send_count)
        if grad_ext.shape[0] == n and not back.shape[0]:
            return grad_ext
        grad = grad_ext[:n].clone()
        if back.shape[0]:
            grad.index_add_(0, spec.send_rows, back)
        return grad

    def _all_to_all_blocks(self, blocks: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]],
                           finish: Callable[[list[torch.Tensor]], torch.Tensor]) -> "Pending":
        """Post sending ``blocks[q]`` to rank ``q``; the result is ``finish`` of the blocks received
        from each rank (shapes given), once the exchange has completed."""
        send = torch.cat([b.reshape(-1) for b in blocks])
        send_counts = [b.numel() for b in blocks]
        recv_counts = [math.prod(sh) for sh in recv_shapes]
        posted = self._all_to_all(send.reshape(-1, 1), send_counts, recv_counts, async_op=True)
        starts = offsets(recv_counts)

        def unpack() -> torch.Tensor:
            flat = posted.wait().reshape(-1)
            return finish([flat[starts[q]:starts[q + 1]].reshape(recv_shapes[q]) for q in range(len(recv_shapes))])
        return Pending(None, unpack)

    def rows_to_cols(self, h: torch.Tensor, row_counts: Sequence[int], col_splits: Sequence[int]) -> torch.Tensor:
        """``rows`` -> ``cols`` layout: ``[n_r, ..., D]`` (this rank's rows) -> ``[N, ..., d_r]`` (every row,
        this rank's columns of the last dimension). ``row_counts[q]`` rows live on rank ``q``; rank
        ``q`` gets columns ``col_splits[q]`` wide, in rank order. NeutronTP's *split* and MixGCN's
        shuffle."""
        return self.rows_to_cols_async(h, row_counts, col_splits).wait()

    def rows_to_cols_async(self, h: torch.Tensor, row_counts: Sequence[int], col_splits: Sequence[int]) -> "Pending":
        """:meth:`rows_to_cols` posted without waiting (the transfer overlaps what the rank does until
        it waits for the result)."""
        h = h.detach()
        if h.dim() < 2 or h.shape[-1] != sum(col_splits) or h.shape[0] != row_counts[self.rank]:
            raise RuntimeError(f"rows_to_cols: rank {self.rank} holds {list(h.shape)}, expected "
                               f"[{row_counts[self.rank]}, ..., {sum(col_splits)}]")
        c = offsets(col_splits)
        mid = tuple(int(d) for d in h.shape[1:-1])
        blocks = [h[..., c[q]:c[q + 1]].contiguous() for q in range(self.world_size)]
        mine = col_splits[self.rank]
        return self._all_to_all_blocks(blocks, [(int(row_counts[q]),) + mid + (int(mine),)
                                                for q in range(self.world_size)],
                                       torch.cat)  # not a closure over h: the rank drops it as the exchange posts

    def cols_to_rows(self, h: torch.Tensor, row_counts: Sequence[int], col_splits: Sequence[int]) -> torch.Tensor:
        """``cols`` -> ``rows`` layout, the inverse of :meth:`rows_to_cols`: ``[N, ..., d_r] -> [n_r, ..., D]``."""
        return self.cols_to_rows_async(h, row_counts, col_splits).wait()

    def cols_to_rows_async(self, h: torch.Tensor, row_counts: Sequence[int], col_splits: Sequence[int]) -> "Pending":
        """:meth:`cols_to_rows` posted without waiting."""
        h = h.detach()
        if h.dim() < 2 or h.shape[0] != sum(row_counts) or h.shape[-1] != col_splits[self.rank]:
            raise RuntimeError(f"cols_to_rows: rank {self.rank} holds {list(h.shape)}, expected "
                               f"[{sum(row_counts)}, ..., {col_splits[self.rank]}]")
        r = offsets(row_counts)
        mid = tuple(int(d) for d in h.shape[1:-1])
        blocks = [h[r[q]:r[q + 1]].contiguous() for q in range(self.world_size)]
        mine = row_counts[self.rank]
        return self._all_to_all_blocks(blocks, [(int(mine),) + mid + (int(col_splits[q]),)
                                                for q in range(self.world_size)],
                                       lambda got: torch.cat(got, dim=-1))  # not over h, as above

    def _ring_count(self, total_bytes: int, members: list[int]) -> None:
        """Count a ring all-gather / reduce-scatter of ``total_bytes`` (the gathered tensor)."""
        n = len(members)
        if n <= 1:
            return
        ring = (n - 1) * total_bytes // n
        me = members.index(self.rank)
        self.stats.add(self.phase, members[(me + 1) % n], sent=ring)
        self.stats.add(self.phase, members[(me - 1) % n], received=ring)

    def all_gather_rows(self, h: torch.Tensor, row_counts: Sequence[int], group: Any = None,
                        members: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``rows`` -> ``replicated``: ``[row_counts[me], ...]`` -> ``[sum(row_counts), ...]``, every member's
        rows in member order. ``group``/``members``: a sub-group instead of all ``world_size`` ranks."""
        members = list(members) if members is not None else list(range(self.world_size))
        n, me = len(members), members.index(self.rank)
        h = h.detach().contiguous()
        if h.shape[0] != row_counts[me] or len(row_counts) != n:
            raise RuntimeError(f"all_gather_rows: rank {self.rank} holds {list(h.shape)}, expected "
                               f"{row_counts[me] if len(row_counts) == n else '?'} rows of {n} members' {list(row_counts)}")
        out = self._exchange(torch.cat([h] * n) if n > 1 else h, [h.shape[0]] * n, list(row_counts), group, n)
        self._ring_count(out.numel() * out.element_size(), members)
        return out

    def reduce_scatter_rows(self, t: torch.Tensor, row_counts: Sequence[int], group: Any = None,
                            members: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Sum-reduce-scatter, the gradient of :meth:`all_gather_rows`: ``[sum(row_counts), ...]`` (a partial
        sum on every member) -> ``[row_counts[me], ...]``, this member's rows of the sum over members."""
        members = list(members) if members is not None else list(range(self.world_size))
        n, me = len(members), members.index(self.rank)
        t = t.detach().contiguous()
        if t.shape[0] != sum(row_counts) or len(row_counts) != n:
            raise RuntimeError(f"reduce_scatter_rows: rank {self.rank} holds {list(t.shape)}, expected "
                               f"{sum(row_counts)} rows over {n} members")
        mine = int(row_counts[me])
        got = self._exchange(t, list(row_counts), [mine] * n, group, n)
        self._ring_count(t.numel() * t.element_size(), members)
        return got.reshape((n, mine) + tuple(t.shape[1:])).sum(0)

    @_tracked("send")
    def send(self, t: torch.Tensor, peer: int) -> None:
        """Blocking send of ``t`` to rank ``peer`` (counted)."""
        t = t.detach().contiguous()
        dist.send(self._host("send", t), dst=peer, group=self.p2p.get((self.rank, peer), self.group))
        self.stats.add(self.phase, peer, sent=t.numel() * t.element_size())

    @_tracked("recv")
    def recv(self, shape: Sequence[int], dtype: torch.dtype, peer: int, device: Any = "cpu") -> torch.Tensor:
        """Blocking receive of a ``shape``/``dtype`` tensor from rank ``peer`` onto ``device`` (counted)."""
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        group = self.p2p.get((peer, self.rank), self.group)
        if "recv" in self.stage_through_host:
            host = torch.empty(tuple(shape), dtype=dtype)
            complete(dist.irecv(host, src=peer, group=group), self.poll)
            t.copy_(host)
        else:
            complete(dist.irecv(t, src=peer, group=group), self.poll)
        self.stats.add(self.phase, peer, received=t.numel() * t.element_size())
        return t

    @_tracked("isend")
    def isend(self, t: torch.Tensor, peer: int) -> Any:
        """Non-blocking send of ``t`` to rank ``peer`` (counted); returns the work handle. ``t`` must
        stay alive and unchanged until the handle's ``wait()`` returns."""
        t = t.detach().contiguous()
        self.stats.add(self.phase, peer, sent=t.numel() * t.element_size())
        buf = self._host("send", t)
        held = buf._use_count()
        return _SendWork(dist.isend(buf, dst=peer, group=self.p2p.get((self.rank, peer), self.group)), buf, held)

    def all_reduce_(self, tensors: Sequence[torch.Tensor], group: Any = None,
                    members: Optional[Sequence[int]] = None) -> None:
        """Sum ``tensors`` in place across the group (flattened into one bucket).

        ``group``/``members``: a sub-group (process group and its ranks) instead of this
        communicator's group of all ``world_size`` ranks.
        """
        if not tensors:
            return
        members = list(members) if members is not None else list(range(self.world_size))
        n = len(members)
        if n <= 1:
            return
        flat = torch._utils._flatten_dense_tensors(list(tensors))
        self.sum_(flat, group)
        for t, r in zip(tensors, torch._utils._unflatten_dense_tensors(flat, list(tensors))):
            t.copy_(r)
        ring = 2 * (n - 1) * flat.numel() * flat.element_size() // n
        me = members.index(self.rank)
        self.stats.add(self.phase, members[(me + 1) % n], sent=ring)
        self.stats.add(self.phase, members[(me - 1) % n], received=ring)

    @_tracked("all_reduce")
    def sum_(self, t: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Sum ``t`` in place across the group (``None``: this communicator's) and return it; not
        counted (the caller counts what it moves)."""
        group = group if group is not None else self.group
        if "all_reduce" in self.stage_through_host:
            host = t.to("cpu", copy=True)
            self._run(lambda: dist.all_reduce(host, group=group, async_op=True), host)
            return t.copy_(host)
        self._run(lambda: dist.all_reduce(t, group=group, async_op=True), t)
        return t

    def _run(self, post: Callable[[], Any], buf: torch.Tensor) -> None:
        """Post a collective on ``buf`` (``post()`` returns its work), wait for it and for the library
        to let go of ``buf`` (:func:`let_go`)."""
        held = buf._use_count()
        complete(post(), self.poll)
        let_go(buf, held)


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, comm: Communicator, spec: HaloSpec) -> torch.Tensor:
        ctx.comm, ctx.spec = comm, spec
        return comm.halo_forward(h, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.comm.halo_backward(grad.contiguous(), ctx.spec), None, None


def halo_exchange(h: torch.Tensor, comm: Communicator, spec: HaloSpec) -> torch.Tensor:
    """Differentiable halo exchange: this rank's rows then the halo rows, gradients sent back."""
    return _HaloExchange.apply(h, comm, spec)


class _Relayout(torch.autograd.Function):
    """rows -> cols (``to_cols``) or cols -> rows; the backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, comm: Communicator, row_counts: tuple, col_splits: tuple,
                to_cols: bool) -> torch.Tensor:
        ctx.args = (comm, row_counts, col_splits, to_cols)
        move = comm.rows_to_cols if to_cols else comm.cols_to_rows
        return move(h, row_counts, col_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        comm, row_counts, col_splits, to_cols = ctx.args
        move = comm.cols_to_rows if to_cols else comm.rows_to_cols
        return move(grad.contiguous(), row_counts, col_splits), None, None, None, None


def rows_to_cols(h: torch.Tensor, comm: Communicator, row_counts: Sequence[int], col_splits: Sequence[int]
                 ) -> torch.Tensor:
    """Differentiable all-to-all ``rows -> cols`` (its backward is ``cols -> rows`` of the gradient)."""
    return _Relayout.apply(h, comm, tuple(row_counts), tuple(col_splits), True)


def cols_to_rows(h: torch.Tensor, comm: Communicator, row_counts: Sequence[int], col_splits: Sequence[int]
                 ) -> torch.Tensor:
    """Differentiable all-to-all ``cols -> rows`` (its backward is ``rows -> cols`` of the gradient)."""
    return _Relayout.apply(h, comm, tuple(row_counts), tuple(col_splits), False)


class _GatherScatterRows(torch.autograd.Function):
    """All-gather of rows (``gather``) or sum-reduce-scatter; each one's backward is the other of the
    gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, comm: Communicator, row_counts: tuple, gather: bool) -> torch.Tensor:
        ctx.args = (comm, row_counts, gather)
        return comm.all_gather_rows(h, row_counts) if gather else comm.reduce_scatter_rows(h, row_counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        comm, row_counts, gather = ctx.args
        back = comm.reduce_scatter_rows if gather else comm.all_gather_rows
        return back(grad.contiguous(), row_counts), None, None, None


def all_gather_rows(h: torch.Tensor, comm: Communicator, row_counts: Sequence[int]) -> torch.Tensor:
    """Differentiable all-gather ``rows -> replicated`` (its backward reduce-scatters the gradient: every
    rank's gradient of the gathered tensor is a partial sum, and rank ``r`` keeps its rows of the total)."""
    return _GatherScatterRows.apply(h, comm, tuple(row_counts), True)


def reduce_scatter_rows(t: torch.Tensor, comm: Communicator, row_counts: Sequence[int]) -> torch.Tensor:
    """Differentiable sum-reduce-scatter (its backward all-gathers the gradient)."""
    return _GatherScatterRows.apply(t, comm, tuple(row_counts), False)
