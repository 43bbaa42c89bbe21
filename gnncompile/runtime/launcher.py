"""Starting ranks: local processes (:func:`launch`) or one rank per process under torchrun (:func:`torchrun_main`).

Every rank runs ``fn(ctx, *args)`` with a :class:`RankContext` inside an initialized
``torch.distributed`` process group (gloo on CPU, NCCL with one GPU per rank, gloo when ranks
share GPUs; :func:`resolve_placement` decides) and returns a picklable value.

**One machine**: ``launch(fn, world_size, args)`` starts ``world_size`` processes (start method
``forkserver``, whose server has imported torch and the runtime once, see :func:`_context`), returns their results ordered by rank, and supervises them. The ranks meet through a
``TCPStore`` that the calling process serves on a free port of 127.0.0.1 (no port can be taken
between choosing and binding it). ``launch(fn, 1, args, inline=True)`` runs rank 0 in the calling
process instead, in a single-process gloo group (for tests and debuggers).

Failure handling (every path leaves no child process behind):

- A rank that raises sends its exception type, message and formatted traceback to the caller at
  once; a rank that dies without a word (a signal, ``os._exit``) is seen by its process sentinel.
  The caller then stops every rank (SIGTERM, SIGKILL after a grace period) and raises
  :class:`RankFailure` (a :class:`~gnncompile.errors.RuntimeFailure`) naming the root-cause rank.
  The others are not left to run into their collective timeout.
- Root cause: a rank that fails because a *peer* is gone (gloo's "Connection closed by peer",
  timeouts, ``torch.distributed`` backend errors) is a secondary failure. When the first failure
  looks secondary, the caller waits up to half a second for a primary one (another rank's
  exception, or a rank that died); secondary failures are listed briefly after the root cause.
- Lagging ranks: each rank records its progress in shared memory (:class:`_ProgressBoard`: how
  many communications it entered, the one it is in, and the program's own position, see
  :func:`~gnncompile.runtime.comm.note_progress`). When every failure is a timeout or a lost peer,
  the root cause is the rank that did not fail: a rank that was stopped (SIGSTOP, a debugger:
  process state ``T`` in ``/proc``) or the one furthest behind, still running (its Python stack
  is dumped to its stderr, ``faulthandler`` on SIGUSR1, and quoted). So a stopped or stuck rank
  is named within the collective timeout plus the half-second settle.
- Hangs: the collective timeout bounds gloo and NCCL collectives, but not gloo point-to-point
  receives in every version, nor waits outside the process group. So the caller also watches the
  ranks' CPU time (``/proc``): when no rank has used CPU for ``timeout`` seconds plus 5 (every
  rank blocked, e.g. each waiting to receive from another; the 5 s let the ranks' own timeouts,
  with their tracebacks, come first) the run is declared hung and :class:`RankFailure` lists the
  ranks still running, where each is, and names a stopped rank or one behind the others. Where
  ``/proc`` is missing the guard counts wall time since the last rank reported instead. A run that
  computes is never cut short, however long it takes.
- Children die with the caller, within a fraction of a second and quietly: a thread in each rank
  waits for the calling process to exit (a pidfd; polling its pid where pidfds are missing), then
  deletes the run's ``temp_paths`` and ends the rank with ``os._exit`` (its stderr pointed at
  ``/dev/null`` first: the pipe it wrote to is gone). The first to notice also kills the
  forkserver (which would wait for its last client, then take most of a second to tear torch
  down), and the other ranks with it: they die with the forkserver (Linux ``PR_SET_PDEATHSIG``).
  Ranks ignore SIGINT, so a Ctrl-C is handled once, by the caller, which stops them; one that
  comes while a rank starts, or while the ranks are being stopped, is taken when that is done.

The ranks do not run the launching program's main script (multiprocessing would re-run it in
every child, see :func:`_main_module_hidden`): ``fn`` and ``args`` are pickled once, in the
caller, by reference where the ranks can import them and by value (cloudpickle) where they
cannot (``__main__`` of a script, ``python -c``, stdin or a notebook), so a script needs no
``if __name__ == "__main__":`` guard and may define its models itself. Something unpicklable is
refused in the caller before any rank starts. Each rank's stderr (its fd 2: Python's and C's
messages) is a pipe the caller reads while it waits, copying it to ``sys.stderr`` line by line
(``[rankN]: ...``); a :class:`RankFailure` quotes the failed rank's last 20 lines
(``stderr_tail``), which for a rank that died without a Python exception is often all there is.

Children get ``threads_per_rank`` threads (``torch.set_num_threads``; ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` are set for them too, as those libraries read
them when they load).

A rank process keeps its heap (:func:`keep_heap`, glibc): a training step allocates and frees the
same activation-sized blocks every step, and glibc's defaults hand blocks of a few MiB back to the
kernel and fault them in again, zeroed, page by page (four element-wise ops on [16745, 64] float32
tensors: 9.5 ms with 4,150 page faults per call, 1.0 ms and none with the heap kept). Launched
ranks and :func:`torchrun_main`'s process keep theirs; ``inline`` runs leave the caller's process
as it is.

**Several machines** (torchrun starts, restarts and tears down the processes; each calls
:func:`torchrun_main`, which joins the group with ``init_method="env://"``)::

    # on every machine (HOST is the first machine's address):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m gnncompile run --torchrun --gpus 8 [the same model and plan flags on every machine]
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import faulthandler
import importlib
import math
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import re
import select
import shutil
import signal
import sys
import textwrap
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ArgumentError, RuntimeFailure
from .comm import set_progress_recorder

__all__ = ["Placement", "RankContext", "RankFailure", "keep_heap", "launch", "resolve_placement", "torchrun_main",
           "visible_gpus"]

T = TypeVar("T")

_SETTLE_S = 0.5          # after a failure that looks secondary, how long to wait for the root cause
_TERM_GRACE_S = 2.0      # SIGTERM, then SIGKILL after this long
_BUSY_FRACTION = 0.05    # a rank using more than this fraction of a core is making progress
_CPU_WINDOW_S = 1.0      # how often the ranks' CPU time is sampled
_GUARD_SLACK_S = 5.0     # the hang guard waits this much longer than the ranks' own timeouts
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_SETTINGS_PREFIX = "GNNCOMPILE_"  # environment variables a rank takes from its caller
_STDERR_TAIL_LINES = 20    # a RankFailure quotes this many of the failed rank's last stderr lines
_STDERR_LINE_CHARS = 500   # ... each cut to this many characters
_WATCH_POLL_S = 0.2        # without pidfds, how often a rank checks that the calling process lives
_LABEL_BYTES = 120         # a rank's progress labels are cut to this many bytes
_DUMP_WAIT_S = 0.3         # how long the caller waits for a lagging rank's stack dump
_SECONDARY_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}
_SECONDARY_MESSAGE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|ECONNRESET|EPIPE|"
                                r"timed out|timeout", re.IGNORECASE)


@dataclass(frozen=True)
class RankContext:
    """Where ``fn`` runs: its rank among ``world_size``, the process group's backend, the device
    to compute on (see :class:`Placement`: ``cuda:local_rank`` under NCCL, a shared
    ``cuda:(local_rank % GPUs)`` under gloo on GPUs, else CPU) and the rank's index on its machine.
    ``stage_through_host``: the ``torch.distributed`` operations whose tensors this rank must copy
    to host memory and back (those the backend cannot run on the device's tensors; see
    :class:`~gnncompile.runtime.comm.Communicator`)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    local_rank: int
    stage_through_host: frozenset[str] = frozenset()


