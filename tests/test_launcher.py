"""The launcher: results by rank, prompt failure reports naming the root cause, hang guards, no
process left behind, inline and torchrun modes.

The rank functions live at module level: spawned children import this module by name (pytest puts
``tests/`` on ``sys.path``, which the children inherit).
"""

from __future__ import annotations

import _thread
import multiprocessing
import os
import socket
import sys
import threading
import time
from multiprocessing import forkserver, resource_tracker
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from gnncompile.errors import RuntimeFailure
from gnncompile.runtime import launcher
from gnncompile.runtime.launcher import RankContext, RankFailure, launch, torchrun_main


# --- rank functions (run in the children) ----------------------------------------------------------

def _page_faults_per_step(ctx: RankContext) -> float:
    """Minor page faults per "step" of four element-wise ops on activation-sized (4 MiB) tensors."""
    import resource

    a, b = torch.randn(16384, 64), torch.randn(16384, 64)

    def step() -> torch.Tensor:
        x = a + b
        y = torch.relu(x)
        z = y * b
        return z + a

    for _ in range(5):  # the heap grows to the step's peak once
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20


def _sum_ranks(ctx: RankContext, offset: int) -> tuple:
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t)
    return ctx, float(t), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def _raise_in_epoch_2(ctx: RankContext) -> None:
    for epoch in range(5):
        t = torch.ones(1)
        dist.all_reduce(t)          # the other ranks wait here for the failed one
        if epoch == 2 and ctx.rank == 1:
            raise ValueError(f"bad batch in epoch {epoch}")


def _exit_3(ctx: RankContext) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(t)


def _recv_from_next(ctx: RankContext) -> None:
    dist.recv(torch.empty(1), src=(ctx.rank + 1) % ctx.world_size)   # nobody ever sends


def _block_forever(ctx: RankContext) -> None:
    threading.Event().wait()        # blocked outside the process group: no collective timeout applies


class _Unloadable:
    """Pickles fine, fails to unpickle (as a result whose class only exists in the child would)."""

    def __reduce__(self) -> tuple:
        return _refuse, ()


def _refuse() -> None:
    raise ImportError("no module named 'only_in_the_child'")


def _return_unloadable(ctx: RankContext) -> _Unloadable:
    return _Unloadable()


def _group_size(ctx: RankContext, x: int) -> tuple[int, int, int]:
    return dist.get_world_size(), ctx.rank, x * 2


def _fail_inline(ctx: RankContext) -> None:
    raise KeyError("missing")


def _complain_then_die(ctx: RankContext, lines: int) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        for i in range(lines):
            print(f"complaint {i}", file=sys.stderr)
        os.write(2, b"C-level last words\n")          # straight to fd 2, as C++ code writes
        os._exit(1)                                   # no Python exception: stderr is all there is
    dist.all_reduce(t)


def _complain_then_raise(ctx: RankContext) -> None:
    print("warning: the learning rate looks large", file=sys.stderr)
    raise ValueError("diverged")


def _chatty(ctx: RankContext, lines: int) -> int:
    # far more than a pipe holds (64 KiB): the caller must read while the rank writes
    for i in range(lines):
        sys.stderr.write(f"progress {i} " + "." * 100 + "\n")
    return ctx.rank


# --- helpers ---------------------------------------------------------------------------------------

def _child_pids() -> set[int]:
    """This process's descendants, zombies included (``/proc``; multiprocessing's list elsewhere).

    Ranks are children of the forkserver, itself a child of this process, so descendants count."""
    if not sys.platform.startswith("linux"):
        return {p.pid for p in multiprocessing.active_children() if p.pid is not None}
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


@pytest.fixture(autouse=True)
def no_leftover_children() -> Iterator[None]:
    resource_tracker.ensure_running()     # multiprocessing's helper processes live as long as this one
    launcher._context()                   # sets the forkserver's preload list
    forkserver.ensure_running()
    before = _child_pids()
    yield
    assert _child_pids() - before == set(), "launch left child processes behind"


# --- tests -----------------------------------------------------------------------------------------

def test_results_by_rank_and_all_reduce() -> None:
    out = launch(_sum_ranks, 3, (10,), timeout=60, threads_per_rank=1)
    assert [ctx.rank for ctx, *_ in out] == [0, 1, 2]
    for ctx, total, threads, omp in out:
        assert (ctx.world_size, ctx.backend, ctx.device, ctx.local_rank) == (3, "gloo", torch.device("cpu"), ctx.rank)
        assert total == 10 + 11 + 12
        assert (threads, omp) == (1, "1")


def test_rank_exception_reported_promptly_while_others_wait() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_raise_in_epoch_2, 3, timeout=60)
    assert time.monotonic() - t0 < 30
    e = info.value
    assert isinstance(e, RuntimeFailure)
    assert (e.rank, e.exc_type) == (1, "ValueError")
    assert "rank 1" in str(e) and "ValueError: bad batch in epoch 2" in str(e)
    assert "_raise_in_epoch_2" in e.remote_traceback


