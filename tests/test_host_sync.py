"""Host synchronizations (issue 17, item 3): the detector of :mod:`gnncompile.testing`, and the
steady-state training step of :func:`gnncompile.train` and of each strategy's plan on its ranks.

A host synchronization makes the CPU wait for the GPU (a scalar read, an output sized by values,
a device -> host copy); on a small graph each one stalls a step. The detector sees them on the CPU
(:func:`gnncompile.testing.count_host_syncs`), so these tests run everywhere. The audits run the
``torch`` kernel backend, the one a GPU runs: the ``native`` backend runs only on the CPU (its C++
kernels read their sizes as scalars, which is no device synchronization there).

What a step may still do is listed in :data:`KERNEL_ALLOWANCES`, each with its reason; an epoch's
metrics (the loss and the evaluation, read on the host for the history) make one read per epoch.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import sys
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

import gnncompile as gc
from gnncompile import kernels
from gnncompile.runtime.trainer import adam, evaluate
from gnncompile.runtime.probe import PHASES, probe, probing
from gnncompile.testing import (HostSyncError, HostSyncs, count_host_syncs, forbid_host_syncs, plan_host_syncs,
                                train_host_syncs)

#: What a step may do that a GPU would not see: dropout_mask's native CPU kernel takes the rows
#: on the host (rows.to("cpu")), the CPU path only (a GPU draws masks with torch operations where
#: the rows are).
KERNEL_ALLOWANCES = (
    "Tensor.to('cpu')* at gnncompile/kernels/dropout.py:* in dropout_mask",
)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def _matches(sync: object, pattern: str) -> bool:
    return fnmatch.fnmatchcase(str(sync), pattern)


def _not_allowed(syncs: HostSyncs, allow: tuple[str, ...]) -> HostSyncs:
    return HostSyncs(s for s in syncs if not any(_matches(s, p) for p in allow))


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ``torch`` kernel backend (CUDA's default) in this process and in launched ranks."""
    monkeypatch.setenv("GNNCOMPILE_BACKEND", "torch")
    before = kernels._default_override
    kernels.set_default_backend("torch")
    yield
    kernels.set_default_backend(before)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=3, seed=1)


# --------------------------------------------------------------------------- the detector
def _ops(syncs: HostSyncs) -> list[str]:
    return [s.op.split(":")[0] for s in syncs]


def test_scalar_reads_are_caught_where_they_are_made() -> None:
    t = torch.arange(5.0)
    with count_host_syncs() as syncs:
        t.sum().item()
        line = _line()
        bool(t.sum())
        int(t[0])
        float(t[1])
        if t[2]:
            pass
        torch.allclose(t, t)
    ops = _ops(syncs)
    assert ops.count("aten._local_scalar_dense") == 5, syncs.report()
    assert "aten.allclose" in ops
    where = f"tests/test_host_sync.py:{line - 1} in test_scalar_reads_are_caught_where_they_are_made"
    assert syncs[0].where == where, syncs[0]


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def test_value_sized_outputs_are_caught() -> None:
    t = torch.arange(6.0, requires_grad=True)
    mask = t.detach() > 2
    repeats = torch.tensor([1, 2])
    with count_host_syncs() as syncs:
        mask.nonzero()
        torch.where(mask)
        t[mask].sum().backward()  # the mask's rows, in the forward and again in the backward
        u = t.detach().clone()
        u[mask] = torch.ones(3)
        torch.masked_select(t.detach(), mask)
        torch.unique(t.detach())
        torch.repeat_interleave(repeats)
        torch.equal(t, t)
    ops = _ops(syncs)
    assert ops.count("aten.nonzero") == 2, syncs.report()
    assert ops.count("aten.index with a boolean mask (t[mask]; output size from the mask)") == 1, syncs.report()
    assert ops.count("aten.index_put with a boolean mask (t[mask] = v; nonzero of the mask)") == 2, syncs.report()
    for op in ("aten.masked_select", "aten._unique2", "aten.repeat_interleave without output_size (output size from "
               "the repeats)", "aten.equal"):
        assert op in ops, (op, syncs.report())


