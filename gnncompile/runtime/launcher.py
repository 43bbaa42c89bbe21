"""Starting ranks: local processes (:func:`launch`) or one rank per process under torchrun (:func:`torchrun_main`).

Every rank runs ``fn(ctx, *args)`` with a :class:`RankContext` inside an initialized
``torch.distributed`` process group (gloo on CPU, NCCL with one GPU per rank) and returns a
picklable value.

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
- Hangs: the collective timeout bounds gloo and NCCL collectives, but not gloo point-to-point
  receives in every version, nor waits outside the process group. So the caller also watches the
  ranks' CPU time (``/proc``): when no rank has used CPU for ``timeout`` seconds plus 5 (every
  rank blocked, e.g. each waiting to receive from another; the 5 s let the ranks' own timeouts,
  with their tracebacks, come first) the run is declared hung and :class:`RankFailure` lists the
  ranks still running. Where ``/proc`` is missing the guard counts wall time since the last rank
  reported instead. A run that computes is never cut short, however long it takes.
- Children die with the caller (Linux ``PR_SET_PDEATHSIG``) and ignore SIGINT, so a Ctrl-C is
  handled once, by the caller, which stops them.

Children get ``threads_per_rank`` threads (``torch.set_num_threads``; ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` are set for them too, as those libraries read
them when they load).

**Several machines** (torchrun starts, restarts and tears down the processes; each calls
:func:`torchrun_main`, which joins the group with ``init_method="env://"``)::

    # on every machine (HOST is the first machine's address):
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m gnncompile run --torchrun --gpus 8 [the same model and plan flags on every machine]
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.connection
import os
import pickle
import re
import signal
import sys
import textwrap
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import RuntimeFailure

__all__ = ["RankContext", "RankFailure", "launch", "torchrun_main"]

T = TypeVar("T")

_SETTLE_S = 0.5          # after a failure that looks secondary, how long to wait for the root cause
_TERM_GRACE_S = 2.0      # SIGTERM, then SIGKILL after this long
_BUSY_FRACTION = 0.05    # a rank using more than this fraction of a core is making progress
_CPU_WINDOW_S = 1.0      # how often the ranks' CPU time is sampled
_GUARD_SLACK_S = 5.0     # the hang guard waits this much longer than the ranks' own timeouts
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_SECONDARY_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}
_SECONDARY_MESSAGE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|ECONNRESET|EPIPE|"
                                r"timed out|timeout", re.IGNORECASE)


@dataclass(frozen=True)
class RankContext:
    """Where ``fn`` runs: its rank among ``world_size``, the process group's backend, the device
    to compute on (``cuda:local_rank`` under NCCL, else CPU) and the rank's index on its machine."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    local_rank: int