def test_os_exit_reported_with_exit_code() -> None:
    with pytest.raises(RankFailure) as info:
        launch(_exit_3, 3, timeout=60)
    # ranks 0 and 2 fail too ("Connection closed by peer"); the root cause is rank 1
    assert (info.value.rank, info.value.exitcode, info.value.exc_type) == (1, 3, None)
    assert "rank 1 of 3 exited unexpectedly with exit code 3" in str(info.value)


def test_deadlock_in_recv_fails_within_timeout() -> None:
    t0 = time.monotonic()
    # the receives time out (or, on a loaded machine, the caller's hang guard fires first)
    with pytest.raises(RankFailure, match="timed out|Timed out|hung"):
        launch(_recv_from_next, 2, timeout=3)
    assert time.monotonic() - t0 < 3 + 15


def test_hang_outside_communication_is_caught_by_the_guard() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="hung") as info:
        launch(_block_forever, 2, timeout=2)
    assert time.monotonic() - t0 < 2 + 5 + 15
    assert info.value.still_running == [0, 1]


def test_result_that_cannot_be_unpickled_one_rank() -> None:
    with pytest.raises(RankFailure, match="result of rank 0 cannot be unpickled.*only_in_the_child"):
        launch(_return_unloadable, 1, timeout=60)


def test_lambda_and_closure_travel_by_value() -> None:
    # what the ranks cannot import (a lambda, a nested function) is pickled by value
    scale = 3

    def scaled(ctx: RankContext, x: int) -> int:
        return (ctx.rank + x) * scale

    main = vars(sys.modules["__main__"])
    before = {k: main.get(k, "absent") for k in ("__file__", "__spec__")}
    assert launch(lambda ctx: ctx.rank * 10, 2, timeout=60) == [0, 10]
    assert launch(scaled, 2, (1,), timeout=60) == [3, 6]
    # hidden from multiprocessing while the ranks start, then restored
    assert {k: main.get(k, "absent") for k in ("__file__", "__spec__")} == before


def test_rank_that_dies_quotes_its_last_stderr_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RankFailure) as info:
        launch(_complain_then_die, 2, (30,), timeout=60)
    e = info.value
    assert (e.rank, e.exitcode, e.exc_type) == (1, 1, None)
    assert e.stderr_tail == [f"complaint {i}" for i in range(11, 30)] + ["C-level last words"]
    text = str(e)
    assert "rank 1 of 2 exited unexpectedly with exit code 1" in text
    assert "last 20 lines of rank 1's stderr:\n  complaint 11\n  complaint 12\n" in text
    assert text.endswith("  complaint 29\n  C-level last words")
    assert "complaint 10\n" not in text
    # and every line was passed on as it came, marked with its rank
    err = capsys.readouterr().err
    assert "[rank1]: complaint 0\n" in err and "[rank1]: C-level last words\n" in err


def test_rank_that_raises_quotes_its_stderr_before_the_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        launch(_complain_then_raise, 1, timeout=60)
    e = info.value
    assert e.stderr_tail == ["warning: the learning rate looks large"]
    assert "rank 0 of 1 failed with ValueError: diverged\n\nlast 1 line of rank 0's stderr:\n" \
           "  warning: the learning rate looks large\n\ntraceback on rank 0:" in str(e)
    assert str(e).endswith("ValueError: diverged")


def test_plenty_of_stderr_is_passed_on_without_blocking_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(_chatty, 2, (3000,), timeout=60) == [0, 1]
    err = capsys.readouterr().err
    for rank in (0, 1):
        assert err.count(f"[rank{rank}]: progress ") == 3000
        assert f"[rank{rank}]: progress 2999 ." in err


