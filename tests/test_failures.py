"""Failures of launched runs: a stopped rank, a rank that falls behind or hangs, a killed rank and a
rank that raises are each named (with how they failed and their last stderr lines) within the
collective timeout plus the launcher's grace period; when the launching process dies, its ranks
and forkserver exit within a second, quietly, and the run's temporary files go with them. Every
test checks that no process is left behind.

Rank functions live at module level: the ranks import this module by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import gnncompile as gc
from gnncompile.runtime import launcher
from gnncompile.runtime.comm import Communicator, note_progress
from gnncompile.runtime.launcher import RankContext, RankFailure, launch
from test_launcher import _child_pids

# startup (forkserver, process group) takes a few seconds on a loaded 2-core machine: the bounds
# below are "timeout + grace + this"
_STARTUP_S = 8.0


# --- rank functions (run in the children) ----------------------------------------------------------

def _sum_until(ctx: RankContext, victim: int, at: int, action: str) -> None:
    """Sum a tensor over the ranks again and again; rank ``victim`` does ``action`` at iteration ``at``."""
    comm = Communicator(ctx.rank, ctx.world_size)
    for i in range(1_000_000):
        note_progress(f"iteration {i}")
        comm.sum_(torch.ones(4))
        if ctx.rank == victim and i == at:
            print(f"rank {ctx.rank} about to {action}", file=sys.stderr, flush=True)
            if action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "spin":
                _spin_forever()
            elif action == "sleep":
                time.sleep(3600)
            elif action == "raise":
                raise ValueError("bad batch")


def _block_or_stop(ctx: RankContext) -> None:
    """Two communications, then rank 0 blocks outside the process group (no timeout applies) and
    rank 1 stops: only the caller's hang guard can end the run."""
    comm = Communicator(ctx.rank, ctx.world_size)
    for _ in range(2):
        comm.sum_(torch.ones(4))
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Event().wait()


def _spin_forever() -> None:
    x = 0
    while True:
        x += 1


def _sum_forever_with_marker(ctx: RankContext, marker: str) -> None:
    comm = Communicator(ctx.rank, ctx.world_size)
    for i in range(1_000_000_000):
        comm.sum_(torch.ones(4))
        if i == 10 and ctx.rank == 0:
            Path(marker).touch()
        if i % 100 == 0:
            print(f"rank {ctx.rank} iteration {i}", file=sys.stderr)   # its stderr pipe breaks with the caller
        time.sleep(0.001)


# --- helpers ---------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_leftover_children() -> Iterator[None]:
    resource_tracker.ensure_running()
    launcher._context()
    forkserver.ensure_running()
    before = _child_pids()
    yield
    assert _child_pids() - before == set(), "a failed run left child processes behind"


def _fail(world: int, victim: int, at: int, action: str, timeout: float) -> tuple[RankFailure, float]:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_sum_until, world, (victim, at, action), timeout=timeout, threads_per_rank=1)
    return info.value, time.monotonic() - t0


