"""The single-device reference trainer and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import gnncompile as gc
from gnncompile import cli


def _small_graph() -> gc.Graph:
    return gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=6, num_features=12, num_classes=3, seed=1)


def test_history_fields_and_lengths() -> None:
    g = _small_graph()
    torch.manual_seed(0)
    hist = gc.train(gc.nn.GCN(g.num_features, 16, g.num_classes), g, epochs=7, verbose=False)
    for field in ("loss", "train_acc", "val_acc", "test_acc", "epoch_time", "eval_time"):
        assert len(getattr(hist, field)) == 7, field
    assert all(t > 0 for t in hist.epoch_time)
    assert 0 <= hist.best_epoch < 7
    assert hist.test_acc_at_best_val == hist.test_acc[hist.best_epoch]
    assert hist.loss[-1] < hist.loss[0]


def test_training_is_deterministic_under_a_seed() -> None:
    g = _small_graph()
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        model = gc.nn.GAT(g.num_features, 4, g.num_classes, heads=2)
        runs.append(gc.train(model, g, epochs=5, seed=11, verbose=False))
    assert runs[0].loss == runs[1].loss
    assert runs[0].val_acc == runs[1].val_acc


def test_eval_every_fills_nan_between_evaluations() -> None:
    g = _small_graph()
    hist = gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=5, eval_every=2, verbose=False)
    assert math.isnan(hist.val_acc[0]) and not math.isnan(hist.val_acc[1]) and not math.isnan(hist.val_acc[4])


@pytest.mark.parametrize("field", ["x", "y", "train_mask"])
def test_training_needs_features_labels_and_train_mask(field: str) -> None:
    g = _small_graph()
    bad = g.replace(**{field: None}) if field != "train_mask" else g.replace(train_mask=torch.zeros(g.num_nodes, dtype=torch.bool))
    with pytest.raises(gc.GraphError, match=field):
        gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), bad, epochs=1, verbose=False)


def test_bad_arguments() -> None:
    g = _small_graph()
    with pytest.raises(ValueError, match="epochs"):
        gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=-1)
    with pytest.raises(ValueError, match="eval_every"):
        gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=1, eval_every=0)


def test_sparse_features_train() -> None:
    g = _small_graph()
    gs = g.replace(x=g.x.to_sparse_csr())
    torch.manual_seed(0)
    h_dense = gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes, dropout=0.0), g, epochs=3, verbose=False)
    torch.manual_seed(0)
    h_sparse = gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes, dropout=0.0), gs, epochs=3, verbose=False)
    assert h_dense.loss == pytest.approx(h_sparse.loss, rel=1e-5)


def test_gcn_on_cora_reaches_079() -> None:
    """Integration: the standard GCN recipe on Cora's Planetoid split (Kipf & Welling 2017)."""
    try:
        g = gc.datasets.load("cora")
    except gc.DatasetError as exc:
        pytest.skip(f"Cora not available: {exc}")
    g = g.normalize_features()
    torch.manual_seed(0)
    model = gc.nn.GCN(g.num_features, 16, g.num_classes, dropout=0.5)
    hist = gc.train(model, g, epochs=200, lr=0.01, weight_decay=5e-4, seed=0, verbose=False)
    assert hist.test_acc_at_best_val >= 0.79, hist.test_acc_at_best_val


