"""The command line as a new user meets it: arguments checked before anything starts, devices,
messages that say what is wrong and with which file, and the planner's explanation (issue 18/16)."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import re
import sys
import warnings
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
    (["train", "--seed", "-1"], "--seed", "in [0, 2^63)"),
    (["run", "--seed", str(2**64)], "--seed", "in [0, 2^63)"),  # (it ended in a raw overflow)
    (["train", "--num-nodes", "0"], "--num-nodes", "positive integer"),
    (["train", "--device", "gpu"], "--device", "cpu, cuda or cuda:N"),
    (["run", "--dist-backend", "mpi"], "--dist-backend", "invalid choice"),
    # a cluster description is parsed with the flags (it exited 1 after them)
    (["run", "--gpus", "abc"], "--gpus", "unknown device model 'abc'"),
    (["plan", "--gpus", "4x"], "--gpus", "cannot parse cluster spec '4x'"),
    (["plan", "--gpus", "0x4xA5000"], "--gpus", "node and device counts must be >= 1"),
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


def test_plan_load_whose_decisions_do_not_apply_to_the_model_says_the_file_does_not_match(tmp_path: Path) -> None:
    """A decision of the file (features='csr', chosen by the planner for a GCN) that the other model
    cannot take: it was a PlanningError about an option the user never passed."""
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    plan = gc.plan(gc.nn.GCN(8, 16, 3), g, gpus=2, strategy="data", partitioner="random", features="csr")
    path = plan.save(tmp_path / "plan.json")
    with pytest.raises(gc.VerificationError, match=r"plan file .* does not match this model and graph: its decisions "
                                                   r"\(.*features='csr'.*\) cannot be planned for them \(features="
                                                   r"'csr': the model reads x"):
        gc.load_plan(path, gc.nn.GraphSAGE(8, 16, 3), g)


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


# --------------------------------------------------------------------------- flags that do not go together, outputs
@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch, nothing_runs: None) -> None:
    """As ``nothing_runs``, and fail the test if a dataset is loaded or a synthetic graph built."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a dataset was loaded although the arguments were invalid")

    monkeypatch.setattr("gnncompile.datasets.load", refuse)
    monkeypatch.setattr("gnncompile.datasets.synthetic", refuse)