def _state(pid: int) -> str:
    """Process state letter (``Z`` zombie), or ``"gone"``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


# --- tests -----------------------------------------------------------------------------------------

def test_stopped_rank_is_named_not_the_ranks_that_waited() -> None:
    e, took = _fail(3, victim=1, at=20, action="stop", timeout=2)
    assert took < 2 + launcher._TERM_GRACE_S + _STARTUP_S
    assert (e.rank, e.stopped, e.exc_type, e.exitcode) == (1, True, None, None)
    text = str(e)
    assert text.startswith("rank 1 of 3 was stopped (SIGSTOP; process state T) past communication 21 "
                           "(all_reduce), at iteration 20; the others were at communication 22 (all_reduce), "
                           "at iteration 21 (ranks 0, 2)"), text
    # the ranks that timed out are listed after it, as symptoms
    assert {line.split()[1] for line in e.secondary} <= {"0", "2"} and e.secondary
    assert e.stderr_tail[-1] == "rank 1 about to stop"


def test_rank_stuck_computing_is_named_with_its_stack() -> None:
    e, took = _fail(3, victim=2, at=5, action="spin", timeout=2)
    assert took < 2 + launcher._TERM_GRACE_S + _STARTUP_S
    assert (e.rank, e.stopped, e.exc_type) == (2, False, None)
    assert str(e).startswith("rank 2 of 3 did not keep up with the other ranks: it is still running "
                             "(process state R: running), past communication 6 (all_reduce), at iteration 5")
    # faulthandler's dump of the stuck rank's stack, asked for by the caller
    assert any("_spin_forever" in line for line in e.stderr_tail), e.stderr_tail


def test_rank_hanging_outside_communication_is_named() -> None:
    e, took = _fail(2, victim=0, at=3, action="sleep", timeout=2)
    assert took < 2 + launcher._TERM_GRACE_S + _STARTUP_S
    assert e.rank == 0 and not e.stopped
    assert "rank 0 of 2 did not keep up with the other ranks: it is still running (process state S: sleeping), " \
           "past communication 4 (all_reduce), at iteration 3" in str(e)
    assert any("time.sleep" in line or "_sum_until" in line for line in e.stderr_tail), e.stderr_tail


def test_hang_guard_names_the_stopped_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="hung") as info:
        launch(_block_or_stop, 2, timeout=1, threads_per_rank=1)
    assert time.monotonic() - t0 < 1 + launcher._GUARD_SLACK_S + launcher._TERM_GRACE_S + _STARTUP_S
    e = info.value
    assert (e.rank, e.stopped, e.still_running) == (1, True, [0, 1])
    assert "\nwhere they are: rank 0 past communication 2 (all_reduce); rank 1 past communication 2 (all_reduce)\n" \
           "rank 1 of 2 was stopped (SIGSTOP; process state T) past communication 2 (all_reduce)" in str(e)


def test_killed_rank_is_named_with_its_signal_and_last_words() -> None:
    e, took = _fail(3, victim=2, at=5, action="kill", timeout=30)
    assert took < launcher._TERM_GRACE_S + _STARTUP_S     # not the collective timeout: the exit is seen at once
    assert (e.rank, e.exitcode) == (2, -signal.SIGKILL)
    assert str(e).startswith("rank 2 of 3 was killed by signal SIGKILL")
    assert e.stderr_tail == ["rank 2 about to kill"]


def test_rank_that_raises_is_named_with_its_exception() -> None:
    e, took = _fail(2, victim=1, at=2, action="raise", timeout=30)
    assert took < _STARTUP_S
    assert (e.rank, e.exc_type) == (1, "ValueError")
    assert "rank 1 of 2 failed with ValueError: bad batch" in str(e)
    assert e.stderr_tail == ["rank 1 about to raise"]


def test_plan_run_failure_leaves_no_program_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    graph = gc.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=8, num_classes=3, seed=0)
    plan = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), graph, gpus=2, strategy="data")
    with pytest.raises(gc.RuntimeFailure, match="rank 1 of 2 failed with RuntimeError: injected failure on rank 1 "
                                                "in epoch 1"):
        plan.run(epochs=3, timeout=30, fail_at=(1, 1), progress=False)
    assert not list(tmp_path.glob("gnncompile-plan-*"))


_KILLED_CALLER = textwrap.dedent("""
    import sys, tempfile
    sys.path.insert(0, {tests!r})
    from test_failures import _sum_forever_with_marker
    from gnncompile.runtime.launcher import launch
    program_dir = tempfile.mkdtemp(prefix="gnncompile-plan-")
    open(program_dir + "/rank0.pt", "wb").write(b"x" * 1000)
    launch(_sum_forever_with_marker, 3, ({marker!r},), timeout=60, threads_per_rank=1, temp_paths=[program_dir])
