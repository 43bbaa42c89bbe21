"""The command line as a new user meets it: arguments checked before anything starts, devices,
messages that say what is wrong and with which file, and the planner's explanation (issue 18/16)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gnncompile as gc
from gnncompile import cli, datasets
from gnncompile.errors import GnnCompileError
from gnncompile import Plan

SMALL = ["--dataset", "sbm", "--num-nodes", "300", "--avg-degree", "4", "--num-features", "8", "--num-classes", "3",
         "--hidden", "8"]
HAS_SHARED = any((d / "cora" / "cora.npz").is_file() for d in datasets.search_paths())
needs_shared = pytest.mark.skipif(not HAS_SHARED, reason="shared/datasets not found")


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a plan is made, a rank started or a model trained."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("work started although the arguments were invalid")

    monkeypatch.setattr(Plan, "run", refuse)
    monkeypatch.setattr("gnncompile.api.plan", refuse)
    monkeypatch.setattr("gnncompile.runtime.trainer.train", refuse)
    monkeypatch.setattr("gnncompile.runtime.executor.run_plan", refuse)


# --------------------------------------------------------------------------- argument validation
BAD = [
    (["run", "--lr", "-1"], "--lr", "> 0"),
    (["run", "--lr", "nan"], "--lr", "> 0"),
    (["train", "--lr", "0"], "--lr", "> 0"),
    (["run", "--epochs", "-1"], "--epochs", "positive integer"),
    (["train", "--epochs", "0"], "--epochs", "positive integer"),
    (["plan", "--hidden", "0"], "--hidden", "positive integer"),
    (["run", "--layers", "-2"], "--layers", "positive integer"),
    (["run", "--dropout", "1.5"], "--dropout", "probability"),
    (["train", "--weight-decay", "-0.1"], "--weight-decay", ">= 0"),
    (["run", "--gpus", "0"], "--gpus", "positive integer"),
    (["run", "--gpus", "-4"], "--gpus", "positive integer"),
    (["run", "--timeout", "0"], "--timeout", "> 0"),
    (["run", "--chunks", "0"], "--chunks", "positive integer"),
    (["train", "--seed", "-1"], "--seed", ">= 0"),
    (["train", "--num-nodes", "0"], "--num-nodes", "positive integer"),
    (["train", "--device", "gpu"], "--device", "cpu, cuda or cuda:N"),
    (["run", "--dist-backend", "mpi"], "--dist-backend", "invalid choice"),
]


@pytest.mark.parametrize("argv, option, says", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_arguments_are_usage_errors_before_anything_runs(argv: list[str], option: str, says: str,
                                                             nothing_runs: None, capsys: Any) -> None:
    """``--lr -1`` used to start the ranks and end in a flattened remote traceback; ``--epochs -1``
    printed the whole plan first. Now argparse refuses them at once, in one usage line."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert f"argument {option}" in last and says in last, last
    assert len(last) < 200


def test_gpus_takes_a_rank_count_or_a_cluster() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["plan", "--gpus", "4"]).gpus == 4
    assert parser.parse_args(["plan", "--gpus", "2x4xA5000-ib200"]).gpus == "2x4xA5000-ib200"
    assert parser.parse_args(["run"]).gpus == 4


# --------------------------------------------------------------------------- devices (issue 16, item 3)
def test_train_passes_the_device(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    seen: dict[str, Any] = {}

    def fake_train(model: Any, graph: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise GnnCompileError("stop here")

    monkeypatch.setattr("gnncompile.runtime.trainer.train", fake_train)
    assert cli.main(["train", *SMALL, "--epochs", "1", "--quiet"]) == 1
    assert seen["device"] == "cpu"
    if torch.cuda.is_available():
        seen.clear()
        assert cli.main(["train", *SMALL, "--epochs", "1", "--quiet", "--device", "cuda:0"]) == 1
        assert seen["device"] == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "run"])
