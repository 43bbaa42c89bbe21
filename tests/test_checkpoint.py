"""Checkpoints, resuming, best model and early stopping (plan.run and gc.train).

:func:`check_resume_matches_straight` is the template a strategy's tests reuse (layer and split
when they arrive, with their own state registered through
:func:`gnncompile.runtime.checkpoint.register_rank_state`): it runs a plan straight through while
checkpointing, then resumes a copy of the middle checkpoint to the end, and requires the same
history and the same final and best parameters, bit for bit (on the CPU).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import gnncompile as gc
from gnncompile.errors import RuntimeFailure
from gnncompile.runtime import checkpoint as ckpt
from gnncompile.runtime.launcher import RankFailure

from graph_strategies import sbm_graph


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(60)


def _gcn(g: gc.Graph, hidden: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)  # dropout 0.5: the random stream matters
    return gc.nn.GCN(g.num_features, hidden, g.num_classes, num_layers=2).double()


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process, from ``/proc``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                out[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, ValueError, IndexError):
                pass
    return out


def _descendants() -> set[int]:
    """Live (non-zombie) descendants of this process."""
    table = _processes()
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, (pp, _) in table.items() if pp in frontier} - found
        found |= frontier
    return {p for p in found if table[p][1] != "Z"}


def _ranks() -> list[int]:
    """The live ranks: children of this process's forkserver (which runs ``multiprocessing.forkserver``)."""
    table = _processes()
    servers = set()
    for pid, (pp, _) in table.items():
        if pp == os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"forkserver" in f.read():
                        servers.add(pid)
            except OSError:
                pass
    return sorted(pid for pid, (pp, state) in table.items() if pp in servers and state != "Z")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for n in a:
        if exact:
            assert torch.equal(a[n], b[n]), f"parameter {n} differs"
        else:
            torch.testing.assert_close(a[n].cpu(), b[n].cpu(), rtol=1e-6, atol=1e-8, msg=f"parameter {n} differs")


def check_resume_matches_straight(make_plan: Callable[[], Any], tmp: Path, epochs: int = 6, split: int = 3,
                                  exact: bool = True, **run: Any) -> Any:
    """The checkpoint template: ``make_plan()`` builds a fresh model and plan (same seed each time).
    A straight run of ``epochs`` writes checkpoints every ``split`` epochs; a copy holding only the
    ``epoch-split`` checkpoint is resumed to ``epochs`` with a fresh model and plan. Loss, accuracy
    histories, final parameters and best parameters must be identical (``exact=False``: equal up
    to float reordering, for devices whose kernels are not deterministic). ``run``: more
    ``plan.run`` arguments. Returns the straight run."""
    straight_dir, resumed_dir = tmp / "straight", tmp / "resumed"
    plan = make_plan()
    straight = plan.run(epochs, checkpoint_dir=straight_dir, checkpoint_every=split, progress=False, timeout=60, **run)
    final = {n: p.detach().clone() for n, p in zip(plan.program[0].param_names, plan.program[0].params)}
    assert (straight_dir / f"epoch-{split}").is_dir() and (straight_dir / f"epoch-{epochs}").is_dir()
    assert (straight_dir / "latest").read_text().strip() == f"epoch-{epochs}"
    resumed_dir.mkdir()
    shutil.copytree(straight_dir / f"epoch-{split}", resumed_dir / f"epoch-{split}")
    plan2 = make_plan()
    resumed = plan2.run(epochs, checkpoint_dir=resumed_dir, resume=True, progress=False, timeout=60, **run)
    for f in ("loss", "train_acc", "val_acc", "test_acc"):
        if exact:
            assert getattr(resumed.history, f) == getattr(straight.history, f), f
        else:
            assert getattr(resumed.history, f) == pytest.approx(getattr(straight.history, f), rel=1e-6, nan_ok=True), f
    _assert_same(final, {n: p.detach().clone() for n, p in zip(plan2.program[0].param_names, plan2.program[0].params)},
                 exact)
    _assert_same(straight.best_state_dict(), resumed.best_state_dict(), exact)
    assert resumed.history.best_epoch == straight.history.best_epoch
    return straight


# strategy -> plan options; ranks 2, tiny graph
RESUMABLE = {
    "data": dict(strategy="data"),
    "tensor": dict(strategy="tensor", chunks=1),
    "mop": dict(strategy="mop", chunks=2, sparse_ranks=1),
    "task": dict(strategy="task", chunks=2),
    "task-regrouped": dict(strategy="task", chunks=4, dependencies="regrouped", subgraph_chunks=2,
                           semantics="relaxed"),
    "task-cached": dict(strategy="task", chunks=3, dependencies="cached", semantics="relaxed"),
    # sampled mini-batches: an epoch's batches and samples follow from (seed, epoch, step)
    "split": dict(strategy="split", batch_size=16, fanouts=[3, 2]),
    "data-minibatch": dict(strategy="data", batch_size=16, fanouts=[3, 2]),
}


@pytest.mark.parametrize("name", sorted(RESUMABLE))
def test_resume_matches_straight(sbm: gc.Graph, name: str, tmp_path: Path) -> None:
    """Exact strategies and relaxed ones whose streams are all restored (regrouping orders come from
    (seed, epoch); cached dependencies' stale chunks are rank state)."""
    check_resume_matches_straight(lambda: gc.plan(_gcn(sbm), sbm, gpus=2, **RESUMABLE[name]), tmp_path)


