"""Training and eval mode survive tracing (issue 18, item 1).

``gc.trace(model, g)`` traces the forward in both modes; the TPGraph it returns runs the training
behaviour in training mode and the eval behaviour in eval mode whatever mode the model was traced in,
and tracing never changes the model's modes. Covered idioms: ``F.dropout(x, p, self.training)``,
``training=self.training``, ``nn.Dropout``, attention dropout on ``[E, H]`` edge values,
``if self.training:`` branches, BatchNorm (module and functional) with running statistics in eval.

1. Property tests: traced == eager in eval mode and, with the same seed (the same dropout masks,
   ``p > 0``), in training mode; modes untouched.
2. The issue's reproduction (a residual dropout model traced in eval; the PyG GAT with batch norm
   is in tests/test_from_pyg.py).
3. The mode contract: specialized graphs refuse the other mode; passes transform both graphs or say
   why not; the verifier checks the eval graph; what cannot be represented is a TraceError.
4. A ``data`` plan's evaluation equals ``gc.train``'s (2 ranks).
"""

from __future__ import annotations

import copy
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gnncompile as gc
from gnncompile import ops
from gnncompile.errors import PassError, TraceError, VerificationError
from gnncompile.ir.verify import verify
from gnncompile.passes.fuse_masked_propagate import fuse_masked_propagate
from gnncompile.passes.infra import PassManager
from gnncompile.passes.recompute import insert_recomputation
from gnncompile.testing import check_trace
from graph_strategies import DT, labelled, small_graphs

F_IN, HID, C = 5, 6, 3
HERE = os.path.basename(__file__)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only add waits


# =========================================================================== the idioms
class PositionalDropout(nn.Module):
    """The issue's model: ``h + F.dropout(relu(propagate(lin(norm(h)))), p, self.training)``."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.p = p
        self.enc, self.lin, self.norm = nn.Linear(F_IN, HID), nn.Linear(HID, HID), nn.LayerNorm(HID)
        self.out = nn.Linear(HID, C)

    def forward(self, g, x):
        h = self.enc(x)
        h = h + F.dropout(F.relu(ops.propagate(g, self.lin(self.norm(h)), norm="mean")), self.p, self.training)
        return self.out(h)


class KeywordDropout(nn.Module):
    """``F.dropout(x, p=p, training=self.training)`` before every layer (PyG's GCN example)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.lin1, self.lin2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)

    def forward(self, g, x):
        x = F.dropout(x, p=self.p, training=self.training)
        x = F.relu(ops.propagate(g, self.lin1(x), "gcn", add_self_loops=True))
        x = F.dropout(x, p=self.p, training=self.training)
        return ops.propagate(g, self.lin2(x), "gcn", add_self_loops=True)


class ModuleDropout(nn.Module):
    """``nn.Dropout`` modules (they read their own mode)."""

    def __init__(self, p: float = 0.4) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)
        self.lin1, self.lin2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)

    def forward(self, g, x):
        h = self.drop(F.relu(ops.propagate(g, self.lin1(x), "mean")))
        return self.lin2(h)


class EdgeDropout(nn.Module):
    """Attention written with primitives, dropout on the ``[E, H]`` coefficients."""

    def __init__(self, p: float = 0.5, heads: int = 2) -> None:
        super().__init__()
        self.p, self.heads = p, heads
        self.lin = nn.Linear(F_IN, heads * HID)
        self.att_src = nn.Parameter(torch.randn(1, heads, HID) * 0.3)
        self.att_dst = nn.Parameter(torch.randn(1, heads, HID) * 0.3)
        self.out = nn.Linear(HID, C)

    def forward(self, g, x):
        h = self.lin(x).view(-1, self.heads, HID)
        e = ops.gather_src(g, (h * self.att_src).sum(-1), True) + ops.gather_dst(g, (h * self.att_dst).sum(-1), True)
        alpha = ops.edge_softmax(g, F.leaky_relu(e, 0.2), True)
        alpha = F.dropout(alpha, self.p, self.training)
        out = ops.propagate(g, h, "none", edge_weight=alpha, add_self_loops=True).mean(dim=1)
        return self.out(F.elu(out))