class RankFailure(RuntimeFailure):
    """A launched run failed.

    ``rank``: the root-cause rank (``None`` for a hang where no rank is stopped or behind the
    others); ``exc_type``: the name of the exception it raised (``None`` if it died without one,
    or did not fail but was stopped or fell behind); ``remote_traceback``: that rank's formatted
    traceback; ``exitcode``: its exit code if it died (negative: killed by that signal);
    ``still_running``: ranks that had not finished (a hang, or a stopped or lagging root cause);
    ``secondary``: one line per other failed rank; ``stderr_tail``: the last lines (up to 20) the
    root-cause rank wrote to its stderr (also quoted in the message; empty when it wrote none or ran in this process);
    ``stopped``: the root-cause rank was stopped (SIGSTOP or a debugger) while the others waited.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, exc_type: Optional[str] = None,
                 remote_traceback: Optional[str] = None, exitcode: Optional[int] = None,
                 still_running: Sequence[int] = (), secondary: Sequence[str] = (),
                 stderr_tail: Sequence[str] = (), stopped: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.still_running = list(still_running)
        self.secondary = list(secondary)
        self.stderr_tail = list(stderr_tail)
        self.stopped = stopped


def check_timeout(timeout: Any) -> None:
    """Refuse a ``timeout`` that is not a finite number of seconds > 0 (:class:`ArgumentError`)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ArgumentError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")


def launch(fn: Callable[..., T], world_size: int, args: tuple = (), *, backend: Optional[str] = None,
           device: Optional[str] = None, placement: Optional[Placement] = None, timeout: float = 300.0,
           threads_per_rank: Optional[int] = None, inline: bool = False,
           temp_paths: Sequence[str] = ()) -> list[T]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks and return the results ordered by rank.

    ``fn``, ``args`` and the results must be picklable; what the ranks cannot import (functions
    and classes defined in ``__main__``: a script, ``python -c``, stdin, a notebook; lambdas)
    travels by value (cloudpickle). The ranks never run the main script, so no
    ``if __name__ == "__main__":`` guard is needed. Each rank's stderr is passed on to
    ``sys.stderr`` line by line, prefixed ``[rankN]:``.

    ``backend``: ``None`` picks NCCL when there is a GPU per rank, else gloo. ``device``: ``None``
    (the backend's: one GPU per rank under NCCL, the CPU under gloo), ``"cpu"``, ``"cuda"`` (ranks
    share the GPUs when they outnumber them) or ``"cuda:N"``; see :func:`resolve_placement`, which
    refuses impossible requests before any rank starts. ``placement``: one decided beforehand
    (instead of ``backend``/``device``). ``timeout`` (seconds) bounds every collective and is the
    hang guard (see the module docstring). ``threads_per_rank`` defaults to the usable cores
    divided among the ranks. ``temp_paths``: files or directories of this run that the ranks
    delete if this process dies while they run (the caller deletes them otherwise).
    ``inline=True`` (``world_size`` 1 only) runs ``fn`` in this process in a single-process gloo
    group, destroyed afterwards; ``threads_per_rank`` does not apply there.

    Raises :class:`RankFailure` if a rank raises, dies or the run hangs; no child outlives the call.
    """
    if world_size < 1:
        raise ArgumentError(f"world_size must be >= 1, got {world_size}")
    check_timeout(timeout)
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ArgumentError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
    if inline:
        if world_size != 1 or backend not in (None, "gloo") or device not in (None, "cpu") or placement is not None:
            raise ArgumentError("inline=True runs one rank with gloo on the CPU: use world_size=1, backend None or "
                             "'gloo', device None or 'cpu' and no placement")
        return [_run_inline(fn, args, timeout)]
    placement = _launch_placement(world_size, device, backend, placement, "launch")
    if placement.num_ranks != world_size:
        raise ArgumentError(f"launch: the placement has {placement.num_ranks} ranks, world_size is {world_size}")
    threads = threads_per_rank or max(1, _usable_cores() // world_size)
    payload = _pickle_payload(fn, args)
    mpc = _context()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    board = _ProgressBoard(mpc, world_size)
    # multiprocessing's directory of this process (the forkserver's socket): also deleted if this process dies
    temp_paths = tuple(map(str, temp_paths)) + (multiprocessing.util.get_temp_dir(),)
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []        # each rank's result
    err_readers: list[multiprocessing.connection.Connection] = []  # each rank's stderr
    tee = _StderrTee()
    finished = False
    try:
        with _child_environment(threads), _main_module_hidden():
            for rank in range(world_size):
                reader, writer = mpc.Pipe(duplex=False)
                err_reader, err_writer = mpc.Pipe(duplex=False)
                conns.append(reader)
                err_readers.append(err_reader)
                tee.add(rank, err_reader)
                p = mpc.Process(target=_child_main, name=f"gnncompile-rank{rank}",
                                args=(rank, world_size, placement, store.port, timeout, threads, os.getpid(),
                                      payload, writer, err_writer, board, temp_paths, _settings()))
                # a Ctrl-C inside start() would lose a rank the forkserver forks anyway (it may
                # still be importing torch): the interrupt is taken once the rank is on the list
                with _interrupts_deferred():
                    try:
                        p.start()
                        procs.append(p)
                    finally:
                        writer.close()
                        err_writer.close()
        results = _Supervisor(procs, conns, timeout, tee, board).run()
        finished = True
        return results
    finally:
        with _interrupts_deferred():    # a second Ctrl-C does not leave the ranks running
            _shutdown(procs, polite=finished, tee=tee)
            tee.close()
            for c in conns + err_readers:
                c.close()


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Within the block a SIGINT (Ctrl-C) is recorded, not acted on; Python's handler for it (or the
    caller's own) runs on exit, so the ``KeyboardInterrupt`` is raised after the block. Does nothing
    outside the main thread (SIGINT reaches only the main thread) or where SIGINT is not handled in
    Python (ignored, or the default action)."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pending:
        handler(*pending[0])


def _launch_placement(ranks: int, device: Any, backend: Optional[str], placement: Optional["Placement"],
                      caller: str) -> "Placement":
    """The placement of ``ranks`` local ranks given to ``launch``/``torchrun_main``: ``placement``
    itself, or one resolved from ``device``/``backend``, where a device left ``None`` is the
    backend's (the CPU under gloo; under NCCL, chosen automatically, the GPUs)."""
    if placement is not None:
        if backend is not None or device is not None:
            raise ArgumentError(f"{caller}: pass either placement or backend/device, not both")
        return placement
    gpus = visible_gpus()
    if device is None and not (backend == "nccl" or (backend is None and 0 < ranks <= gpus)):
        device = "cpu"
    return resolve_placement(ranks, gpus, device, backend)