def test_checkpoint_layout_and_atomic_pointer(sbm: gc.Graph, tmp_path: Path) -> None:
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    res = plan.run(5, checkpoint_dir=tmp_path, checkpoint_every=2, progress=False, timeout=60)
    # every 2 epochs and the last; the two newest kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "epoch-4", "epoch-5", "latest"]
    last = tmp_path / "epoch-5"
    meta = json.loads((last / "meta.json").read_text())
    assert meta["epoch"] == 5 and meta["history"]["loss"] == res.history.loss
    assert json.loads((last / "plan.json").read_text())["strategy"] == "data"
    assert any(f.suffix == ".distcp" for f in last.iterdir()) and (last / ".metadata").is_file()
    best = torch.load(tmp_path / "best.pt")
    assert best["epoch"] == res.history.best_epoch
    _assert_same(best["state_dict"], res.best_state_dict())
    # a write that died before its rename leaves a staging directory: the previous checkpoint stays
    (tmp_path / ".staging-epoch6").mkdir()
    (tmp_path / ".staging-epoch6" / "__0_0.distcp").write_bytes(b"partial")
    assert ckpt.latest(tmp_path) == last
    # a lost pointer: the newest complete directory
    (tmp_path / "latest").unlink()
    assert ckpt.latest(tmp_path) == last


def test_refusals_before_any_rank_starts(sbm: gc.Graph, tmp_path: Path) -> None:
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    with pytest.raises(RuntimeFailure, match="holds no complete checkpoint"):
        plan.run(4, checkpoint_dir=tmp_path / "empty", resume=True, progress=False)
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        plan.run(4, resume=True)
    with pytest.raises(ValueError, match="checkpoint_every"):
        plan.run(4, checkpoint_dir=tmp_path / "x", checkpoint_every=0)
    with pytest.raises(ValueError, match="patience"):
        plan.run(4, patience=0)
    plan.run(2, checkpoint_dir=tmp_path / "d", checkpoint_every=1, progress=False, timeout=60)
    with pytest.raises(RuntimeFailure, match="already holds checkpoints"):
        plan.run(2, checkpoint_dir=tmp_path / "d", progress=False)
    with pytest.raises(RuntimeFailure, match="more than epochs=1"):
        plan.run(1, checkpoint_dir=tmp_path / "d", resume=True, progress=False)
    # another model: hidden width 5
    other = gc.plan(_gcn(sbm, hidden=5), sbm, gpus=2, strategy="data")
    with pytest.raises(RuntimeFailure, match=r"model\.params") as info:
        other.run(4, checkpoint_dir=tmp_path / "d", resume=True, progress=False)
    assert "graph" not in str(info.value).split("what differs:")[1].split("\nresume")[0]
    # another graph of other size
    g2 = sbm_graph(70)
    with pytest.raises(RuntimeFailure, match=r"graph\.description"):
        gc.plan(_gcn(g2), g2, gpus=2, strategy="data").run(4, checkpoint_dir=tmp_path / "d", resume=True,
                                                          progress=False)
    # the edges renumbered, the data as it was: same name, sizes, degrees and data, other structure
    perm = torch.randperm(sbm.num_nodes, generator=torch.Generator().manual_seed(3))
    data = dict(x=sbm.x, y=sbm.y, train_mask=sbm.train_mask, val_mask=sbm.val_mask, test_mask=sbm.test_mask)
    renumbered = gc.Graph.from_edge_index(perm[sbm.edge_index()], sbm.num_nodes, name=sbm.name, **data)
    with pytest.raises(RuntimeFailure, match="written for another graph"):
        gc.plan(_gcn(renumbered), renumbered, gpus=2, strategy="data").run(
            4, checkpoint_dir=tmp_path / "d", resume=True, progress=False)
    # another plan
    with pytest.raises(RuntimeFailure, match=r"plan\.options"):
        gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data", partitioner="random").run(
            4, checkpoint_dir=tmp_path / "d", resume=True, progress=False)
    with pytest.raises(RuntimeFailure, match=r"plan\.strategy"):
        gc.plan(_gcn(sbm), sbm, gpus=2, strategy="tensor", chunks=1).run(
            4, checkpoint_dir=tmp_path / "d", resume=True, progress=False)