# --------------------------------------------------------------------------- CLI
def test_cli_train_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "hist.json"
    rc = cli.main(["train", "--dataset", "sbm", "--num-nodes", "400", "--num-features", "8", "--num-classes", "3",
                   "--epochs", "3", "--hidden", "8", "--quiet", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["loss"]) == 3 and data["model"] == "gcn"
    assert "test acc" in capsys.readouterr().out


def test_cli_errors_are_one_line_and_nonzero(capsys) -> None:
    rc = cli.main(["train", "--dataset", "no-such-dataset", "--epochs", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("gnncompile: error: unknown dataset 'no-such-dataset'")
    assert err.count("\n") == 1


def test_cli_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--model", "not-a-model"])
    assert exc.value.code == 2


def test_cli_help_and_datasets_via_module() -> None:
    for args in (["--help"], ["train", "--help"], ["datasets", "--help"]):
        r = subprocess.run([sys.executable, "-m", "gnncompile", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage:" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gnncompile", "datasets", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    assert isinstance(json.loads(r.stdout), list)


@pytest.mark.parametrize("kwargs, what", [(dict(lr=-1.0), "lr"), (dict(lr=float("nan")), "lr"),
                                          (dict(epochs=-1), "epochs"), (dict(epochs=2.5), "epochs"),
                                          (dict(weight_decay=-1e-4), "weight_decay"),
                                          # seeds gc.plan refuses: past int64 they overflowed in a rank
                                          (dict(seed=2**64), r"seed must be None or an int in \[0, 2\^63\)"),
                                          (dict(seed=-1), "seed"), (dict(seed=True), "seed")])
def test_bad_training_arguments_are_refused_before_any_work(kwargs: dict, what: str, monkeypatch) -> None:
    g = _small_graph()
    model = gc.nn.GCN(g.num_features, 8, g.num_classes)
    with pytest.raises(gc.ArgumentError, match=what):   # (a ValueError too)
        gc.train(model, g, **{"epochs": 1, **kwargs})
    plan = gc.plan(model, g, gpus=2, strategy="data", partitioner="contiguous")
    from gnncompile.runtime import executor

    def no_launch(*args, **kw):  # the check must come before any rank starts
        raise AssertionError("ranks were started")

    monkeypatch.setattr(executor, "launch", no_launch)
    with pytest.raises(gc.ArgumentError, match=what):
        plan.run(**{"epochs": 1, **kwargs})


def test_plan_seeds_are_ints_below_2_63_and_metis_takes_any_of_them() -> None:
    """pymetis takes a C int: seed=2**40 raised its raw TypeError; past 2^63 the options refuse."""
    g = _small_graph()
    model = gc.nn.GCN(g.num_features, 8, g.num_classes)
    with pytest.raises(gc.PlanningError, match=r"seed.*an integer in \[0, 2\^63\).*got 18446744073709551616"):
        gc.plan(model, g, gpus=2, strategy="data", partitioner="metis", seed=2**64)
    far = gc.plan(model, g, gpus=2, strategy="data", partitioner="metis", seed=2**40 + 5)
    near = gc.plan(model, g, gpus=2, strategy="data", partitioner="metis", seed=5)
    assert far.info["partition"] == near.info["partition"] and far.info["owned_rows"] == near.info["owned_rows"]


@pytest.mark.parametrize("field", ["y", "train_mask"])
def test_plan_run_needs_labels_and_training_vertices(field: str, monkeypatch) -> None:
    """As gc.train does, before any rank starts (a plan's loss was 0 on a graph without them)."""
    g = _small_graph()
    bad = g.replace(y=None) if field == "y" else g.replace(train_mask=torch.zeros(g.num_nodes, dtype=torch.bool))
    plan = gc.plan(gc.nn.GCN(g.num_features, 8, 3), bad, gpus=2, strategy="data", partitioner="contiguous")
    from gnncompile.runtime import executor

    def no_launch(*args, **kw):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(executor, "launch", no_launch)
    with pytest.raises(gc.GraphError, match=rf"^{field}: the graph this plan was made for has no"):
        plan.run(epochs=1)


def test_a_model_with_fewer_outputs_than_classes_is_refused() -> None:
    g = _small_graph()  # 3 classes
    narrow = gc.nn.GCN(g.num_features, 8, 2)
    with pytest.raises(gc.ArgumentError, match=r"GCN returned \[300, 2\] on 'sbm-300'; training needs logits "
                                               r"\[300, >= 3\]"):
        gc.train(narrow, g, epochs=1, verbose=False)
    with pytest.raises(gc.ArgumentError, match=r"GCN's output has 2 column\(s\), one logit per class, but 'sbm-300' "
                                               r"has 3 classes"):
        gc.plan(narrow, g, gpus=2)
    wide = gc.nn.GCN(g.num_features, 8, 5)   # extra logits are allowed (never the argmax of a trained model)
    assert len(gc.train(wide, g, epochs=1, verbose=False).loss) == 1
    assert gc.plan(wide, g, gpus=2, strategy="data").program is not None


def test_a_model_built_for_another_input_width_is_refused_naming_both_widths() -> None:
    """gc.train's first forward names the model, the graph and the widths (it was torch's bare
    "mat1 and mat2 shapes cannot be multiplied"); the model's own exception is the cause."""
    g = _small_graph()
    model = gc.nn.GCN(g.num_features + 3, 8, 3)
    with pytest.raises(gc.ArgumentError, match=rf"^model: GCN\(g, x\) failed on 'sbm-300' \(300 vertices, .*x "
                                               rf"\[300, {g.num_features}\].*mat1 and mat2.*the graph has "
                                               rf"{g.num_features} features but the model's linear layers take "
                                               rf"\[8, {g.num_features + 3}\]") as info:
        gc.train(model, g, epochs=1, verbose=False)
    assert isinstance(info.value.__cause__, RuntimeError)

    class Broken(torch.nn.Module):  # any other failure of the first forward: named, no width hint
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(g.num_features, 3)

        def forward(self, g, x):
            raise ZeroDivisionError("the model's own bug")

    with pytest.raises(gc.ArgumentError, match=r"Broken\(g, x\) failed on 'sbm-300' .*ZeroDivisionError: the "
                                               r"model's own bug$"):
        gc.train(Broken(), g, epochs=1, verbose=False)


def test_a_model_without_parameters_and_a_non_floating_dtype_are_refused_up_front() -> None:
    """They failed inside torch (the optimizer's "empty parameter list", Module.to's TypeError)."""
    g = _small_graph()

    class Propagate(torch.nn.Module):
        def forward(self, g, x):
            return gc.ops.propagate(g, x, norm="gcn")

    with pytest.raises(gc.ArgumentError, match=r"^model: Propagate has no trainable parameters"):
        gc.train(Propagate(), g, epochs=1, verbose=False)
    frozen = gc.nn.GCN(g.num_features, 8, g.num_classes).requires_grad_(False)
    with pytest.raises(gc.ArgumentError, match=r"^model: GCN has no trainable parameters"):
        gc.train(frozen, g, epochs=1, verbose=False)
    for dtype in (torch.int32, torch.bool, "float32"):
        with pytest.raises(gc.ArgumentError, match=rf"^dtype must be a floating torch\.dtype .*got {dtype!r}"):
            gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=1, dtype=dtype, verbose=False)
    assert len(gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=1, dtype=torch.float64,
                        verbose=False).loss) == 1


def test_a_dtype_the_kernels_cannot_compute_in_is_refused_naming_the_supported_ones() -> None:
    """float16 failed inside the first forward on the CPU, blamed on the model ("GCN(g, x) failed
    ... gnncompile_spmm not implemented for 'Half'"); a device that is none raised torch's
    RuntimeError."""
    g = _small_graph()
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(gc.ArgumentError, match=rf"^dtype must be .*CPU kernels .*torch\.float32 or torch\.float64"
                                                   rf".*got {dtype!r}"):
            gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=1, dtype=dtype, verbose=False)
    with pytest.raises(gc.ArgumentError, match=r"^device must be a torch.device or its name .*got 'gpu'"):
        gc.train(gc.nn.GCN(g.num_features, 8, g.num_classes), g, epochs=1, device="gpu", verbose=False)