def torchrun_main(fn: Callable[..., T], args: tuple = (), *, backend: Optional[str] = None,
                  device: Optional[str] = None, placement: Optional[Placement] = None, timeout: float = 300.0,
                  threads_per_rank: Optional[int] = None) -> T:
    """Run ``fn(ctx, *args)`` as the rank torchrun started this process as; return its result.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``), ``MASTER_ADDR`` and
    ``MASTER_PORT`` as torchrun sets them and joins the group with ``init_method="env://"``.
    ``backend``: ``None`` picks NCCL when this machine has a GPU per local rank, else gloo;
    ``device`` and ``placement`` as for :func:`launch`, over this machine's local ranks.
    Exceptions propagate (torchrun tears the other processes down), except that a failed
    collective (a peer that exited or stopped, a lost connection: ``torch.distributed``'s
    ``DistError`` or gloo's transport errors) becomes a :class:`RuntimeFailure` saying this rank
    lost its peers and that their output names the cause; the group is destroyed on every path.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeFailure(f"not started by torchrun: environment variable(s) {', '.join(missing)} unset")
    check_timeout(timeout)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    placement = _launch_placement(local_world, device, backend, placement, "torchrun_main")
    if local_rank >= placement.num_ranks:
        raise RuntimeFailure(f"LOCAL_RANK {local_rank} is outside the placement's {placement.num_ranks} local ranks "
                             "(LOCAL_WORLD_SIZE)")
    if threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    keep_heap()
    ctx = _init_group(rank, world_size, local_rank, placement, timeout, init_method="env://")
    try:
        result = fn(ctx, *args)
        # every rank finishes before any tears its connections down: a rank that destroyed its group
        # while a peer was still using it made the peer abort at exit ("terminate called without an
        # active exception", about one run in five of two gloo ranks)
        dist.barrier()
        return result
    except RuntimeError as exc:
        if not _lost_peers(exc):
            raise
        head = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeFailure(f"rank {rank} of {world_size}: a collective failed ({head}); another rank has most "
                             f"likely failed or stopped (its output, or torchrun's summary, names the cause)") from exc
    finally:
        dist.destroy_process_group()


def _lost_peers(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective rather than an error of the rank's own work:
    ``torch.distributed``'s ``DistError`` (NCCL, stores, timeouts) or gloo's transport errors,
    which reach Python as a plain ``RuntimeError`` naming gloo's source."""
    return isinstance(exc, dist.DistError) or "gloo/transport" in str(exc) or "Connection reset by peer" in str(exc) \
        or "Connection closed by peer" in str(exc)


def _context() -> Any:
    """A forkserver context whose server has imported torch and the runtime once per process.

    A rank then starts in a fraction of a second instead of re-importing torch (~2 s of CPU per
    rank with "spawn", and as much again when it builds its first optimizer). The server is
    forked before any torch thread pool exists, so children start clean; where forkserver is
    unavailable, "spawn".
    """
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            # torch._dynamo: torch.optim's first optimizer imports it (~2.5 s of CPU) otherwise
            ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "gnncompile.runtime.executor"])
        else:  # pragma: no cover - non-POSIX
            ctx = mp.get_context("spawn")
        _CONTEXT = ctx
    return _CONTEXT


_CONTEXT: Any = None


# --- the child side --------------------------------------------------------------------------------