def test_cuda_device_without_cuda_is_refused_at_once(command: str, nothing_runs: None, capsys: Any) -> None:
    assert cli.main([command, *SMALL, "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gnncompile: error: --device cuda: no CUDA device is visible") and "--device cpu" in err


def test_run_passes_device_and_backend_only_when_given(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    seen: list[dict[str, Any]] = []

    def fake_run(self: Plan, **kwargs: Any) -> Any:
        seen.append(kwargs)
        raise GnnCompileError("stop here")

    monkeypatch.setattr(Plan, "run", fake_run)
    assert cli.main(["run", *SMALL, "--gpus", "2", "--strategy", "data", "--partitioner", "random", "--quiet"]) == 1
    assert "device" not in seen[-1] and "backend" not in seen[-1]
    assert cli.main(["run", *SMALL, "--gpus", "2", "--strategy", "data", "--partitioner", "random", "--quiet",
                     "--device", "cpu", "--dist-backend", "gloo"]) == 1
    assert seen[-1]["device"] == "cpu" and seen[-1]["backend"] == "gloo"
    assert seen[-1]["epochs"] == 200 and seen[-1]["lr"] == 0.01


def test_nccl_on_cpu_is_refused_before_planning(nothing_runs: None, capsys: Any) -> None:
    assert cli.main(["run", *SMALL, "--device", "cpu", "--dist-backend", "nccl"]) == 1
    assert "--dist-backend nccl needs a CUDA device" in capsys.readouterr().err


# --------------------------------------------------------------------------- messages
def test_a_graph_without_features_says_which_and_names_the_file(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "nofeat.npz"
    np.savez(path, edge_index=np.array([[0, 1, 2], [1, 2, 0]]), num_nodes=np.int64(3), y=np.array([0, 1, 0]))
    assert cli.main(["train", "--dataset", str(path), "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "has no node features (x)" in err and "labels" not in err.split("datasets with")[0]
    assert str(path) in err
    assert err.count("\n") == 1


@needs_shared
def test_pubmed_is_marked_not_trainable(capsys: Any) -> None:
    assert cli.main(["datasets"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "pubmed" in line)
    assert "no: no features" in row
    cora = next(line for line in out.splitlines() if " cora " in line)
    assert "yes" in cora.split("│")[-2]
    assert cli.main(["datasets", "--json"]) == 0
    info = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert info["pubmed"]["trainable"] is False and info["pubmed"]["missing"] == ["features"]
    assert info["cora"]["trainable"] is True
    assert cli.main(["train", "--dataset", "pubmed", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "'pubmed'" in err and "pubmed.npz" in err and "no node features (x)" in err and "cora" in err


def test_garbage_npz_says_it_is_not_a_graph(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "garbage.npz"
    path.write_bytes(bytes(range(3, 200)))
    assert cli.main(["train", "--dataset", str(path), "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "is not a graph file" in err and str(path) in err and "pickle" not in err


# --------------------------------------------------------------------------- the planner's explanation
def test_explain_counts_agree_with_what_it_shows() -> None:
    """It said "Search over 11 candidates" and showed 8 (plus 2 rejected): every candidate is now
    accounted for: ranked rows + "not shown" + rejected == the total."""
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), g, "2x4xA5000-ib200")
    result = plan.search
    assert len(result.ranked) > 2  # so that top=2 hides some
    for top in (2, 8, 100):
        text = result.report(top)
        total = int(re.search(r"Search over (\d+) candidates", text).group(1))
        fit = int(re.search(r"(\d+) fit", text).group(1))
        rejected = int(re.search(r"(\d+) rejected", text).group(1))
        rows = [ln for ln in text.splitlines() if re.match(r"\s+\d+\s+\w+\[", ln)]
        more = re.search(r"\.\.\. (\d+) slower candidates? not shown", text)
        hidden = int(more.group(1)) if more else 0
        assert total == len(result.ranked) + len(result.rejected) == fit + rejected
        assert len(rows) + hidden == fit, text
        assert len(rows) == min(top, fit)
        if rejected:
            assert f"rejected ({rejected})" in text
    assert str(result) == result.report(8)


def test_plan_load_for_another_model_shows_what_differs(tmp_path: Path) -> None:
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GCN(8, 16, 3, num_layers=2), g, gpus=2, strategy="data", partitioner="random")
    path = plan.save(tmp_path / "plan.json")
    with pytest.raises(gc.VerificationError) as info:
        gc.load_plan(path, gc.nn.GCN(8, 32, 3, num_layers=2), g)
    msg = str(info.value)
    assert "rank 0 differs" not in msg
    details = msg.splitlines()[1:]
    assert details and "rank 0 stage 0 costs[0] (convs_0_lin) width: saved 16, rebuilt 32" in msg
    for line in details:
        m = re.match(r"\s+.*: saved (.*), rebuilt (.*)$", line)
        assert m is None or m.group(1) != m.group(2), line


def test_run_of_a_dataset_known_by_its_statistics_only_is_refused_before_planning(nothing_runs: None,
                                                                                   capsys: Any) -> None:
    assert cli.main(["run", "--dataset", "ogbn-products", "--gpus", "2"]) == 1
    err = capsys.readouterr().err
    assert "--dataset ogbn-products: only its statistics are known here" in err and "gnncompile plan" in err


@needs_shared
def test_datasets_table_keeps_whole_numbers_in_a_pipe(capsys: Any) -> None:
    """(stdout is not a terminal here, as in a pipe: rich shortened 13,752 to '13,…' at 80 columns)"""
    assert cli.main(["datasets"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "13,752" in out


def test_early_stop_is_in_the_title(capsys: Any) -> None:
    assert cli.main(["train", *SMALL, "--epochs", "60", "--patience", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d+ of 60 epochs \(early stop: no better validation accuracy for 1 epoch\(s\)\)", out), out