""")


_KILLED_PLAN_RUN = textwrap.dedent("""
    import gnncompile as gc
    graph = gc.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=8, num_classes=3, seed=0)
    plan = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), graph, gpus=2, strategy="data")
    plan.run(epochs=10 ** 9, timeout=60, threads_per_rank=1)
""")


def test_ranks_exit_quietly_within_a_second_of_the_caller_and_delete_its_files(tmp_path: Path) -> None:
    marker = tmp_path / "running"
    script = _KILLED_CALLER.format(tests=os.path.dirname(__file__), marker=str(marker))

    def started(caller: subprocess.Popen) -> bool:
        if marker.exists():
            assert list(tmp_path.glob("gnncompile-plan-*")) and list(tmp_path.glob("pymp-*"))
            return True
        return False
    _kill_caller_and_check(script, started, 3, tmp_path)


def test_plan_run_killed_with_its_caller_leaves_nothing(tmp_path: Path) -> None:
    # killed while training (the ranks deleted their programs as they loaded them) or, on a slow
    # machine, while they load them (the ranks delete the directory as they exit)
    t0 = time.monotonic()

    def started(caller: subprocess.Popen) -> bool:
        return len(_ranks_of(caller.pid)[1]) >= 2 and time.monotonic() - t0 > 0.5
    _kill_caller_and_check(_KILLED_PLAN_RUN, started, 2, tmp_path)


def _ranks_of(caller: int) -> tuple[list[int], list[int]]:
    """The forkserver(s) started by process ``caller`` and the ranks they started (``/proc``)."""
    parents = {pid: _parent(pid) for pid in _child_pids()}
    servers = [pid for pid, parent in parents.items()
               if parent == caller and b"multiprocessing.forkserver" in _cmdline(pid)]
    return servers, [pid for pid, parent in parents.items() if parent in servers]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _kill_caller_and_check(script: str, started: Callable[[subprocess.Popen], bool], ranks: int,
                           tmp_path: Path) -> None:
    """Run ``script`` in a child Python with ``TMPDIR=tmp_path``; once ``started``, SIGKILL it and
    check that its ranks and forkserver are gone within a second, without a word, and its
    temporary files with them."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    caller = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not started(caller):
            assert caller.poll() is None, caller.communicate()[1].decode()
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        descendants = {pid for pid in _child_pids() if _ancestor(pid, caller.pid)}
        servers, rank_pids = _ranks_of(caller.pid)
        assert len(servers) == 1 and len(rank_pids) == ranks, (servers, rank_pids)
        caller.kill()
        t0 = time.monotonic()
        caller.wait()
        while any(_state(pid) not in ("gone", "Z") for pid in descendants) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert took < 1.0, {pid: _state(pid) for pid in descendants}
        err = caller.stderr.read().decode()
        assert "Traceback" not in err and "Error" not in err, err
        assert not list(tmp_path.glob("gnncompile-plan-*")) and not list(tmp_path.glob("pymp-*"))
    finally:
        if caller.poll() is None:
            caller.kill()
        caller.wait()
        caller.stdout.close()
        caller.stderr.close()


def _ancestor(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is an ancestor of ``pid`` (``/proc``)."""
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), "60", True, 0, -1])
def test_timeout_that_is_not_a_finite_positive_number_is_refused_before_any_rank(timeout: object) -> None:
    """NaN was a bare ValueError from int(nan) and a string a TypeError, after the ranks started."""
    g = gc.datasets.synthetic("sbm", num_nodes=40, avg_degree=4, num_features=4, num_classes=2, seed=0)
    plan = gc.plan(gc.nn.GCN(4, 4, 2), g, gpus=2, strategy="data")
    with pytest.raises(gc.ArgumentError, match="timeout must be a finite number of seconds > 0"):
        plan.run(1, timeout=timeout, progress=False)
    with pytest.raises(gc.ArgumentError, match="timeout must be a finite number of seconds > 0"):
        launch(lambda ctx: None, 1, timeout=timeout)