def _child_main(rank: int, world_size: int, placement: "Placement", port: int, timeout: float, threads: int,
                parent_pid: int, payload: bytes, conn: multiprocessing.connection.Connection,
                stderr: multiprocessing.connection.Connection, board: "_ProgressBoard",
                temp_paths: tuple[str, ...], settings: Optional[dict[str, str]] = None) -> None:
    """Body of a spawned rank: take the caller's gnncompile ``settings`` (:func:`_settings`), make ``stderr`` its fd 2, watch the calling process ``parent_pid``
    (exit quietly, deleting ``temp_paths``, when it dies), record progress on ``board``, unpickle
    ``(fn, args)`` from ``payload``, join the group, run ``fn``, send ``("ok", pickled result)`` or
    ``("error", type name, message, traceback)`` to the caller, destroy the group."""
    if sys.stderr is not None:
        sys.stderr.flush()
    os.dup2(stderr.fileno(), 2)     # sys.stderr writes to fd 2: Python's and C's messages both go there
    stderr.close()
    _exit_with_parent(parent_pid, temp_paths)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the caller asks a lagging rank where it is
    set_progress_recorder(_RankRecorder(board, rank))
    # a forkserver child inherits the server's environment, not the launcher's: set the thread
    # variables here too (libraries that size their pools later read them), and the caller's settings
    os.environ.update({k: str(threads) for k in _THREAD_ENV})
    if settings is not None:
        for k in [k for k in os.environ if k.startswith(_SETTINGS_PREFIX) and k not in settings]:
            del os.environ[k]
        os.environ.update(settings)
    torch.set_num_threads(threads)
    keep_heap()
    failed = False
    try:
        try:
            fn, args = pickle.loads(payload)
            store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=timeout))
            ctx = _init_group(rank, world_size, rank, placement, timeout, store=store)
            # by value where needed: a result may hold objects of classes that came from __main__
            message: tuple = ("ok", cloudpickle.dumps(fn(ctx, *args), protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the caller
            failed = True
            message = ("error", type(exc).__name__, str(exc) + _main_lookup_hint(exc), traceback.format_exc())
        # sent before the group is destroyed, so a root cause arrives before its peers' symptoms
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        if not failed:
            _wait_for_peers(store, world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
    if failed:
        sys.exit(1)


def _wait_for_peers(store: dist.Store, world_size: int) -> None:
    """Return when every rank has finished ``fn`` (bounded by the store's timeout; when a rank fails
    the caller stops the others meanwhile). A rank that destroyed its group and exited at once could
    close its connections while a peer is still completing the group's set-up (gloo's
    connectFullMesh: "Connection closed by peer") or the tail of a last collective with it."""
    if store.add("gnncompile/finished", 1) == world_size:
        store.set("gnncompile/all-finished", b"1")
    store.wait(["gnncompile/all-finished"])


#: glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap (glibc's largest static mmap threshold on 64-bit)
_HEAP_BLOCKS = 32 << 20


def keep_heap() -> bool:
    """Have this process's C heap keep the memory it frees (glibc): blocks up to 32 MiB are served
    from the heap instead of fresh mappings, and freed memory is not trimmed back to the kernel, so
    a training step reuses the pages the last step freed instead of faulting them in again.

    The process's resident memory stays at its peak; tensor memory (what
    :class:`~gnncompile.runtime.memory.PeakMemory` counts) is unchanged. Returns whether the
    settings took (``False`` without glibc: another C library or a preloaded allocator that
    ignores ``mallopt``).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either turns off glibc's dynamic adjustment of both
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _init_group(rank: int, world_size: int, local_rank: int, placement: "Placement", timeout: float,
                **init: Any) -> RankContext:
    """Select the rank's device (``placement.devices[local_rank]``; a CUDA device becomes the
    current one) and initialize the default process group with ``placement.backend``; ``init``:
    its ``store`` or ``init_method``."""
    device = placement.device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch.optim's first optimizer imports torch._dynamo; imported after the group exists, it keeps
    # the group alive past destroy_process_group (torch 2.13), and a gloo worker still alive at
    # interpreter exit aborts the process ("terminate called without an active exception") when it
    # drops a tensor. Imported before, the group is torn down (its threads joined) when destroyed.
    importlib.import_module("torch._dynamo")
    dist.init_process_group(placement.backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout), **init)
    return RankContext(rank=rank, world_size=world_size, backend=placement.backend, device=device,
                       local_rank=local_rank, stage_through_host=placement.stage_through_host)


def _exit_with_parent(parent_pid: int, temp_paths: Sequence[str] = ()) -> None:
    """End this rank, quietly, within a fraction of a second of the death of the calling process
    ``parent_pid``, deleting ``temp_paths`` first (see :func:`_watch_caller`); and have the kernel
    kill it when its kernel parent, the forkserver, dies (Linux ``PR_SET_PDEATHSIG``).

    The forkserver alone is no guard: it exits only when its last client has, and every rank is one.
    """
    server = _forkserver_pidfd(parent_pid)
    pidfd: Optional[int] = None
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:          # the caller died before this rank got here
        _exit_quietly(temp_paths, server)
    except (AttributeError, OSError):   # no pidfds (not Linux, or a kernel before 5.3): poll the pid
        pidfd = None
    threading.Thread(target=_watch_caller, args=(parent_pid, pidfd, tuple(temp_paths), server), daemon=True,
                     name="gnncompile-watch-caller").start()
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _forkserver_pidfd(caller_pid: int) -> Optional[int]:
    """A pidfd of the forkserver that started this process (its parent, when that is not the caller
    ``caller_pid`` and runs ``multiprocessing.forkserver``), or ``None``."""
    server = os.getppid()
    if server in (caller_pid, 1) or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(server)
        with open(f"/proc/{server}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" not in f.read():
                os.close(fd)
                return None
        return fd
    except OSError:
        return None


def _watch_caller(pid: int, pidfd: Optional[int], temp_paths: tuple[str, ...], server: Optional[int]) -> None:
    """Thread body: wait until process ``pid`` exits (its ``pidfd`` turns readable; without one,
    check every ``_WATCH_POLL_S`` seconds), then :func:`_exit_quietly`."""
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:     # a process of another user took the pid: the caller is gone
                break
            time.sleep(_WATCH_POLL_S)
    _exit_quietly(temp_paths, server)


def _exit_quietly(temp_paths: Sequence[str], server: Optional[int] = None) -> None:
    """The calling process is gone: delete ``temp_paths``, kill the forkserver (pidfd ``server``:
    it serves only the dead caller, and would take most of a second to tear torch down) and end
    this process at once, writing nothing (stdout and stderr go to ``/dev/null``: the caller's end
    of the stderr pipe is closed, and every write would raise ``BrokenPipeError``)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    except OSError:
        pass
    for path in temp_paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if server is not None:      # the other ranks die with it (PR_SET_PDEATHSIG), after their deletions or not
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(server, signal.SIGKILL)
    os._exit(1)


_MAIN_LOOKUP = re.compile(r"on <module '__main__'|from '__main__'|No module named '__mp_main__'")


def _main_lookup_hint(exc: BaseException) -> str:
    """A sentence to append to ``exc`` when it is a failed lookup in ``__main__`` (unpickling an
    object pickled by reference to the launching program's main script), else ``""``."""
    if not isinstance(exc, (AttributeError, ImportError)) or not _MAIN_LOOKUP.search(str(exc)):
        return ""
    return (" (ranks do not run the launching program's main script, so what it defines reaches them only "
            "by value: pickle it with cloudpickle, e.g. torch.save(obj, f, pickle_module=cloudpickle), or "
            "define it in an importable module)")


def _run_inline(fn: Callable[..., T], args: tuple, timeout: float) -> T:
    """Rank 0 of 1 in this process: a gloo group over an in-memory store, destroyed afterwards."""
    if dist.is_initialized():
        raise RuntimeFailure("launch(inline=True) needs this process to have no process group; "
                             "one is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout))
    ctx = RankContext(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"), local_rank=0)
    try:
        return fn(ctx, *args)
    except Exception as exc:
        raise RankFailure(f"rank 0 of 1 failed with {type(exc).__name__}: {exc}", rank=0,
                          exc_type=type(exc).__name__, remote_traceback=traceback.format_exc()) from exc
    finally:
        dist.destroy_process_group()


# --- progress -------------------------------------------------------------------------------------


class _ProgressBoard:
    """Every rank's progress, in memory shared between the caller and the ranks: per rank, how many
    communications it entered, whether it is inside one now, the name of the last one and the
    program's last position (:func:`~gnncompile.runtime.comm.note_progress`). Ranks write their
    own slots (:class:`_RankRecorder`); the caller reads them (:meth:`read`) when a run stalls."""

    def __init__(self, mpc: Any, world_size: int) -> None:
        self.counts = mpc.RawArray(ctypes.c_int64, 2 * world_size)           # entered, inside (0/1)
        self.labels = mpc.RawArray(ctypes.c_char, 2 * world_size * _LABEL_BYTES)  # last op, position

    def read(self, rank: int) -> "_Position":
        """Rank ``rank``'s progress as last written (the rank may be writing: a label may be torn)."""
        def label(slot: int) -> str:
            start = (2 * rank + slot) * _LABEL_BYTES
            return self.labels[start:start + _LABEL_BYTES].rstrip(b"\0").decode(errors="replace")
        return _Position(int(self.counts[2 * rank]), bool(self.counts[2 * rank + 1]), label(0), label(1))


class _RankRecorder:
    """A rank's :class:`~gnncompile.runtime.comm.ProgressRecorder`: writes its slots of a
    :class:`_ProgressBoard` (a few shared-memory stores per call)."""

    def __init__(self, board: _ProgressBoard, rank: int) -> None:
        # memoryviews: a store through one takes a tenth of the time of one through ctypes
        self._counts = memoryview(board.counts).cast("B").cast("q")
        self._labels = memoryview(board.labels).cast("B")
        self._rank = rank
        self._encoded: dict[str, bytes] = {}

    def begin(self, op: str) -> None:
        i = 2 * self._rank
        self._counts[i] += 1
        self._counts[i + 1] = 1
        self._put(0, op)

    def end(self) -> None:
        self._counts[2 * self._rank + 1] = 0

    def where(self, text: str) -> None:
        self._put(1, text)

    def _put(self, slot: int, text: str) -> None:
        data = self._encoded.get(text)
        if data is None:
            data = text.encode(errors="replace")[:_LABEL_BYTES].ljust(_LABEL_BYTES, b"\0")
            if len(self._encoded) < 256:    # communication names repeat; positions mostly do not
                self._encoded[text] = data
        start = (2 * self._rank + slot) * _LABEL_BYTES
        self._labels[start:start + _LABEL_BYTES] = data


@dataclass(frozen=True)
class _Position:
    """A rank's progress (see :class:`_ProgressBoard`)."""

    communications: int
    inside: bool
    op: str
    where: str

    def describe(self) -> str:
        """E.g. ``waiting in communication 42 (all_reduce), at step 3 instruction 7 (AR grads)``."""
        if self.communications == 0:
            text = "before its first communication"
        elif self.inside:
            text = f"waiting in communication {self.communications} ({self.op})"
        else:
            text = f"past communication {self.communications} ({self.op})"
        return text + (f", at {self.where}" if self.where else "")


def _proc_stat(pid: Optional[int]) -> Optional[list[str]]:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _process_state(pid: Optional[int]) -> Optional[str]:
    """The state letter of process ``pid`` in ``/proc`` (``R`` running, ``S`` sleeping, ``T``
    stopped, ``t`` stopped by a debugger, ...), or ``None`` if unknown."""
    fields = _proc_stat(pid)
    return fields[0] if fields else None


_STATE_NAMES = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep"}


# --- the caller side -------------------------------------------------------------------------------


@dataclass
class _Failure:
    """One rank's failure: an exception it reported, or (``exc_type`` None) an exit without a result."""

    rank: int
    exc_type: Optional[str]
    message: str
    remote_traceback: Optional[str] = None
    exitcode: Optional[int] = None
    stopped: bool = False              # a rank that did not fail but was stopped while the others waited
    lagging: bool = False              # a rank that did not fail but stayed behind the others

    @property
    def secondary(self) -> bool:
        """Whether this looks like a symptom of another rank's failure (a lost peer, a timeout)."""
        return self.exc_type is not None and (self.exc_type in _SECONDARY_TYPES
                                              or bool(_SECONDARY_MESSAGE.search(self.message)))

    def describe(self) -> str:
        if self.exc_type is not None:
            return f"failed with {self.exc_type}: {self.message}"
        return self.message

    @staticmethod
    def from_exit(rank: int, exitcode: Optional[int]) -> "_Failure":
        if exitcode is not None and exitcode < 0:
            try:
                what = f"was killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
            except ValueError:
                what = f"was killed by signal {-exitcode} (exit code {exitcode})"
        elif exitcode == 0:
            what = "exited (exit code 0) without returning a result"
        else:
            what = f"exited unexpectedly with exit code {exitcode}"
        return _Failure(rank, None, what, exitcode=exitcode)


class _Supervisor:
    """Collects the ranks' results, watching their pipes, process sentinels and CPU time (and
    passing their stderr on through ``tee`` meanwhile)."""

    def __init__(self, procs: list[multiprocessing.process.BaseProcess],
                 conns: list[multiprocessing.connection.Connection], timeout: float, tee: "_StderrTee",
                 board: _ProgressBoard) -> None:
        self.procs = procs
        self.tee = tee
        self.board = board
        self.timeout = timeout
        self.world_size = len(procs)
        self.results: dict[int, Any] = {}
        self.failures: list[_Failure] = []
        self.pipes = {c: r for r, c in enumerate(conns)}             # ranks yet to send their message
        self.sentinels = {p.sentinel: r for r, p in enumerate(procs)}  # ranks still running
        self.guard = _HangGuard([p.pid for p in procs], timeout)

    def run(self) -> list[Any]:
        """Results ordered by rank; raises :class:`RankFailure` on the first failure or a hang."""
        settle_until: Optional[float] = None
        while len(self.results) < self.world_size:
            wait_s = self.guard.interval
            if settle_until is not None:
                wait_s = max(0.0, min(wait_s, settle_until - time.monotonic()))
            ready = self.tee.wait(list(self.pipes) + list(self.sentinels), wait_s)
            if ready:
                self.guard.progress()
            for obj in ready:
                if obj in self.pipes:
                    self._receive(obj)
            for obj in ready:
                if obj in self.sentinels:
                    self._exited(self.sentinels.pop(obj))
            if self.failures:
                if not all(f.secondary for f in self.failures):
                    break
                settle_until = settle_until or time.monotonic() + _SETTLE_S
                if time.monotonic() >= settle_until or not self.sentinels:
                    break
            elif self.guard.hung([self.procs[r].pid for r in self.sentinels.values()]):
                raise self._hang_error()
        if self.failures:
            raise self._error()
        return [self.results[r] for r in range(self.world_size)]

    def _receive(self, conn: multiprocessing.connection.Connection) -> None:
        rank = self.pipes.pop(conn)
        try:
            data = conn.recv_bytes()
        except EOFError:
            return                  # closed without a message: the sentinel reports the exit
        kind, *rest = pickle.loads(data)
        if kind == "error":
            self.failures.append(_Failure(rank, *rest))
            return
        try:
            self.results[rank] = pickle.loads(rest[0])
        except Exception as exc:
            raise RankFailure(f"the result of rank {rank} cannot be unpickled in the calling process: "
                              f"{type(exc).__name__}: {exc}", rank=rank, exc_type=type(exc).__name__) from exc

    def _exited(self, rank: int) -> None:
        conn = next((c for c, r in self.pipes.items() if r == rank), None)
        if conn is not None and conn.poll(0):
            self._receive(conn)
        if rank not in self.results and all(f.rank != rank for f in self.failures):
            proc = self.procs[rank]
            proc.join(_TERM_GRACE_S)    # its sentinel fires as it exits, a moment before it can be reaped
            self.failures.append(_Failure.from_exit(rank, proc.exitcode))

    def _hang_error(self) -> RankFailure:
        # a rank that returned its result waits for the others (_wait_for_peers): finished, not running
        running = sorted(r for r in self.sentinels.values() if r not in self.results)
        text = (f"run hung: no rank made progress (used CPU) for {self.timeout + _GUARD_SLACK_S:g} s, every rank "
                f"blocked (waiting to receive from another?); still running: ranks {', '.join(map(str, running))}")
        if self.results:
            text += f"; finished: ranks {', '.join(map(str, sorted(self.results)))}"
        text += "\nwhere they are: " + "; ".join(f"rank {r} {self.board.read(r).describe()}" for r in running)
        behind = self._laggard(running, unique=True)
        tail: list[str] = []
        if behind is not None:
            text += f"\nrank {behind.rank} of {self.world_size} {behind.describe()}"
            tail = self._lagging_tail(behind)
            if tail:
                text += self._quote_tail(behind.rank, tail)
        return RankFailure(text, rank=behind.rank if behind else None, still_running=running, stderr_tail=tail,
                           stopped=bool(behind and behind.stopped))

    def _laggard(self, candidates: Sequence[int], unique: bool = False) -> Optional[_Failure]:
        """Among ``candidates`` (live ranks that have not failed), the one the others wait for: a
        stopped one (process state ``T``/``t``), else the one that entered the fewest communications
        (with ``unique``, only if no other has as few). ``None`` if there is none."""
        if not candidates:
            return None
        states = {r: _process_state(self.procs[r].pid) for r in candidates}
        positions = {r: self.board.read(r) for r in range(self.world_size)}
        stopped = [r for r in candidates if states[r] in ("T", "t")]
        rank = min(stopped or candidates, key=lambda r: (positions[r].communications, r))
        if not stopped and unique and sum(positions[r].communications == positions[rank].communications
                                          for r in candidates) > 1:
            return None
        where = positions[rank].describe()
        state = states[rank]
        if stopped:
            how = "a debugger" if state == "t" else "SIGSTOP"
            text = f"was stopped ({how}; process state {state}) {where}"
        else:
            shown = f"process state {state}: {_STATE_NAMES[state]}" if state in _STATE_NAMES else \
                f"process state {state or 'unknown'}"
            text = f"did not keep up with the other ranks: it is still running ({shown}), {where}"
        others: dict[str, list[int]] = {}
        for r in range(self.world_size):
            if r != rank and r not in self.results:
                p = positions[r]
                key = f"communication {p.communications} ({p.op})" if p.communications else "no communication"
                others.setdefault(key + (f", at {p.where}" if p.where else ""), []).append(r)
        if others:
            text += "; the others were at " + "; ".join(
                f"{where} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for where, rs in others.items())
        return _Failure(rank, None, text, stopped=bool(stopped), lagging=not stopped)

    def _lagging_tail(self, root: _Failure) -> list[str]:
        """The last stderr lines of a lagging rank; a running one is first asked for its Python stack
        (``faulthandler``, SIGUSR1), a stopped one cannot answer."""
        if root.lagging:
            with contextlib.suppress(OSError, TypeError):
                os.kill(self.procs[root.rank].pid, signal.SIGUSR1)
            return self.tee.tail(root.rank, wait=_DUMP_WAIT_S)
        return self.tee.tail(root.rank)

    @staticmethod
    def _quote_tail(rank: int, tail: list[str]) -> str:
        return (f"\n\nlast {len(tail)} line{'s' if len(tail) != 1 else ''} of rank {rank}'s stderr:\n"
                + textwrap.indent("\n".join(tail), "  ", lambda line: True))

    def _error(self) -> RankFailure:
        root = next((f for f in self.failures if not f.secondary), None)
        text = ""
        if root is None:
            # every failure is a symptom: the cause is a rank that has not failed, stopped or behind
            failed = {f.rank for f in self.failures}
            root = self._laggard([r for r in sorted(self.sentinels.values())
                                  if r not in self.results and r not in failed])
        if root is None:
            root = self.failures[0]
            text = "every failed rank lost a peer or timed out (a deadlock, or a rank stuck outside the group?)\n"
        others = [f"rank {f.rank} {_first_line(f.describe())}" for f in self.failures if f is not root]
        text += f"rank {root.rank} of {self.world_size} {root.describe()}"
        if others:
            text += "\nthen: " + "\n      ".join(others)
        # a rank that died: its last words (up to the end of its stderr, which its exit closes);
        # one that raised wrote what it wrote before its report, already in the pipe
        if root.stopped or root.lagging:
            tail = self._lagging_tail(root)
        else:
            tail = self.tee.tail(root.rank, wait=_TERM_GRACE_S if root.exc_type is None else 0.0)
        if tail:
            text += self._quote_tail(root.rank, tail)
        if root.remote_traceback:
            text += f"\n\ntraceback on rank {root.rank}:\n" + textwrap.indent(root.remote_traceback.rstrip(), "  ")
        running = [r for r in sorted(self.sentinels.values()) if r not in self.results] if root.stopped or \
            root.lagging else []
        return RankFailure(text, rank=root.rank, exc_type=root.exc_type, remote_traceback=root.remote_traceback,
                           exitcode=root.exitcode, still_running=running, secondary=others, stderr_tail=tail,
                           stopped=root.stopped)


class _HangGuard:
    """Declares a run hung when no rank has used CPU (over ``_BUSY_FRACTION`` of a core) for
    ``timeout + _GUARD_SLACK_S`` seconds; without ``/proc``, when no rank has reported for that
    long. The slack lets the ranks' own timeouts fire first: their tracebacks show where each waited.
    """

    def __init__(self, pids: list[int], timeout: float) -> None:
        self.timeout = timeout
        self.interval = min(1.0, max(0.05, timeout / 20))
        self._cpu = {pid: _cpu_seconds(pid) for pid in pids}
        self._last_sample = self._last_progress = time.monotonic()

    def progress(self) -> None:
        """A rank reported or exited."""
        self._last_progress = time.monotonic()

    def hung(self, pids: list[int]) -> bool:
        """Whether the run is hung; samples the CPU time of ``pids`` (the live ranks) every second."""
        now = time.monotonic()
        if now - self._last_sample >= _CPU_WINDOW_S:
            # an idle rank's threads wake now and then (a clock tick or so a second): not progress
            busy = max(_BUSY_FRACTION * (now - self._last_sample), 3 / os.sysconf("SC_CLK_TCK"))
            for pid in pids:
                cpu, before = _cpu_seconds(pid), self._cpu.get(pid)
                if cpu is not None and before is not None and cpu - before > busy:
                    self._last_progress = now
                self._cpu[pid] = cpu
            self._last_sample = now
        return now - self._last_progress > self.timeout + _GUARD_SLACK_S


def _cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds used by process ``pid`` (all its threads), or ``None`` if unknown."""
    fields = _proc_stat(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None
    except (ValueError, IndexError):
        return None


def _shutdown(procs: list[multiprocessing.process.BaseProcess], polite: bool, tee: "_StderrTee") -> None:
    """Stop and reap every process: SIGTERM, then SIGKILL after ``_TERM_GRACE_S``; with ``polite``
    (the ranks are finishing on their own) they first get ``_TERM_GRACE_S`` to exit. Their stderr
    is passed on meanwhile (a rank blocked on a full stderr pipe could not exit)."""
    for sig in ((None,) if polite else ()) + (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        for p in alive:
            if sig == signal.SIGTERM:
                p.terminate()
                with contextlib.suppress(OSError, TypeError):   # a stopped process acts on it once continued
                    os.kill(p.pid, signal.SIGCONT)
            elif sig == signal.SIGKILL:
                p.kill()
        waiting = {p.sentinel for p in alive}
        deadline = time.monotonic() + _TERM_GRACE_S
        while waiting and time.monotonic() < deadline:
            waiting.difference_update(tee.wait(list(waiting), deadline - time.monotonic()))
        for p in alive:
            p.join(0)
    for p in procs:
        p.join()
        p.close()


def _settings() -> dict[str, str]:
    """The caller's ``GNNCOMPILE_*`` environment variables, which its ranks take over (a rank forked
    from the forkserver would otherwise see the server's, as they were when it started)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_SETTINGS_PREFIX)}


@contextmanager
def _child_environment(threads: int) -> Iterator[None]:
    """Set the thread-count variables children read at start-up; restore them afterwards."""
    saved = {k: os.environ.get(k) for k in _THREAD_ENV}
    os.environ.update({k: str(threads) for k in _THREAD_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_MISSING = object()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Hide where ``__main__`` came from (its ``__file__`` and ``__spec__``) while ranks start.

    multiprocessing's forkserver and spawn start methods re-run the launching program's main
    script (or ``-m`` module) in every child, as ``__mp_main__``, from these two attributes
    (``multiprocessing.spawn.get_preparation_data``): a script without an
    ``if __name__ == "__main__":`` guard would run again in every rank and start ranks of its own,
    and ``python -`` or a notebook have no file to re-run. Hidden, the children run no main at all;
    they need nothing from it: ``fn``, ``args`` and what they refer to in ``__main__`` travel by
    value (:func:`_pickle_payload`). ``sys.path`` and the working directory still reach them.
    """
    main = sys.modules.get("__main__")
    namespace = getattr(main, "__dict__", None)
    if namespace is None:
        yield
        return
    saved = {k: namespace.get(k, _MISSING) for k in ("__file__", "__spec__")}
    namespace.pop("__file__", None)
    namespace["__spec__"] = None
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is _MISSING:
                namespace.pop(k, None)
            else:
                namespace[k] = v


def _pickle_payload(fn: Callable[..., Any], args: tuple) -> bytes:
    """``(fn, args)`` pickled for the ranks: by reference what they can import, by value (cloudpickle)
    what they cannot: functions and classes defined in ``__main__`` (the ranks do not run it, see
    :func:`_main_module_hidden`), lambdas and nested functions. Raises
    :class:`~gnncompile.errors.RuntimeFailure` at once, in the caller, when something cannot be pickled."""
    try:
        return cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError, ...
        raise RuntimeFailure(f"cannot send the function and its arguments to the ranks ({type(exc).__name__}: "
                             f"{_first_line(str(exc))}); pass picklable values (no open files, locks, sockets "
                             f"or generators) and refer to such things by name or path instead") from exc


class _StderrTee:
    """The ranks' stderr, passed on to this process's ``sys.stderr`` and remembered.

    Each rank's fd 2 is the write end of a pipe (:func:`_child_main`); this process reads the read
    ends whenever it waits for the ranks (:meth:`wait`), writes every line to ``sys.stderr``
    prefixed ``[rankN]:`` (so warnings are seen as they come, in a notebook too) and keeps each
    rank's last ``_STDERR_TAIL_LINES`` lines for :class:`RankFailure` (:meth:`tail`).
    """

    def __init__(self) -> None:
        self._open: dict[int, int] = {}       # read end still open (no EOF yet) -> rank
        self._partial: dict[int, bytes] = {}  # rank -> the start of a line not yet ended
        self._tails: dict[int, collections.deque[str]] = {}

    def add(self, rank: int, reader: multiprocessing.connection.Connection) -> None:
        """Watch ``reader`` (the read end of rank ``rank``'s stderr pipe; the caller closes it)."""
        fd = reader.fileno()
        os.set_blocking(fd, False)
        self._open[fd] = rank
        self._partial[rank] = b""
        self._tails[rank] = collections.deque(maxlen=_STDERR_TAIL_LINES)

    def wait(self, objects: list[Any], timeout: float) -> list[Any]:
        """Like :func:`multiprocessing.connection.wait` over ``objects`` (returns those ready, or
        ``[]`` after ``timeout`` seconds), passing the ranks' stderr on meanwhile."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            ready = multiprocessing.connection.wait(list(objects) + list(self._open),
                                                    max(0.0, deadline - time.monotonic()))
            hits = []
            for obj in ready:
                if isinstance(obj, int) and obj in self._open:
                    self._read(obj)
                else:
                    hits.append(obj)
            if hits or time.monotonic() >= deadline:
                return hits

    def tail(self, rank: int, wait: float = 0.0) -> list[str]:
        """The last lines rank ``rank`` wrote to stderr: what its pipe holds now, and what arrives
        until the pipe closes (the rank and anything it started exited) or ``wait`` seconds pass."""
        deadline = time.monotonic() + wait
        fd = next((f for f, r in self._open.items() if r == rank), None)
        while fd in self._open:
            if self._read(fd):
                if time.monotonic() > deadline + 1.0:    # a rank that writes without a pause
                    break
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not multiprocessing.connection.wait([fd], remaining):
                break
        lines = list(self._tails.get(rank, ()))
        if self._partial.get(rank):
            lines.append(_tail_line(self._partial[rank]))
        return lines[-_STDERR_TAIL_LINES:]

    def close(self) -> None:
        """Pass on what the pipes still hold (the ranks have exited) and any unfinished last lines."""
        for fd in list(self._open):
            for _ in range(64):     # bounded: something the rank started may still be writing
                if fd not in self._open or not self._read(fd):
                    break
        for rank, rest in self._partial.items():
            if rest:
                self._emit(rank, [rest])
        self._open.clear()
        self._partial = {r: b"" for r in self._partial}

    def _read(self, fd: int) -> bool:
        """Read what ``fd`` holds (up to 1 MiB); whether anything was read or the pipe closed."""
        rank = self._open[fd]
        chunks: list[bytes] = []
        closed = False
        while len(chunks) < 16:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                closed = True
                del self._open[fd]
                break
            chunks.append(data)
        if not chunks and not closed:
            return False
        *lines, rest = (self._partial[rank] + b"".join(chunks)).split(b"\n")
        if closed or len(rest) > 65536:   # the end, or a very long line (a progress bar): pass it on
            if rest:
                lines.append(rest)
            rest = b""
        self._partial[rank] = rest
        if lines:
            self._emit(rank, lines)
        return True

    def _emit(self, rank: int, lines: list[bytes]) -> None:
        self._tails[rank].extend(_tail_line(line) for line in lines)
        text = "".join(f"[rank{rank}]: {line.decode(errors='replace')}\n" for line in lines)
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):   # no stderr (pythonw), or closed
            pass


def _tail_line(line: bytes) -> str:
    """A stderr line as a terminal would show it last (after its last carriage return), cut to size."""
    text = line.decode(errors="replace").rstrip("\r").rsplit("\r", 1)[-1].rstrip()
    return text if len(text) <= _STDERR_LINE_CHARS else text[: _STDERR_LINE_CHARS - 3] + "..."


@dataclass(frozen=True)
class Placement:
    """Where a run's ranks compute and how they communicate, as :func:`resolve_placement` decided it.

    ``backend``: the process group's backend (``"gloo"`` or ``"nccl"``); ``devices``: the device of
    each rank on this machine (index: the local rank), ``"cpu"`` or ``"cuda:N"``; ``num_gpus``:
    the GPUs visible when it was decided; ``stage_through_host``: the ``torch.distributed``
    operations whose tensors the ranks copy to host memory and back (see
    :func:`~gnncompile.runtime.comm.host_staged_ops`).
    """

    backend: str
    devices: tuple[str, ...]
    num_gpus: int = 0
    stage_through_host: frozenset[str] = frozenset()

    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def device_type(self) -> str:
        """``"cuda"`` when the ranks compute on GPUs, else ``"cpu"``."""
        return "cuda" if self.devices and self.devices[0].startswith("cuda") else "cpu"

    @property
    def shared(self) -> bool:
        """Whether some GPU hosts more than one rank (shared-GPU mode: gloo, with host staging)."""
        return self.device_type == "cuda" and len(set(self.devices)) < len(self.devices)

    def device(self, local_rank: int) -> torch.device:
        """The device rank ``local_rank`` computes on."""
        return torch.device(self.devices[local_rank])

    def describe(self) -> str:
        """One line: ranks, devices (which ranks share which GPU), backend and host staging, e.g.
        ``4 ranks on 1 GPU (cuda:0: ranks 0-3), gloo; send, recv staged through host memory``."""
        n = self.num_ranks
        ranks = f"{n} rank{'s' if n != 1 else ''}"
        if self.device_type == "cpu":
            where = f"{ranks} on CPU"
        else:
            by_device: dict[str, list[int]] = {}
            for r, d in enumerate(self.devices):
                by_device.setdefault(d, []).append(r)
            if not self.shared:
                where = f"{ranks} on {len(by_device)} GPU{'s' if len(by_device) != 1 else ''} (one per rank: " + \
                        ", ".join(f"{r}->{d}" for r, d in enumerate(self.devices)) + ")"
            else:
                where = f"{ranks} sharing {len(by_device)} GPU{'s' if len(by_device) != 1 else ''} (" + \
                        "; ".join(f"{d}: ranks {_ranges(rs)}" for d, rs in by_device.items()) + ")"
        text = f"{where}, {self.backend}"
        if self.stage_through_host:
            text += f"; {', '.join(sorted(self.stage_through_host))} staged through host memory"
        return text


def visible_gpus() -> int:
    """The number of CUDA devices this process can use (0 without CUDA); does not create a CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(num_ranks: int, num_gpus: int, device: Any = None, backend: Optional[str] = None,
                      stage_through_host: Optional[Iterable[str]] = None) -> Placement:
    """Decide where ``num_ranks`` ranks on one machine with ``num_gpus`` GPUs compute and how they talk.

    ``device``: ``None`` (auto: the GPUs when there are any, else the CPU), ``"cpu"``, ``"cuda"``
    (every GPU: rank ``r`` on ``cuda:(r % num_gpus)``) or ``"cuda:N"`` (every rank on GPU ``N``).
    ``backend``: ``None`` (auto: NCCL when every rank has a GPU of its own, else gloo: ranks on
    the CPU, or sharing GPUs), ``"gloo"`` or ``"nccl"``. ``stage_through_host``: ``None`` (what
    the backend needs on the device: :func:`~gnncompile.runtime.comm.host_staged_ops`) or the
    operations to stage anyway (a subset of :data:`~gnncompile.runtime.comm.STAGEABLE_OPS`, or
    ``{"all"}``; tests use it to run the staging path on the CPU).

    Pure (the caller passes ``num_gpus``, e.g. :func:`visible_gpus`). Raises
    :class:`~gnncompile.errors.RuntimeFailure` naming the problem and the fix when the request is
    impossible: CUDA without a GPU, a GPU index out of range, NCCL on the CPU, NCCL with fewer
    GPUs than ranks (NCCL refuses two ranks on one GPU).
    """
    from .comm import STAGEABLE_OPS, host_staged_ops

    if num_ranks < 1:
        raise RuntimeFailure(f"a run needs at least one rank, got {num_ranks}")
    if backend not in (None, "gloo", "nccl"):
        raise RuntimeFailure(f"backend must be 'gloo', 'nccl' or None (auto), got {backend!r}")
    text = None if device is None else str(device)
    index: Optional[int] = None
    if text is None:
        kind = "cuda" if num_gpus > 0 else "cpu"
    elif text == "cpu" or text == "cuda":
        kind = text
    elif re.fullmatch(r"cuda:\d+", text):
        kind, index = "cuda", int(text.split(":")[1])
    else:
        raise RuntimeFailure(f"device must be 'cpu', 'cuda', 'cuda:N' or None (auto), got {device!r}")
    if kind == "cuda" and num_gpus == 0:
        raise RuntimeFailure(f"device={text!r} requested but no CUDA GPU is visible (torch.cuda.is_available() is "
                             "False or CUDA_VISIBLE_DEVICES hides them); use device='cpu' (or leave the device "
                             "unset: the CPU where there is no GPU)")
    if index is not None and index >= num_gpus:
        raise RuntimeFailure(f"device={text!r} requested but this machine has {num_gpus} GPU(s) (cuda:0.."
                             f"cuda:{num_gpus - 1}); use one of those, or 'cuda' to spread the ranks over all")
    if kind == "cpu":
        devices = ("cpu",) * num_ranks
        if backend == "nccl":
            why = "no GPU is visible" if text is None else "device='cpu' was asked for"
            raise RuntimeFailure(f"backend='nccl' needs the ranks on GPUs, but {why}; use backend='gloo' (or None) "
                                 "to run on the CPU")
        chosen = "gloo"
    else:
        gpus = [index] if index is not None else list(range(num_gpus))
        devices = tuple(f"cuda:{gpus[r % len(gpus)]}" for r in range(num_ranks))
        if backend == "nccl" and num_ranks > len(gpus):
            raise RuntimeFailure(f"backend='nccl' needs one GPU per rank (NCCL refuses two ranks on one GPU): "
                                 f"{num_ranks} ranks, {len(gpus)} GPU(s)"
                                 f"{' (device=' + repr(text) + ')' if index is not None else ''}; use backend='gloo' "
                                 f"(or None) to let ranks share GPUs, or at most {len(gpus)} rank(s)")
        chosen = backend or ("nccl" if num_ranks <= len(gpus) else "gloo")
    if stage_through_host is None:
        staged = host_staged_ops(chosen, kind)
    else:
        staged = frozenset(stage_through_host)
        if "all" in staged:
            staged = STAGEABLE_OPS
        unknown = sorted(staged - STAGEABLE_OPS)
        if unknown:
            raise RuntimeFailure(f"stage_through_host: unknown operation(s) {unknown}; valid: "
                                 f"{sorted(STAGEABLE_OPS)} or 'all'")
    return Placement(backend=chosen, devices=tuple(devices), num_gpus=num_gpus, stage_through_host=staged)


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in list(ranks[1:]) + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