class TrainingBranch(nn.Module):
    """``if self.training:``: extra noise-free regularizing path in training only (structurally
    different graphs), plus dropout."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.lin1, self.lin2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)
        self.aux = nn.Linear(HID, HID)

    def forward(self, g, x):
        h = F.relu(ops.propagate(g, self.lin1(x), "gcn", add_self_loops=True))
        if self.training:
            h = F.dropout(h, self.p, True) + 0.1 * torch.tanh(self.aux(h))
        else:
            h = h * 1.5
        return ops.propagate(g, self.lin2(h), "mean")


def _randomize_running_stats(bn: nn.Module) -> None:
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)


class ModuleBatchNorm(nn.Module):
    """``nn.BatchNorm1d`` between layers: batch statistics in training, running ones in eval."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)
        self.bn = nn.BatchNorm1d(HID)
        _randomize_running_stats(self.bn)
        self.p = p

    def forward(self, g, x):
        h = self.bn(ops.propagate(g, self.lin1(x), "gcn", add_self_loops=True))
        h = F.dropout(F.relu(h), p=self.p, training=self.training)
        return self.lin2(h)


class FunctionalBatchNorm(nn.Module):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, self.training)`` with own buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(F_IN, HID), nn.Linear(HID, C)
        self.weight = nn.Parameter(torch.rand(HID) + 0.5)
        self.bias = nn.Parameter(torch.randn(HID) * 0.1)
        self.register_buffer("running_mean", torch.rand(HID) - 0.5)
        self.register_buffer("running_var", torch.rand(HID) + 0.5)

    def forward(self, g, x):
        h = ops.propagate(g, self.lin1(x), "mean")
        h = F.batch_norm(h, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, 1e-5)
        return self.lin2(F.relu(h))


IDIOMS = {
    "positional": PositionalDropout,
    "keyword": KeywordDropout,
    "module": ModuleDropout,
    "edge": EdgeDropout,
    "branch": TrainingBranch,
    "batchnorm": ModuleBatchNorm,
    "functional_batchnorm": FunctionalBatchNorm,
    "gat_layers": lambda: gc.nn.GAT(F_IN, 3, C, num_layers=2, heads=2, dropout=0.5),  # dropout inside GATConv
}


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return IDIOMS[name]().to(DT)


def modes_of(m: nn.Module) -> dict[str, bool]:
    return {k: s.training for k, s in m.named_modules()}


