"""The executor: runs a rank's instruction list with autograd, and ``run_plan`` across ranks.

A rank keeps two stores: values (model inputs, stage outputs, converted values) and gradients of
values. ``Forward(s, c)`` feeds stage ``s``'s inputs as detached leaves (requiring grad when the
value does), runs the stage module and keeps the leaves and outputs for the backward, like a
pipeline stage. ``Backward(s, c)`` back-propagates the stage's outputs with the gradients found in
the gradient store (the loss, for the stage that produces the logits) and adds the leaves'
gradients into the store. Communication instructions call :class:`~gnncompile.runtime.comm.Communicator`
(their ``grad=True`` form moves gradients). Every instruction's start and end time is recorded
(the host clock on the CPU, CUDA events on a GPU).

Devices: a rank computes on ``ctx.device`` (see :func:`~gnncompile.runtime.launcher.resolve_placement`):
its modules and its step inputs (graph, features, labels, masks, halo lists: the step-input provider,
:mod:`gnncompile.runtime.inputs`) move there before training, received tensors and dropout masks
are made there, and its measurements come back on the CPU.

The loss on a rank is ``sum of cross-entropy over its training rows / global training count``;
the reported loss and accuracies are reduced across ranks (counted as ``metrics`` traffic, apart
from the training step's bytes).

Checkpoints (:mod:`gnncompile.runtime.checkpoint`): with ``checkpoint_dir`` every rank writes its
owned parameters and their Adam state, its random streams and its stale chunks after every
``checkpoint_every`` epochs; a resumed rank loads them before its first step and continues the
epoch loop where the checkpoint ended.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.graph import _engine_run_backward

from ..errors import ArgumentError, GraphError, RuntimeFailure, VerificationError
from ..paths import output_problem
from .. import kernels
from ..graph.core import Graph
from ..frontend.ops import MaskCache, MaskDraw, drop_replay, prepare_graph, replay_pack, replay_unpack
from ..nn.functional import prepare_sparse_features
from ..ir.plan import (AllGather, AllReduce, AllToAll, Backward, Forward, Free, HaloExchange, Instruction,
                       OptimizerStep, Plan, RankProgram, Recompute, Recv, ReduceScatter, Send, StageSpec, member_rows,
                       resolve_shape)
from ..ir.rules import register_execute, rule
from . import checkpoint as ckpt
from .comm import Communicator, HaloSpec, Pending, note_progress, polls_by_default
from .inputs import StepInputProvider, StepView
from .launcher import (Placement, RankContext, RankFailure, check_timeout, launch, resolve_placement,
                       visible_gpus)
from .memory import PeakMemory
from .probe import probe
from .trainer import History, ProgressLines, adam, check_training_args, off_schedule_dropped

__all__ = ["TimelineEvent", "RankResult", "RunResult", "run_plan", "run_plan_torchrun", "execute_rank",
           "plan_placement", "describe_run", "plan_fingerprint"]


@dataclass(frozen=True)
class TimelineEvent:
    """One executed instruction: the training step (epoch), its short form, start and end in seconds
    since training started (the ranks pass a barrier there, so their times are comparable; on a
    GPU, CUDA events recorded around the instruction on the rank's stream)."""

    step: int
    instruction: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RankResult:
    """What one rank measured.

    ``bytes_sent`` / ``bytes_received``: bytes of one training step (halo exchanges, gradient
    all-reduce), identical in every step of a full-graph plan; a sampled plan's steps differ (each
    its own sample), and these are the mean over the run's steps; ``sent_to`` / ``received_from``:
    the same per peer.
    ``comm``: all traffic of the run by phase (``train``, ``eval``, ``metrics``) and peer.
    ``peak_memory``: peak bytes of live tensors during the first training step (CUDA allocator on
    GPU; profiler allocation accounting on CPU), above what was live before it.
    ``timeline``: every executed instruction of every training step (of this run: a resumed run's
    first step is the one after its checkpoint, and its peak memory is measured there).
    ``checkpoint_time``: seconds each checkpoint write took on this rank (from its start to the
    rename on rank 0); ``restore_time``: seconds the resume's load took (``None``: not resumed).
    """

    rank: int
    bytes_sent: int
    bytes_received: int
    sent_to: dict[int, int]
    received_from: dict[int, int]
    comm: dict[str, Any]
    peak_memory: int
    timeline: list[TimelineEvent]
    epoch_time: list[float]
    num_owned: int = 0
    checkpoint_time: list[float] = field(default_factory=list)
    restore_time: Optional[float] = None
    #: bytes the rank's graph inputs hold after its first training step (structure, weights and
    #: everything derived from them and cached: :meth:`gnncompile.Graph.structure_bytes`)
    topology_bytes: int = 0

    def __repr__(self) -> str:   # (the timeline holds every instruction of every step)
        return (f"RankResult(rank={self.rank}, bytes_sent={self.bytes_sent}, bytes_received={self.bytes_received}, "
                f"peak_memory={self.peak_memory}, num_owned={self.num_owned}, epochs={len(self.epoch_time)}, "
                f"timeline=<{len(self.timeline)} events>)")

    def time_by_kind(self) -> dict[str, float]:
        """Total time per instruction kind (``F``, ``B``, ``HALO``, ``AR``...) over all steps."""
        out: dict[str, float] = {}
        for e in self.timeline:
            head = e.instruction.split()[0]
            k = head[0] if head[0] in "FBR" and head[1:2].isdigit() else head
            out[k] = out.get(k, 0.0) + e.duration
        return out


@dataclass
class RunResult:
    """Result of ``plan.run``: the history (same fields as :func:`gnncompile.train`'s) and per-rank data."""

    history: History
    ranks: list[RankResult]
    plan: Plan
    #: with ``capture=True``: the first step's logits (global row order) and parameter gradients
    captured: Optional[dict[str, Any]] = None
    #: where the ranks ran and how they communicated (backend, rank -> device, host staging)
    placement: Optional[Placement] = None

    def __repr__(self) -> str:   # one line: the plan, history and timelines print in full elsewhere
        h = self.history
        last = f", loss={h.loss[-1]:.4g}" if h.loss else ""
        best = f", best_val_acc={h.best_val_acc:.4g} at epoch {h.best_epoch}" if h.best_epoch is not None else ""
        where = f", {self.placement.describe()}" if self.placement is not None else ""
        return (f"RunResult(strategy={self.plan.strategy!r}, ranks={len(self.ranks)}, epochs={len(h.loss)}"
                f"{last}{best}{where})")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:   # IPython
        printer.text(repr(self))

    def best_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers (by the model's names; buffers as :func:`combine_buffers`
        makes them) at the epoch of the best validation accuracy (``history.best_epoch``; on a
        resumed run, over all its epochs): ``model.load_state_dict(result.best_state_dict(),
        strict=False)``. See :meth:`History.best_state_dict`."""
        return self.history.best_state_dict()

    def describe_placement(self) -> str:
        """One line for a run's header: where the ranks ran, and where the plan was planned for
        (see :func:`describe_run`)."""
        if self.placement is None:
            return f"{self.plan.num_ranks} ranks (placement not recorded)"
        return describe_run(self.plan, self.placement)

    def timeline(self, path: str, step: Optional[int] = None) -> Any:
        """Draw the measured timeline of ``step`` (default: the last) of every rank into ``path``
        (Gantt chart: compute, communication, idle gaps; see :mod:`gnncompile.viz.timeline`)."""
        from ..viz.timeline import draw_timeline

        problem = output_problem(path)
        if problem is not None:
            raise ArgumentError(f"timeline: cannot write {str(path)!r}: {problem}")
        try:
            return draw_timeline([r.timeline for r in self.ranks], path, step=step,
                                 title=f"{self.plan.strategy} plan on {self.plan.num_ranks} ranks: measured step "
                                       f"{'last' if step is None else step}")
        except ValueError as exc:   # (viz raises ValueError: an unknown picture type, a step not run)
            raise ArgumentError(f"timeline: {exc}") from None

    def comm_table(self) -> str:
        head = f"{'rank':>4}  {'owned':>8}  {'sent/step':>12}  {'recv/step':>12}  {'peak mem':>10}  {'step ms':>8}"
        lines = [head]
        steps = int(self.plan.info.get("steps_per_epoch") or 1)  # (a sampled plan's epoch runs several)
        for r in self.ranks:
            step = sorted(t / steps for t in (r.epoch_time[1:] or r.epoch_time))
            med = step[len(step) // 2] * 1e3 if step else math.nan
            lines.append(f"{r.rank:>4}  {r.num_owned:>8,}  {_mib(r.bytes_sent):>12}  {_mib(r.bytes_received):>12}  "
                         f"{_mib(r.peak_memory):>10}  {med:>8.1f}")
        return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# --------------------------------------------------------------------------- one rank
class _Clock:
    """Start and end times of instructions, in seconds since the rank's time origin.

    On the CPU the host clock at the instruction's start and end. On CUDA, where kernels run
    after the host queues them, CUDA events recorded on the rank's current stream before and after
    the instruction: the device's time of the work (host time where the work blocks the host, as
    gloo's communication does). :meth:`mark` returns an opaque mark; :meth:`settle` (once the
    marks are recorded) waits for the device, after which :meth:`seconds` reads them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.origin: Any = None
        self.t0 = time.perf_counter()

    def _event(self) -> Any:
        """A timing event recorded on this rank's device's current stream (named explicitly: an event
        records on the current *device's* stream otherwise, and ``elapsed_time`` needs both events on
        one device)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        """Set the time origin (after the ranks' barrier, so their timelines line up)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.origin = self._event()
        self.t0 = time.perf_counter()

    def mark(self) -> Any:
        if self.cuda:
            if self.origin is None:
                self.start()
            return self._event()
        return time.perf_counter() - self.t0

    def settle(self) -> None:
        """Wait for the device: ``elapsed_time`` fails on an event the device has not reached yet."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, mark: Any) -> float:
        """Seconds from the origin to ``mark`` (CUDA: call :meth:`settle` after the last mark first)."""
        return self.origin.elapsed_time(mark) / 1e3 if self.cuda else float(mark)


def _part_slice(t: torch.Tensor, part: tuple[int, ...]) -> torch.Tensor:
    """``t``'s slice ``part = (dim, start, stop)`` (dim 0: rows; 1: the last dimension)."""
    if not part:
        return t
    dim, lo, hi = part
    return t[lo:hi] if dim == 0 else t[..., lo:hi]


class _Posted:
    """A value whose collective is posted but not waited for (the executor waits at its first read)."""

    def __init__(self, pending: Pending, requires_grad: bool) -> None:
        self.pending, self.requires_grad = pending, requires_grad

    def result(self) -> torch.Tensor:
        return self.pending.wait().requires_grad_(self.requires_grad)


class _Rank:
    """One rank's state while it executes: the communicator, its process groups and halo lists.

    Values and gradients are stored by ``(name, chunk)``; a name not stored is looked up in the
    chunk's inputs (``chunk_inputs``: the program's, or a regrouped epoch's), then in the model
    inputs (chunk-independent).
    """

    def __init__(self, prog: RankProgram, ctx: RankContext, provider: StepInputProvider) -> None:
        self.prog = prog
        #: this rank's buffers (:func:`run_buffers`) at the best validation epoch so far, and as
        #: the run found them
        self.best_buffers: dict[str, torch.Tensor] = {}
        self.initial_buffers = {n: b.detach().cpu().clone() for n, b in run_buffers(prog).items()}
        self.ctx = ctx
        self.provider = provider
        self.comm = Communicator(ctx.rank, ctx.world_size, stage_through_host=ctx.stage_through_host,
                                 poll=polls_by_default(ctx.backend, ctx.device))
        self.clock = _Clock(ctx.device)
        send_index, recv_count = provider.step.halo
        g = provider.inputs.get("g")
        self.halo = HaloSpec(tuple(send_index), tuple(recv_count), int(g.num_nodes) if g is not None else 0)
        #: process groups other than the world, by member tuple (every rank creates every group)
        self.groups: dict[tuple[int, ...], Any] = {}
        if ctx.world_size > 1:
            for members in prog.groups:
                pg = dist.new_group(list(members))
                if ctx.rank in members:
                    self.groups[tuple(members)] = pg
        # received values whose gradient this rank sends back: they must require grad
        self.grad_sent = {(i.value, i.chunk) for i in prog.instructions if rule(i).side == "send" and i.grad}
        #: historical embeddings of stale reads (relaxed dependencies): per value, one row per vertex
        #: of the chunk order (zeros before the first copy); ``history_grads``: the gradients the
        #: readers of stale copies computed last step (used with ``historical_gradients``)
        self.history: dict[str, torch.Tensor] = {}
        self.history_grads: dict[str, torch.Tensor] = {}
        rows = provider.step.chunk_rows
        self._row_starts = [sum(rows[:k]) for k in range(len(rows) + 1)]
        #: per chunk, the indices of its training rows in the view in use (:meth:`train_rows`)
        self._train_rows: dict[int, torch.Tensor] = {}
        self.train_mask: Any = None
        self.offsets: tuple = ()
        self.use(provider.evaluation())

    def _group(self, members: tuple[int, ...]) -> Any:
        if len(members) == self.ctx.world_size:
            return None
        try:
            return self.groups[tuple(members)]
        except KeyError:
            raise RuntimeFailure(f"rank {self.ctx.rank}: the plan uses group {tuple(members)}, which it does not list "
                                 "in its process groups") from None

    def _free(self, key: tuple[str, int], values: dict, pieces: dict, concat: dict, roots: dict, sends: dict,
              pending: list, freed: dict, output: str) -> None:
        """``Free(value, chunk)``: drop this rank's references to the stored value ``key`` and
        release a stage output's storage that only its stage's backward still holds (as its root).

        The plan puts ``Free`` after the value's last forward read and after its sends certainly
        completed (:mod:`gnncompile.passes.free`), so waiting for them here returns at once; a send
        buffer of whole rows aliases the value. The output's autograd node stays; its storage is
        swapped for one element (Megatron-LM's ``deallocate_output_tensor``) and its backward runs
        through :func:`_run_backward`, which does not compare the gradient's shape with it. Only a
        pure output is such a root: one another op of its stage also read may be saved by that
        op's backward (a LayerNorm on a residual sum) and keeps its storage (the step does not
        record it as a root); a local consumer's input leaf is a tensor of its own.
        """
        for work, buf in sends.pop(key, ()):
            work.wait()
            pending[:] = [wb for wb in pending if wb[0] is not work]
        v = values.pop(key, None)
        if isinstance(v, _Posted):  # a posted all-to-all nobody read: complete it (collectives stay in step)
            v = v.result()
        parts = pieces.pop(key, None)
        if v is None and parts:
            v = parts[0][1]
        for ck in [ck for ck in concat if ck[0] == key[0] and key[1] in ck[1]]:
            del concat[ck]  # the stages that read it keep it as their input leaf until their backward
        if isinstance(v, torch.Tensor):
            freed[key] = torch.zeros((), dtype=v.dtype, device=v.device).expand(v.shape) if v.layout == torch.strided \
                else v
        root = roots.pop(key, None)
        if root is not None and key[0] != output and root.grad_fn is not None and root.layout == torch.strided:
            if root._base is not None:  # a view of the stage's own intermediate: its storage too
                root._base.data = torch.empty((1,), dtype=root._base.dtype, device=root.device)
            root.data = torch.empty((1,), dtype=root.dtype, device=root.device)

    def use(self, view: StepView) -> None:
        """Take chunk inputs, scored rows' offsets, labels and training mask from ``view`` (the
        step-input provider's, for a training step or an evaluation)."""
        if view.train_rows is not None:
            self._train_rows = {0: view.train_rows}
        elif view.train_mask is not self.train_mask or tuple(view.offsets) != tuple(self.offsets):
            self._train_rows = {}  # another mask: its rows are found again at their first use
        self.chunk_inputs, self.offsets = view.chunk_inputs, view.offsets
        self.labels, self.train_mask = view.labels, view.train_mask
        self.sizes = view.sizes
        self.slots = view.slots
        self.halos = view.halos
        self.loss_rows = view.loss_rows

    def halo_spec(self, ins: HaloExchange, get: Callable[[str, int], Any]) -> HaloSpec:
        """The exchange lists of ``ins``: the rank's own, or the step's lists of its graph input."""
        if not ins.halo:
            return self.halo
        try:
            send_index, recv_count = self.halos[ins.halo]
        except KeyError:
            raise RuntimeFailure(f"rank {self.ctx.rank}: `{ins}` exchanges through {ins.halo!r}, which this step's "
                                 "inputs do not give lists for") from None
        block = get(ins.halo, ins.chunk)
        return HaloSpec(tuple(send_index), tuple(recv_count), int(block.num_src) - sum(recv_count))

    def _slot(self, k: int) -> Any:
        """Where chunk ``k``'s rows are in the history tables this step (a slice, or vertex ids)."""
        if self.slots is not None:
            return self.slots[k]
        return slice(self._row_starts[k], self._row_starts[k + 1])

    def _slot_rows(self, k: int) -> int:
        return int(self.slots[k].numel()) if self.slots is not None else self.provider.step.chunk_rows[k]

    def stale_read(self, name: str, k: int, like: torch.Tensor) -> torch.Tensor:
        """Chunk ``k`` of ``name`` from the history (zeros shaped like ``like``'s rows before a copy)."""
        table = self.history.get(name)
        if table is None:
            return like.new_zeros((self._slot_rows(k),) + tuple(like.shape[1:]))
        return table[self._slot(k)]

    def stale_store(self, store: dict[str, torch.Tensor], name: str, k: int, v: torch.Tensor,
                    add: bool = False) -> None:
        """Write (or with ``add``, add) chunk ``k``'s rows ``v`` into ``store[name]``."""
        table = store.get(name)
        if table is None:
            table = store[name] = v.new_zeros((self._row_starts[-1],) + tuple(v.shape[1:]))
        if add:
            table[self._slot(k)] += v.detach()
        else:
            table[self._slot(k)] = v.detach()

    def shape(self, ins: Instruction, shape: tuple) -> tuple[int, ...]:
        """``shape`` of ``ins`` with this step's values of its per-step sizes (:class:`StepSize`)."""
        try:
            return resolve_shape(shape, self.sizes)
        except VerificationError as e:
            raise RuntimeFailure(f"rank {self.ctx.rank}: `{ins}`: {e}") from None

    def _rows(self, t: Any, chunk: int) -> Any:
        """Chunk ``chunk``'s rows of a rank-wide per-row tensor (labels, masks)."""
        if t is None or not self.offsets:
            return t
        return t[self.offsets[chunk]:self.offsets[chunk + 1]]

    def train_rows(self, chunk: int) -> torch.Tensor:
        """The indices of chunk ``chunk``'s training rows among its scored rows, in the view in use:
        found once per training mask (``nonzero``, a host synchronization on a GPU; a sampled step's
        view gives them) and kept, so that a step's loss selects its rows without one."""
        rows = self._train_rows.get(chunk)
        if rows is None:
            mask = self._rows(self.train_mask, chunk)
            rows = self._train_rows[chunk] = torch.zeros(0, dtype=torch.long, device=self.ctx.device) \
                if mask is None else torch.nonzero(mask).flatten()
        return rows

    def step(self, modules: dict, stages: tuple, instructions: tuple, output: str, loss_fn: Any,
             epoch: int, timeline: Optional[list], optimizer: Optional[torch.optim.Optimizer],
             capture: Optional[dict] = None) -> Any:
        prog = self.prog
        # stale reads keep this step's copies only at the steps history_refresh, 2 history_refresh,
        # ... (GNNPipe's fixed history; 1: every step)
        refresh = (epoch + 1) % self.provider.step.history_refresh == 0
        # historical gradients (relaxed): what the readers of stale copies computed last step is
        # added to those chunks' gradients this step
        historical_gradients = self.provider.step.historical_gradients and optimizer is not None
        next_grads: dict[str, torch.Tensor] = {}
        values: dict[tuple[str, int], Any] = {}
        grads: dict[tuple[str, int], torch.Tensor] = {}
        pieces: dict[tuple[str, int], list] = {}
        pending: list = []  # (work, buffer) of posted sends
        # forward sends of each (value, chunk): their buffers may alias the value, so its memory
        # is released (Free) only after they completed
        sends: dict[tuple[str, int], list] = {}
        saved: dict[tuple[int, int], tuple[dict, dict]] = {}
        #: stage outputs kept as roots of their stage's backward, by (value, chunk)
        roots: dict[tuple[str, int], torch.Tensor] = {}
        #: freed values: a stand-in of their shape and dtype (one element of memory, zero strides) for
        #: the gradient communication that only needs the shape (zeros of a gradient nobody made)
        freed: dict[tuple[str, int], torch.Tensor] = {}
        spec = {s.index: s for s in stages}
        for st in stages if historical_gradients else ():
            for name, per_chunk in st.stale:
                if name in self.history_grads:
                    for k in {k for ks in per_chunk for k in ks}:
                        grads[(name, k)] = self.history_grads[name][self._slot(k)].clone()
        losses: dict[int, Any] = {}
        logits: dict[int, torch.Tensor] = {}
        clock = self.clock
        marks: list[tuple[str, Any, Any]] = []  # (instruction, start mark, end mark)
        chunked = bool(self.offsets) and len(self.offsets) > 2
        masks = MaskCache() if (chunked or prog.dropout_draws) and optimizer is not None else None
        # a stage's masks are dropped after its last backward on this rank
        last_backward = {ins.stage: i for i, ins in enumerate(instructions) if isinstance(ins, Backward)} \
            if masks is not None else {}
        mask_release = {i: s for s, i in last_backward.items()}
        # cross-chunk reads: one concatenation (and one gradient leaf) per (value, chunks read) and
        # step, shared by the chunks that read the same chunks
        concat: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        # how many forwards of this step read each concatenation: after the last one it is dropped,
        # and a training leaf that no op saved for backward keeps only its shape (its gradient still
        # arrives whole): a chunk's cross-chunk input does not stay alive until its backward
        concat_uses: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
        for ins in instructions:
            if isinstance(ins, Forward):
                for name in spec[ins.stage].inputs:
                    key = _concat_key(spec[ins.stage], name, ins.chunk)
                    if key is not None:
                        concat_uses[key] = concat_uses.get(key, 0) + 1
        if masks is not None and prog.dropout_draws:  # every mask of the step, in single-device order
            mine = {s.index for s in stages}
            for stage, ordinal, shape, dtype, p in prog.dropout_draws:
                # every rank draws every mask's seed (the random stream must match single-device
                # training's) but keeps only those of its own stages; rows are computed where used
                draw = MaskDraw(p, shape[0], tuple(shape[1:]), getattr(torch, dtype), self.ctx.device)
                if stage in mine:
                    masks.keep((stage, ordinal), draw)

        def get(name: str, chunk: int) -> Any:
            key = (name, chunk)
            if key in values:
                v = values[key]
                if isinstance(v, _Posted):
                    v = values[key] = v.result()
                return v
            if key in pieces:  # blocks received from several ranks: concatenate them in place order
                parts = sorted(pieces.pop(key), key=lambda pt: pt[0][1])
                # an empty block adds nothing, and its slab may run the other way (a member holding
                # none of the columns of a value narrower than its group sends a [rows, 0] block)
                parts = [pt for pt in parts if pt[1].numel()] or parts
                dim = 0 if parts[0][0][0] == 0 else -1
                t = torch.cat([x.detach() for _, x in parts], dim=dim)
                if any(x.requires_grad for _, x in parts):
                    t.requires_grad_(True)
                values[key] = t
                return t
            ci = self.chunk_inputs.get(chunk)
            if ci is not None and name in ci:
                return ci[name]
            if key in freed:
                return freed[key]
            try:
                return self.provider.inputs[name]
            except KeyError:
                raise RuntimeFailure(f"rank {self.ctx.rank}: value {name!r} of chunk {chunk} is not available "
                                     f"(step {epoch})") from None

        def take_loss(chunk: int, out: torch.Tensor) -> None:
            losses[chunk] = loss_fn(out, chunk)
            logits[chunk] = out.detach()

        # gradient all-to-alls posted but not waited for: ((value, chunk), Pending); a gradient is
        # complete once they are added in, before a Backward of a stage producing it or any
        # communication (which may read any gradient)
        posted_grads: list[tuple[tuple[str, int], Pending]] = []

        def settle(keys: Optional[set] = None) -> None:
            keep = []
            for key, p in posted_grads:
                if keys is None or key in keys:
                    _accumulate(grads, key, p.wait())
                else:
                    keep.append((key, p))
            posted_grads[:] = keep

        def forward(ins: Forward) -> None:
            # a function, so that its temporaries (inputs, outputs, concatenations) are not kept
            # alive by this frame until the next forward: Free must be able to release them
            st = spec[ins.stage]
            leaves: dict[str, tuple[torch.Tensor, tuple[int, ...], list[int]]] = {}
            args = []
            last_use = []  # (key, concatenation) read for the last time this step
            own_leaves: list[torch.Tensor] = []
            for name in st.inputs:
                fresh_read, old = _chunk_reads(st, name, ins.chunk)
                read = fresh_read
                if old:  # relaxed: chunks not computed yet this step come from the previous step
                    fresh = {k: get(name, k) for k in fresh_read}
                    like = next(iter(fresh.values()))
                    if refresh:
                        for k, t in fresh.items():
                            self.stale_store(self.history, name, k, t)
                    read = tuple(sorted(set(fresh_read) | set(old)))
                    parts = [fresh[k] if k in fresh else self.stale_read(name, k, like) for k in read]
                    stale_here = set(old)
                else:
                    gone = [k for k in read if (name, k) in freed]
                    if gone:  # verify_plan rejects such a plan; never compute on a stand-in
                        raise RuntimeFailure(f"rank {self.ctx.rank}: `{ins}` reads {name} c{gone[0]}, which "
                                             f"was freed (step {epoch})")
                    parts = [get(name, k) for k in read]
                    stale_here = set()
                track = any(isinstance(p, torch.Tensor) and p.requires_grad for p in parts)
                key = (name, read, tuple(sorted(stale_here)))
                if len(parts) > 1 and key in concat:
                    v = concat[key]
                else:
                    v = parts[0] if len(parts) == 1 else torch.cat([p.detach() for p in parts])
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.layout == torch.strided \
                            and track and optimizer is not None:
                        v = v.detach().requires_grad_(True)
                    if len(parts) > 1:
                        concat[key] = v
                if track and optimizer is not None and isinstance(v, torch.Tensor) and v.requires_grad \
                        and v.is_leaf:
                    leaves[name] = (v, read, [p.shape[0] if p.dim() else 1 for p in parts], stale_here)  # (0-dim: one part)
                if len(parts) > 1 and key in concat_uses:
                    concat_uses[key] -= 1
                    if concat_uses[key] == 0:
                        last_use.append((key, v))
                elif len(parts) == 1 and name in leaves:
                    own_leaves.append(v)  # this forward's own leaf: only its gradient is needed later
                args.append(v)
            saved_storage: set[int] = set()

            def pack(t: Any) -> Any:
                # a dropout's output is kept as its input and mask (computed again in backward);
                # anything else as a detached alias, as autograd keeps without hooks: a saved stage
                # output (a custom op saving its own result) must keep its storage when Free swaps
                # the output's
                kept = replay_pack(t)
                if kept is not t:
                    saved_storage.add(kept.x.untyped_storage().data_ptr())
                    return kept
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    saved_storage.add(t.untyped_storage().data_ptr())
                    return t.detach()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, replay_unpack) if optimizer is not None \
                    else contextlib.nullcontext():
                if masks is not None:
                    with masks.stage(ins.stage):
                        outs = modules[ins.stage](*args)
                else:
                    outs = modules[ins.stage](*args)
            outd = dict(zip(st.outputs, outs))
            for v in outd.values():  # kept beyond the stage: a later reader saves the output itself
                drop_replay(v)
            # a gradient leaf that no op saved for backward keeps only its shape: its memory is the
            # value's, which Free releases after its last use (a concatenation's, after its last read)
            for key, v in last_use:
                concat.pop(key, None)
            for v in [v for _, v in last_use] + own_leaves:
                if optimizer is None or not (v.is_leaf and v.requires_grad and v.layout == torch.strided):
                    continue
                ptr = v.untyped_storage().data_ptr()
                if ptr in saved_storage or any(isinstance(o, torch.Tensor) and o.layout == torch.strided
                                               and o.untyped_storage().data_ptr() == ptr for o in outd.values()):
                    continue  # an op keeps it for backward (or returned it): it stays
                v.data = torch.zeros((), dtype=v.dtype, device=v.device).expand(v.shape)
            for o, v in outd.items():
                values[(o, ins.chunk)] = v
            if output in outd:
                take_loss(ins.chunk, outd[output])
            if optimizer is not None:
                saved[(ins.stage, ins.chunk)] = (leaves, outd)
                inner = _outputs_used_inside(modules[ins.stage])
                for i, (o, v) in enumerate(outd.items()):
                    # an output another op of its stage also read may be saved by that op's backward:
                    # only a pure output is a root whose storage Free may release; a view
                    # (``lin(x).view(-1, H, C)``) only of an intermediate of the stage, released with it
                    if isinstance(v, torch.Tensor) and v.requires_grad and i not in inner and \
                            (v._base is None or _own_intermediate(v._base, outd.values(), args, saved_storage)):
                        roots[(o, ins.chunk)] = v

        def backward(ins: Backward) -> None:
            # a function for the same reason: the leaves' gradients die with it
            leaves, outd = saved.pop((ins.stage, ins.chunk))
            for o in outd:
                roots.pop((o, ins.chunk), None)
            pairs = []
            for name, o in outd.items():
                if name == output:
                    if losses.get(ins.chunk) is not None and losses[ins.chunk].requires_grad:
                        pairs.append((losses[ins.chunk], None))
                elif (name, ins.chunk) in grads and isinstance(o, torch.Tensor) and o.requires_grad:
                    pairs.append((o, grads.pop((name, ins.chunk))))
            if pairs and masks is not None:  # recomputed segments redraw the stage's masks from the cache
                with masks.stage(ins.stage):
                    _run_backward(pairs)
            elif pairs:
                _run_backward(pairs)
            # what the step keeps of the chunk's loss and outputs no longer holds their graph, whose
            # gradient-accumulation nodes would keep the stage's input leaves alive to the step's end
            if losses.get(ins.chunk) is not None and output in outd:
                losses[ins.chunk] = losses[ins.chunk].detach()
            for name, o in outd.items():
                if isinstance(o, torch.Tensor) and o.grad_fn is not None and values.get((name, ins.chunk)) is o:
                    values[(name, ins.chunk)] = o.detach()
            for name, (leaf, read, rows, stale_here) in leaves.items():
                if leaf.grad is None:
                    continue
                g_leaf, leaf.grad = leaf.grad, None  # a shared leaf collects the next chunk's gradient
                if len(read) == 1:
                    _accumulate(grads, (name, read[0]), g_leaf)
                else:
                    for k, g in zip(read, torch.split(g_leaf, rows)):
                        if k in stale_here:  # a previous step's copy: no gradient goes back this step
                            if historical_gradients:  # (the next step adds it to the chunk's gradient)
                                self.stale_store(next_grads, name, k, g, add=True)
                            continue
                        # a view would keep the whole concatenated gradient alive
                        _accumulate(grads, (name, k), g if (name, k) in grads else g.clone())

        phase = "step" if optimizer is not None else "evaluation"
        state = _StepState(self, get, forward, backward, values, grads, pieces, pending, sends, posted_grads, concat,
                           roots, freed, output, optimizer, capture)
        for i, ins in enumerate(instructions):
            note_progress(f"{phase} {epoch} instruction {i} ({ins})")
            t0 = clock.mark() if timeline is not None else None
            r = rule(ins)
            if posted_grads and r.runs == "backward":
                settle({(o, ins.chunk) for o in spec[ins.stage].outputs})
            elif posted_grads and r.runs != "forward" and r.kind != "memory":  # Free touches no gradient
                settle()
            r.execute_rule()(state, ins)
            if i in mask_release:
                masks.release(mask_release[i])
            if r.communicates and getattr(ins, "output", None) == output and not getattr(ins, "grad", False):
                # the output arrives by communication (e.g. gathered back to rows): the loss starts
                # here, and its gradient is what the matching gradient communication sends back
                c = ins.chunk
                out = get(output, c)
                if optimizer is not None and out.is_floating_point():
                    out = out.detach().requires_grad_(True)
                    values[(output, c)] = out
                take_loss(c, out)
                loss = losses[c]
                if optimizer is not None and loss is not None and loss.requires_grad:
                    grads[(output, c)] = torch.autograd.grad(loss, out)[0]
            if timeline is not None:
                marks.append((str(ins), t0, clock.mark()))
        for work, _ in pending:
            work.wait()
        settle()
        for key, v in list(values.items()):  # complete every posted collective within its step
            if isinstance(v, _Posted):
                values[key] = v.result()
        if timeline is not None and marks:
            clock.settle()
            timeline.extend(TimelineEvent(epoch, text, clock.seconds(a), clock.seconds(b)) for text, a, b in marks)
        for st in stages if refresh else ():  # keep this step's copies of the stale-read chunks
            for name, per_chunk in st.stale:
                for k in {k for ks in per_chunk for k in ks}:
                    if (name, k) in values or (name, k) in pieces:
                        self.stale_store(self.history, name, k, get(name, k))
        if historical_gradients:
            self.history_grads = next_grads
        if capture is not None and logits:
            capture["logits"] = torch.cat([logits[c] for c in sorted(logits)]).cpu().clone()
        total = None
        for c in sorted(losses):
            if losses[c] is not None:
                total = losses[c] if total is None else total + losses[c]
        out = torch.cat([logits[c] for c in sorted(logits)]) if logits else None
        return total, out