def test_host_copies_are_caught() -> None:
    """Device -> host copies; host -> device copies of host tensors (to the run's device, named by a
    ``torch.device``, which on a CPU run is the CPU), blocking unless ``non_blocking``."""
    t = torch.arange(3.0)
    with count_host_syncs() as syncs:
        t.cpu()
        t.tolist()
        t.to("cpu")
        t.to("cpu", torch.float64)
        t.to(torch.device("cpu"))  # the run's device: t is there already
        torch.tensor(2.0).to(t.device)  # a host scalar to the run's device
        torch.tensor(2.0).to(t.device, non_blocking=True)
        torch.tensor([1.0], device=t.device)  # made on the host, then copied
        torch.tensor(2.0).to("cpu")  # stays on the host
    assert _ops(syncs) == ["Tensor.cpu", "Tensor.tolist", "Tensor.to('cpu')", "Tensor.to('cpu')",
                           "Tensor.to(device) of a host tensor", "torch.tensor(data, device=)"], syncs.report()


def test_what_does_not_synchronize_is_not_recorded() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters(), lr=0.01, fused=True)
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    rows = torch.tensor([0, 2, 5])
    with count_host_syncs() as syncs:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            out = lin(x)
            loss = F.cross_entropy(out.index_select(0, rows), y.index_select(0, rows))
            loss.backward()
            opt.step()
        t = x.clone()
        t[x > 0] = 0.0  # a scalar fill: torch runs masked_fill_
        torch.repeat_interleave(x[:2], torch.tensor([1, 2]), dim=0, output_size=3)
        x.to(torch.float64)
        (x.argmax(-1) == y).sum()
    assert not syncs, syncs.report()


def test_host_tensors_are_not_device_synchronizations() -> None:
    """Tensors the block makes on the host (a factory given no device, ``.cpu()`` of a device tensor)
    and what is computed from them alone stay on the host in a GPU run: reading them waits for nothing."""
    t = torch.arange(4.0)
    with count_host_syncs() as syncs:
        int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))  # a seed from the CPU generator
        torch.arange(3).sum().item()
        torch.tensor([1, 2]).tolist()
    assert not syncs, syncs.report()
    with count_host_syncs() as syncs:
        torch.zeros(2, device="cpu").sum().item()  # a device named: a stand-in for the run's device
        torch.zeros_like(t).sum().item()
    assert _ops(syncs) == ["aten._local_scalar_dense"] * 2, syncs.report()


def test_forbid_host_syncs_raises_for_what_is_not_allowed() -> None:
    t = torch.arange(3.0)
    with pytest.raises(HostSyncError, match="1 host synchronization") as err:
        with forbid_host_syncs(allow=["Tensor.tolist*"]) as syncs:
            t.tolist()
            t.sum().item()
    assert len(syncs) == 2 and len(err.value.syncs) == 1
    assert "test_host_sync.py" in str(err.value)
    with forbid_host_syncs(allow=["aten._local_scalar_dense* in test_forbid_host_syncs_raises_*"]):
        t.sum().item()


def test_probe_is_a_no_op_unless_installed() -> None:
    seen = []

    def recorder(phase: str, epoch: int):
        seen.append((phase, epoch))
        return count_host_syncs()

    with probe("step", 0):
        pass
    with probing(recorder):
        with probe("metrics", 3):
            pass
    with probe("step", 1):
        pass
    assert seen == [("metrics", 3)] and PHASES == ("step", "metrics")


# --------------------------------------------------------------------------- gc.train
TRAIN_MODELS = {
    "gcn": lambda g: gc.nn.GCN(g.num_features, 8, g.num_classes, num_layers=2, dropout=0.5),
    "gat": lambda g: gc.nn.GAT(g.num_features, 4, g.num_classes, num_layers=2, heads=2, dropout=0.4),
    "sage": lambda g: gc.nn.GraphSAGE(g.num_features, 8, g.num_classes, num_layers=2),
    "gin": lambda g: gc.nn.GIN(g.num_features, 8, g.num_classes, num_layers=2),
    "gcnii": lambda g: gc.nn.GCNII(g.num_features, 8, g.num_classes, num_layers=3),
}