def test_unpicklable_argument_is_refused_in_the_caller() -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"cannot send the function and its arguments to the ranks "
                                             r"\(TypeError: cannot pickle '_thread.lock' object\)") as info:
        launch(_group_size, 2, (threading.Lock(),), timeout=60)
    assert "\n" not in str(info.value)
    assert not isinstance(info.value, RankFailure)      # no rank started
    assert time.monotonic() - t0 < 5


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="KeyboardInterrupt is delivered to the main thread")
def test_keyboard_interrupt_in_caller_stops_the_ranks() -> None:
    import signal

    # an interactive caller's SIGINT disposition: Python's handler. A process started in the
    # background by a shell without job control (as CI runners may start pytest) inherits SIGINT
    # ignored, and then neither Ctrl-C nor interrupt_main reaches it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_block_forever, 2, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_while_a_rank_starts_loses_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands after the forkserver was asked for a rank, before start() returned it
    (the server may still be importing torch), is taken once the launcher knows that rank."""
    import signal
    from multiprocessing import popen_forkserver

    real = popen_forkserver.Popen._launch
    started = []

    def launch_then_interrupt(self, process_obj):  # type: ignore[no-untyped-def]
        real(self, process_obj)
        started.append(self.pid)
        _thread.interrupt_main()
        time.sleep(0.5)      # the interrupt is due here, before start() has returned

    monkeypatch.setattr(popen_forkserver.Popen, "_launch", launch_then_interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_block_forever, 2, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(started) == 1     # the first start was interrupted; the fixture checks it was stopped


def test_interrupts_deferred_takes_a_ctrl_c_after_the_block() -> None:
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = False
        with pytest.raises(KeyboardInterrupt):
            with launcher._interrupts_deferred():
                _thread.interrupt_main()
                time.sleep(0.1)
                reached = True
        assert reached and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with launcher._interrupts_deferred():   # nothing pending, nothing raised
            pass
    finally:
        signal.signal(signal.SIGINT, previous)


def test_inline_runs_repeatedly_and_cleans_up() -> None:
    for x in (1, 2):
        assert launch(_group_size, 1, (x,), inline=True) == [(1, 0, 2 * x)]
        assert not dist.is_initialized()
    with pytest.raises(RankFailure, match="rank 0 of 1 failed with KeyError") as info:
        launch(_fail_inline, 1, inline=True)
    assert isinstance(info.value.__cause__, KeyError)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="world_size=1"):
        launch(_group_size, 2, (1,), inline=True)


def test_torchrun_main_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    assert torchrun_main(_group_size, (5,), backend="gloo", timeout=30) == (1, 0, 10)
    assert not dist.is_initialized()
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeFailure, match="MASTER_PORT"):
        torchrun_main(_group_size, (5,))


_TEARDOWN_SCRIPT = """
import os, socket, sys, torch
from gnncompile.runtime.launcher import torchrun_main
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
assert "torch._dynamo" not in sys.modules, "the check needs torch._dynamo unimported when the group starts"

def fn(ctx):
    # torch.optim's first optimizer imports torch._dynamo, as a training rank's does
    torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    return 1

torchrun_main(fn, (), backend="gloo", timeout=30)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(",".join(n for n in names if "gloo" in n))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists the process's threads in /proc")
def test_torchrun_main_tears_the_group_down_before_returning() -> None:
    """The group's worker threads are joined when ``torchrun_main`` returns, also when the rank built
    an optimizer: a gloo worker still alive at interpreter exit aborts the process ("terminate called
    without an active exception") when it drops a tensor after Python has finalized."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _TEARDOWN_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", f"gloo threads alive after torchrun_main returned: {r.stdout.strip()}"


_LOST_PEER_SCRIPT = """
import os, socket, sys
from gnncompile.errors import RuntimeFailure
from gnncompile.runtime.launcher import torchrun_main
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

def fn(ctx, message):
    raise RuntimeError(message)

for message in ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
                "the rank's own bug"):
    try:
        torchrun_main(fn, (message,), backend="gloo", timeout=30)
    except Exception as exc:
        print(type(exc).__name__, "|", exc)
"""


def test_torchrun_rank_that_lost_its_peers_says_so() -> None:
    """Under torchrun a surviving rank saw gloo's raw RuntimeError ("Connection closed by peer"):
    a failed collective is now a RuntimeFailure saying another rank most likely failed; the
    rank's own errors pass through unchanged."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", _LOST_PEER_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lost, own = r.stdout.strip().splitlines()
    assert lost.startswith("RuntimeFailure | rank 0 of 1: a collective failed") and "another rank" in lost, lost
    assert own == "RuntimeError | the rank's own bug", own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and getrusage page faults")
def test_launched_ranks_keep_their_heap() -> None:
    """A rank reuses the memory its last step freed: glibc's defaults return 4 MiB blocks to the
    kernel and fault them in again every step (1,000-4,000 page faults for these four ops)."""
    faults = launch(_page_faults_per_step, 2, ())
    assert max(faults) < 200, faults


def _settings_seen(ctx: RankContext) -> tuple:
    return os.environ.get("GNNCOMPILE_DROPOUT_MASKS"), os.environ.get("GNNCOMPILE_TEST_ONLY_SETTING")


def test_ranks_take_the_callers_gnncompile_settings(monkeypatch) -> None:
    """A rank forked from the forkserver (started before the caller changed its environment) sees the
    caller's GNNCOMPILE_* variables, set and unset, as they are at the launch."""
    launch(_sum_ranks, 2, (0,), timeout=30)  # the forkserver runs, with today's environment
    monkeypatch.setenv("GNNCOMPILE_DROPOUT_MASKS", "torch")
    assert launch(_settings_seen, 2, timeout=30) == [("torch", None)] * 2
    monkeypatch.delenv("GNNCOMPILE_DROPOUT_MASKS")
    monkeypatch.setenv("GNNCOMPILE_TEST_ONLY_SETTING", "1")
    assert launch(_settings_seen, 2, timeout=30) == [(None, "1")] * 2