@dataclass
class _StepState:
    """What the execution rules of one step of a rank share (see :meth:`_Rank.step`): the rank, its
    stores (values, gradients, received blocks, posted sends and all-to-alls, ...) and the step's
    closures (``get`` a value, run a stage's ``forward``/``backward``)."""

    rank: "_Rank"
    get: Callable[[str, int], Any]
    forward: Callable[[Forward], None]
    backward: Callable[[Backward], None]
    values: dict
    grads: dict
    pieces: dict
    pending: list
    sends: dict
    posted_grads: list
    concat: dict
    roots: dict
    freed: dict
    output: str
    optimizer: Optional[torch.optim.Optimizer]
    capture: Optional[dict]


# --------------------------------------------------------------------------- execution rules
def _execute_forward(st: _StepState, ins: Forward) -> None:
    st.forward(ins)


def _execute_backward(st: _StepState, ins: Backward) -> None:
    st.backward(ins)


def _execute_recompute(st: _StepState, ins: Recompute) -> None:
    raise RuntimeFailure(f"rank {st.rank.ctx.rank}: the executor cannot run instruction {ins} "
                         f"({type(ins).__name__}) yet")


def _execute_optimizer_step(st: _StepState, ins: OptimizerStep) -> None:
    for work, _ in st.pending:  # sends must be complete before parameters change
        work.wait()
    st.pending.clear()
    prog = st.rank.prog
    if st.capture is not None:
        st.capture["grads"] = {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                               for n, p in zip(prog.param_names, prog.params)}
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)