@pytest.mark.parametrize("name", sorted(TRAIN_MODELS))
def test_train_steady_step_has_no_host_sync(sbm: gc.Graph, name: str, torch_backend: None) -> None:
    torch.manual_seed(0)
    syncs = train_host_syncs(TRAIN_MODELS[name](sbm), sbm, epochs=3, first=1)
    assert not syncs["step"], syncs["step"].report()
    # the metrics of each of the two epochs: one read of the loss with the evaluation
    assert [s.op for s in syncs["metrics"]] == ["Tensor.tolist: device -> host copy"] * 2, syncs["metrics"].report()
    assert all(" in train" in s.where and "runtime/trainer.py" in s.where for s in syncs["metrics"])


def test_train_without_evaluation_reads_only_the_loss(sbm: gc.Graph, torch_backend: None) -> None:
    torch.manual_seed(0)
    syncs = train_host_syncs(TRAIN_MODELS["gcn"](sbm), sbm, epochs=4, first=1, eval_every=5)
    assert not syncs["step"], syncs["step"].report()
    ops = [s.op.split(":")[0] for s in syncs["metrics"]]
    assert ops == ["aten._local_scalar_dense", "aten._local_scalar_dense", "Tensor.tolist"], syncs["metrics"].report()


def test_train_history_is_the_reference_loop(sbm: gc.Graph) -> None:
    """The loss and accuracies gc.train reports are those of the plain loop (boolean masks, a read
    per step): the rows by index and the deferred reads change no number."""
    torch.manual_seed(0)
    model = gc.nn.GCN(sbm.num_features, 8, sbm.num_classes, num_layers=2, dropout=0.0).double()
    ref = _plain_loop(model, sbm.replace(x=sbm.x.double()), epochs=3)
    hist = gc.train(model, sbm, epochs=3, verbose=False)
    assert hist.loss == ref["loss"]
    for k in ("train_acc", "val_acc", "test_acc"):
        assert getattr(hist, k) == ref[k]
    assert evaluate(model, sbm, sbm.x.double()) == _plain_evaluate(model, sbm, sbm.x.double())


def _plain_evaluate(model: torch.nn.Module, g: gc.Graph, x: torch.Tensor) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        logits = model(g, x)
    model.train()
    out = {}
    for k in ("train", "val", "test"):
        mask = getattr(g, f"{k}_mask")
        n = int(mask.sum())
        out[f"{k}_acc"] = float((logits[mask].argmax(-1) == g.y[mask]).sum()) / n if n else math.nan
    out["loss"] = float(F.cross_entropy(logits[g.train_mask], g.y[g.train_mask]))
    return out


def _plain_loop(model: torch.nn.Module, g: gc.Graph, epochs: int) -> dict[str, list[float]]:
    """gc.train's loop as it was: boolean masks, the loss read after each step (a copy of ``model``)."""
    model = copy.deepcopy(model)
    torch.manual_seed(0)
    opt = adam(model.parameters(), 0.01, 5e-4)
    out: dict[str, list[float]] = {"loss": [], "train_acc": [], "val_acc": [], "test_acc": []}
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        logits = model(g, g.x)
        loss = F.cross_entropy(logits[g.train_mask], g.y[g.train_mask])
        loss.backward()
        opt.step()
        out["loss"].append(float(loss.detach()))
        acc = _plain_evaluate(model, g, g.x)
        for k in ("train_acc", "val_acc", "test_acc"):
            out[k].append(acc[k])
    return out


# --------------------------------------------------------------------------- plans on their ranks
PLANS = {
    "data": dict(strategy="data"),
    "tensor": dict(strategy="tensor"),
    "task": dict(strategy="task", chunks=2),
    "layer": dict(strategy="layer"),
}