COMBOS = [
    (["train", "--dataset", "cora", "--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["run", "--dataset", "cora", "--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["run", "--dataset", "cora", "--checkpoint-dir", __file__], "exists and is not a directory"),
    (["train", "--dataset", "cora", "--fanouts", "5,5"], "--fanouts needs --batch-size"),
    (["train", "--dataset", "cora", "--eval-fanouts", "5,5"], "--eval-fanouts needs --batch-size"),
    (["train", "--dataset", "cora", "--batch-size", "64"], "--batch-size needs --fanouts"),
    (["run", "--dataset", "cora", "--gpus", "2", "--fanouts", "5,5"], "--fanouts needs --batch-size"),
    (["run", "--dataset", "cora", "--gpus", "2", "--strategy", "split", "--batch-size", "64"],
     "--batch-size needs --fanouts"),
    (["plan", "--dataset", "cora", "--gpus", "2", "--strategy", "split"], "--strategy split needs --batch-size"),
    (["train", "--dataset", "cora", "--heads", "4"], "--model gcn has no attention heads (models with heads: gat)"),
    (["trace", "--model", "sage", "--heads", "2"], "--model sage has no attention heads"),
    (["train", "--dataset", "cora", "--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    (["train", "--dataset", "cora", "--num-nodes", "100", "--num-features", "3"],
     "--num-nodes, --num-features apply to synthetic graphs only (--dataset sbm, rmat, er), not to --dataset cora"),
    (["plan", "--dataset", "ogbn-products", "--avg-degree", "3"], "--avg-degree applies to synthetic graphs only"),
    (["run", "--dataset", "cora", "--strategy", "tensor", "--partitioner", "metis"],
     "--partitioner: --strategy tensor has no such option (its options: --dropout-masks, --backward, --recompute, "
     "--decouple, --chunks)"),
    (["plan", "--dataset", "cora", "--strategy", "data", "--chunks", "4"], "--chunks: --strategy data has no such option"),
    (["plan", "--dataset", "cora", "--strategy", "mop", "--recompute"], "--recompute: --strategy mop has no such"),
]


@pytest.mark.parametrize("argv, says", COMBOS, ids=[" ".join(a) for a, _ in COMBOS])
def test_flags_that_do_not_go_together_are_usage_errors_before_loading(argv: list[str], says: str,
                                                                        nothing_loads: None, capsys: Any) -> None:
    """``--fanouts`` without ``--batch-size``, ``--heads`` with gcn, ``--backend nope``... loaded the
    dataset first and failed with status 1; ``--num-nodes`` on cora was silently ignored."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gnncompile {argv[0]}: error: ") and says in last, last


def test_a_strategy_option_at_its_neutral_value_is_taken_with_any_strategy() -> None:
    """(``--chunks 1`` is no chunking, which a strategy without chunks does: gc.plan accepts it too.)"""
    parser = cli.build_parser()
    for argv in (["plan", "--strategy", "data", "--chunks", "1"], ["run", "--strategy", "mop", "--no-recompute"],
                 ["plan", "--chunks", "4", "--partitioner", "metis"]):
        cli._check_arguments(parser, parser.parse_args(argv))  # no SystemExit


def _help(command: str) -> dict[str, str]:
    """``command``'s flags -> their help text as ``--help`` prints it (with metavar and defaults)."""
    parser = cli._command_parser(cli.build_parser(), command)
    out = {}
    for action in parser._actions:
        if action.option_strings:
            text = parser._get_formatter()._expand_help(action) if action.help else ""
            out[action.option_strings[0]] = " ".join(text.split())
    return out


@pytest.mark.parametrize("command", ["train", "trace", "plan", "run", "calibrate", "datasets"])
def test_help_says_each_default_once_with_readable_metavars(command: str) -> None:
    """``--batch-size STRATEGY_BATCH_SIZE`` leaked the option's destination; ``--chunks`` said
    "(default 4 per rank) (default: searched)"."""
    usage = cli._command_parser(cli.build_parser(), command).format_help()
    assert "STRATEGY_" not in usage
    for flag, text in _help(command).items():
        assert text.count("default") <= 1, (flag, text)
    if command in ("plan", "run"):
        helps = _help(command)
        assert helps["--chunks"].endswith("(default: searched; layer: 4 per rank)")
        assert helps["--sparse-ranks"].endswith("ranks aggregating (the rest run the dense updates) (default: half)")
        assert helps["--p-ranks"].endswith("(default: from the cost model, NeutronTask Eq 7)")
        assert "--batch-size B" in usage and "--chunks K" in usage and "--stages S" in usage


@pytest.mark.parametrize("command", ["trace", "plan"])
def test_commands_that_train_nothing_take_no_training_flags(command: str, capsys: Any) -> None:
    """``trace --epochs 5 --lr 0.1`` was accepted and ignored."""
    assert not {"--epochs", "--lr", "--weight-decay"} & set(_help(command))
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--epochs", "5"])
    assert exc.value.code == 2 and "unrecognized arguments: --epochs 5" in capsys.readouterr().err
    for used in ("train", "run"):
        assert {"--epochs", "--lr", "--weight-decay"} <= set(_help(used))


def test_synthetic_flags_are_still_taken_on_synthetic_graphs() -> None:
    args = cli.build_parser().parse_args(["train", *SMALL, "--batch-size", "8", "--fanouts", "2,2"])
    cli._check_arguments(cli.build_parser(), args)  # no SystemExit
    assert cli._load_graph(args).num_nodes == 300


def test_fanouts_may_start_with_minus_one_and_have_no_empty_entries(nothing_loads: None, capsys: Any) -> None:
    """``--fanouts -1,5`` was "expected one argument" (argparse took -1,5 for a flag); ``3,,2`` was
    silently 3,2."""
    parser = cli.build_parser()
    args = parser.parse_args(cli._attach_number_lists(["train", "--batch-size", "8", "--fanouts", "-1,5",
                                                       "--eval-fanouts", "-1,-1"]))
    assert args.fanouts == (-1, 5) and args.eval_fanouts == (-1, -1)
    args = parser.parse_args(cli._attach_number_lists(["run", "--strategy", "split", "--batch-size", "8",
                                                       "--fanouts", "-1,-1"]))
    assert args.strategy_fanouts == (-1, -1)
    assert parser.parse_args(cli._attach_number_lists(["train", "--fan", "-1,5"])).fanouts == (-1, 5)  # abbreviated
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--dataset", "cora", "--batch-size", "8", "--fanouts", "3,,2"])
    assert exc.value.code == 2 and "an empty fanout in '3,,2'" in capsys.readouterr().err


def _outputs(tmp: Path) -> list[tuple[list[str], str]]:
    return [
        (["train", *SMALL, "--json", str(tmp)], f"argument --json: {tmp} is a directory"),
        (["run", *SMALL, "--json", str(tmp / "no" / "r.json")], f"argument --json: directory {tmp / 'no'} does not"),
        (["plan", *SMALL, "--save", str(tmp)], f"argument --save: {tmp} is a directory"),
        (["plan", *SMALL, "--save", str(tmp / "f.txt" / "p.json")], f"argument --save: {tmp / 'f.txt'} is not a dir"),
        (["trace", *SMALL, "--dot", str(tmp)], f"argument --dot: {tmp} is a directory"),
        (["plan", *SMALL, "--timeline", str(tmp / "t.xyz")], "argument --timeline: "),
        (["run", *SMALL, "--memory-plot", str(tmp / "no" / "m.png")], "argument --memory-plot: directory"),
        (["calibrate", "--quick", "--out", str(tmp)], f"argument --out: {tmp} is a directory"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_unwritable_outputs_are_usage_errors_before_anything_runs(case: int, tmp_path: Path, nothing_loads: None,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: Any) -> None:
    """``--json /tmp`` trained for the whole run, then ended in an IsADirectoryError traceback."""
    monkeypatch.setattr("gnncompile.calibration.calibrate", lambda *a, **k: pytest.fail("calibrated"))
    (tmp_path / "f.txt").write_text("a file")
    argv, says = _outputs(tmp_path)[case]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert out == "" and says in last, last
    if "--timeline" in argv:
        assert "unsupported picture file type '.xyz'" in last and ".png" in last and ".svg" in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), IsADirectoryError(21, "Is a directory", "x")])
def test_an_os_error_when_writing_is_one_line_naming_the_file(error: OSError, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """(``--save /proc/version`` as root passes every check and fails in the write: a traceback)"""
    def fail(self: Plan, path: Any) -> None:
        raise error

    monkeypatch.setattr(Plan, "save", fail)
    path = tmp_path / "p.json"
    assert cli.main(["plan", *SMALL, "--gpus", "2", "--strategy", "data", "--partitioner", "random",
                     "--save", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"gnncompile: error: cannot write {path}: {error.strerror}\n"


def test_other_os_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", "/data/cora.npz")

    monkeypatch.setattr("gnncompile.datasets.load", fail)
    assert cli.main(["train", "--dataset", "cora", "--epochs", "1"]) == 1
    assert capsys.readouterr().err == "gnncompile: error: /data/cora.npz: Permission denied\n"


def test_timeline_without_a_suffix_says_the_file_written(tmp_path: Path, capsys: Any) -> None:
    """It said "timeline written to tl" while matplotlib wrote tl.png."""
    assert cli.main(["plan", *SMALL, "--gpus", "2", "--strategy", "data", "--partitioner", "random",
                     "--timeline", str(tmp_path / "tl"), "--memory-plot", str(tmp_path / "mem.SVG")]) == 0
    out = capsys.readouterr().out
    assert f"timeline written to {tmp_path / 'tl.png'}\n" in out
    assert f"memory plot written to {tmp_path / 'mem.SVG'}\n" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.SVG", "tl.png"]
    assert (tmp_path / "mem.SVG").read_text().lstrip().startswith("<?xml")


def test_json_dash_is_standard_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """``--json -`` wrote a file named ``-``; now the JSON alone goes to standard output."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *SMALL, "--epochs", "2", "--quiet", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["model"] == "gcn" and len(data["loss"]) == 2
    assert "final test acc" in err  # the table, out of the JSON's way
    assert list(tmp_path.iterdir()) == []
    for command in ("train", "run"):
        help_text = " ".join(cli._command_parser(cli.build_parser(), command).format_help().split())
        assert "(-: to standard output" in help_text


def test_json_output_is_strict_json_when_values_are_not_finite(tmp_path: Path, capsys: Any) -> None:
    """A diverged run's NaN losses were written as ``NaN``, which is not JSON (``jq``, JavaScript and
    strict parsers refuse the whole file); they are ``null`` now, to a file and to standard output."""
    def strict(text: str) -> Any:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))

    args = ["train", *SMALL, "--epochs", "3", "--lr", "1e30", "--quiet"]
    assert cli.main([*args, "--json", "-"]) == 0
    data = strict(capsys.readouterr().out)
    assert None in data["loss"] and all(v is None or math.isfinite(v) for v in data["loss"])
    assert cli.main([*args, "--json", str(tmp_path / "h.json")]) == 0
    assert strict((tmp_path / "h.json").read_text())["loss"] == data["loss"]


@pytest.mark.parametrize("args", [["plan", *SMALL, "--gpus", "2", "--strategy", "data", "--save", "-"],
                                  ["trace", *SMALL, "--dot", "-"], ["train", *SMALL, "--epochs", "1", "--quiet", "--json", "-"]])
def test_dash_outputs_to_a_standard_output_that_fails(args: list, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """With standard output closed (``>&-``: Python's ``sys.stdout`` is None) ``--save -`` wrote nothing and
    exited 0; a write that failed (``>/dev/full``) said ``[Errno 28] No space left on device``, naming nothing."""
    flag = args[-2]
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert f"argument {flag}: -: standard output is closed" in capsys.readouterr().err

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sys, "stdout", Full())
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "gnncompile: error: cannot write standard output: No space left on device"


def test_save_and_dot_dash_are_standard_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """(They wrote files named ``-``.)"""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", *SMALL, "--gpus", "2", "--strategy", "data", "--save", "-"]) == 0
    out, err = capsys.readouterr()
    saved = tmp_path / "plan.json"
    saved.write_text(out)
    assert gc.load_plan(saved).strategy == "data" and "plan written to standard output" in err
    assert cli.main(["trace", *SMALL, "--dot", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.lstrip().startswith("digraph") and "DOT written to standard output" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


# --------------------------------------------------------------------------- errors name the flags given
def test_checkpoint_errors_name_the_flags(tmp_path: Path, capsys: Any) -> None:
    """The checkpoint errors said ``resume=True but checkpoint_dir '...'``: Python spellings of the
    flags the user typed."""
    missing, file = tmp_path / "none", tmp_path / "file"
    file.write_text("not a directory")
    assert cli.main(["train", *SMALL, "--epochs", "1", "--quiet", "--checkpoint-dir", str(missing), "--resume"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"gnncompile: error: --resume but --checkpoint-dir '{missing}' holds no complete checkpoint")
    assert "run without --resume" in err and "resume=" not in err and "checkpoint_dir" not in err
    # a directory that cannot be one is a usage error (exit 2) before anything loads, as unwritable outputs are
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *SMALL, "--epochs", "1", "--quiet", "--checkpoint-dir", str(file)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"gnncompile train: error: argument --checkpoint-dir: {file} exists and is not a directory"


def test_error_spelling_keeps_the_command_line_form_of_a_hint(tmp_path: Path) -> None:
    from gnncompile.runtime.checkpoint import resume_hint

    flags = cli._keyword_flags(cli._command_parser(cli.build_parser(), "run"), "run")
    hint = cli._flag_spelling(resume_hint(tmp_path / "ck_1", "plan.run"), flags)
    assert hint == f"no checkpoint was written before the failure: rerun from the start with --checkpoint-dir " \
                   f"{tmp_path / 'ck_1'}, without --resume"
    said = ("checkpoint_dir '/d' already holds checkpoints (newest: epoch-2); pass resume=True (CLI: --resume) to "
            "continue; dropout='replicated' needs full-graph plans (batch_size), recompute=False; /data/batch_size.npz")
    assert cli._flag_spelling(said, flags) == (
        "--checkpoint-dir '/d' already holds checkpoints (newest: epoch-2); pass --resume to continue; "
        "--dropout-masks replicated needs full-graph plans (--batch-size), --no-recompute; /data/batch_size.npz")
    train = cli._keyword_flags(cli._command_parser(cli.build_parser(), "train"), "train")
    assert cli._flag_spelling("dropout=0.5, backend='x'", train) == "--dropout 0.5, --backend x"
    assert cli._flag_spelling("backend='x'", flags) == "--dist-backend x"
    # a candidate's options are plan vocabulary, not flags the user gave
    closest = "the closest, data[partitioner=metis, recompute=False] x2, needs 178.86 GiB per rank"
    assert cli._flag_spelling(closest, flags) == closest


# --------------------------------------------------------------------------- calibrate
def _calibrated(path: Any = None, **kwargs: Any) -> Any:
    """What ``gc.calibrate`` returns, without measuring: a cluster with a calibration record shaped
    as the CPU's (and as long: curves of many points)."""
    from gnncompile.cost_models.hardware import Cluster

    cal = {"host": "box", "torch": "2.x", "quick": True, "cores": 2, "threads": [1, 2],
           "rates": {"flops": {"float32": [183e9, 352e9], "float64": [85e9, 39e9]}, "mem_bandwidth": [9.2e9, 11.9e9],
                     "spmm_bandwidth": [26.2e9, 28.6e9], "edge_rate": [1.17e9, 2.28e9]},
           "spmm_curve": [{"working_set": 2**k, "bandwidth": [1e9, 2e9], "edge_rate": [1e9, 2e9]} for k in range(200)],
           "op_overhead": {"seconds": 3.1e-6},
           "collectives": {"backend": "gloo", "world_size": 2, "latency": 219e-6, "bandwidth": 1.28e9}}
    cluster = dataclasses.replace(Cluster.parse("1xcpu"), calibration=cal)
    if path is not None:
        cluster.save(path)
    return cluster


def test_calibrate_prints_a_summary_and_the_record_only_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: Any) -> None:
    """``gnncompile calibrate`` printed its whole ~660-line record."""
    monkeypatch.setattr("gnncompile.calibration.calibrate", _calibrated)
    profile = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--out", str(profile)]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) < 10 and "{" not in out
    assert "GEMM float32 183 / 352 GFLOP/s" in out and "memory 9.2 / 11.9 GB/s" in out
    assert "latency 219 us, bandwidth 1.28 GB/s" in out and "per op 3.1 us" in out
    assert lines[-1].startswith(f"profile written to {profile}")
    assert len(json.loads(profile.read_text())["calibration"]["spmm_curve"]) == 200
    assert cli.main(["calibrate", "--quick", "--out", str(profile), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["spmm_curve"]) == 200 and "GEMM float32" in err
    assert cli.main(["calibrate", "--quick", "--out", str(profile), "--json", str(tmp_path / "cal.json")]) == 0
    assert json.loads((tmp_path / "cal.json").read_text())["host"] == "box"


def test_usage_errors_of_a_command_print_its_usage(capsys: Any) -> None:
    """An unknown flag and ``--resume`` without ``--checkpoint-dir`` printed the top-level usage."""
    for argv, says in ((["plan", "--quiet"], "unrecognized arguments: --quiet"),
                       (["train", "--resume"], "--resume needs --checkpoint-dir")):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"usage: gnncompile {argv[0]} " in err and f"gnncompile {argv[0]}: error: {says}" in err


def test_resuming_a_run_that_had_ended_says_nothing_was_trained(tmp_path: Path, capsys: Any) -> None:
    """It printed a measured table of zeros beside the predictions, and a step time."""
    argv = ["run", "--dataset", "sbm", "--num-nodes", "60", "--gpus", "2", "--epochs", "2", "--quiet",
            "--checkpoint-dir", str(tmp_path / "ck")]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "no epoch trained in this run: its checkpoint holds 2 epochs" in out
    assert "one training step (measured)" not in out and "step time: predicted" not in out


def test_calibrate_prints_the_warnings_of_a_busy_host() -> None:
    """The record's plausibility warnings (a busy host) end the summary, with what to do."""
    cal = _calibrated().calibration | {"warnings": ["push_factor 0.43 < 1: scattering measured faster"]}
    lines = cli._cpu_calibration_summary(cal)
    assert lines[-2:] == ["warning: push_factor 0.43 < 1: scattering measured faster",
                          "  (the host was likely busy while measuring: calibrate again when it is quiet)"]
    assert not any("warning" in line for line in cli._cpu_calibration_summary(_calibrated().calibration))


# --------------------------------------------------------------------------- run table
def test_run_table_vertices_of_ranks_holding_the_whole_graph() -> None:
    """mop's sparse ranks (and most of task's) showed 0 vertices: they score none (the runtime's
    ``num_owned``) though they hold every vertex."""
    from types import SimpleNamespace

    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), g, gpus=4, strategy="mop", chunks=2)
    sparse = [dp.rank for dp in p.ranks if dp.sizes.all_nodes]
    assert sparse and len(sparse) < 4
    for dp in p.ranks:
        owned = 0 if dp.rank in sparse else dp.sizes.nodes
        shown = cli._vertices_held(p, SimpleNamespace(rank=dp.rank, num_owned=owned))
        assert shown == (300 if dp.rank in sparse else dp.sizes.nodes) and shown > 0


def test_run_table_of_a_sampled_plan_shows_steps_not_epochs(capsys: Any) -> None:
    """A sampled plan's "step time" column and line showed the whole epoch's time (23 steps of it
    against a per-step prediction), and its halo rows 0 though each step exchanges rows."""
    assert cli.main(["run", *SMALL, "--gpus", "2", "--strategy", "split", "--batch-size", "40", "--fanouts", "3,3",
                     "--epochs", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    steps = -(-int(gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3,
                                         seed=1).train_mask.sum()) // 40)
    assert steps > 1 and f"step time (epoch / {steps})" in out.replace("\n", " ").replace("│", " ")


def test_fanouts_in_library_errors_are_named_by_their_flag() -> None:
    """A wrong count of --fanouts was reported as 'fanouts has 1 entries' (--eval-fanouts by its flag)."""
    parser = cli.build_parser()
    flags = cli._keyword_flags(cli._command_parser(parser, "run"), "run")
    msg = "split[batch_size=32, fanouts=(5,)] x2: cannot lower: fanouts has 1 entries but GraphSAGE has 2 GNN layers"
    assert cli._flag_spelling(msg, flags) == ("split[batch_size=32, fanouts=(5,)] x2: cannot lower: --fanouts has 1 "
                                              "entries but GraphSAGE has 2 GNN layers")


def test_version(capsys: Any) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"gnncompile {version('gnncompile')}\n"
    assert version("gnncompile") == gc.__version__


def test_warnings_print_as_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """`gnncompile datasets` with an unreadable file printed Python's warning form: the library's
    file and line, the category and the source line that warned (``infos = datasets.list()``)."""
    (tmp_path / "broken.npz").write_bytes(b"hello\n")
    monkeypatch.setenv("GNNCOMPILE_DATA", str(tmp_path))
    with warnings.catch_warnings():   # (still a warning: filters and -W apply)
        warnings.simplefilter("always")
        assert cli.main(["datasets"]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "broken" in ln)
    assert line.startswith("gnncompile: warning: datasets: skipped 'broken', not a readable graph"), err
    assert "UserWarning" not in err and "datasets.py" not in err and "infos =" not in err, err


def test_synthetic_kinds_are_accepted_in_any_case_and_listed_for_unknown_datasets(nothing_runs: None,
                                                                                   capsys: Any) -> None:
    """--dataset SBM said "unknown dataset 'SBM'" and the list of names never mentioned the kinds."""
    args = cli.build_parser().parse_args(["train", "--dataset", "SBM", "--num-nodes", "40"])
    cli._check_combinations(pytest.fail, args)
    assert args.dataset == "sbm" and cli._load_graph(args).num_nodes == 40
    assert cli.main(["train", "--dataset", "no_such_dataset", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "unknown dataset 'no_such_dataset'" in err and "synthetic graphs (built in, any case): sbm, rmat, er" in err


def test_an_empty_dataset_name_is_refused(nothing_runs: None, capsys: Any) -> None:
    """--dataset "" loaded the current directory."""
    assert cli.main(["train", "--dataset", "", "--epochs", "1"]) == 1
    assert "name_or_path: is empty" in capsys.readouterr().err