def _own_intermediate(base: torch.Tensor, outputs: Any, inputs: Any, saved_storage: set[int]) -> bool:
    """Whether ``base`` (the base of a view a stage returned) is an intermediate of the stage only:
    made by an op (not a leaf, input or parameter), not itself returned or passed in, and no op of
    the stage saved its storage for backward (``saved_storage``: a replayed dropout keeps its input
    tensor itself). Its storage may then go with the view's."""
    return base.grad_fn is not None and base.layout == torch.strided and \
        base.untyped_storage().data_ptr() not in saved_storage and not any(base is t for t in (*outputs, *inputs))


def _outputs_used_inside(module: Any) -> frozenset[int]:
    """Positions of a stage module's outputs that another op of the module also reads (cached on
    the module)."""
    cached = getattr(module, "_gnncompile_inner_outputs", None)
    if cached is None:
        graph = getattr(module, "graph", None)
        cached = frozenset()
        if graph is not None:
            out = next((n for n in graph.nodes if n.op == "output"), None)
            values = out.args[0] if out is not None else ()
            values = values if isinstance(values, (tuple, list)) else (values,)
            cached = frozenset(i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)
                               and any(u.op != "output" for u in v.users))
        module._gnncompile_inner_outputs = cached
    return cached


def _execute_free(st: _StepState, ins: Free) -> None:
    st.rank._free((ins.value, ins.chunk), st.values, st.pieces, st.concat, st.roots, st.sends, st.pending,
                  st.freed, st.output)