@pytest.mark.parametrize("strategy", sorted(PLANS))
def test_plan_steady_step_has_no_host_sync(sbm: gc.Graph, strategy: str, torch_backend: None) -> None:
    torch.manual_seed(0)
    model = gc.nn.GCN(sbm.num_features, 8, sbm.num_classes, num_layers=2, dropout=0.5)
    plan = gc.plan(model, sbm, gpus=2, **PLANS[strategy])
    ranks = plan_host_syncs(plan, epochs=3, first=1, device="cpu", timeout=60)
    assert len(ranks) == 2
    for r, syncs in enumerate(ranks):
        bad = _not_allowed(syncs["step"], KERNEL_ALLOWANCES)
        assert not bad, f"rank {r}:\n{bad.report()}"
        _check_plan_metrics(syncs["metrics"], epochs=2, rank=r)


def _check_plan_metrics(syncs: HostSyncs, epochs: int, rank: int) -> None:
    """One read per epoch (the reduced loss and accuracies), plus the best parameters' copy to the
    host when the validation accuracy improved (after that read: the device has nothing queued)."""
    reads = [s for s in syncs if s.op.startswith("Tensor.tolist") and s.where.startswith(
        "gnncompile/runtime/executor.py:") and s.where.endswith(" in execute_rank")]
    best = [s for s in syncs if s.op.startswith("Tensor.cpu") and s.where.endswith(" in execute_rank")]
    assert len(reads) == epochs and len(reads) + len(best) == len(syncs), f"rank {rank}:\n{syncs.report()}"


def test_gat_plan_steady_step_has_no_host_sync(sbm: gc.Graph, torch_backend: None) -> None:
    """Edge ops (attention, edge softmax, multi-head products) and halo exchanges: none reads the device."""
    torch.manual_seed(0)
    model = gc.nn.GAT(sbm.num_features, 4, sbm.num_classes, num_layers=2, heads=2, dropout=0.0)
    ranks = plan_host_syncs(gc.plan(model, sbm, gpus=2, strategy="data"), epochs=2, first=1, device="cpu", timeout=60)
    for r, syncs in enumerate(ranks):
        assert not syncs["step"], f"rank {r}:\n{syncs['step'].report()}"


# --------------------------------------------------------------------------- the same on a GPU
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("name", ["gcn", "gat"])
def test_train_steady_step_has_no_host_sync_on_cuda(sbm: gc.Graph, name: str) -> None:
    """On a GPU the detector also sees the copies between host and device that ATen makes."""
    torch.manual_seed(0)
    syncs = train_host_syncs(TRAIN_MODELS[name](sbm), sbm, epochs=3, first=1, device="cuda")
    bad = _not_allowed(syncs["step"], KERNEL_ALLOWANCES)
    assert not bad, bad.report()
    in_train = [s.where.startswith("gnncompile/runtime/trainer.py:") and s.where.endswith(" in train")
                for s in syncs["metrics"]]
    assert in_train and all(in_train), syncs["metrics"].report()


@pytest.mark.gpu
@CUDA
def test_plan_steady_step_has_no_host_sync_on_cuda(sbm: gc.Graph) -> None:
    """Two ranks sharing the GPU talk through gloo, which stages their transfers through host memory
    (:mod:`gnncompile.runtime.comm`): those copies are the backend's (none under NCCL, a GPU per rank)."""
    torch.manual_seed(0)
    model = gc.nn.GCN(sbm.num_features, 8, sbm.num_classes, num_layers=2, dropout=0.5)
    ranks = plan_host_syncs(gc.plan(model, sbm, gpus=2, strategy="data"), epochs=3, first=1, device="cuda",
                            timeout=120)
    for r, syncs in enumerate(ranks):
        bad = HostSyncs(s for s in _not_allowed(syncs["step"], KERNEL_ALLOWANCES)
                        if not s.where.startswith("gnncompile/runtime/comm.py:"))
        assert not bad, f"rank {r}:\n{bad.report()}"
