"""The README is executed (issue 18, item 3): a README edit that breaks an example fails here.

* Every ```python block of README.md runs, in order, in one namespace (later blocks use the
  ``model`` and ``graph`` of earlier ones), from a temporary working directory (the blocks write
  ``step.png``, ``plan.json``, ``t.png``, ``m.png``). The only change: ``gc.train`` and
  ``Plan.run`` are wrapped to cap ``epochs`` at :data:`EPOCHS` (the text is not edited).
* Every command of the "Command line" section runs as a smoke test (the main job, ``--help`` and
  ``torchrun`` through the installed entry points, the others by ``gnncompile.cli.main`` in the
  test's process), with ``--epochs N`` cut to :data:`EPOCHS` (added where a training
  command relies on the default), ``calibrate`` made ``--quick`` and writing to a temporary profile
  (``$GNNCOMPILE_PROFILE`` points every command at it, so none reads or writes the user's cache),
  and the multi-machine ``torchrun`` command of "Several machines" in its single-machine form
  (``torchrun --standalone --nproc-per-node 2`` with ``--gpus 2``). A command with ``--device cuda``
  is skipped where no CUDA device is visible.

The test ids list what ran: ``test_python_block[<n>-<section>: <first line>]`` and
``test_command[<the README's command>]``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
#: the epoch count every README example is cut to
EPOCHS = 2


# --------------------------------------------------------------------------- parsing the README
def _sections() -> list[tuple[str, str]]:
    """``(heading, body)`` for every ``## `` section."""
    parts = re.split(r"^## (.+)$", TEXT, flags=re.M)
    return [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]


def _blocks(body: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", body, flags=re.M | re.S)


def python_blocks() -> list[tuple[str, str]]:
    """``(id, code)`` for every python block, in README order."""
    out = []
    for heading, body in _sections():
        for code in _blocks(body, "python"):
            first = next(line for line in code.splitlines() if line.strip())
            out.append((f"{len(out) + 1}-{heading}: {first.strip()[:60]}", code))
    return out


def _logical_lines(code: str) -> Iterator[str]:
    """Lines of a bash block with ``\\`` continuations joined and comments dropped."""
    for line in code.replace("\\\n", " ").splitlines():
        line = " ".join(re.sub(r"\s+#.*$", "", line).split())
        if line and not line.startswith("#"):
            yield line


def commands() -> list[str]:
    """The README's commands: each of the "Command line" section (``a; b`` is two), then the
    ``torchrun`` command of the multi-machine example."""
    out: list[str] = []
    for heading, body in _sections():
        if heading == "Command line":
            for block in _blocks(body, "bash"):
                for line in _logical_lines(block):
                    out += [part.strip() for part in line.split(";") if part.strip()]
    for heading, body in _sections():
        for block in _blocks(body, "bash"):
            out += [line for line in _logical_lines(block) if line.startswith("torchrun ")]
    return out


def runnable(command: str, profile: Path) -> list[str]:
    """The argv that runs ``command`` here: epochs cut, calibrate quick and into ``profile``,
    ``gnncompile`` the installed entry point next to this interpreter, and ``torchrun --nnodes 2
    --nproc-per-node 4 --rdzv-... -m gnncompile run --gpus 8 ...`` in its single-machine form
    ``torchrun --standalone --nproc-per-node 2 -m gnncompile run --gpus 2 ...``."""
    argv = shlex.split(command)
    assert "gnncompile" in argv, command
    program = argv[argv.index("gnncompile") + 1:]
    sub = next((a for a in program if not a.startswith("-")), None)
    if "--epochs" in program:
        program[program.index("--epochs") + 1] = str(EPOCHS)
    elif sub in ("train", "run") and "--help" not in program:
        program += ["--epochs", str(EPOCHS)]
    if sub == "calibrate":
        program += ["--quick", "--out", str(profile)]
    if argv[0] == "torchrun":
        assert "--nproc-per-node" in argv and argv[argv.index("gnncompile") - 1] == "-m", command
        program[program.index("--gpus") + 1] = "2"
        return [_tool("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "gnncompile", *program]
    assert argv[0] == "gnncompile", command
    return [_tool("gnncompile"), *program]


def _tool(name: str) -> str:
    """The console script ``name`` installed with this interpreter (``.venv/bin/name``)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return found


BLOCKS = python_blocks()
COMMANDS = commands()


def test_the_readme_has_what_the_tests_execute() -> None:
    assert len(BLOCKS) >= 5 and any("plan.run(" in code for _, code in BLOCKS)
    assert any(c.startswith("gnncompile calibrate") for c in COMMANDS)
    assert any(c.startswith("torchrun ") for c in COMMANDS)
    assert sum(c.startswith("gnncompile run ") for c in COMMANDS) >= 5


# --------------------------------------------------------------------------- python blocks
class _Session:
    """The README's python blocks run in order in one namespace, each at most once."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.namespace: dict[str, Any] = {"__name__": "__readme__"}
        self.done = 0
        self.failed: Optional[str] = None

    def run_through(self, index: int) -> None:
        """Run blocks ``done .. index`` (earlier blocks define what later ones use)."""
        while self.done <= index:
            block_id, code = BLOCKS[self.done]
            if self.failed is not None:
                pytest.fail(f"an earlier README block failed ({self.failed}); block {block_id!r} depends on it")
            try:
                exec(compile(code, f"README.md python block {block_id}", "exec"), self.namespace)
            except BaseException:
                self.failed = block_id
                raise
            self.done += 1


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Session]:
    import gnncompile
    from gnncompile import Plan

    real_train, real_run = gnncompile.train, Plan.run

    def train(model: Any, graph: Any, epochs: int = 200, *args: Any, **kwargs: Any) -> Any:
        return real_train(model, graph, min(epochs, EPOCHS), *args, **kwargs)

    def run(self: Plan, epochs: int = 200, *args: Any, **kwargs: Any) -> Any:
        return real_run(self, min(epochs, EPOCHS), *args, **kwargs)

    workdir = tmp_path_factory.mktemp("readme")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gnncompile, "train", train)
        mp.setattr(Plan, "run", run)
        mp.setenv("GNNCOMPILE_PROFILE", str(workdir / "cpu_profile.json"))
        mp.chdir(workdir)
        yield _Session(workdir)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[block_id for block_id, _ in BLOCKS])