class RankFailure(RuntimeFailure):
    """A launched run failed.

    ``rank``: the root-cause rank (``None`` for a hang); ``exc_type``: the name of the exception it
    raised (``None`` if it died without one); ``remote_traceback``: that rank's formatted
    traceback; ``exitcode``: its exit code if it died (negative: killed by that signal);
    ``still_running``: ranks that had not finished (hang); ``secondary``: one line per other
    failed rank.
    """

    def __init__(self, message: str, *, rank: Optional[int] = None, exc_type: Optional[str] = None,
                 remote_traceback: Optional[str] = None, exitcode: Optional[int] = None,
                 still_running: Sequence[int] = (), secondary: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.still_running = list(still_running)
        self.secondary = list(secondary)


def launch(fn: Callable[..., T], world_size: int, args: tuple = (), *, backend: Optional[str] = None,
           timeout: float = 300.0, threads_per_rank: Optional[int] = None, inline: bool = False) -> list[T]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks and return the results ordered by rank.

    ``fn`` must be importable by child processes (a module-level function) and ``args`` and the
    results picklable; a script that calls ``launch`` needs the ``if __name__ == "__main__":``
    guard (children re-import the main module). ``backend``: ``None`` picks NCCL when there is a
    GPU per rank, else gloo. ``timeout`` (seconds) bounds every collective and is the hang guard
    (see the module docstring). ``threads_per_rank`` defaults to the usable cores divided among
    the ranks.
    ``inline=True`` (``world_size`` 1 only) runs ``fn`` in this process in a single-process gloo
    group, destroyed afterwards; ``threads_per_rank`` does not apply there.

    Raises :class:`RankFailure` if a rank raises, dies or the run hangs; no child outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
    if inline:
        if world_size != 1 or backend not in (None, "gloo"):
            raise ValueError("inline=True runs one rank with gloo: use world_size=1 and backend None or 'gloo'")
        return [_run_inline(fn, args, timeout)]
    backend = backend or _default_backend(world_size)
    threads = threads_per_rank or max(1, _usable_cores() // world_size)
    mpc = _context()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    finished = False
    try:
        with _child_environment(threads), _main_module_importable():
            for rank in range(world_size):
                reader, writer = mpc.Pipe(duplex=False)
                conns.append(reader)
                p = mpc.Process(target=_child_main, name=f"gnncompile-rank{rank}",
                                args=(rank, world_size, backend, store.port, timeout, threads, os.getpid(), fn,
                                      args, writer))
                try:
                    p.start()
                except (pickle.PicklingError, AttributeError, TypeError) as exc:
                    raise RuntimeFailure(f"cannot start rank {rank}: fn must be a module-level function and "
                                         f"args picklable ({exc})") from exc
                finally:
                    writer.close()
                procs.append(p)
        results = _Supervisor(procs, conns, timeout).run()
        finished = True
        return results
    finally:
        _shutdown(procs, polite=finished)
        for c in conns:
            c.close()


def torchrun_main(fn: Callable[..., T], args: tuple = (), *, backend: Optional[str] = None,
                  timeout: float = 300.0, threads_per_rank: Optional[int] = None) -> T:
    """Run ``fn(ctx, *args)`` as the rank torchrun started this process as; return its result.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``), ``MASTER_ADDR`` and
    ``MASTER_PORT`` as torchrun sets them and joins the group with ``init_method="env://"``.
    ``backend``: ``None`` picks NCCL when this machine has a GPU per local rank, else gloo.
    Exceptions propagate (torchrun tears the other processes down); the group is destroyed on
    every path.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeFailure(f"not started by torchrun: environment variable(s) {', '.join(missing)} unset")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = backend or _default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
    if threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    ctx = _init_group(rank, world_size, local_rank, backend, timeout, init_method="env://")
    try:
        return fn(ctx, *args)
    finally:
        dist.destroy_process_group()


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


def _child_main(rank: int, world_size: int, backend: str, port: int, timeout: float, threads: int,
                parent_pid: int, fn: Callable[..., Any], args: tuple,
                conn: multiprocessing.connection.Connection) -> None:
    """Body of a spawned rank: join the group, run ``fn``, send ``("ok", pickled result)`` or
    ``("error", type name, message, traceback)`` to the caller, destroy the group."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a forkserver child inherits the server's environment, not the launcher's: set the thread
    # variables here too (libraries that size their pools later read them)
    os.environ.update({k: str(threads) for k in _THREAD_ENV})
    torch.set_num_threads(threads)
    failed = False
    try:
        try:
            store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=timeout))
            ctx = _init_group(rank, world_size, rank, backend, timeout, store=store)
            message: tuple = ("ok", pickle.dumps(fn(ctx, *args), protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the caller
            failed = True
            message = ("error", type(exc).__name__, str(exc), traceback.format_exc())
        # sent before the group is destroyed, so a root cause arrives before its peers' symptoms
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
    if failed:
        sys.exit(1)


def _init_group(rank: int, world_size: int, local_rank: int, backend: str, timeout: float,
                **init: Any) -> RankContext:
    """Select the device and initialize the default process group; ``init``: its ``store`` or
    ``init_method``."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout), **init)
    return RankContext(rank=rank, world_size=world_size, backend=backend, device=device, local_rank=local_rank)


def _exit_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux; elsewhere a no-op).

    The kernel parent is the forkserver, which exits when the launching process ``parent_pid``
    does, so a rank dies with the process that launched it either way.
    """
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    try:
        os.kill(parent_pid, 0)  # the launcher died before the request took effect
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


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


# --- the caller side -------------------------------------------------------------------------------


@dataclass
class _Failure:
    """One rank's failure: an exception it reported, or (``exc_type`` None) an exit without a result."""

    rank: int
    exc_type: Optional[str]
    message: str
    remote_traceback: Optional[str] = None
    exitcode: Optional[int] = None

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
    """Collects the ranks' results, watching their pipes, process sentinels and CPU time."""

    def __init__(self, procs: list[multiprocessing.process.BaseProcess],
                 conns: list[multiprocessing.connection.Connection], timeout: float) -> None:
        self.procs = procs
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
            ready = multiprocessing.connection.wait(list(self.pipes) + list(self.sentinels), wait_s)
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
        running = sorted(self.sentinels.values())
        text = (f"run hung: no rank made progress (used CPU) for {self.timeout + _GUARD_SLACK_S:g} s, every rank "
                f"blocked (waiting to receive from another?); still running: ranks {', '.join(map(str, running))}")
        if self.results:
            text += f"; finished: ranks {', '.join(map(str, sorted(self.results)))}"
        return RankFailure(text, still_running=running)

    def _error(self) -> RankFailure:
        root = next((f for f in self.failures if not f.secondary), None)
        text = ""
        if root is None:
            root = self.failures[0]
            text = "every failed rank lost a peer or timed out (a deadlock, or a rank stuck outside the group?)\n"
        others = [f"rank {f.rank} {_first_line(f.describe())}" for f in self.failures if f is not root]
        text += f"rank {root.rank} of {self.world_size} {root.describe()}"
        if others:
            text += "\nthen: " + "\n      ".join(others)
        if root.remote_traceback:
            text += f"\n\ntraceback on rank {root.rank}:\n" + textwrap.indent(root.remote_traceback.rstrip(), "  ")
        return RankFailure(text, rank=root.rank, exc_type=root.exc_type, remote_traceback=root.remote_traceback,
                           exitcode=root.exitcode, secondary=others)


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
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _shutdown(procs: list[multiprocessing.process.BaseProcess], polite: bool) -> None:
    """Stop and reap every process: SIGTERM, then SIGKILL after ``_TERM_GRACE_S``; with ``polite``
    (the ranks are finishing on their own) they first get ``_TERM_GRACE_S`` to exit."""
    for sig in ((None,) if polite else ()) + (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        for p in alive:
            if sig == signal.SIGTERM:
                p.terminate()
            elif sig == signal.SIGKILL:
                p.kill()
        multiprocessing.connection.wait([p.sentinel for p in alive], _TERM_GRACE_S)
        for p in alive:
            p.join(0)
    for p in procs:
        p.join()
        p.close()


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


@contextlib.contextmanager
def _main_module_importable() -> Iterator[None]:
    """Hide ``__main__.__file__`` while ranks start when it names no file (``python -``, ``-c``).

    multiprocessing re-runs the launcher's main script in every child; a main read from stdin
    cannot be re-run, and the ranks need nothing from it (``fn`` must live in an importable module).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _default_backend(ranks_per_machine: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_per_machine else "gloo"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