def _execute_send(st: _StepState, ins: Send) -> None:
    rk, c, get = st.rank, ins.chunk, st.get
    src = st.grads.get((ins.name, c)) if ins.grad else get(ins.name, c)
    if src is None:  # no gradient reached this value: send zeros of its shape
        src = torch.zeros_like(get(ins.name, c))
    t = _part_slice(src.detach(), ins.part).contiguous()
    if tuple(t.shape) != rk.shape(ins, ins.shape):
        raise RuntimeFailure(f"rank {rk.ctx.rank}: `{ins}` sends shape {list(t.shape)}, the plan says "
                             f"{list(rk.shape(ins, ins.shape))}")
    st.pending.append((rk.comm.isend(t, ins.peer), t))
    if not ins.grad:
        st.sends.setdefault((ins.name, ins.chunk), []).append(st.pending[-1])


def _execute_recv(st: _StepState, ins: Recv) -> None:
    rk, c, get, grads = st.rank, ins.chunk, st.get, st.grads
    dtype = getattr(torch, ins.dtype)
    t = rk.comm.recv(rk.shape(ins, ins.shape), dtype, ins.peer, device=rk.ctx.device)
    key = (ins.name, c)
    if ins.grad:
        if ins.part:
            if key not in grads:
                grads[key] = torch.zeros_like(get(ins.name, c))
            _part_slice(grads[key], ins.part).add_(t)
        else:
            _accumulate(grads, key, t)
    else:
        if t.is_floating_point() and (ins.value, c) in rk.grad_sent:
            t.requires_grad_(True)
        if ins.part:
            st.pieces.setdefault(key, []).append((ins.part, t))
            st.values.pop(key, None)
        else:
            st.values[key] = t


def _execute_halo_exchange(st: _StepState, ins: HaloExchange) -> None:
    rk, c, get, grads = st.rank, ins.chunk, st.get, st.grads
    if not ins.grad:
        src = get(ins.value, c)
        out = rk.comm.halo_forward(src, rk.halo_spec(ins, get))
        st.values[(ins.output, c)] = out.requires_grad_(src.requires_grad) if src.is_floating_point() else out
    else:
        g_ext = grads.pop((ins.output, c), None)
        if g_ext is None:  # the consumers produced no gradient (e.g. all rows masked): still take part
            g_ext = torch.zeros_like(get(ins.output, c))
        _accumulate(grads, (ins.value, c), rk.comm.halo_backward(g_ext, rk.halo_spec(ins, get)))


def _execute_all_to_all(st: _StepState, ins: AllToAll) -> None:
    rk, c, get, grads = st.rank, ins.chunk, st.get, st.grads
    to_cols = ins.src_layout == "rows"
    if (ins.src_layout, ins.dst_layout) not in (("rows", "cols"), ("cols", "rows")):
        raise RuntimeFailure(f"rank {rk.ctx.rank}: no all-to-all from {ins.src_layout} to {ins.dst_layout}")
    # from this rank's side: rows -> cols sends (my rows, q's columns), receives (q's rows, mine)
    # (the columns are the last dimension: [n, H, C] values split C)
    send_shapes = [rk.shape(ins, s) for s in ins.send_shapes]
    recv_shapes = [rk.shape(ins, s) for s in ins.recv_shapes]
    if to_cols:
        row_counts, col_splits = [s[0] for s in recv_shapes], [s[-1] for s in send_shapes]
    else:
        row_counts, col_splits = [s[0] for s in send_shapes], [s[-1] for s in recv_shapes]
    backward = rk.comm.cols_to_rows_async if to_cols else rk.comm.rows_to_cols_async
    if not ins.grad:  # posted: the transfer overlaps the next instructions until a reader waits
        src = get(ins.value, c)
        post = rk.comm.rows_to_cols_async if to_cols else rk.comm.cols_to_rows_async
        st.values[(ins.output, c)] = _Posted(post(src, row_counts, col_splits), src.requires_grad)
    else:  # posted too: added into the gradient before anything reads it (see step)
        g_out = grads.pop((ins.output, c), None)
        if g_out is None:  # no consumer produced a gradient: still take part in the collective
            g_out = torch.zeros_like(get(ins.output, c))
        st.posted_grads.append(((ins.value, c), backward(g_out.contiguous(), row_counts, col_splits)))


def _execute_rows_collective(gather: bool) -> Callable[[_StepState, Any], None]:
    """The rule of an all-gather (``gather``) or a reduce-scatter: rows -> replicated (AG; its gradient
    is a sum-reduce-scatter) or the reverse (RS); the gathered tensor's rows are the members'
    balanced blocks in group order (:func:`member_rows`)."""
    def execute(st: _StepState, ins: Union[AllGather, ReduceScatter]) -> None:
        rk, c, get, grads = st.rank, ins.chunk, st.get, st.grads
        counts = member_rows(rk.shape(ins, ins.shape)[0] if ins.shape else 0, len(ins.group))
        kw = dict(group=rk._group(ins.group), members=ins.group)
        forward, backward = (rk.comm.all_gather_rows, rk.comm.reduce_scatter_rows) if gather else \
            (rk.comm.reduce_scatter_rows, rk.comm.all_gather_rows)
        if not ins.grad:
            src = get(ins.value, c)
            out = forward(src, counts, **kw)
            st.values[(ins.output, c)] = out.requires_grad_(src.requires_grad) if out.is_floating_point() else out
        else:
            g_out = grads.pop((ins.output, c), None)
            if g_out is None:  # no consumer produced a gradient: still take part in the collective
                g_out = torch.zeros_like(get(ins.output, c))
            _accumulate(grads, (ins.value, c), backward(g_out.contiguous(), counts, **kw))
    return execute


def _execute_all_reduce(st: _StepState, ins: AllReduce) -> None:
    rk = st.rank
    placement = rk.prog.placement
    params = [p for n, p in zip(rk.prog.param_names, rk.prog.params) if p.requires_grad and placement.reduces(n)]
    # a parameter the step gave no gradient (unused by the forward, or only through detached values)
    # takes part with zeros and gets none back, as single-device training leaves it (Adam then
    # skips it, weight decay included): whether a parameter gets a gradient follows from the
    # stages' graphs, the same on every rank of a group that reduces it
    gradless = [p for p in params if p.grad is None]
    for p in gradless:
        p.grad = torch.zeros_like(p)
    rk.comm.all_reduce_([p.grad for p in params], group=rk._group(ins.group), members=ins.group)
    for p in gradless:
        p.grad = None


for _cls, _fn in {
    Forward: _execute_forward, Backward: _execute_backward, Recompute: _execute_recompute,
    OptimizerStep: _execute_optimizer_step, Free: _execute_free, Send: _execute_send, Recv: _execute_recv,
    HaloExchange: _execute_halo_exchange, AllToAll: _execute_all_to_all,
    AllGather: _execute_rows_collective(gather=True), ReduceScatter: _execute_rows_collective(gather=False),
    AllReduce: _execute_all_reduce,
}.items():
    register_execute(_cls, _fn)
del _cls, _fn


def _move_modules(prog: RankProgram, device: torch.device) -> None:
    """Put a rank's stage modules on ``device`` (in place; parameters keep their identity, so every
    stage module still shares them). Its step inputs move with the :class:`StepInputProvider`."""
    for m in list(prog.modules.values()) + list(prog.eval_modules.values()):
        m.to(device)