def run(module: nn.Module, g: gc.Graph, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients for a fixed upstream gradient, RNG seeded with ``seed``."""
    torch.manual_seed(seed)
    with ops.plan_dropout_draws():  # F.dropout draws as dropout_noise does (as gnncompile's training does)
        out = module(g, g.x)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
        params = dict(module.named_parameters())
        grads = torch.autograd.grad(out, list(params.values()), up, allow_unused=True)
    return out.detach(), {k: (torch.zeros_like(p) if gr is None else gr) for (k, p), gr in zip(params.items(), grads)}


def assert_same(tp: nn.Module, model: nn.Module, g: gc.Graph, seed: int, what: str) -> None:
    out_t, gr_t = run(tp, g, seed)
    out_e, gr_e = run(model, g, seed)
    torch.testing.assert_close(out_t, out_e, rtol=0, atol=0, msg=lambda m: f"{what}: output: {m}")
    for k, ge in gr_e.items():
        torch.testing.assert_close(gr_t[k], ge, rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{what}: grad {k}: {m}")


# =========================================================================== 1. properties
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(IDIOMS)), traced_in_eval=st.booleans(),
       seed=st.integers(0, 1000))
def test_traced_equals_eager_in_both_modes(g: gc.Graph, name: str, traced_in_eval: bool, seed: int) -> None:
    model = make(name, seed)
    model.train(not traced_in_eval)
    tp = check_trace(model, g, seed=seed)  # modes untouched; eval, training (same seed), eval again
    assert tp.training == model.training == (not traced_in_eval)


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(sorted(IDIOMS)), mode=st.booleans(), leaf_flip=st.booleans())
def test_tracing_leaves_every_mode_alone(name: str, mode: bool, leaf_flip: bool) -> None:
    """model.training and every submodule's mode are the same before and after; the trace starts
    in them (a leaf module in a mode of its own, such as a frozen BatchNorm, included)."""
    model = make(name)
    model.train(mode)
    if leaf_flip:
        leaves = [m for kind in (nn.BatchNorm1d, nn.Dropout, nn.Linear) for m in model.modules() if isinstance(m, kind)]
        leaves[0].train(not mode)
    before = modes_of(model)
    tp = gc.trace(model, gc.GraphStats(40, 120, F_IN, C))
    assert modes_of(model) == before
    mine = modes_of(tp)
    assert all(mine[k] == v for k, v in before.items() if k in mine)
    tp.train(not mode)
    assert modes_of(model) == before
    if tp.eval_graph is not None:
        assert tp.eval_graph.training is False


def test_frozen_batch_norm_in_a_training_model() -> None:
    """A leaf module in a mode of its own (a frozen BatchNorm while the model trains) is represented:
    the trace starts in those modes and computes what the model computes."""
    g = labelled(gc.Graph.from_edge_index(torch.randint(0, 30, (2, 90), generator=torch.Generator().manual_seed(1)),
                                          30))
    model = make("batchnorm").train()
    model.bn.eval()
    tp = gc.trace(model, g)
    assert tp.training and not tp.get_submodule("bn").training
    assert_same(tp, model, g, 4, "training mode with a frozen BatchNorm")
    assert not model.bn.training


def test_dropout_really_drops_in_training_mode_only() -> None:
    """The training-mode comparison above compares real dropout: masks differ between seeds, and
    eval mode is deterministic."""
    g = labelled(gc.Graph.from_edge_index(torch.randint(0, 30, (2, 90), generator=torch.Generator().manual_seed(0)),
                                          30))
    for name in ("positional", "keyword", "edge", "branch"):
        model = make(name)
        tp = gc.trace(model, g)
        tp.train()
        a, _ = run(tp, g, 1)
        b, _ = run(tp, g, 2)
        assert not torch.equal(a, b), f"{name}: no dropout in training mode"
        tp.eval()
        a, _ = run(tp, g, 1)
        b, _ = run(tp, g, 2)
        assert torch.equal(a, b), f"{name}: randomness in eval mode"


# =========================================================================== 2. the cases
def test_model_traced_in_eval_runs_eval_and_training_behaviour() -> None:
    """Issue 18: a model in eval() traced with gc.trace held training dropout (differed by 1.2)."""
    g = gc.datasets.synthetic("sbm", num_nodes=80, avg_degree=5, num_features=F_IN, num_classes=C, seed=0)
    g = g.replace(x=g.x.to(DT))
    model = make("positional").eval()
    tp = gc.trace(model, g)
    assert not tp.training and not model.training
    assert torch.equal(tp(g, g.x), model(g, g.x))
    text = str(tp)
    assert "eval mode runs tp.eval_graph" in text.splitlines()[0] and "dropout" in text.splitlines()[0]
    # traced after train(), evaluated after eval() (differed by 0.93)
    model.train()
    tp = gc.trace(model, g)
    assert tp.training
    tp.eval(), model.eval()
    assert torch.equal(tp(g, g.x), model(g, g.x))
    # the eval graph holds dropout with training=False; the training graph the active one
    flags = {n.name: n.kwargs.get("training", n.args[2] if len(n.args) > 2 else None)
             for n in tp.graph.nodes if n.target is F.dropout}
    eval_flags = {n.name: n.kwargs.get("training", n.args[2] if len(n.args) > 2 else None)
                  for n in tp.eval_graph.graph.nodes if n.target is F.dropout}
    assert flags == {"dropout": True} and eval_flags == {"dropout": False}


# =========================================================================== 3. the mode contract
def test_specialized_graphs_refuse_the_other_mode() -> None:
    g = labelled(gc.Graph.from_edge_index(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]), 4))
    model = make("keyword")
    tp_train = gc.trace(model, g, training=True)
    tp_eval = gc.trace(model, g, training=False)
    assert tp_train.specialized is True and tp_eval.specialized is False and tp_train.eval_graph is None
    assert "traced for training mode only" in str(tp_train).splitlines()[0]
    tp_train(g, g.x)
    tp_eval(g, g.x)
    tp_train.eval()
    with pytest.raises(TraceError, match=r"traced for training mode only.*called in eval mode"):
        tp_train(g, g.x)
    tp_eval.train()
    with pytest.raises(TraceError, match=r"traced for eval mode only.*called in training mode"):
        tp_eval(g, g.x)
    with pytest.raises(TraceError, match="training must be None"):
        gc.trace(model, g, training="yes")  # type: ignore[arg-type]


def test_one_graph_when_modes_do_not_change_it() -> None:
    """No mode-dependent functional code: one graph (Dropout/BatchNorm modules read their own mode)."""
    tp = gc.trace(make("module"), gc.GraphStats(40, 120, F_IN, C))
    assert tp.eval_graph is None and tp.specialized is None and "eval" not in str(tp).splitlines()[0]
    branch = gc.trace(make("branch"), gc.GraphStats(40, 120, F_IN, C))
    header = str(branch).splitlines()[0]
    assert "a different graph" in header and f"{HERE}:" in header, header
    assert [n.name for n in branch.eval_graph.graph.nodes if n.name.startswith("aux")] == []


def test_passes_transform_both_graphs() -> None:
    g = labelled(gc.Graph.from_edge_index(torch.randint(0, 20, (2, 60), generator=torch.Generator().manual_seed(4)),
                                          20))
    model = gc.nn.GCN(F_IN, HID, C, num_layers=2, dropout=0.5).to(DT)
    tp = gc.trace(model, g)
    fused = PassManager([fuse_masked_propagate, insert_recomputation])(tp)
    assert fused.eval_graph is not None and fused.eval_graph is not tp.eval_graph
    assert any(n.target is ops.masked_propagate for n in fused.graph.nodes)
    recomputed = insert_recomputation(tp, segments=[["relu", "dropout"]])
    for out in (fused, recomputed):
        assert out.training and out.eval_graph.training is False and out.specialized is None
        assert out.mode_note == tp.mode_note
        verify(out)
        for mode in (True, False):
            out.train(mode), model.train(mode)
            assert_same(out, model, g, 5, f"after passes, {'training' if mode else 'eval'} mode")
    assert any(n.name.startswith("recompute") for n in recomputed.graph.nodes)
    assert any(n.name.startswith("recompute") for n in recomputed.eval_graph.graph.nodes)
    # a copy (what passes work on) and a rebinding keep the eval graph, sharing submodules as before
    dup = copy.deepcopy(tp)
    assert dup.eval_graph is not None and dup.eval_graph is not tp.eval_graph
    bound = tp.bind(gc.GraphStats(1000, 5000, F_IN, C))
    assert bound.eval_graph.stats == bound.stats and verify(bound) is bound


class LinearWithInputDropout(nn.Module):
    """``Â (Â (dropout(x) W1)) W2``: linear after the input dropout, so exact decoupling applies."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(F_IN, HID, bias=False), nn.Linear(HID, C, bias=False)

    def forward(self, g, x):
        x = F.dropout(x, 0.5, self.training)
        return ops.propagate(g, self.l2(ops.propagate(g, self.l1(x), "gcn")), "gcn")


class LinearNoDropout(LinearWithInputDropout):
    def forward(self, g, x):
        return ops.propagate(g, self.l2(ops.propagate(g, self.l1(x), "gcn")), "gcn")


def test_a_pass_that_retraces_keeps_the_mode_contract() -> None:
    """decouple re-traces the rewritten graph; the result still follows the mode (both graphs
    decoupled), and a graph without an eval graph is not turned into a specialized one."""
    from gnncompile.passes.decouple import decouple_exact

    g = labelled(gc.Graph.from_edge_index(torch.randint(0, 25, (2, 80), generator=torch.Generator().manual_seed(5)),
                                          25))
    torch.manual_seed(0)
    model = LinearWithInputDropout().to(DT)
    out = decouple_exact(gc.trace(model, g))
    assert out.specialized is None and out.eval_graph is not None and verify(out) is out
    for mode in (True, False):
        out.train(mode), model.train(mode)
        out_t, _ = run(out, g, 3)
        out_e, _ = run(model, g, 3)
        torch.testing.assert_close(out_t, out_e, rtol=1e-10, atol=1e-12)
    plain = decouple_exact(gc.trace(LinearNoDropout().to(DT), g))
    assert plain.specialized is None and plain.eval_graph is None
    plain.eval()
    plain(g, g.x)


def test_pass_that_cannot_apply_to_the_eval_graph_is_refused() -> None:
    tp = gc.trace(make("branch"), gc.GraphStats(40, 120, F_IN, C))
    train_only = next(n.name for n in tp.graph.nodes if n.name.startswith("tanh"))
    with pytest.raises(PassError, match=r"insert_recomputation cannot transform the eval-mode graph.*"
                                        r"no node named 'tanh'.*training=True"):
        insert_recomputation(tp, segments=[[train_only]])
    # the training graph alone can take it
    alone = gc.trace(make("branch"), gc.GraphStats(40, 120, F_IN, C), training=True)
    verify(insert_recomputation(alone, segments=[[train_only]]))


def test_verifier_checks_the_eval_graph() -> None:
    tp = gc.trace(make("keyword"), gc.GraphStats(40, 120, F_IN, C))
    bad = copy.deepcopy(tp)
    node = next(n for n in bad.eval_graph.graph.nodes if n.target is ops.propagate)
    node.meta["tp"] = node.meta["tp"].with_(kind="T")
    with pytest.raises(VerificationError, match=r"eval-mode graph \(tp.eval_graph\).*propagate"):
        verify(bad)
    other = copy.deepcopy(tp)
    other.set_eval_graph(tp.eval_graph.bind(gc.GraphStats(99, 999, F_IN, C)), tp.mode_note)
    with pytest.raises(VerificationError, match="same statistics"):
        verify(other)


class MixedModes(nn.Module):
    """A GAT whose first conv the user put in eval mode while the model trains."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = gc.nn.GATConv(F_IN, HID, heads=2, dropout=0.5)
        self.conv2 = gc.nn.GATConv(2 * HID, C, heads=1, dropout=0.5)

    def forward(self, g, x):
        return self.conv2(g, F.elu(self.conv1(g, x)))


def test_submodule_in_another_mode_is_refused_with_its_line() -> None:
    model = MixedModes().train()
    model.conv1.eval()
    with pytest.raises(TraceError, match=r"conv1 are in eval mode.*layers\.py:\d+.*model\.train\(\) or model\.eval"):
        gc.trace(model, gc.GraphStats(40, 120, F_IN, C))
    assert model.training and not model.conv1.training
    gc.trace(model, gc.GraphStats(40, 120, F_IN, C), training=True)  # one mode explicitly: fine
    model.conv1.train()
    gc.trace(model, gc.GraphStats(40, 120, F_IN, C))


class EvalOnlyUntraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F_IN, C)

    def forward(self, g, x):
        h = ops.propagate(g, self.lin(x), "mean")
        if not self.training:
            if h.sum() > 0:  # data-dependent: only in eval mode
                h = h * 2
        return h


def test_mode_that_cannot_be_traced_names_the_mode_and_line() -> None:
    with pytest.raises(TraceError, match=rf"in eval mode .*{HERE}:\d+.*data-dependent"):
        gc.trace(EvalOnlyUntraceable().train(), gc.GraphStats(40, 120, F_IN, C))
    gc.trace(EvalOnlyUntraceable().train(), gc.GraphStats(40, 120, F_IN, C), training=True)  # training alone


# =========================================================================== 4. plans evaluate like gc.train
class PlanModel(nn.Module):
    """Dropout (positional and keyword), an ``if self.training`` branch and edge dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.aux = nn.Linear(8, 8)

    def forward(self, g, x):
        h = F.dropout(x, 0.3, self.training)
        h = F.relu(ops.propagate(g, self.lin1(h), "gcn", add_self_loops=True))
        if self.training:
            h = h + 0.5 * torch.tanh(self.aux(h))
        h = F.dropout(h, p=0.5, training=self.training)
        return ops.propagate(g, self.lin2(h), "mean")


def test_data_plan_evaluates_like_gc_train() -> None:
    g = gc.datasets.synthetic("sbm", num_nodes=90, avg_degree=5, num_features=6, num_classes=3, seed=3)
    g = g.replace(x=g.x.to(DT))
    torch.manual_seed(0)
    model = PlanModel().to(DT)
    ref_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    hist = gc.train(ref_model, g, epochs=3, lr=0.05, seed=0, verbose=False)
    plan = gc.plan(plan_model, g, gpus=2, strategy="data")
    res = plan.run(epochs=3, lr=0.05, seed=0, timeout=90)
    for field in ("loss", "train_acc", "val_acc", "test_acc"):
        ours, ref = getattr(res.history, field), getattr(hist, field)
        assert len(ours) == len(ref) == 3
        for a, b in zip(ours, ref):
            assert (math.isnan(a) and math.isnan(b)) or abs(a - b) < 1e-9, f"{field}: plan {ours}, gc.train {ref}"
    # the check can fail: in training mode the trained model's accuracies differ from eval mode's
    ref_model.train()
    torch.manual_seed(0)
    logits = ref_model(g, g.x)
    train_mode = [float((logits[m].argmax(-1) == g.y[m]).float().mean()) for m in (g.train_mask, g.val_mask)]
    assert train_mode != [hist.train_acc[-1], hist.val_acc[-1]]
    for a, b in zip(res.history.loss, hist.loss):
        assert abs(a - b) < 1e-9


class BatchNormPlanModel(nn.Module):
    """A BatchNorm between two propagations: its running statistics are buffers the plan updates."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(F_IN + 1, HID), nn.BatchNorm1d(HID), nn.Linear(HID, C)

    def forward(self, g, x):
        h = torch.relu(self.bn(ops.propagate(g, self.l1(x), norm="gcn", add_self_loops=True)))
        return ops.propagate(g, self.l2(h), norm="gcn", add_self_loops=True)


@pytest.mark.parametrize("strategy", ["data", "mop"])
def test_relaxed_plan_returns_and_checkpoints_buffers(tmp_path, strategy: str) -> None:
    """BatchNorm's running statistics (relaxed plans: per-rank statistics) reach the user's model
    after the run and the best state, and a resumed run continues from the checkpointed ones: its
    evaluation and buffers equal an uninterrupted run's (they were the initial statistics before)."""
    g = gc.datasets.synthetic("sbm", num_nodes=80, avg_degree=5, num_features=F_IN + 1, num_classes=C, seed=1)
    g = g.replace(x=g.x.to(DT))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return BatchNormPlanModel().to(DT)

    m1 = model()
    straight = gc.plan(m1, g, gpus=2, strategy=strategy, semantics="relaxed").run(
        6, seed=0, progress=False, timeout=120, checkpoint_dir=tmp_path / "s", checkpoint_every=3)
    assert int(m1.bn.num_batches_tracked) == 6 and not torch.equal(m1.bn.running_var, torch.ones(HID, dtype=DT))
    best = straight.best_state_dict()
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(best)
    assert int(best["bn.num_batches_tracked"]) == straight.history.best_epoch + 1
    (tmp_path / "r").mkdir()
    shutil.copytree(tmp_path / "s" / "epoch-3", tmp_path / "r" / "epoch-3")
    m2 = model()
    resumed = gc.plan(m2, g, gpus=2, strategy=strategy, semantics="relaxed").run(
        6, seed=0, progress=False, timeout=120, checkpoint_dir=tmp_path / "r", resume=True)
    assert resumed.history.val_acc == straight.history.val_acc and resumed.history.loss == straight.history.loss
    for name, buf in m1.named_buffers():
        assert torch.equal(dict(m2.named_buffers())[name], buf), name


class ConstantBufferModel(nn.Module):
    """A buffer training never changes (a fixed feature scale): not per-rank state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, F_IN + 1))
        self.l1, self.l2 = nn.Linear(F_IN + 1, HID), nn.Linear(HID, C)

    def forward(self, g, x):
        h = torch.relu(ops.propagate(g, self.l1(x * self.scale), norm="gcn", add_self_loops=True))
        return ops.propagate(g, self.l2(h), norm="gcn", add_self_loops=True)


def test_only_buffers_training_changes_keep_a_checkpoint_on_its_rank_count(tmp_path) -> None:
    """Running statistics are each rank's own (another rank count is refused naming them); a
    constant buffer is the same everywhere and does not stop re-sharding."""
    g = gc.datasets.synthetic("sbm", num_nodes=80, avg_degree=5, num_features=F_IN + 1, num_classes=C, seed=1)
    g = g.replace(x=g.x.to(DT))
    for make, ok in ((ConstantBufferModel, True), (BatchNormPlanModel, False)):
        torch.manual_seed(0)
        d = tmp_path / make.__name__
        gc.plan(make().to(DT), g, gpus=2, strategy="data", semantics="relaxed").run(
            2, progress=False, timeout=120, checkpoint_dir=d)
        torch.manual_seed(0)
        more = gc.plan(make().to(DT), g, gpus=3, strategy="data", semantics="relaxed")
        if ok:
            more.run(3, progress=False, timeout=120, checkpoint_dir=d, resume=True)
        else:
            with pytest.raises(gc.RuntimeFailure, match=r"written on 2 ranks, this plan has 3: .*per-rank state "
                                                        r"\(buffers\)"):
                more.run(3, progress=False, timeout=120, checkpoint_dir=d, resume=True)