def test_damaged_checkpoint_refused(sbm: gc.Graph, tmp_path: Path) -> None:
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    plan.run(2, checkpoint_dir=tmp_path, checkpoint_every=1, progress=False, timeout=60)
    data = sorted((tmp_path / "epoch-2").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    with pytest.raises(RuntimeFailure, match=rf"epoch-2 is damaged: {data.name} has .* bytes.*delete"):
        plan.run(4, checkpoint_dir=tmp_path, resume=True, progress=False)
    # deleting it, as the message says, resumes from the one before ...
    shutil.rmtree(tmp_path / "epoch-2")
    # ... unless one of its bits flipped: same size, other contents (the digests recorded at saving)
    data = sorted((tmp_path / "epoch-1").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(RuntimeFailure, match=rf"epoch-1 is damaged: the contents of {data.name} changed"):
        plan.run(4, checkpoint_dir=tmp_path, resume=True, progress=False)
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    res = plan.run(3, checkpoint_dir=tmp_path, resume=True, progress=False, timeout=60)
    assert res.history.epochs == 3
    # damaged inside a file of the right size: torch.distributed.checkpoint's error, named
    meta_file = tmp_path / "epoch-3" / ".metadata"
    meta_file.write_bytes(b"\0" * meta_file.stat().st_size)
    (tmp_path / "epoch-3" / "meta.json").write_text(json.dumps(
        {**json.loads((tmp_path / "epoch-3" / "meta.json").read_text()), "files": {}, "digests": {}}))
    with pytest.raises(RuntimeFailure, match="epoch-3"):
        plan.run(4, checkpoint_dir=tmp_path, resume=True, progress=False, timeout=60)


@pytest.mark.parametrize("name", ["data", "tensor", "mop", "task"])
def test_resume_on_more_ranks_reshards(sbm: gc.Graph, name: str, tmp_path: Path) -> None:
    """Parameters and Adam state are stored once by name: 2 ranks, then 3. These plans' dropout
    masks are replicated (the ranks continue the stream of the rank that drew them all), so the run
    is the 2-rank run's up to float reassociation."""
    opts = RESUMABLE[name]
    straight = gc.plan(_gcn(sbm), sbm, gpus=2, **opts).run(6, checkpoint_dir=tmp_path / "a", checkpoint_every=3,
                                                           progress=False, timeout=60)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "epoch-3", tmp_path / "b" / "epoch-3")
    res = gc.plan(_gcn(sbm), sbm, gpus=3, **opts).run(6, checkpoint_dir=tmp_path / "b", resume=True, progress=False,
                                                      timeout=60)
    assert res.history.loss[:3] == straight.history.loss[:3]
    assert res.history.loss[3:] == pytest.approx(straight.history.loss[3:], rel=1e-9, abs=1e-12)
    _assert_same(res.best_state_dict(), straight.best_state_dict(), exact=res.history.best_epoch < 3)


def test_per_rank_state_cannot_move_to_another_rank_count(sbm: gc.Graph, tmp_path: Path) -> None:
    opts = RESUMABLE["task-cached"]
    gc.plan(_gcn(sbm), sbm, gpus=2, **opts).run(2, checkpoint_dir=tmp_path, progress=False, timeout=60)
    with pytest.raises(RuntimeFailure, match=r"written on 2 ranks, this plan has 3: .*per-rank state \(stale\)"):
        gc.plan(_gcn(sbm), sbm, gpus=3, **opts).run(4, checkpoint_dir=tmp_path, resume=True, progress=False)


def test_failure_message_says_how_to_resume_and_resume_finishes(sbm: gc.Graph, tmp_path: Path) -> None:
    straight = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(6, progress=False, timeout=60)
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    before = _descendants()
    with pytest.raises(RankFailure, match="injected failure") as info:
        plan.run(6, checkpoint_dir=tmp_path, checkpoint_every=2, fail_at=(1, 5), progress=False, timeout=60)
    deadline = time.monotonic() + 5
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants() - before == set(), "the failed run left processes behind"
    last = str(info.value).splitlines()[-1]
    assert "epoch-4" in last and "resume=True" in last and "--resume" in last and str(tmp_path) in last
    res = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(6, checkpoint_dir=tmp_path, resume=True,
                                                               progress=False, timeout=60)
    assert res.history.loss == straight.history.loss


def test_sigkill_of_a_rank_then_resume(sbm: gc.Graph, tmp_path: Path) -> None:
    """A rank killed with SIGKILL once a checkpoint exists: the run fails naming it, no process is
    left behind, and resuming gives the uninterrupted run's history."""
    epochs = 60
    straight = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(epochs, progress=False, timeout=60)
    before = _descendants()
    killed: list[int] = []

    def kill_a_rank() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "latest").exists():
            time.sleep(0.002)
        ranks = _ranks()
        if ranks:
            pid = ranks[-1]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    watcher = threading.Thread(target=kill_a_rank)
    watcher.start()
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    with pytest.raises(RankFailure, match="SIGKILL") as info:
        plan.run(epochs, checkpoint_dir=tmp_path, checkpoint_every=2, progress=False, timeout=30)
    watcher.join()
    assert killed
    assert "resume=True" in str(info.value).splitlines()[-1]
    deadline = time.monotonic() + 5
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants() - before == set(), "the failed run left processes behind"
    res = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(epochs, checkpoint_dir=tmp_path, resume=True,
                                                               progress=False, timeout=60)
    assert res.history.loss == straight.history.loss


def test_patience_stops_and_best_state_is_the_best_epochs(sbm: gc.Graph, tmp_path: Path) -> None:
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    res = plan.run(40, patience=2, checkpoint_dir=tmp_path, progress=False, timeout=60)
    h = res.history
    assert h.stopped_at is not None and h.epochs == h.stopped_at + 1 < 40
    assert h.stopped_at - h.best_epoch == 2
    assert all(v <= h.best_val_acc for v in h.val_acc)
    assert (tmp_path / f"epoch-{h.epochs}").is_dir()  # the stopping epoch is checkpointed
    # resuming a run that stopped trains nothing more (it trained one more epoch before)
    again = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(40, patience=2, checkpoint_dir=tmp_path,
                                                                 resume=True, progress=False, timeout=60)
    assert again.history.loss == h.loss and again.history.stopped_at == h.stopped_at
    assert not (tmp_path / f"epoch-{h.epochs + 1}").exists()
    # the best parameters are those a run of best_epoch + 1 epochs ends with
    short = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    short.run(h.best_epoch + 1, progress=False, timeout=60)
    _assert_same(res.best_state_dict(), {n: p.detach() for n, p in zip(short.program[0].param_names,
                                                                        short.program[0].params)})