def _run_backward(pairs: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
    """``torch.autograd.backward`` of ``(tensor, gradient)`` pairs (``None``: a scalar loss, gradient 1)
    without its check of each gradient's shape against its tensor: a stage output whose storage a
    ``Free`` released keeps its autograd node but not its shape (Megatron-LM's ``custom_backward``).
    The gradients come from the plan's own shapes (the consumer's backward, a received gradient)."""
    tensors = tuple(t for t, _ in pairs)
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in pairs)
    _engine_run_backward(tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def _chunk_reads(st: StageSpec, name: str, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunks of input ``name`` that ``Forward(st, chunk)`` reads fresh, and those it reads stale."""
    return (tuple(st.chunks_read(name, chunk)) if st.reads else (chunk,),
            tuple(st.chunks_stale(name, chunk)) if st.stale else ())


def _concat_key(st: StageSpec, name: str, chunk: int) -> Optional[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The key of the concatenation ``Forward(st, chunk)`` reads of input ``name`` (``None``: one chunk)."""
    fresh, old = _chunk_reads(st, name, chunk)
    read = tuple(sorted(set(fresh) | set(old))) if old else fresh
    return (name, read, tuple(sorted(old))) if len(read) > 1 else None


def _accumulate(store: dict, name: Any, g: torch.Tensor) -> None:
    store[name] = g if name not in store else store[name] + g


def _input_graphs(provider: StepInputProvider) -> list[Graph]:
    """The graphs among the rank's program inputs (its own and its chunks'), each once."""
    stores = [provider.step.inputs, *provider.step.chunk_inputs.values()]
    return list({id(v): v for store in stores for v in store.values() if isinstance(v, Graph)}.values())


def _prepare_graphs(prog: RankProgram, provider: StepInputProvider, dtype: torch.dtype) -> None:
    """Build the graphs' derived structures before the first step (resident topology, not the
    step's memory or time): :func:`~gnncompile.frontend.ops.prepare_graph` for the rank's programs,
    and the native kernels' form of sparse CSR input features
    (:func:`~gnncompile.nn.functional.prepare_sparse_features`)."""
    graphs = [m.graph for m in (*prog.modules.values(), *prog.eval_modules.values()) if hasattr(m, "graph")]
    for g in _input_graphs(provider):
        prepare_graph(g, graphs, dtype, prog.backward)
    for store in (provider.inputs, *provider.step.chunk_inputs.values()):
        for v in store.values():
            prepare_sparse_features(v)


def _topology_bytes(provider: StepInputProvider) -> int:
    """Bytes held by the graphs among the rank's program inputs (its own and its chunks'), with
    their caches: :meth:`~gnncompile.graph.Graph.structure_bytes` of each."""
    return sum(g.structure_bytes() for g in _input_graphs(provider))


def _sampled_epoch(rank: "_Rank", prog: RankProgram, provider: StepInputProvider, loss_fn: Any, epoch: int,
                   timeline: list, optimizer: torch.optim.Optimizer, captured: Optional[dict],
                   n_train: int) -> torch.Tensor:
    """The steps of one epoch of a sampled plan; returns this rank's share of the epoch's mean loss
    (each step's loss weighted by its seeds; the ranks' shares add up to it)."""
    steps = provider.steps_per_epoch
    total = torch.zeros((), dtype=torch.float64, device=rank.ctx.device)  # summed on the device: no host sync
    for i in range(steps):
        view = provider.sampled_step(epoch, i)
        rank.use(view)
        first = epoch == 0 and i == 0
        if captured is not None and first:
            captured["owned"] = view.owned.cpu()
        rows = view.loss_rows
        del view
        loss, _ = rank.step(prog.modules, prog.stages, prog.instructions, prog.output, loss_fn, epoch * steps + i,
                            timeline, optimizer, captured if first else None)
        if loss is not None:
            total += loss.detach().double() * rows  # float(loss) * rows, in the same float64 arithmetic
    return total / max(n_train, 1)


def execute_rank(ctx: RankContext, prog: RankProgram, epochs: int, lr: float, weight_decay: float,
                 seed: Optional[int], eval_every: int, capture: bool, fail_at: Optional[tuple[int, int]],
                 progress: bool = False, run_options: Optional[dict] = None) -> dict:
    """Train on one rank up to ``epochs`` steps on ``ctx.device``; returns this rank's measurements
    (picklable, on the CPU). With ``progress``, rank 0 prints :class:`ProgressLines` to stderr.

    ``run_options`` (from :func:`run_plan`): ``checkpoint`` (a :class:`CheckpointOptions`),
    ``resume_from``/``resume_meta`` (the checkpoint to continue from and its ``meta.json``),
    ``patience``, ``fingerprint`` and ``plan_json`` (written into each checkpoint)."""
    if seed is not None:
        # replicated masks: every rank makes single-device training's RNG calls from its seed;
        # otherwise rank 0 uses the seed and the others distinct streams
        torch.manual_seed(seed if ctx.rank == 0 or prog.same_seed else seed + 1_000_003 * ctx.rank)
    device = ctx.device
    if device.type != "cpu":
        _move_modules(prog, device)
    params = prog.params
    provider = StepInputProvider(prog.step, device, params[0].dtype if params else None, sample_seed=seed)
    _prepare_graphs(prog, provider, params[0].dtype if params else torch.get_default_dtype())
    labels, masks, counts = provider.step.labels, provider.step.masks, prog.counts
    n_train = max(counts["train"], 1)

    def loss_fn(logits: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        # the training rows by index, found once (:meth:`_Rank.train_rows`): a boolean mask would
        # find them (a host synchronization on a GPU) in every step's forward and backward
        rows = rank.train_rows(chunk)
        if rows.numel() == 0:
            return logits.sum() * 0.0
        y = rank._rows(rank.labels, chunk)
        return F.cross_entropy(logits.index_select(0, rows), y.index_select(0, rows), reduction="sum") / \
            (rank.loss_rows or n_train)

    optimizer = adam([p for p in params if p.requires_grad], lr, weight_decay)
    rank = _Rank(prog, ctx, provider)
    timeline: list[TimelineEvent] = []
    epoch_time: list[float] = []
    peak = topology = 0
    history = {"loss": [], "train_acc": [], "val_acc": [], "test_acc": [], "eval_time": []}
    captured: Optional[dict] = {} if capture else None
    owned = {n for n in prog.param_names if prog.placement.holder(n) == ctx.rank}
    opts = run_options or {}
    if ctx.world_size > 1 and directional_p2p(ctx.backend):
        rank.comm.directional_groups(opts.get("p2p_pairs", ()))
    checkpoint: Optional[ckpt.CheckpointOptions] = opts.get("checkpoint")
    patience: Optional[int] = opts.get("patience")
    ck_group = None
    if checkpoint is not None and ctx.world_size > 1 and dist.get_backend() != "gloo":
        ck_group = dist.new_group(backend="gloo")  # torch.distributed.checkpoint coordinates with host objects
    #: best validation accuracy so far: its epoch and this rank's owned parameters there
    best: dict[str, Any] = {"val": -math.inf, "epoch": None, "params": {}}
    stopped_at: Optional[int] = None
    start = 0
    checkpoint_time: list[float] = []
    restore_time: Optional[float] = None
    if opts.get("resume_from") is not None:
        t_restore = time.perf_counter()
        start = _restore_rank(rank, optimizer, opts["resume_from"], opts["resume_meta"], best, ck_group)
        saved = opts["resume_meta"]["history"]
        for k in history:
            history[k] = list(saved[k])
        epoch_time = list(saved["epoch_time"])
        # a run that early stopping ended stays ended: resuming it trains no further epoch
        stopped_at = opts["resume_meta"].get("stopped_at")
        restore_time = time.perf_counter() - t_restore
    if ctx.world_size > 1:
        dist.barrier()  # a common time origin, so the ranks' timelines line up
    rank.clock.start()
    lines = ProgressLines(epochs, f"run {prog.world_size} ranks") if progress and ctx.rank == 0 else None
    train_steps = 0
    for epoch in range(start, epochs if stopped_at is None else start):
        if fail_at is not None and fail_at == (ctx.rank, epoch):
            raise RuntimeError(f"injected failure on rank {ctx.rank} in epoch {epoch}")
        for m in prog.modules.values():
            m.train()
        rank.comm.phase = "train"
        t0 = time.perf_counter()
        # the training step makes no host synchronization (tests/test_host_sync.py)
        with PeakMemory(device) if epoch == start else contextlib.nullcontext() as pm, probe("step", epoch):
            if provider.sampled:  # several steps, each on its own sampled mini-batch
                loss = _sampled_epoch(rank, prog, provider, loss_fn, epoch, timeline, optimizer, captured, n_train)
                train_steps += provider.steps_per_epoch
            else:
                if provider.regrouped:  # this epoch's subgraphs (part of the step's time and memory)
                    view = provider.training(epoch)
                    rank.use(view)
                    if captured is not None and epoch == 0:
                        captured["owned"] = None if view.owned is None else view.owned.cpu()
                    del view
                loss, _ = rank.step(prog.modules, prog.stages, prog.instructions, prog.output, loss_fn, epoch,
                                    timeline, optimizer, captured if epoch == 0 else None)
                train_steps += 1
            rank.use(provider.evaluation())
        if epoch == start:
            peak = pm.peak_bytes
            topology = _topology_bytes(provider)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        epoch_time.append(time.perf_counter() - t0)
        with probe("metrics", epoch):
            t1 = time.perf_counter()
            # the last epoch is evaluated off the schedule too: reported, but neither the best
            # parameters nor patience follow it, and checkpoints leave it out (History.best_epoch)
            scheduled = (epoch + 1) % eval_every == 0
            do_eval = scheduled or epoch == epochs - 1
            # the epoch's loss and correct predictions stay on the device until the one read below
            stats = torch.zeros(4, dtype=torch.float64, device=device)
            if loss is not None:
                stats[0] = loss.detach()
            if do_eval:
                rank.comm.phase = "eval"
                for m in prog.eval_modules.values():
                    m.eval()
                with torch.no_grad():
                    _, logits = rank.step(prog.eval_modules, prog.eval_stages, prog.eval_instructions,
                                          prog.eval_output, lambda z, c=0: None, epoch, None, None)
                if logits is not None and labels is not None:  # ranks that compute no output rows: nothing
                    right = logits.argmax(dim=-1) == labels
                    for i, m in enumerate(("train", "val", "test")):
                        if masks[m] is not None:
                            stats[1 + i] = (right & masks[m]).sum()
            rank.comm.phase = "metrics"
            if ctx.world_size > 1:
                flat = stats.clone()
                rank.comm.sum_(flat)
                rank.comm.stats.add("metrics", (ctx.rank + 1) % ctx.world_size, sent=flat.numel() * 8)
                stats = flat
            read = stats.tolist()  # the epoch's one host synchronization: history, patience, progress
            history["loss"].append(read[0])
            for i, m in enumerate(("train", "val", "test")):
                history[f"{m}_acc"].append(read[1 + i] / counts[m] if do_eval and counts[m] else math.nan)
            history["eval_time"].append(time.perf_counter() - t1)
            if lines is not None:
                lines.update(epoch, history["loss"][-1], history["val_acc"][-1])
            val = history["val_acc"][-1]
            if scheduled and not math.isnan(val) and val > best["val"]:  # the first epoch of the best accuracy
                best.update(val=val, epoch=epoch, params={n: p.detach().cpu().clone()
                                                          for n, p in zip(prog.param_names, params) if n in owned})
                rank.best_buffers = {n: b.detach().cpu().clone() for n, b in run_buffers(prog).items()}
            if patience is not None and scheduled and \
                    epoch - (-1 if best["epoch"] is None else best["epoch"]) >= patience:
                stopped_at = epoch  # every rank sees the same (reduced) accuracies, so all stop here
            if checkpoint is not None and ((epoch + 1) % checkpoint.every == 0 or epoch == epochs - 1
                                           or stopped_at is not None):
                t_save = time.perf_counter()
                _save_rank(rank, optimizer, checkpoint, epoch + 1, owned, best,
                           history if scheduled else off_schedule_dropped(history), epoch_time, stopped_at, opts,
                           ck_group)
                checkpoint_time.append(time.perf_counter() - t_save)
        if stopped_at is not None:
            break
    if lines is not None:
        lines.close()
    if best["epoch"] is None and history["val_acc"] and not math.isnan(history["val_acc"][-1]):
        # no scheduled evaluation (eval_every > epochs): the last one's parameters are the best
        best.update(val=history["val_acc"][-1], epoch=len(history["val_acc"]) - 1,
                    params={n: p.detach().cpu().clone() for n, p in zip(prog.param_names, params) if n in owned})
        rank.best_buffers = {n: b.detach().cpu().clone() for n, b in run_buffers(prog).items()}

    cs = rank.comm.stats
    steps = max(train_steps, 1)
    train_sent = {q: b // steps for q, b in cs.sent.get("train", {}).items()}
    train_recv = {q: b // steps for q, b in cs.received.get("train", {}).items()}
    out = {
        "rank": ctx.rank, "history": history, "epoch_time": epoch_time, "timeline": timeline,
        "sent_to": train_sent, "received_from": train_recv, "comm": cs.as_dict(), "peak_memory": peak,
        "topology_bytes": topology,
        "num_owned": int(prog.step.owned.numel()) if prog.step.owned is not None else
        int(prog.step.inputs["g"].num_nodes),
        "pid": os.getpid(), "stopped_at": stopped_at, "checkpoint_time": checkpoint_time,
        "restore_time": restore_time,
        "best": {"epoch": best["epoch"], "val": best["val"], "params": best["params"], "buffers": rank.best_buffers},
        "buffers": {n: b.detach().cpu().clone() for n, b in run_buffers(prog).items()},
    }
    if capture:
        out["captured"] = captured
    if owned:
        out["params"] = {n: p.detach().cpu().clone() for n, p in zip(prog.param_names, params) if n in owned}
    return out


def _stale_state(rank: "_Rank") -> dict[str, torch.Tensor]:
    return {**{f"value/{name}": t for name, t in rank.history.items()},
            **{f"grad/{name}": t for name, t in rank.history_grads.items()}}


def _restore_stale(rank: "_Rank", tensors: dict[str, torch.Tensor]) -> None:
    rank.history, rank.history_grads = {}, {}
    for key, t in tensors.items():
        kind, name = key.split("/", 1)
        (rank.history if kind == "value" else rank.history_grads)[name] = t.to(rank.ctx.device)


# relaxed plans' stale reads: the historical embeddings (and gradients) of chunks not computed yet
ckpt.register_rank_state("stale", _stale_state, _restore_stale)


def p2p_pairs(programs: list[RankProgram]) -> list[tuple[int, int]]:
    """Every ``(src, dst)`` of the programs' point-to-point messages (training and evaluation), sorted:
    the same list on every rank, which creates a group per pair (:func:`directional_p2p`)."""
    return sorted({(p.rank, i.peer) for p in programs for i in (*p.instructions, *p.eval_instructions)
                   if isinstance(i, Send)})


def directional_p2p(backend: str) -> bool:
    """Whether ranks send point-to-point messages through a group per direction: under NCCL (two
    ranks that each send to the other before receiving would otherwise wait on each other: NCCL
    runs a pair's sends and receives of one group in order on one stream), or when
    ``$GNNCOMPILE_P2P_GROUPS`` is ``directional`` (``shared``: never; for tests on gloo, whose
    sends progress on the host either way)."""
    mode = os.environ.get("GNNCOMPILE_P2P_GROUPS", "auto")
    if mode not in ("auto", "directional", "shared"):
        raise ArgumentError(f"$GNNCOMPILE_P2P_GROUPS must be auto, directional or shared, got {mode!r}")
    return mode == "directional" or (mode == "auto" and backend == "nccl")


def run_buffers(prog: RankProgram) -> dict[str, torch.Tensor]:
    """The model's buffers (BatchNorm's running statistics...) that this rank's training step
    updates, by their names in the user's model: those of the stage modules its ``Forward`` and
    ``Recompute`` instructions run (stage modules keep the model's module paths). Each rank that
    runs a module holds its own values of its buffers (only relaxed plans normalize by a rank's or
    a chunk's rows)."""
    stages = sorted({i.stage for i in prog.instructions if isinstance(i, (Forward, Recompute))})
    out: dict[str, torch.Tensor] = {}
    for s in stages:
        for n, b in prog.modules[s].named_buffers():
            out.setdefault(n, b)
    return out


def combine_buffers(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One value per buffer from the ranks that run its module (``per_rank``: each rank's
    :func:`run_buffers` values): the mean over them for floating buffers (running statistics), the
    first rank's for others (``num_batches_tracked``, the same on each)."""
    names: dict[str, list[torch.Tensor]] = {}
    for bufs in per_rank:
        for n, t in bufs.items():
            names.setdefault(n, []).append(t)
    return {n: torch.stack(ts).mean(0).to(ts[0].dtype) if ts[0].is_floating_point() else ts[0].clone()
            for n, ts in names.items()}


def _buffer_state(rank: "_Rank") -> dict[str, torch.Tensor]:
    """The buffers training changed (running statistics; a constant buffer is not per-rank state,
    so it does not keep a checkpoint from another rank count), now and at the best epoch."""
    changed = {n: b for n, b in run_buffers(rank.prog).items() if not torch.equal(b.cpu(), rank.initial_buffers[n])}
    return {**{f"now/{n}": b for n, b in changed.items()},
            **{f"best/{n}": b for n, b in rank.best_buffers.items() if n in changed}}


def _restore_buffers(rank: "_Rank", tensors: dict[str, torch.Tensor]) -> None:
    now = run_buffers(rank.prog)
    rank.best_buffers = {}
    with torch.no_grad():
        for key, t in tensors.items():
            kind, name = key.split("/", 1)
            if kind == "best":
                rank.best_buffers[name] = t.cpu()
            elif name in now:
                now[name].copy_(t)


# the model's buffers this rank updates (its own running statistics) and their values at the best epoch
ckpt.register_rank_state("buffers", _buffer_state, _restore_buffers)


def _save_rank(rank: "_Rank", optimizer: torch.optim.Optimizer, options: ckpt.CheckpointOptions, done: int,
               owned: set[str], best: dict, history: dict, epoch_time: list[float], stopped_at: Optional[int],
               opts: dict, group: Any) -> None:
    """Write this rank's part of the checkpoint after ``done`` epochs (collective; see
    :mod:`gnncompile.runtime.checkpoint` for the keys)."""
    prog, r = rank.prog, rank.ctx.rank
    tensors: dict[str, torch.Tensor] = {}
    for n, p in zip(prog.param_names, prog.params):
        if n not in owned:
            continue
        tensors[f"params/{n}"] = p
        for field_name, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{n}/{field_name}"] = v
        if n in best["params"]:
            tensors[f"best/{n}"] = best["params"][n]
    tensors[f"rank{r}/rng/cpu"] = torch.get_rng_state()
    if rank.ctx.device.type == "cuda":
        tensors[f"rank{r}/rng/cuda"] = torch.cuda.get_rng_state(rank.ctx.device)
    for name, (get, _) in ckpt.RANK_STATE.items():
        for k, v in get(rank).items():
            tensors[f"rank{r}/{name}/{k}"] = v

    def meta() -> dict:
        return {"history": {**history, "epoch_time": list(epoch_time)}, "best_epoch": best["epoch"],
                "best_val": best["val"] if best["epoch"] is not None else None, "stopped_at": stopped_at,
                "fingerprint": opts["fingerprint"], "same_seed": bool(prog.same_seed),
                # same-seed plans: the rank that computes every parameterized op draws every mask (a
                # rank without dense ops draws none), so its stream is the one to continue
                "rng_rank": int(prog.placement.main)}

    ckpt.save(options, done, tensors, rank=r, meta=meta, plan_json=opts.get("plan_json"), process_group=group)


def _restore_rank(rank: "_Rank", optimizer: torch.optim.Optimizer, path: str, meta: dict, best: dict,
                  group: Any) -> int:
    """Load this rank's state from checkpoint ``path``: parameters and optimizer state by name (so
    another rank count can read them), the best parameters, the random streams and the registered
    per-rank state (same rank count; with another one, ranks of a same-seed plan take the
    stream of the rank that drew every mask, ``rng_rank``, and the others keep their fresh seeds).
    Returns the epoch to continue from."""
    prog, ctx = rank.prog, rank.ctx
    saved_ranks = meta["fingerprint"]["plan"]["ranks"]
    same = saved_ranks == ctx.world_size
    src = ctx.rank if same else (int(meta.get("rng_rank", 0)) if prog.same_seed
                                 else (ctx.rank if ctx.rank < saved_ranks else None))
    names = set(prog.param_names)

    def wanted(key: str) -> bool:
        head, _, rest = key.partition("/")
        if head in ("params", "best"):
            return rest in names
        if head == "optim":
            return rest.rsplit("/", 1)[0] in names
        if same:
            return head == f"rank{ctx.rank}"
        return src is not None and key.startswith(f"rank{src}/rng/")

    t = ckpt.load_tensors(Path(path), wanted, process_group=group)
    device = ctx.device
    with torch.no_grad():
        for n, p in zip(prog.param_names, prog.params):
            if f"params/{n}" in t:
                p.copy_(t[f"params/{n}"])
    for n, p in zip(prog.param_names, prog.params):
        state = {k.rsplit("/", 1)[1]: v for k, v in t.items() if k.startswith(f"optim/{n}/")}
        if p.requires_grad and state:
            ckpt.set_optimizer_state(optimizer, p, state, device)
    owned = {n for n in prog.param_names if prog.placement.holder(n) == ctx.rank}
    if meta.get("best_epoch") is not None:
        best.update(val=meta["best_val"], epoch=meta["best_epoch"],
                    params={n: t[f"best/{n}"] for n in owned if f"best/{n}" in t})
    if src is not None and f"rank{src}/rng/cpu" in t:
        torch.set_rng_state(t[f"rank{src}/rng/cpu"])
    if src is not None and device.type == "cuda" and f"rank{src}/rng/cuda" in t:
        torch.cuda.set_rng_state(t[f"rank{src}/rng/cuda"], device)
    if same:
        for name, (_, set_) in ckpt.RANK_STATE.items():
            prefix = f"rank{ctx.rank}/{name}/"
            set_(rank, {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)})
    return int(meta["epoch"])


def plan_fingerprint(plan: Plan) -> dict[str, Any]:
    """What a checkpoint of ``plan``'s run must match to be resumed: the model (class, parameter
    names, shapes, dtypes, and a hash of its trace: ``info["model_hash"]``), the graph (its
    description, a hash of each rank's structure and the planned graph's features, labels and masks:
    ``info["data_hash"]``) and the plan (strategy, semantics,
    relaxations, options, ranks); :func:`_prepare_run` adds the training settings."""
    programs: list[RankProgram] = plan.program
    p0 = programs[0]

    def structure(prog: RankProgram) -> str:
        graphs = [prog.step.inputs.get("g")] + [ci.get("g") for _, ci in sorted(prog.step.chunk_inputs.items())]
        return ckpt.tensor_hash(*[t for g in graphs if g is not None for t in (g.indptr, g.indices)])

    options = json.loads(json.dumps(plan.options, sort_keys=True, default=str))
    return {"model": {"class": plan.info.get("model"),
                      "params": [[n, list(p.shape), str(p.dtype)] for n, p in zip(p0.param_names, p0.params)],
                      # what it computes: code and hyperparameters (a dropout rate), as traced
                      "traced": plan.info.get("model_hash")},
            "graph": {"description": plan.info.get("graph"), "structure_by_rank": [structure(p) for p in programs],
                      "data": plan.info.get("data_hash")},
            "plan": {"strategy": plan.strategy, "semantics": plan.semantics, "relaxations": list(plan.relaxations),
                     "options": options, "ranks": plan.num_ranks}}


def _reshard_refusal(path: Path, meta: dict) -> Optional[str]:
    """Why a checkpoint cannot continue on another number of ranks (``None``: it can). Parameters
    and optimizer state are stored by name, once, so every strategy's ranks can read theirs; state
    that belongs to one rank (registered rank state, e.g. stale chunks) cannot move."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    kinds = sorted({k.split("/")[1] for k in keys if k.startswith("rank") and k.split("/")[1] != "rng"})
    if kinds:
        return (f"it holds per-rank state ({', '.join(kinds)}) that belongs to its "
                f"{meta['fingerprint']['plan']['ranks']} ranks' chunks")
    return None


def plan_placement(plan: Plan, device: Any = None, backend: Optional[str] = None,
                   stage_through_host: Optional[Any] = None) -> Placement:
    """Where :func:`run_plan` with these arguments runs ``plan``'s ranks on this machine (decided
    before anything starts; raises :class:`~gnncompile.RuntimeFailure` for an impossible request).
    See :func:`~gnncompile.runtime.launcher.resolve_placement`; a ``device`` left ``None`` is
    ``$GNNCOMPILE_DEVICE`` when set (e.g. ``cpu`` on a GPU machine), else chosen automatically."""
    return _placement(plan.num_ranks, device, backend, stage_through_host)


def _placement(num_ranks: int, device: Any, backend: Optional[str], stage_through_host: Optional[Any] = None
               ) -> Placement:
    """:func:`~gnncompile.runtime.launcher.resolve_placement` on this machine's GPUs, ``device``
    ``None`` read from ``$GNNCOMPILE_DEVICE`` (a refusal then names the variable)."""
    from_env = default_device() if device is None else None
    try:
        return resolve_placement(num_ranks, visible_gpus(), device if device is not None else from_env, backend,
                                 stage_through_host)
    except RuntimeFailure as exc:
        if from_env is None:
            raise
        raise RuntimeFailure(f"$GNNCOMPILE_DEVICE={from_env!r} (the device of runs that name none): {exc}; "
                             "or unset GNNCOMPILE_DEVICE") from None


def default_device() -> Optional[str]:
    """The device a run uses when none is named: ``$GNNCOMPILE_DEVICE`` if set, else ``None``
    (automatic: the GPUs when there are any, else the CPU)."""
    return os.environ.get("GNNCOMPILE_DEVICE") or None


def describe_run(plan: Plan, placement: Placement) -> str:
    """One line for a run's header: where the ranks run (:meth:`Placement.describe`) and what the
    plan was planned for (``plan.cluster``; the planner records its devices in
    ``plan.info["devices"]``), with a note when the two differ in kind (GPUs vs CPU) or in the
    number of devices, e.g. ``4 ranks on CPU, gloo; planned for 1 node x 4 A100-80GB: runs on this
    machine's CPU instead (predicted times and memory are for the planned devices)``."""
    text = placement.describe()
    cluster = str(plan.cluster or "").strip()
    if not cluster:
        return text
    text += f"; planned for {cluster.split(' (')[0]}"
    devices = plan.info.get("devices")  # recorded by the planner (absent from plans made by hand)
    if not isinstance(devices, dict):
        return text
    planned_devices = int(devices["nodes"]) * int(devices["per_node"])
    planned_kind = "cpu" if devices["kind"] == "cpu" else "cuda"
    used = len(set(placement.devices)) if placement.device_type == "cuda" else 0
    if planned_kind != placement.device_type:
        where = "this machine's CPU" if placement.device_type == "cpu" else \
            f"{used} GPU{'s' if used != 1 else ''}"
        text += f": runs on {where} instead (predicted times and memory are for the planned devices)"
    elif planned_kind == "cuda" and used != planned_devices:
        text += (f": runs on {used} GPU{'s' if used != 1 else ''} instead of {planned_devices} (predicted times and "
                 "memory are for the planned devices)")
    elif planned_kind == "cpu" and int(devices["nodes"]) > 1 and placement.num_ranks == planned_devices:
        # every rank on this machine (torchrun across hosts places only this host's ranks here)
        text += (f": runs on this machine alone instead of {devices['nodes']} nodes (predicted times are for the "
                 "planned nodes and links)")
    return text


def run_plan(plan: Plan, epochs: int = 200, lr: float = 0.01, weight_decay: float = 5e-4, *,
             seed: Optional[int] = 0, eval_every: int = 1, timeout: float = 300.0, capture: bool = False,
             update_model: bool = True, fail_at: Optional[tuple[int, int]] = None,
             threads_per_rank: Optional[int] = None, device: Any = None, backend: Optional[str] = None,
             stage_through_host: Optional[Any] = None, progress: bool = True,
             checkpoint_dir: Optional[str | os.PathLike] = None, checkpoint_every: int = 10, resume: bool = False,
             patience: Optional[int] = None) -> RunResult:
    """Train with ``plan`` on ``plan.num_ranks`` local processes (see :func:`_run_plan` for the
    run's own arguments); this adds checkpoints, resuming and early stopping.

    ``checkpoint_dir``: write a checkpoint there every ``checkpoint_every`` epochs and after the
    last one (:mod:`gnncompile.runtime.checkpoint`: parameters, Adam state, random streams, stale
    chunks, history; atomic), and the best-validation parameters to ``checkpoint_dir/best.pt``. A
    directory that already holds checkpoints is refused unless ``resume``. ``resume=True``
    continues from the newest checkpoint up to ``epochs`` in total (the history covers all of
    them): for exact plans the trajectory is bit-identical to an uninterrupted run on the CPU; a
    checkpoint of another model, graph or plan, a damaged one, or none at all is refused with a
    :class:`~gnncompile.RuntimeFailure` naming why. On another number of ranks the parameters and
    optimizer state are re-sharded (stored by name); random streams follow rank 0's for plans with
    replicated dropout masks and are fresh for other ranks, and checkpoints with per-rank state
    (stale chunks; the model's buffers, such as BatchNorm's running statistics, which each rank
    keeps for the rows it normalizes) are refused. When a rank fails, the :class:`RankFailure`'s message ends with a
    line saying how to resume. ``patience``: stop after this many epochs without a higher
    validation accuracy (``history.stopped_at`` says where). ``result.best_state_dict()`` gives
    the parameters at the best validation accuracy.
    """
    check_timeout(timeout)
    check_training_args(epochs, lr, weight_decay, patience, resume, checkpoint_dir, eval_every=eval_every, seed=seed)
    with ckpt.claimed(checkpoint_dir, resume):  # (a second run into it meanwhile is refused)
        options, run_options = _prepare_run(plan, epochs, lr, weight_decay, capture=capture,
                                            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                                            resume=resume, patience=patience, seed=seed, eval_every=eval_every)
        try:
            result = _run_plan(plan, epochs, lr, weight_decay, seed=seed, eval_every=eval_every, timeout=timeout,
                               capture=capture, update_model=update_model, fail_at=fail_at,
                               threads_per_rank=threads_per_rank, device=device, backend=backend,
                               stage_through_host=stage_through_host, progress=progress, run_options=run_options)
        except RankFailure as e:
            if options is not None:
                e.args = (f"{e}\n{ckpt.resume_hint(options.directory, 'plan.run')}",)
            raise
        if options is not None and getattr(result.history, "_best_state", None) is not None:
            ckpt.write_best(options.directory, result.history._best_state, result.history.best_epoch,
                            result.history.best_val_acc)
        return result


def _prepare_run(plan: Plan, epochs: int, lr: float, weight_decay: float, *, capture: bool,
                 checkpoint_dir: Optional[str | os.PathLike], checkpoint_every: int, resume: bool,
                 patience: Optional[int], seed: Optional[int] = 0, create: bool = True, missing_note: str = "",
                 eval_every: int = 1) -> tuple[Optional[ckpt.CheckpointOptions], dict[str, Any]]:
    """What :func:`run_plan` and :func:`run_plan_torchrun` do before any rank trains: check the
    arguments, fingerprint the plan and decide what to resume from (:func:`ckpt.prepare`; with
    ``create=False`` it only reads, for every torchrun process; ``missing_note`` ends the error for
    a missing checkpoint). Returns the checkpoint options (``None``: no checkpoints) and the
    ``run_options`` of :func:`execute_rank`. Its callers have checked the arguments
    (:func:`check_training_args`)."""
    programs: list[RankProgram] = plan.program
    counts = programs[0].counts
    if not counts.get("labels", 1):
        raise GraphError("y: the graph this plan was made for has no labels; training needs them")
    if not counts.get("train"):
        raise GraphError("train_mask: the graph this plan was made for has no training vertices")
    if patience is not None and not programs[0].counts.get("val"):
        raise ArgumentError("patience needs validation vertices (the graph's val_mask is empty)")
    options: Optional[ckpt.CheckpointOptions] = None
    run_options: dict[str, Any] = {"patience": patience}
    if checkpoint_dir is not None:
        options = ckpt.CheckpointOptions(str(checkpoint_dir), checkpoint_every, resume)
        if capture and resume:
            raise ArgumentError("capture=True records the first step, which a resumed run does not take; drop one")
        fingerprint = plan_fingerprint(plan)
        fingerprint["training"] = {"seed": None if seed is None else int(seed), "lr": float(lr),
                                   "weight_decay": float(weight_decay), "eval_every": int(eval_every)}
        found = ckpt.prepare(options, fingerprint, reshard=_reshard_refusal, create=create, missing_note=missing_note)
        if found is not None and found.epoch > epochs:
            raise RuntimeFailure(f"checkpoint {found.path} holds {found.epoch} epochs, more than epochs={epochs}; "
                                 f"pass epochs >= {found.epoch} to continue it")
        run_options.update(checkpoint=options, fingerprint=fingerprint, plan_json=plan.to_json(),
                           resume_from=None if found is None else str(found.path),
                           resume_meta=None if found is None else found.meta)
    return options, run_options


def _run_plan(plan: Plan, epochs: int = 200, lr: float = 0.01, weight_decay: float = 5e-4, *,
              seed: Optional[int] = 0, eval_every: int = 1, timeout: float = 300.0, capture: bool = False,
              update_model: bool = True, fail_at: Optional[tuple[int, int]] = None,
              threads_per_rank: Optional[int] = None, device: Any = None, backend: Optional[str] = None,
              stage_through_host: Optional[Any] = None, progress: bool = True,
              run_options: Optional[dict] = None) -> RunResult:
    """Train with ``plan`` on ``plan.num_ranks`` local processes.

    ``device``: ``None`` (auto: the GPUs when CUDA is available, else the CPU), ``"cpu"``,
    ``"cuda"`` (rank ``r`` on ``cuda:(r % GPUs)``) or ``"cuda:N"``. ``backend``: ``None`` (auto:
    NCCL when every rank has a GPU of its own, else gloo, with ranks sharing GPUs), ``"gloo"`` or
    ``"nccl"``. An impossible request (CUDA without a GPU, NCCL on the CPU or with fewer GPUs
    than ranks) raises :class:`~gnncompile.RuntimeFailure` before any rank starts; the choice is
    in the result's ``placement`` (:meth:`RunResult.describe_placement`; :func:`plan_placement`
    gives it before the run). ``stage_through_host``: force host staging of these communication
    operations (see :class:`~gnncompile.runtime.comm.Communicator`; for tests).
    ``timeout`` bounds every collective and receive: a rank that raises or dies makes the run
    raise :class:`~gnncompile.RuntimeFailure` naming it, and no process is left behind.
    With ``update_model`` the user's model receives the trained parameters and buffers (a buffer
    updated on several ranks: :func:`combine_buffers`, the mean of running statistics). ``capture`` returns the
    first step's logits and gradients (for checks against the single-device reference).
    ``fail_at=(rank, epoch)`` injects a failure (for testing fault handling). ``progress``: rank 0
    prints a progress line to stderr about every 10 s (runs shorter than that print nothing).
    :func:`run_plan` has checked the arguments.
    """
    placement = plan_placement(plan, device, backend, stage_through_host)
    directional_p2p(placement.backend)   # (a bad $GNNCOMPILE_P2P_GROUPS: refused before the ranks start)
    programs: list[RankProgram] = plan.program
    if placement.device_type == "cpu":
        # the native CPU kernels are built (a first build: ~30 s, more on a busy host) or loaded here,
        # once, not in every rank, each waiting for the one building within its collective timeout
        kernels.default_backend("cpu")
    # each rank deletes its program once loaded and the last one the directory (_rank_main); if this
    # process dies, the ranks delete it (launch's temp_paths)
    with tempfile.TemporaryDirectory(prefix="gnncompile-plan-", ignore_cleanup_errors=True) as tmp:
        # each rank loads only its own program (a rank's graph shard can be large)
        run_options = {**(run_options or {}), "p2p_pairs": p2p_pairs(programs)}
        main_fns = _MainFunctions(programs)
        for prog in programs:
            # by value what ranks cannot import: model classes defined in __main__ (a script, a notebook),
            # and the functions of __main__ the traced code calls, installed first (_MainFunctions)
            torch.save((main_fns, prog), os.path.join(tmp, f"rank{prog.rank}.pt"), pickle_module=cloudpickle)
        results = launch(_rank_main, plan.num_ranks, (tmp, epochs, lr, weight_decay, seed, eval_every, capture,
                                                      fail_at, progress, run_options),
                         placement=placement, timeout=timeout, threads_per_rank=threads_per_rank, temp_paths=(tmp,))
    results = sorted(results, key=lambda r: r["rank"])
    h0 = results[0]["history"]
    history = History(loss=h0["loss"], train_acc=h0["train_acc"], val_acc=h0["val_acc"], test_acc=h0["test_acc"],
                      epoch_time=[max(r["epoch_time"][e] for r in results) for e in range(len(h0["loss"]))],
                      eval_time=h0["eval_time"], stopped_at=results[0].get("stopped_at"), eval_every=eval_every)
    p0 = programs[0]
    if results[0]["best"]["epoch"] is not None:  # each parameter from its owner
        history._best_state = {n: results[p0.placement.holder(n)]["best"]["params"][n]
                               for n in p0.param_names}
        history._best_state.update(combine_buffers([r["best"]["buffers"] for r in results]))
    ranks = []
    for r in results:
        ranks.append(RankResult(
            rank=r["rank"], bytes_sent=sum(r["sent_to"].values()), bytes_received=sum(r["received_from"].values()),
            sent_to=r["sent_to"], received_from=r["received_from"], comm=r["comm"], peak_memory=r["peak_memory"],
            timeline=r["timeline"], epoch_time=r["epoch_time"], num_owned=r["num_owned"],
            checkpoint_time=r["checkpoint_time"], restore_time=r["restore_time"], topology_bytes=r["topology_bytes"]))
    captured = None
    if capture:
        captured = _gather_capture(programs, results)
    if update_model:
        with torch.no_grad():
            for p, name in zip(programs[0].params, programs[0].param_names):
                owner = programs[0].placement.holder(name)
                if name in results[owner].get("params", {}):
                    p.copy_(results[owner]["params"][name])
            # the stage modules share the user's modules (and buffers) in this process
            targets: dict[str, torch.Tensor] = {}
            for prog in programs:
                for m in (*prog.modules.values(), *prog.eval_modules.values()):
                    for n, b in m.named_buffers():
                        targets.setdefault(n, b)
            for n, t in combine_buffers([r["buffers"] for r in results]).items():
                if n in targets:
                    targets[n].copy_(t)
    return RunResult(history=history, ranks=ranks, plan=plan, captured=captured, placement=placement)


class _MainFunctions:
    """The functions of the caller's ``__main__`` that the programs' traced code calls (a
    ``torch.fx.wrap``-ped function of a script or notebook): fx pickles a graph module's code with
    ``from __main__ import f``, which a rank's own ``__main__`` cannot satisfy. Unpickled before the
    program (the first item of the rank's file), it sets them on the rank's ``__main__``, pickled
    by value (cloudpickle)."""

    def __init__(self, programs: list[RankProgram]) -> None:
        self.functions: dict[str, Any] = {}
        for prog in programs:
            for m in (*prog.modules.values(), *prog.eval_modules.values()):
                for node in getattr(getattr(m, "graph", None), "nodes", ()):
                    target = node.target
                    if node.op == "call_function" and getattr(target, "__module__", None) == "__main__":
                        self.functions[target.__name__] = target

    def __reduce__(self) -> tuple:
        return _install_main_functions, (self.functions,)


def _install_main_functions(functions: dict[str, Any]) -> None:
    main = sys.modules["__main__"]
    for name, fn in functions.items():
        if not hasattr(main, name):
            setattr(main, name, fn)


def _rank_main(ctx: RankContext, program_dir: str, *args: Any) -> dict:
    path = os.path.join(program_dir, f"rank{ctx.rank}.pt")
    _, prog = torch.load(path, weights_only=False)
    os.unlink(path)
    with contextlib.suppress(OSError):  # not empty: another rank has yet to load its program
        os.rmdir(program_dir)
    return execute_rank(ctx, prog, *args)


def _gather_capture(programs: list[RankProgram], results: list[dict]) -> dict:
    logits_parts = [r["captured"].get("logits") for r in results]
    n = sum(int(p.step.owned.numel()) for p in programs)
    first = next(t for t in logits_parts if t is not None)
    logits = first.new_zeros((n,) + tuple(first.shape[1:]))
    for p, r, t in zip(programs, results, logits_parts):
        if t is not None:  # a regrouped step scores its rows in the epoch's order
            owned = r["captured"].get("owned")
            logits[p.step.owned if owned is None else owned] = t
    p0 = programs[0]
    grads = {n: results[p0.placement.holder(n)]["captured"].get("grads", {}).get(n)
             for n in p0.param_names}
    return {"logits": logits, "grads": grads}


def run_plan_torchrun(plan: Plan, epochs: int = 200, lr: float = 0.01, weight_decay: float = 5e-4, *,
                      seed: Optional[int] = 0, eval_every: int = 1, timeout: float = 300.0, device: Any = None,
                      backend: Optional[str] = None, progress: bool = True,
                      checkpoint_dir: Optional[str | os.PathLike] = None, checkpoint_every: int = 10,
                      resume: bool = False, patience: Optional[int] = None) -> Optional[RunResult]:
    """Run this process's rank of ``plan`` under ``torchrun`` (one process per rank, any number of machines).

    ``device``/``backend`` as for :func:`run_plan`, decided over this machine's local ranks
    (``LOCAL_WORLD_SIZE``) and its GPUs.

    Every process builds the same plan (planning is deterministic for the same model, graph, seed and
    options) and executes the program of its ``RANK``; ``WORLD_SIZE`` must equal ``plan.num_ranks``.
    Rank 0 returns a :class:`RunResult` with its own measurements (the history is global); the other
    ranks return ``None``.

    ``checkpoint_dir``, ``checkpoint_every``, ``resume`` and ``patience`` as for :func:`run_plan`.
    Every process decides what to resume from by reading the directory (nothing written); once
    the group is up the ranks compare their decisions, and rank 0 alone creates the directory
    and renames checkpoints into place. On several machines the directory must be on a
    filesystem every machine shares: a rank that does not see the checkpoint others see, or rank
    0 not seeing a rank's files, is a :class:`~gnncompile.RuntimeFailure` saying so. Rank 0
    writes ``checkpoint_dir/best.pt`` from the last checkpoint's best parameters.
    """
    from .launcher import torchrun_main

    check_training_args(epochs, lr, weight_decay, patience, resume, checkpoint_dir, eval_every=eval_every, seed=seed)
    check_timeout(timeout)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if not world:
        raise RuntimeFailure(f"not started by torchrun (WORLD_SIZE is unset): launch this under torchrun with "
                             f"{plan.num_ranks} processes in all (--nproc-per-node x --nnodes = {plan.num_ranks}), "
                             f"or run the plan without torchrun (plan.run; the CLI without --torchrun)")
    if world != plan.num_ranks:
        raise RuntimeFailure(f"torchrun started {world} processes (WORLD_SIZE) but the plan has "
                             f"{plan.num_ranks} ranks; pass --gpus {world} or --nproc-per-node x --nnodes = "
                             f"{plan.num_ranks}")
    options, run_options = _prepare_run(plan, epochs, lr, weight_decay, capture=False, checkpoint_dir=checkpoint_dir,
                                        checkpoint_every=checkpoint_every, resume=resume, patience=patience,
                                        seed=seed, create=False, missing_note=ckpt.SHARED_FS, eval_every=eval_every)
    programs: list[RankProgram] = plan.program
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    placement = _placement(local_world, device, backend)

    run_options["p2p_pairs"] = p2p_pairs(programs)

    def main(ctx: RankContext) -> dict:
        if options is not None:
            _agree_on_checkpoint(ctx, options, run_options.get("resume_from"))
        return execute_rank(ctx, programs[ctx.rank], epochs, lr, weight_decay, seed, eval_every, False, None,
                            progress, run_options)

    r = torchrun_main(main, (), placement=placement, timeout=timeout)
    if r["rank"] != 0:
        return None
    h = r["history"]
    history = History(loss=h["loss"], train_acc=h["train_acc"], val_acc=h["val_acc"], test_acc=h["test_acc"],
                      epoch_time=r["epoch_time"], eval_time=h["eval_time"], stopped_at=r.get("stopped_at"),
                      eval_every=eval_every)
    last = None if options is None else ckpt.latest(options.directory)
    if last is not None and r["best"]["epoch"] is not None:  # each owner wrote its best parameters there
        names = programs[0].param_names
        best = ckpt.load_tensors(last, lambda k: (k.startswith("best/") and k[5:] in names)
                                 or k.split("/")[1:3] == ["buffers", "best"], distributed=False)
        history._best_state = {n: best[f"best/{n}"] for n in names if f"best/{n}" in best}
        per_rank: dict[str, dict[str, torch.Tensor]] = {}
        for k, t in best.items():
            if not k.startswith("best/"):   # rank<r>/buffers/best/<name>
                per_rank.setdefault(k.split("/")[0], {})[k.split("/", 3)[3]] = t
        history._best_state.update(combine_buffers(list(per_rank.values())))
        ckpt.write_best(options.directory, history._best_state, r["best"]["epoch"], r["best"]["val"])
    rank = RankResult(rank=0, bytes_sent=sum(r["sent_to"].values()), bytes_received=sum(r["received_from"].values()),
                      sent_to=r["sent_to"], received_from=r["received_from"], comm=r["comm"],
                      peak_memory=r["peak_memory"], timeline=r["timeline"], epoch_time=r["epoch_time"],
                      num_owned=r["num_owned"], checkpoint_time=r["checkpoint_time"],
                      restore_time=r["restore_time"], topology_bytes=r["topology_bytes"])
    return RunResult(history=history, ranks=[rank], plan=plan, placement=placement)


def _agree_on_checkpoint(ctx: RankContext, options: ckpt.CheckpointOptions, resume_from: Optional[str]) -> None:
    """Under torchrun, after the group is up: every rank must have decided to resume from the
    same checkpoint (or none); then rank 0 creates the directory (:func:`ckpt.make_directory`)
    and the others wait for it."""
    seen: list[Any] = [None] * ctx.world_size
    mine = None if resume_from is None else Path(resume_from).name
    dist.all_gather_object(seen, mine)
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {q}: {s or 'no checkpoint'}" for q, s in enumerate(seen))
        raise RuntimeFailure(f"the ranks see different checkpoints in {options.directory} ({found}); {ckpt.SHARED_FS}")
    if ctx.rank == 0:
        ckpt.make_directory(options)
    dist.barrier()