def test_python_block(index: int, session: _Session) -> None:
    session.run_through(index)


def test_python_blocks_did_what_they_say(session: _Session) -> None:
    """The blocks' results, checked where the README states them (after all blocks ran)."""
    session.run_through(len(BLOCKS) - 1)
    ns = session.namespace
    history, result, plan = ns["history"], ns["result"], ns["plan"]
    assert len(history.loss) == EPOCHS and len(result.history.loss) == EPOCHS
    assert result.ranks[0].bytes_sent > 0
    for name in ("step.png", "plan.json", "t.png", "m.png"):
        assert (session.workdir / name).stat().st_size > 0, name
    assert plan.num_ranks == 64  # the last plan: ogbn-papers100M on 8x8xA100-ib200


# --------------------------------------------------------------------------- commands
def _through_the_entry_point(command: str) -> bool:
    """Whether ``command`` runs as its own process through the installed console script: the
    ``torchrun`` command (torchrun starts the ranks), ``gnncompile --help`` and the README's first
    ``gnncompile run`` (the main job). The others run ``gnncompile.cli.main`` in the test's
    process (the same parser and commands, without a second interpreter's start and a second
    forkserver importing torch: the suite's time)."""
    first_run = next(c for c in COMMANDS if c.startswith("gnncompile run "))
    return command.startswith("torchrun ") or command in ("gnncompile --help", first_run)


def _run_in_process(program: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
                    ) -> tuple[int, str, str]:
    """``gnncompile <program>`` by ``cli.main`` here: its exit status, standard output and error.
    What a command may change in the process (torch's thread count, the default kernel backend)
    is restored."""
    import torch

    from gnncompile import cli, kernels

    threads, backend = torch.get_num_threads(), kernels._default_override
    monkeypatch.setattr(sys, "argv", ["gnncompile", *program])   # the usage lines' program name
    capfd.readouterr()
    try:
        rc = cli.main(program)
    except SystemExit as exc:   # --help, usage errors
        rc = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        torch.set_num_threads(threads)
        kernels._default_override = backend
    out, err = capfd.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_command(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
                 ) -> None:
    import torch

    if "--device cuda" in command and not torch.cuda.is_available():
        pytest.skip("the command trains on a GPU and this machine has no CUDA device")
    profile = tmp_path / "cpu_profile.json"
    argv = runnable(command, profile)
    users = Path.home() / ".cache" / "gnncompile" / "cpu_profile.json"
    before = users.stat().st_mtime_ns if users.exists() else None
    if _through_the_entry_point(command):
        env = {**os.environ, "GNNCOMPILE_PROFILE": str(profile)}
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        rc, out, err = r.returncode, r.stdout, r.stderr
    else:
        monkeypatch.setenv("GNNCOMPILE_PROFILE", str(profile))
        monkeypatch.chdir(tmp_path)
        rc, out, err = _run_in_process(argv[1:], monkeypatch, capfd)
    assert rc == 0, f"{' '.join(argv)} exited {rc}:\n{out[-3000:]}\n{err[-3000:]}"
    assert out.strip()
    if "calibrate" in argv:
        assert profile.is_file() and str(profile) in out
    assert (users.stat().st_mtime_ns if users.exists() else None) == before  # the user's cache untouched
    for flag in ("--save", "--timeline"):
        if flag in argv:
            assert (tmp_path / argv[argv.index(flag) + 1]).stat().st_size > 0