def test_train_resume_best_and_patience(sbm: gc.Graph, tmp_path: Path) -> None:
    straight_model = _gcn(sbm)
    straight = gc.train(straight_model, sbm, 6, verbose=False)
    gc.train(_gcn(sbm), sbm, 3, verbose=False, checkpoint_dir=tmp_path, checkpoint_every=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "epoch-2", "epoch-3", "latest"]
    model = _gcn(sbm)
    resumed = gc.train(model, sbm, 6, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert resumed.loss == straight.loss and resumed.val_acc == straight.val_acc
    _assert_same(_params(model), _params(straight_model))
    _assert_same(resumed.best_state_dict(), straight.best_state_dict())
    with pytest.raises(RuntimeFailure, match=r"model\.params"):
        gc.train(_gcn(sbm, hidden=5), sbm, 6, verbose=False, checkpoint_dir=tmp_path, resume=True)
    stopped = gc.train(_gcn(sbm), sbm, 100, verbose=False, patience=3, checkpoint_dir=tmp_path / "p")
    assert stopped.stopped_at is not None and stopped.epochs == stopped.stopped_at + 1
    again = gc.train(_gcn(sbm), sbm, 100, verbose=False, patience=3, checkpoint_dir=tmp_path / "p", resume=True)
    assert again.loss == stopped.loss and again.stopped_at == stopped.stopped_at   # nothing more trained
    best_model = _gcn(sbm)
    gc.train(best_model, sbm, stopped.best_epoch + 1, verbose=False)
    _assert_same(stopped.best_state_dict(), best_model.state_dict())
    with pytest.raises(RuntimeFailure, match="keeps no best parameters"):
        gc.History().best_state_dict()


def test_cli_checkpoint_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gnncompile.cli import main

    small = ["--dataset", "sbm", "--num-nodes", "60", "--avg-degree", "4", "--num-features", "6", "--num-classes", "3",
             "--hidden", "6", "--quiet"]
    d = tmp_path / "ck"
    assert main(["run", *small, "--gpus", "2", "--strategy", "data", "--epochs", "2", "--checkpoint-dir", str(d),
                 "--checkpoint-every", "1"]) == 0
    assert (d / "epoch-2").is_dir()
    assert main(["run", *small, "--gpus", "2", "--strategy", "data", "--epochs", "3", "--checkpoint-dir", str(d),
                 "--resume", "--patience", "5"]) == 0
    assert json.loads((d / "epoch-3" / "meta.json").read_text())["epoch"] == 3
    assert main(["train", *small, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "best.pt").is_file()
    for bad in (["--checkpoint-every", "0"], ["--patience", "0"], ["--resume"]):
        with pytest.raises(SystemExit):
            main(["train", *small, "--epochs", "2", *bad])
    capsys.readouterr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("name", ["data", "task-regrouped"])
def test_resume_matches_straight_on_gpu(sbm: gc.Graph, name: str, tmp_path: Path) -> None:
    """On CUDA: the CUDA generator (dropout masks drawn on the device) and the moments on the
    device are restored; checkpoints go through a gloo group when the ranks use NCCL."""
    check_resume_matches_straight(lambda: gc.plan(_gcn(sbm), sbm, gpus=2, **RESUMABLE[name]), tmp_path,
                                  exact=False, device="cuda")


def test_torchrun_resume_matches_straight(tmp_path: Path) -> None:
    """``gnncompile run --torchrun`` (2 processes under ``torchrun --standalone``): 4 epochs with
    checkpoints, then ``--resume`` to 6, give the history of 6 straight epochs, loss for loss."""
    import subprocess
    import sys

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"torchrun is not installed next to {sys.executable}")
    small = ["--dataset", "sbm", "--num-nodes", "60", "--avg-degree", "4", "--num-features", "6", "--num-classes", "3",
             "--hidden", "6", "--quiet", "--strategy", "data", "--device", "cpu"]
    d = tmp_path / "ck"

    def start(name: str, *extra: str) -> subprocess.Popen:
        argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "gnncompile", "run", "--torchrun",
                "--gpus", "2", *small, "--json", str(tmp_path / f"{name}.json"), *extra]
        return subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(proc: subprocess.Popen) -> None:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]

    straight = start("straight", "--epochs", "6")  # independent of the other two: runs beside them
    finish(start("first", "--epochs", "4", "--checkpoint-dir", str(d), "--checkpoint-every", "2"))
    assert sorted(p.name for p in d.glob("epoch-*")) == ["epoch-2", "epoch-4"]
    finish(start("resumed", "--epochs", "6", "--checkpoint-dir", str(d), "--checkpoint-every", "2", "--resume"))
    finish(straight)
    a = json.loads((tmp_path / "straight.json").read_text())
    b = json.loads((tmp_path / "resumed.json").read_text())
    first = json.loads((tmp_path / "first.json").read_text())
    assert len(a["loss"]) == len(b["loss"]) == 6 and first["loss"] == a["loss"][:4]
    assert b["loss"] == a["loss"] and b["val_acc"] == a["val_acc"] and b["test_acc"] == a["test_acc"]
    assert len(set(a["loss"])) > 1  # it trained
    assert json.loads((d / "epoch-6" / "meta.json").read_text())["epoch"] == 6
    best = torch.load(d / "best.pt")  # rank 0 gathers it from the owners' parts of the last checkpoint
    assert best["epoch"] == a["val_acc"].index(max(a["val_acc"]))
    assert set(best["state_dict"]) == {n for n, _ in _gcn(sbm_graph(60)).named_parameters()}


def test_torchrun_decision_reads_only(tmp_path: Path) -> None:
    """What every torchrun process runs before the group is up (``create=False``) writes nothing,
    and a checkpoint it cannot see is refused with the shared-filesystem requirement."""
    d = tmp_path / "ck"
    fingerprint = {"model": {}, "graph": {}, "plan": {"ranks": 2}}
    assert ckpt.prepare(ckpt.CheckpointOptions(str(d)), fingerprint, create=False) is None
    assert not d.exists()
    with pytest.raises(RuntimeFailure, match="no complete checkpoint.*filesystem every machine shares"):
        ckpt.prepare(ckpt.CheckpointOptions(str(d), resume=True), fingerprint, create=False,
                     missing_note=ckpt.SHARED_FS)
    assert not d.exists()
    with pytest.raises(RuntimeFailure, match="not there as this process sees.*filesystem every machine shares"):
        ckpt.load_tensors(d / "epoch-2", lambda k: True, distributed=False)


def test_unreadable_checkpoint_is_a_runtime_failure_in_train(sbm: gc.Graph, tmp_path: Path) -> None:
    """torch.distributed.checkpoint's CheckpointException is a BaseException: gc.train (one process,
    no rank to report it) turns it into the project's error too."""
    gc.train(_gcn(sbm), sbm, 2, verbose=False, checkpoint_dir=tmp_path)
    meta_file = tmp_path / "epoch-2" / ".metadata"
    meta_file.write_bytes(b"\0" * meta_file.stat().st_size)
    (tmp_path / "epoch-2" / "meta.json").write_text(json.dumps(
        {**json.loads((tmp_path / "epoch-2" / "meta.json").read_text()), "files": {}, "digests": {}}))
    with pytest.raises(RuntimeFailure, match=r"checkpoint .*epoch-2 cannot be read"):
        gc.train(_gcn(sbm), sbm, 4, verbose=False, checkpoint_dir=tmp_path, resume=True)


def test_checkpoint_exception_is_a_runtime_failure(sbm: gc.Graph, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch.distributed.checkpoint raises for a load that failed in a reader: a BaseException,
    which ``except Exception`` misses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    gc.train(_gcn(sbm), sbm, 2, verbose=False, checkpoint_dir=tmp_path)

    def failing_load(*args, **kwargs):
        raise CheckpointException("load failed on rank 0", {})

    monkeypatch.setattr(dcp, "load", failing_load)
    with pytest.raises(RuntimeFailure, match=r"epoch-2 cannot be read \(CheckpointException"):
        gc.train(_gcn(sbm), sbm, 4, verbose=False, checkpoint_dir=tmp_path, resume=True)


def test_checkpoint_dir_that_cannot_be_made_or_resumed_is_refused_without_side_effects(sbm: gc.Graph,
                                                                                        tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RuntimeFailure, match=r"checkpoint_dir .*file/sub' cannot be created"):
        gc.train(_gcn(sbm), sbm, 1, verbose=False, checkpoint_dir=tmp_path / "file" / "sub")
    with pytest.raises(RuntimeFailure, match=r"resume=True but checkpoint_dir .*absent' holds no complete checkpoint \(it does not exist\)"):
        gc.train(_gcn(sbm), sbm, 1, verbose=False, checkpoint_dir=tmp_path / "absent", resume=True)
    assert not (tmp_path / "absent").exists()


def test_a_fingerprint_difference_names_the_key_inside_a_long_dict() -> None:
    """The plan options (a long dict) were cut at 160 characters, before the key that differed."""
    options = {f"option_{i:02d}": "a fairly long value" for i in range(12)}
    saved = {"plan": {"options": {**options, "stages": 2}, "ranks": 2}, "model": {"params": 10}}
    current = {"plan": {"options": {**options, "stages": 3}, "ranks": 3}, "model": {"params": 10}}
    assert ckpt.compare_fingerprints(saved, current) == ["plan.options.stages: checkpoint 2, this run 3",
                                                         "plan.ranks: checkpoint 2, this run 3"]
    assert ckpt.compare_fingerprints(saved, current, ignore=("plan.ranks",)) == [
        "plan.options.stages: checkpoint 2, this run 3"]


def _no_space(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("what", ["tensors", "meta.json"])
def test_a_failed_checkpoint_write_is_a_runtime_failure_and_keeps_the_previous_one(
        sbm: gc.Graph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        what: str) -> None:
    """A full disk while torch.distributed.checkpoint writes (its CheckpointException is a
    BaseException, which escaped gc.train and printed a traceback from the CLI) or while meta.json
    is written: the project's error, naming the directory and the OS error (the cause); the
    previous checkpoint stays the one to resume from."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from gnncompile.cli import main

    straight = gc.train(_gcn(sbm), sbm, 3, verbose=False)
    gc.train(_gcn(sbm), sbm, 1, verbose=False, checkpoint_dir=tmp_path)
    with monkeypatch.context() as patch:
        if what == "tensors":
            create_stream = FileSystem.create_stream
            patch.setattr(FileSystem, "create_stream",
                          lambda fs, path, mode: _no_space() if "w" in mode else create_stream(fs, path, mode))
        else:
            patch.setattr(ckpt, "write_text", _no_space)
        with pytest.raises(RuntimeFailure, match=rf"checkpoint of epoch 2 could not be written to checkpoint_dir "
                                                 rf"'{tmp_path}': \[Errno {errno.ENOSPC}\] No space left on device; "
                                                 r"the previous checkpoint \(epoch-1\) is unchanged") as info:
            gc.train(_gcn(sbm), sbm, 3, verbose=False, checkpoint_dir=tmp_path, checkpoint_every=1, resume=True)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        assert ckpt.latest(tmp_path) == tmp_path / "epoch-1"
        assert not list(tmp_path.glob(".staging-*"))
        small = ["--dataset", "sbm", "--num-nodes", "60", "--avg-degree", "4", "--num-features", "6",
                 "--num-classes", "3", "--hidden", "6", "--quiet"]
        capsys.readouterr()
        assert main(["train", *small, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "cli")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("gnncompile: error: checkpoint of epoch") and err.count("\n") == 1, err
    resumed = gc.train(_gcn(sbm), sbm, 3, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert resumed.loss == straight.loss


def test_a_failed_best_parameters_write_is_a_runtime_failure(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RuntimeFailure, match=r"the best parameters could not be written to .*file/best\.pt"):
        ckpt.write_best(tmp_path / "file", {"w": torch.zeros(2)}, 0, 0.5)


def test_a_fingerprint_difference_names_the_rows_near_the_end_of_a_long_list(sbm: gc.Graph, tmp_path: Path) -> None:
    """model.params (rows [name, shape, dtype]) was compared whole and cut at 160 characters, so a
    3-layer checkpoint resumed with a 4-layer model showed only the first, equal, rows."""
    def gcn(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return gc.nn.GCN(sbm.num_features, 6, sbm.num_classes, num_layers=layers).double()

    gc.train(gcn(3), sbm, 1, verbose=False, checkpoint_dir=tmp_path)
    with pytest.raises(RuntimeFailure) as info:
        gc.train(gcn(4), sbm, 2, verbose=False, checkpoint_dir=tmp_path, resume=True)
    lines = str(info.value).splitlines()
    assert "  model.params: only in this run: convs.3.bias [3] torch.float64, convs.3.lin.weight [3, 6] " \
           "torch.float64" in lines
    assert "  model.params[convs.2.lin.weight]: checkpoint [3, 6] torch.float64, this run [6, 6] torch.float64" in lines
    rows = [[f"layer{i}.weight", [6, 6], "torch.float64"] for i in range(10)]
    assert ckpt.compare_fingerprints({"model": {"params": rows}}, {"model": {"params": rows[:3]}}) == [
        "model.params: only in the checkpoint: layer3.weight [6, 6] torch.float64, layer4.weight [6, 6] "
        "torch.float64, layer5.weight [6, 6] torch.float64, layer6.weight [6, 6] torch.float64 and 3 more"]
    assert ckpt.compare_fingerprints({"model": {"params": rows}}, {"model": {"params": rows[::-1]}}) == [
        "model.params[0]: checkpoint layer0.weight [6, 6] torch.float64, this run layer9.weight [6, 6] torch.float64 "
        "(the same rows in another order)"]
    hashes = [f"{i:016x}" for i in range(20)]
    assert ckpt.compare_fingerprints({"graph": {"structure": hashes}}, {"graph": {"structure": hashes[:18] + ["x"]}}) \
        == ["graph.structure[18]: checkpoint \"0000000000000012\", this run \"x\"",
            "graph.structure: checkpoint 20 entries, this run 19"]


@pytest.mark.parametrize("change, what", [(dict(seed=7), "training.seed: checkpoint 0, this run 7"),
                                          (dict(lr=0.02), "training.lr: checkpoint 0.01, this run 0.02"),
                                          (dict(weight_decay=0.0), "training.weight_decay: checkpoint 0.0005, this "
                                                                   "run 0.0"),
                                          (dict(dropout=0.1), "model.modules[(root)]: checkpoint GCN dropout=0.5, "
                                                              "num_layers=2, this run GCN dropout=0.1, num_layers=2")],
                         ids=["seed", "lr", "weight_decay", "dropout"])
def test_train_resume_refuses_other_training_settings(sbm: gc.Graph, tmp_path: Path, change: dict,
                                                      what: str) -> None:
    """gc.train's fingerprint holds the seed (mini-batches and dropout masks follow from it), lr,
    weight_decay and the model's hyperparameters that are not parameter shapes (a dropout rate)."""
    def gcn(dropout: float = 0.5) -> torch.nn.Module:
        torch.manual_seed(0)
        return gc.nn.GCN(sbm.num_features, 6, sbm.num_classes, num_layers=2, dropout=dropout).double()

    gc.train(gcn(), sbm, 1, verbose=False, checkpoint_dir=tmp_path, batch_size=16, fanouts=[3, 2])
    model = gcn(change.pop("dropout", 0.5))
    with pytest.raises(RuntimeFailure, match="was written by another run; what differs:\n  " + re.escape(what) + "\n"):
        gc.train(model, sbm, 2, verbose=False, checkpoint_dir=tmp_path, resume=True, batch_size=16, fanouts=[3, 2],
                 **change)


def test_module_signature_carries_hyperparameters_that_are_not_shapes() -> None:
    def net(p: float) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(p))

    assert ckpt.module_signature(net(0.5)) == [["", "Sequential", "", ""],
                                               ["0", "Linear", "in_features=3, out_features=4, bias=True", ""],
                                               ["1", "Dropout", "p=0.5, inplace=False", ""]]
    assert ckpt.compare_fingerprints({"model": {"modules": ckpt.module_signature(net(0.5))}},
                                     {"model": {"modules": ckpt.module_signature(net(0.25))}}) == [
        "model.modules[1]: checkpoint Dropout p=0.5, inplace=False, this run Dropout p=0.25, inplace=False"]
    signature = ckpt.module_signature(gc.nn.GAT(6, 4, 3, heads=2))
    assert json.loads(json.dumps(signature)) == signature


def test_a_checkpoint_without_the_later_fingerprint_fields_still_resumes(sbm: gc.Graph, tmp_path: Path) -> None:
    """Checkpoints written before the training settings and module signature were recorded resume."""
    straight = gc.train(_gcn(sbm), sbm, 3, verbose=False)
    gc.train(_gcn(sbm), sbm, 2, verbose=False, checkpoint_dir=tmp_path)
    meta_file = tmp_path / "epoch-2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["fingerprint"]["training"], meta["fingerprint"]["model"]["modules"], meta["fingerprint"]["graph"]["data"]
    meta_file.write_text(json.dumps(meta))
    assert gc.train(_gcn(sbm), sbm, 3, verbose=False, checkpoint_dir=tmp_path, resume=True).loss == straight.loss


@pytest.mark.parametrize("name", ["meta.json", ".metadata"])
def test_a_newest_checkpoint_missing_a_file_is_skipped_with_a_warning(sbm: gc.Graph, tmp_path: Path,
                                                                      name: str) -> None:
    straight = gc.train(_gcn(sbm), sbm, 4, verbose=False)
    gc.train(_gcn(sbm), sbm, 3, verbose=False, checkpoint_dir=tmp_path, checkpoint_every=1)
    (tmp_path / "epoch-3" / name).unlink()
    with pytest.warns(UserWarning, match=rf"checkpoint .*epoch-3 skipped: {re.escape(name)} missing \(it was damaged "
                                         r"after it was written\); using epoch-2"):
        resumed = gc.train(_gcn(sbm), sbm, 4, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert resumed.loss == straight.loss


@pytest.mark.parametrize("change,what", [(dict(lr=0.02), r"training.lr: checkpoint 0.01, this run 0.02"),
                                          (dict(seed=3), r"training.seed: checkpoint 0, this run 3"),
                                          (dict(dropout=0.1), r"model.traced: checkpoint \"\w+\", this run \"\w+\"")],
                         ids=["lr", "seed", "dropout"])
def test_plan_resume_refuses_other_training_settings(sbm: gc.Graph, tmp_path: Path, change: dict, what: str) -> None:
    """A plan's checkpoint records lr, weight_decay and the seed, and a hash of the model's trace
    (gc.nn.GCN's dropout rate is a constant in its code): a resume with another was accepted and
    trained on silently (the reviewer's --dropout 0.1 and --lr 0.5 after --resume)."""
    def plan(dropout: float = 0.5) -> Any:
        torch.manual_seed(0)
        model = gc.nn.GCN(sbm.num_features, 6, sbm.num_classes, num_layers=2, dropout=dropout).double()
        return gc.plan(model, sbm, gpus=2, strategy="data")

    plan().run(1, checkpoint_dir=tmp_path, progress=False, timeout=60)
    p = plan(change.pop("dropout", 0.5))
    with pytest.raises(RuntimeFailure, match="was written by another run; what differs:\n  " + what + "\n"):
        p.run(2, checkpoint_dir=tmp_path, resume=True, progress=False, timeout=60, **change)
    plan().run(2, checkpoint_dir=tmp_path, resume=True, progress=False, timeout=60)   # the same settings resume


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def test_a_run_continued_with_eval_every_equals_one_run_straight_through(sbm: gc.Graph, tmp_path: Path) -> None:
    """The last epoch is evaluated off the ``eval_every`` schedule: a run of 5 epochs evaluated epoch
    5, and that evaluation went into the best parameters, patience and the checkpoint, so the run
    continued to 12 chose another best epoch and stopped elsewhere than one run of 12. It is
    reported, not chosen, and checkpoints leave it out."""
    kw = dict(eval_every=2, patience=3, lr=0.05, verbose=False)
    straight = gc.train(_gcn(sbm), sbm, 12, **kw)
    short = gc.train(_gcn(sbm), sbm, 5, checkpoint_dir=tmp_path / "t", **kw)
    assert short.val_acc[4] == short.val_acc[4] and short.val_acc[3] == short.val_acc[3]  # both measured
    resumed = gc.train(_gcn(sbm), sbm, 12, checkpoint_dir=tmp_path / "t", resume=True, **kw)
    assert _same(resumed.val_acc, straight.val_acc) and resumed.loss == straight.loss
    assert (resumed.best_epoch, resumed.stopped_at) == (straight.best_epoch, straight.stopped_at)
    _assert_same(resumed.best_state_dict(), straight.best_state_dict())
    assert (short.best_epoch + 1) % 2 == 0  # the scheduled evaluation, whatever the last one measured
    def plan() -> Any:  # (a run trains the plan's model: each run its own)
        return gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")

    run = dict(eval_every=2, patience=3, lr=0.05, progress=False, timeout=120)
    straight = plan().run(12, **run).history
    plan().run(5, checkpoint_dir=tmp_path / "p", **run)
    resumed = plan().run(12, checkpoint_dir=tmp_path / "p", resume=True, **run).history
    assert _same(resumed.val_acc, straight.val_acc) and resumed.loss == straight.loss
    assert (resumed.best_epoch, resumed.stopped_at) == (straight.best_epoch, straight.stopped_at)


def test_run_arguments_refused_before_any_rank_starts(sbm: gc.Graph, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan.run(eval_every=0)`` failed in every rank (ZeroDivisionError); -3 and 1.5 ran; an empty
    ``checkpoint_dir`` wrote checkpoints into the current directory."""
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    for bad in (0, -3, 1.5, True):
        with pytest.raises(gc.ArgumentError, match=rf"eval_every must be an int >= 1, got {bad!r}"):
            plan.run(2, eval_every=bad, progress=False)
        with pytest.raises(gc.ArgumentError, match="eval_every must be an int >= 1"):
            gc.train(_gcn(sbm), sbm, 2, eval_every=bad, verbose=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(gc.ArgumentError, match="checkpoint_dir is an empty path"):
        plan.run(2, checkpoint_dir="", progress=False)
    with pytest.raises(gc.ArgumentError, match="checkpoint_dir is an empty path"):
        gc.train(_gcn(sbm), sbm, 2, checkpoint_dir="", verbose=False)
    assert list(tmp_path.iterdir()) == []


def test_a_graph_with_other_features_labels_or_masks_is_refused(sbm: gc.Graph, tmp_path: Path) -> None:
    """Same structure, other data (features scaled, labels rolled, train and val swapped) resumed
    silently: the fingerprint hashed only the edges. On another rank count too (re-sharding)."""
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    plan.run(2, checkpoint_dir=tmp_path / "p", progress=False, timeout=60)
    gc.train(_gcn(sbm), sbm, 2, checkpoint_dir=tmp_path / "t", verbose=False)
    for other in (sbm.replace(x=sbm.x * 2), sbm.replace(y=sbm.y.roll(1)),
                  sbm.replace(train_mask=sbm.val_mask, val_mask=sbm.train_mask)):
        for gpus in (2, 3):
            with pytest.raises(RuntimeFailure, match=r"graph\.data: checkpoint"):
                gc.plan(_gcn(other), other, gpus=gpus, strategy="data").run(4, checkpoint_dir=tmp_path / "p",
                                                                           resume=True, progress=False)
        with pytest.raises(RuntimeFailure, match=r"graph\.data: checkpoint"):
            gc.train(_gcn(other), other, 4, checkpoint_dir=tmp_path / "t", resume=True, verbose=False)


def test_eval_every_is_a_training_setting_of_a_checkpoint(sbm: gc.Graph, tmp_path: Path) -> None:
    """Continued with another eval_every, the best epoch (recomputed on the new schedule) and the
    best parameters (chosen on the old one) told of different epochs: refused."""
    gc.train(_gcn(sbm), sbm, 6, eval_every=3, checkpoint_dir=tmp_path, verbose=False)
    with pytest.raises(RuntimeFailure, match=r"training\.eval_every: checkpoint 3, this run 2"):
        gc.train(_gcn(sbm), sbm, 8, eval_every=2, checkpoint_dir=tmp_path, resume=True, verbose=False)


def test_without_a_scheduled_evaluation_the_last_one_chooses(sbm: gc.Graph, tmp_path: Path) -> None:
    """eval_every above epochs: only the last epoch is evaluated; its parameters are the best (there
    were none, and best_state_dict said no validation accuracy was measured)."""
    model = _gcn(sbm)
    hist = gc.train(model, sbm, 3, eval_every=10, checkpoint_dir=tmp_path / "t", verbose=False)
    assert hist.best_epoch == 2 and hist.val_acc[-1] == hist.val_acc[-1]
    _assert_same(hist.best_state_dict(), model.state_dict())
    assert (tmp_path / "t" / "best.pt").is_file()
    run = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data").run(3, eval_every=10, progress=False, timeout=60)
    assert run.history.best_epoch == 2 and set(run.best_state_dict()) >= {n for n, _ in model.named_parameters()}


def test_a_checkpoint_renamed_into_place_but_not_published_says_so(sbm: gc.Graph, tmp_path: Path) -> None:
    """A failure after the checkpoint was renamed into place (updating ``latest``) said the previous
    checkpoint was unchanged, naming the new one, and left ``.latest.tmp<pid>`` behind; a resume
    then followed the stale ``latest`` back to the older checkpoint."""
    gc.train(_gcn(sbm), sbm, 1, checkpoint_dir=tmp_path, verbose=False)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()   # os.replace of the temporary file onto it fails
    with pytest.raises(RuntimeFailure, match=r"checkpoint of epoch 2 is complete in .*epoch-2 but updating 'latest' "
                                             r"failed: .*a resume continues from it"):
        gc.train(_gcn(sbm), sbm, 2, checkpoint_dir=tmp_path, resume=True, verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "epoch-1", "epoch-2", "latest"]
    (tmp_path / "latest").rmdir()
    (tmp_path / "latest").write_text("epoch-1\n")   # the pointer a run that died there left
    assert ckpt.latest(tmp_path) == tmp_path / "epoch-2"
    straight = gc.train(_gcn(sbm), sbm, 2, verbose=False)
    assert gc.train(_gcn(sbm), sbm, 2, checkpoint_dir=tmp_path, resume=True, verbose=False).loss == straight.loss


def test_a_second_run_into_a_directory_in_use_is_refused(sbm: gc.Graph, tmp_path: Path) -> None:
    """Two runs started into one checkpoint_dir at once both passed the "already holds checkpoints"
    check and wrote into it: mixed checkpoints (one run's files under the other's meta.json). A run
    holds the directory (flock) from its start to its end."""
    d = tmp_path / "ck"
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    with ckpt.claimed(d):   # another run holds it
        with pytest.raises(RuntimeFailure, match="is in use by another run writing checkpoints there"):
            gc.train(_gcn(sbm), sbm, 2, checkpoint_dir=d, verbose=False)
        with pytest.raises(RuntimeFailure, match="is in use by another run writing checkpoints there"):
            plan.run(2, checkpoint_dir=d, progress=False)
    assert list(d.iterdir()) == []
    gc.train(_gcn(sbm), sbm, 2, checkpoint_dir=d, verbose=False)   # free again once it ended
    fresh = tmp_path / "refused"
    with pytest.raises(gc.ArgumentError, match="fanouts / eval_fanouts need batch_size"):
        gc.train(_gcn(sbm), sbm, 2, fanouts=[2, 2], checkpoint_dir=fresh, verbose=False)
    assert not fresh.exists()   # a run refused before writing leaves no directory behind
    assert sorted(p.name for p in d.iterdir()) == ["best.pt", "epoch-2", "latest"]
