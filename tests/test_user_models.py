"""Models as PyG users write them, built from gnncompile.ops primitives (issue 18, item 4).

Each model below is written the way a PyTorch Geometric user writes one (torch.nn modules, functional
dropout reading ``self.training``, Python loops over constructor-time lists), with
:mod:`gnncompile.ops` primitives in place of PyG's message passing. For each:

- traced == eager in eval mode and, with the same seed (the same dropout masks), in training mode,
  whatever mode the model was traced in;
- planned by ``data`` on 2 ranks == single device (:func:`gnncompile.testing.check_plan`: loss,
  logits, every gradient, every updated parameter), and by ``tensor`` for the models the tensor
  strategy takes; what a strategy cannot take is refused with a PlanningError saying what.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gnncompile as gc
from gnncompile import PlanningError, ops
from gnncompile.testing import check_plan, check_trace
from graph_strategies import DT, sbm_graph, small_graphs

F_IN, C = 6, 3  # sbm_graph's features and classes


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only add waits


# =========================================================================== the models
class EdgeWeightedGCN(nn.Module):
    """GCN whose edge weights are learned from the endpoint features (an edge MLP, sigmoid)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * d_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.conv1 = nn.Linear(d_in, hidden)
        self.conv2 = nn.Linear(hidden, d_out)
        self.dropout = dropout

    def forward(self, g, x):
        pair = torch.cat([ops.gather_src(g, x), ops.gather_dst(g, x)], dim=-1)
        w = torch.sigmoid(self.edge_mlp(pair)).squeeze(-1)
        h = F.relu(ops.propagate(g, self.conv1(x), "gcn", edge_weight=w))
        h = F.dropout(h, p=self.dropout, training=self.training)
        return ops.propagate(g, self.conv2(h), "gcn", edge_weight=w)


class GATv2(nn.Module):
    """GATv2 attention (Brody et al.): ``a^T LeakyReLU(W_l x_j + W_r x_i)``, attention dropout."""

    def __init__(self, d_in: int, hidden: int, d_out: int, heads: int = 2, dropout: float = 0.4) -> None:
        super().__init__()
        self.heads, self.hidden, self.dropout = heads, hidden, dropout
        self.lin_l = nn.Linear(d_in, heads * hidden)
        self.lin_r = nn.Linear(d_in, heads * hidden)
        self.att = nn.Parameter(torch.randn(1, heads, hidden) * 0.3)
        self.out = nn.Linear(heads * hidden, d_out)

    def forward(self, g, x):
        xl = self.lin_l(x).view(-1, self.heads, self.hidden)
        xr = self.lin_r(x).view(-1, self.heads, self.hidden)
        e = F.leaky_relu(ops.gather_src(g, xl, True) + ops.gather_dst(g, xr, True), 0.2)
        alpha = ops.edge_softmax(g, (e * self.att).sum(dim=-1), True)
        alpha = F.dropout(alpha, self.dropout, self.training)
        h = ops.propagate(g, xl, "none", edge_weight=alpha, add_self_loops=True)
        return self.out(F.elu(h.reshape(-1, self.heads * self.hidden)))


class MixHop(nn.Module):
    """MixHop layers: ``concat_p  Â^p X W_p`` for powers ``p`` of the adjacency."""

    def __init__(self, d_in: int, hidden: int, d_out: int, powers: tuple[int, ...] = (0, 1, 2),
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.powers, self.dropout = powers, dropout
        self.lins1 = nn.ModuleList(nn.Linear(d_in, hidden) for _ in powers)
        self.lins2 = nn.ModuleList(nn.Linear(len(powers) * hidden, hidden) for _ in powers)
        self.out = nn.Linear(len(powers) * hidden, d_out)

    def mixhop(self, g, x, lins):
        outs = []
        for p, lin in zip(self.powers, lins):
            h = lin(x)
            for _ in range(p):
                h = ops.propagate(g, h, "gcn", add_self_loops=True)
            outs.append(h)
        return torch.cat(outs, dim=-1)

    def forward(self, g, x):
        x = F.dropout(x, p=self.dropout, training=self.training)
        h = F.relu(self.mixhop(g, x, self.lins1))
        h = F.dropout(h, p=self.dropout, training=self.training)
        h = F.relu(self.mixhop(g, h, self.lins2))
        return self.out(h)


class JKNet(nn.Module):
    """Jumping-knowledge GCN with ``mode`` "cat", "max" or "lstm" (PyG's JumpingKnowledge)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, mode: str = "cat", num_layers: int = 3,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.mode, self.dropout = mode, dropout
        dims = [d_in] + [hidden] * num_layers
        self.convs = nn.ModuleList(gc.nn.GCNConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        if mode == "lstm":
            self.lstm = nn.LSTM(hidden, hidden, bidirectional=True, batch_first=True)
            self.att = nn.Linear(2 * hidden, 1)
        self.out = nn.Linear(num_layers * hidden if mode == "cat" else hidden, d_out)

    def forward(self, g, x):
        xs = []
        for conv in self.convs:
            x = F.dropout(F.relu(conv(g, x)), p=self.dropout, training=self.training)
            xs.append(x)
        if self.mode == "cat":
            h = torch.cat(xs, dim=-1)
        elif self.mode == "max":
            h = torch.stack(xs, dim=-1).max(dim=-1)[0]
        else:  # PyG's "lstm": attention over the layers from a bi-LSTM
            stacked = torch.stack(xs, dim=1)  # [N, L, hidden]
            alpha, _ = self.lstm(stacked)
            alpha = torch.softmax(self.att(alpha).squeeze(-1), dim=-1)
            h = (stacked * alpha.unsqueeze(-1)).sum(dim=1)
        return self.out(h)


class PreNormResidual(nn.Module):
    """Pre-norm residual blocks: ``h + dropout(relu(Â lin(BatchNorm(h))))`` (DeeperGCN style)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, num_blocks: int = 2, dropout: float = 0.3) -> None:
        super().__init__()
        self.encoder = nn.Linear(d_in, hidden)
        self.norms = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(num_blocks))
        self.lins = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_blocks))
        self.decoder = nn.Linear(hidden, d_out)
        self.dropout = dropout
        with torch.no_grad():  # eval mode uses running statistics: make them non-trivial
            for bn in self.norms:
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, g, x):
        h = self.encoder(x)
        for norm, lin in zip(self.norms, self.lins):
            z = ops.propagate(g, lin(norm(h)), "gcn", add_self_loops=True)
            h = h + F.dropout(F.relu(z), self.dropout, self.training)
        return self.decoder(h)


class TeleportAPPNP(nn.Module):
    """APPNP whose teleport term is learned: ``h <- (1 - a) Â h + a * gate(h0) * h0``."""

    def __init__(self, d_in: int, hidden: int, d_out: int, K: int = 4, alpha: float = 0.1,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, d_out))
        self.gate = nn.Linear(d_out, d_out)
        self.K, self.alpha = K, alpha

    def forward(self, g, x):
        h0 = self.mlp(x)
        teleport = torch.sigmoid(self.gate(h0)) * h0
        h = h0
        for _ in range(self.K):
            h = (1 - self.alpha) * ops.propagate(g, h, "gcn", add_self_loops=True) + self.alpha * teleport
        return h


class TwoTower(nn.Module):
    """Two encoders whose outputs share one propagation, then split into two heads that are summed."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.tower_a = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh())
        self.tower_b = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU())
        self.head_a, self.head_b = nn.Linear(hidden, d_out), nn.Linear(hidden, d_out)
        self.hidden, self.dropout = hidden, dropout

    def forward(self, g, x):
        a, b = self.tower_a(x), self.tower_b(F.dropout(x, self.dropout, self.training))
        shared = ops.propagate(g, torch.cat([a, b], dim=-1), "mean")
        pa, pb = shared.split(self.hidden, dim=-1)
        return self.head_a(pa) + self.head_b(F.dropout(pb, self.dropout, self.training))


class BranchDropout(nn.Module):
    """Reads ``self.training`` in an ``if``: ``if self.training: x = F.dropout(x, p)`` (dropout's
    default ``training=True``), the training and eval graphs differ in structure."""

    def __init__(self, d_in: int, hidden: int, d_out: int, p: float = 0.5) -> None:
        super().__init__()
        self.conv1, self.conv2 = gc.nn.GCNConv(d_in, hidden), gc.nn.GCNConv(hidden, d_out)
        self.p = p

    def forward(self, g, x):
        h = F.relu(self.conv1(g, x))
        if self.training:
            h = F.dropout(h, self.p)
        return self.conv2(g, h)


class ModeDependentRate(nn.Module):
    """Reads ``self.training`` in an expression: ``p = self.p if self.training else 0.0`` with
    ``F.dropout(h, p)`` (the graphs differ in an argument that is not a mode flag)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, p: float = 0.4) -> None:
        super().__init__()
        self.sage = gc.nn.SAGEConv(d_in, hidden)
        self.lin = nn.Linear(hidden, d_out)
        self.p = p

    def forward(self, g, x):
        p = self.p if self.training else 0.0
        h = F.dropout(F.relu(self.sage(g, x)), p)
        return ops.propagate(g, self.lin(h), "mean")


class SubmoduleTraining(nn.Module):
    """Reads ``self.training`` in its layers: a custom layer with ``F.dropout(x, p, self.training)``
    on the messages, and an ``nn.Dropout`` module between the layers."""

    class Layer(nn.Module):
        def __init__(self, d_in: int, d_out: int, p: float) -> None:
            super().__init__()
            self.lin, self.root, self.p = nn.Linear(d_in, d_out), nn.Linear(d_in, d_out), p

        def forward(self, g, x):
            msg = F.dropout(ops.gather_src(g, self.lin(x)), self.p, self.training)
            return ops.aggregate(g, msg, "mean") + self.root(x)

    def __init__(self, d_in: int, hidden: int, d_out: int, p: float = 0.3) -> None:
        super().__init__()
        self.layer1, self.layer2 = self.Layer(d_in, hidden, p), self.Layer(hidden, d_out, p)
        self.drop = nn.Dropout(0.5)

    def forward(self, g, x):
        return self.layer2(g, self.drop(F.relu(self.layer1(g, x))))


class LayerSpecLoop(nn.Module):
    """A Python loop over a constructor-time list of layer specs ``(width, norm, hops)``."""

    def __init__(self, d_in: int, hidden: int, d_out: int,
                 specs: tuple[tuple[int, str, int], ...] = ((8, "gcn", 1), (5, "mean", 2), (7, "sum", 1)),
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.specs, self.dropout = list(specs), dropout
        dims = [d_in] + [w for w, _, _ in specs]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(dims[-1], d_out)

    def forward(self, g, x):
        for (width, norm, hops), lin in zip(self.specs, self.lins):
            x = lin(x)
            for _ in range(hops):
                x = ops.propagate(g, x, norm, add_self_loops=norm != "sum")
            x = F.dropout(torch.tanh(x) if norm == "sum" else F.relu(x), self.dropout, self.training)
        return self.out(x)


class DGLNames(nn.Module):
    """DGL's names for forward's inputs, ``forward(self, graph, feat)``, and a submodule called ``x``
    (its call would take the features' name in the traced graph)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.x, self.out, self.dropout = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out), dropout

    def forward(self, graph, feat):
        h = self.x(feat)
        h = F.dropout(F.relu(ops.propagate(graph, h, "gcn", add_self_loops=True)) + h, self.dropout, self.training)
        return ops.propagate(graph, self.out(h), "mean")


class InPlace(nn.Module):
    """PyG-style in-place ops on computed values: ``conv(x).relu_()``, ``h += r``, a discarded
    ``h.relu_()`` whose change later readers of ``h`` see, and ``nn.ReLU(inplace=True)``."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)
        self.act, self.dropout = nn.ReLU(inplace=True), dropout

    def forward(self, g, x):
        h = ops.propagate(g, self.l1(x), "gcn", add_self_loops=True).relu_()
        a = ops.propagate(g, h, "mean")
        a += h
        a.relu_()
        a = F.dropout(self.act(self.l2(a) + ops.propagate(g, a, "sum")), self.dropout, self.training)
        return self.l3(a)


class SharedScalar(nn.Module):
    """GIN-style ``(1 + eps) h`` with one 0-dim learnable ``eps`` for both rounds (a 0-dim value
    crossing stages), and a buffer read in every step (a temperature: plans read its value then)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)
        self.eps = nn.Parameter(torch.tensor(0.3))
        self.register_buffer("temp", torch.tensor(2.0))
        self.dropout = dropout

    def forward(self, g, x):
        h = F.dropout(torch.relu(self.l1(x)), self.dropout, self.training)
        c = 1 + self.eps
        for _ in range(2):
            h = torch.relu(self.l2(c * h + ops.propagate(g, h, "sum")))
        return self.l3(h) * (1.0 / self.temp)


class NewTensors(nn.Module):
    """Constants made with ``h.new_*`` (they take only ``h``'s dtype and device): a row of scales, a
    per-column offset, a filled tensor expanded over the rows, zeros of ``h``'s shape."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.hidden, self.dropout = hidden, dropout

    def forward(self, g, x):
        h = F.dropout(torch.relu(ops.propagate(g, self.l1(x), "gcn", add_self_loops=True)), self.dropout,
                      self.training)
        h = h * h.new_ones(1, self.hidden) * 0.5 + h.new_tensor([float(i) for i in range(self.hidden)])
        h = h + h.new_full((1, self.hidden), 2.0).expand_as(h) + h.new_zeros(h.shape)
        return ops.propagate(g, self.l2(h), "mean")


class SkipDropout(nn.Module):
    """Three dropouts whose single-device order is not the plan's stage order: the skip branch's
    dropout comes last in forward but runs in the first stage, with the input's."""

    def __init__(self, d_in: int, hidden: int, d_out: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.c1, self.c2 = gc.nn.SAGEConv(d_in, hidden), gc.nn.SAGEConv(hidden, d_out)
        self.skip, self.dropout = nn.Linear(d_in, d_out), dropout

    def forward(self, g, x):
        x = F.dropout(x, self.dropout, self.training)
        h = F.dropout(torch.relu(self.c1(g, x)), self.dropout, self.training)
        return self.c2(g, h) + F.dropout(self.skip(x), self.dropout, self.training)


HID = 4
MODELS = {
    "edge_weighted_gcn": lambda: EdgeWeightedGCN(F_IN, HID, C),
    "gatv2": lambda: GATv2(F_IN, HID, C),
    "mixhop": lambda: MixHop(F_IN, HID, C),
    "jk_cat": lambda: JKNet(F_IN, HID, C, "cat"),
    "jk_max": lambda: JKNet(F_IN, HID, C, "max"),
    "jk_lstm": lambda: JKNet(F_IN, HID, C, "lstm"),
    "prenorm_batchnorm": lambda: PreNormResidual(F_IN, HID, C),
    "teleport_appnp": lambda: TeleportAPPNP(F_IN, HID, C),
    "two_tower": lambda: TwoTower(F_IN, HID, C),
    "branch_dropout": lambda: BranchDropout(F_IN, HID, C),
    "mode_dependent_rate": lambda: ModeDependentRate(F_IN, HID, C),
    "submodule_training": lambda: SubmoduleTraining(F_IN, HID, C),
    "layer_spec_loop": lambda: LayerSpecLoop(F_IN, HID, C),
    "dgl_names": lambda: DGLNames(F_IN, HID, C),
    "in_place": lambda: InPlace(F_IN, HID, C),
    "shared_scalar": lambda: SharedScalar(F_IN, HID, C),
    "new_tensors": lambda: NewTensors(F_IN, HID, C),
    "skip_dropout": lambda: SkipDropout(F_IN, HID, C),
}


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().to(DT)


def run(module: nn.Module, g: gc.Graph, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    out = module(g, g.x)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    params = list(module.parameters())
    grads = torch.autograd.grad(out, params, up, allow_unused=True)
    return out.detach(), [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)]


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(48)


# =========================================================================== traced == eager
@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), traced_in_eval=st.booleans(),
       seed=st.integers(0, 100))
def test_traced_equals_eager_in_both_modes(g: gc.Graph, name: str, traced_in_eval: bool, seed: int) -> None:
    g = g.replace(x=torch.randn(g.num_nodes, F_IN, generator=torch.Generator().manual_seed(seed), dtype=DT))
    model = make(name, seed)
    model.train(not traced_in_eval)
    check_trace(model, g, seed=seed)  # modes untouched; eval, training (same seed: same masks), eval again


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_traced_equals_eager_and_drops_out_in_training_only(sbm: gc.Graph, name: str) -> None:
    for traced_in_eval in (False, True):
        model = make(name)
        model.train(not traced_in_eval)
        tp = check_trace(model, sbm, seed=3)
    tp.train()
    a, _ = run(tp, sbm, 1)
    b, _ = run(tp, sbm, 2)
    assert not torch.equal(a, b), "no dropout in training mode: the training-mode comparison would be vacuous"
    tp.eval()
    assert torch.equal(run(tp, sbm, 1)[0], run(tp, sbm, 2)[0])


# =========================================================================== planned == single device
_NOT_EXACT = r"Each rank would use its own rows only; pass semantics='relaxed'"
DATA_REFUSED = {  # model -> what the data strategy's refusal must say
    # PyG's GCNConv(edge_weight=...) normalization needs global degrees of computed weights
    "edge_weighted_gcn": r"op 'propagate': norm='gcn' of computed edge weights needs every source's global "
                         r"out-degree.*use norm='mean' or normalize first",
    "prenorm_batchnorm": r"norms_0: BatchNorm1d normalizes with statistics over all vertices; norms_1: BatchNorm1d "
                         r"normalizes with statistics over all vertices\. " + _NOT_EXACT,
    # conservative: the LSTM returns (out [N, L, 2H], (h, c) [2, N, H]), not one vertex-rowed tensor
    "jk_lstm": r"lstm: takes its output rows from the vertices as a whole.*" + _NOT_EXACT,
}
TENSOR_MODELS = ["edge_weighted_gcn", "gatv2", "jk_cat", "jk_max", "mixhop", "teleport_appnp", "two_tower",
                 "branch_dropout", "mode_dependent_rate", "layer_spec_loop", "dgl_names", "in_place", "shared_scalar", "new_tensors",
                 "skip_dropout"]
TENSOR_REFUSED = {
    "prenorm_batchnorm": DATA_REFUSED["prenorm_batchnorm"],
    "jk_lstm": DATA_REFUSED["jk_lstm"],
    "submodule_training": r"strategy 'tensor' does not support edge-wise op 'aggregate' feeding 'add': edge-wise "
                          r"results are replicated on every rank.*use strategy='data'",
}


def test_every_model_is_planned_or_refused_by_each_strategy() -> None:
    assert set(MODELS) == set(TENSOR_MODELS) | set(TENSOR_REFUSED)
    assert not set(TENSOR_MODELS) & set(TENSOR_REFUSED)


@pytest.mark.parametrize("name", sorted(set(MODELS) - set(DATA_REFUSED)))
def test_data_plan_equals_single_device(sbm: gc.Graph, name: str) -> None:
    check_plan(make(name), sbm, 2, strategy="data", rtol=1e-9, atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", TENSOR_MODELS)
def test_tensor_plan_equals_single_device(sbm: gc.Graph, name: str) -> None:
    check_plan(make(name), sbm, 2, strategy="tensor", rtol=1e-9, atol=1e-11, timeout=60)


def test_masks_drawn_in_single_device_order_when_stages_reorder_the_dropouts(sbm: gc.Graph) -> None:
    """Ranks running every dropout drew each mask as their stages reached it, so a later dropout in
    an earlier stage took an earlier mask: data, tensor and split steps differed from single-device
    training under an exact label (data and tensor: test_*_plan_equals_single_device)."""
    train = int(sbm.train_mask.sum())
    check_plan(make("skip_dropout"), sbm, 2, strategy="split", batch_size=train, fanouts=[3, 3], rtol=1e-9,
               atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", sorted(DATA_REFUSED))
def test_data_refusals_say_what(sbm: gc.Graph, name: str) -> None:
    with pytest.raises(PlanningError, match=DATA_REFUSED[name]):
        gc.plan(make(name), sbm, gpus=2, strategy="data")


@pytest.mark.parametrize("name", sorted(TENSOR_REFUSED))
def test_tensor_refusals_say_what(sbm: gc.Graph, name: str) -> None:
    with pytest.raises(PlanningError, match=TENSOR_REFUSED[name]):
        gc.plan(make(name), sbm, gpus=2, strategy="tensor")


class DotAttention(nn.Module):
    """Dot-product attention from one value on both ends of each edge (``gather_src`` and
    ``gather_dst`` of ``z``), normalized per destination."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, g, x):
        z = self.lin(x)
        alpha = ops.edge_softmax(g, (ops.gather_src(g, z) * ops.gather_dst(g, z)).sum(-1))
        return self.out(F.relu(ops.propagate(g, z, norm="none", edge_weight=alpha)))


@pytest.mark.parametrize("strategy", ["data", "task", "layer"])
def test_one_value_on_both_ends_of_the_edges(sbm: gc.Graph, strategy: str) -> None:
    """A chunk's propagation stage reads the chunks of the sources: its destination-side op gets the
    chunk's own rows of them (every rank failed in gather_dst before, after a verified plan)."""
    torch.manual_seed(0)
    check_plan(DotAttention(F_IN, HID, C).to(DT), sbm, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60)


# =========================================================================== what cannot be traced
class DropEdgeByCount(nn.Module):
    """DropEdge written with the graph's size: ``torch.rand(g.num_edges) > p`` inside forward."""

    def __init__(self, d_in: int, d_out: int, p: float = 0.2) -> None:
        super().__init__()
        self.lin, self.p = nn.Linear(d_in, d_out), p

    def forward(self, g, x):
        w = (torch.rand(g.num_edges) > self.p).to(x.dtype)
        return ops.propagate(g, self.lin(x), "mean", edge_weight=w)


class ClipByValue(nn.Module):
    """Rescales when the largest activation is big: a Python ``if`` on a tensor value."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, g, x):
        h = ops.propagate(g, self.lin(x), "gcn")
        if h.abs().max().item() > 10.0:
            h = h / 10.0
        return h


def _line_of(cls: type, text: str) -> str:
    import inspect
    import os

    lines, start = inspect.getsourcelines(cls)
    return re.escape(f"{os.path.basename(__file__)}:{start + next(i for i, ln in enumerate(lines) if text in ln)}")


def test_inputs_are_named_g_and_x_whatever_the_model_calls_them(sbm: gc.Graph) -> None:
    """Plans name their inputs g and x (a DGL-style model crashed every rank under task and layer,
    and was refused by tensor and mop); messages keep the model's own names."""
    tp = gc.trace(make("dgl_names"), sbm)
    assert [n.name for n in tp.graph.nodes if n.op == "placeholder"] == ["g", "x"]
    for strategy in ("task", "layer"):
        check_plan(make("dgl_names"), sbm, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60)

    class ReadsTheGraph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(F_IN, C)

        def forward(self, graph, feat):
            return self.lin(feat) * graph.num_nodes

    with pytest.raises(gc.TraceError, match=r"graph\.num_nodes"):
        gc.trace(ReadsTheGraph(), sbm)


def test_in_place_ops_on_computed_values_become_out_of_place(sbm: gc.Graph) -> None:
    """A stage's input is a leaf of autograd, which refuses in-place changes: every rank of a tensor,
    mop, task or layer plan crashed on conv(x).relu_(); the traced graph has no in-place op left,
    and each reader after a change reads the changed value."""
    tp = gc.trace(make("in_place"), sbm)
    calls = [n for n in tp.graph.nodes if n.op in ("call_method", "call_function", "call_module")]
    assert not [n for n in calls if str(n.target).endswith("_") or n.kwargs.get("inplace")]
    assert not [m for m in tp.modules() if getattr(m, "inplace", False)]
    assert make("in_place").act.inplace  # (the model's own module is left as it is)
    for strategy in ("task", "layer"):
        check_plan(make("in_place"), sbm, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60)


def test_a_buffer_is_read_when_the_step_runs(sbm: gc.Graph) -> None:
    """fx evaluated ``1.0 / self.temp`` once at trace time into a constant, so a plan kept the
    temperature it was planned with: a schedule or a loaded checkpoint changed gc.train's result
    and not the plan's. Buffers are graph inputs now, read by each step."""
    model = make("shared_scalar").eval()
    tp = gc.trace(model, sbm)
    assert "temp" in [n.target for n in tp.graph.nodes if n.op == "get_attr"]
    planned = copy.deepcopy(model).train()
    plan = gc.plan(planned, sbm, 2, strategy="data")
    planned.temp.fill_(5.0)  # after planning: a schedule, or load_state_dict
    model.temp.fill_(5.0)
    ref = gc.train(model.train(), sbm, epochs=1, seed=4, verbose=False)
    got = plan.run(epochs=1, seed=4, timeout=60)
    assert got.history.loss == pytest.approx(ref.loss, rel=1e-9)


class CountsSteps(nn.Module):
    """A step counter kept in a buffer, updated in forward: assigned, or changed in place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.lin, self.in_place = nn.Linear(F_IN, C), in_place
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, g, x):
        if self.training:
            if self.in_place:
                self.steps.add_(1)
            else:
                self.steps += 1
        return ops.propagate(g, self.lin(x), "gcn") * (1 + self.steps)


@pytest.mark.parametrize("in_place", [False, True], ids=["assigned", "in_place"])
def test_a_forward_that_updates_its_buffers_is_refused(sbm: gc.Graph, in_place: bool) -> None:
    """A plan runs forward per chunk and again when it recomputes: it cannot replay an update of
    the model's state. The update was dropped silently (the plan trained another function than
    gc.train, under an exact label), and tracing left a Proxy in the model's own buffer."""
    model = CountsSteps(in_place).to(DT)
    if in_place:
        what = rf"changes the model's buffer 'steps' in place at .*{_line_of(CountsSteps, 'self.steps.add_(1)')}"
    else:
        what = r"forward assigns the buffer\(s\) \['steps'\]"
    with pytest.raises(gc.TraceError, match=rf"{what}.*outside forward"):
        gc.plan(model, sbm, 2, strategy="data")
    assert type(model.steps) is torch.Tensor and float(model.steps) == 0.0  # the model is as it was


class BufferUses(nn.Module):
    """Buffers read as sizes (a loop over a buffer's rows), through ``.data``, as a Python value, and
    a tensor made in forward and changed in place (eager code makes it afresh at each call)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.lin, self.use = nn.Linear(F_IN, C), use
        self.register_buffer("w", torch.tensor([0.5, 0.25, 0.125], dtype=DT))
        self.register_buffer("flag", torch.tensor(True))

    def forward(self, g, x):
        h = ops.propagate(g, self.lin(x), "gcn")
        if self.use == "sizes":
            for k in range(self.w.numel()):
                h = h + self.w[k] * ops.propagate(g, h, "mean")
        elif self.use == "data":
            self.w.data.mul_(2)
        elif self.use == "value" and self.flag:
            h = h * 2
        elif self.use == "made":
            bias = torch.ones(C, dtype=DT)  # (no traced input: fx keeps it as a constant)
            bias += self.lin.bias  # (a traced change of the constant)
            h = h + bias
        return h


@pytest.mark.parametrize("use", ["sizes", "made"])
def test_buffer_sizes_and_tensors_made_in_forward_trace(sbm: gc.Graph, use: str) -> None:
    """Proxied buffers refused ``range(self.w.numel())``; an in-place change of a tensor made in
    forward was refused as a change of 'the model's buffer _tensor_constant0' (before that, fx
    changed its one constant at every call)."""
    check_trace(BufferUses(use).to(DT), sbm, seed=1)
    check_plan(BufferUses(use).to(DT), sbm, 2, strategy="data", rtol=1e-9, atol=1e-11, timeout=60)


def test_buffer_values_in_python_and_changes_through_data_are_refused(sbm: gc.Graph) -> None:
    with pytest.raises(gc.TraceError, match=r"reads the value of the buffer 'flag' as a Python value.*constructor "
                                            r"attribute"):
        gc.trace(BufferUses("value"), sbm)
    with pytest.raises(gc.TraceError, match=rf"changes the model's buffer 'w' in place at .*"
                                            rf"{_line_of(BufferUses, 'self.w.data.mul_(2)')}"):
        gc.trace(BufferUses("data"), sbm)


class UnusedHead(nn.Module):
    """A head the forward never calls, and one whose output is detached: neither gets a gradient."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.l1, self.spare, self.frozen = nn.Linear(d_in, d_out), nn.Linear(d_in, d_out), nn.Linear(d_in, d_out)

    def forward(self, g, x):
        return ops.propagate(g, self.l1(x), "gcn") + self.frozen(x).detach()


@pytest.mark.parametrize("strategy", ["data", "tensor"])
def test_parameters_without_a_gradient_get_none_and_stay_put(sbm: gc.Graph, strategy: str) -> None:
    """The gradient all-reduce gave them zeros, and Adam's weight decay moved them (gc.train leaves
    them alone); check_plan now requires None where the reference has none."""
    check_plan(UnusedHead(F_IN, C).to(DT), sbm, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60)


def test_what_cannot_be_traced_names_the_line_and_the_fix(sbm: gc.Graph) -> None:
    with pytest.raises(gc.TraceError, match=rf"num_edges.*{_line_of(DropEdgeByCount, 'w = (torch.rand')}.*primitives"):
        gc.trace(DropEdgeByCount(F_IN, C), sbm)
    with pytest.raises(gc.TraceError, match=rf"{_line_of(ClipByValue, 'if h.abs')}.*data-dependent control flow"):
        gc.trace(ClipByValue(F_IN, C).eval(), sbm)


def test_the_checking_helpers_refuse_what_they_cannot_compare_and_cast_features(sbm: gc.Graph) -> None:
    """check_plan compared a sampled epoch's mean loss with one mini-batch's (a false failure),
    and a tuple output died in a raw TypeError; check_trace fed float32 features to a float64
    model (gc.train and gc.plan cast them)."""
    g = gc.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=F_IN, num_classes=C, seed=0)
    train = int(g.train_mask.sum())
    with pytest.raises(gc.ArgumentError, match=rf"check_plan compares one step.*the {train} training vertices"):
        check_plan(gc.nn.GraphSAGE(F_IN, HID, C, dropout=0.0), g, 2, strategy="split", batch_size=train - 1,
                   fanouts=[2, 2])

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(F_IN, C)

        def forward(self, g, x):
            h = ops.propagate(g, self.lin(x), "gcn")
            return h, h

    with pytest.raises(gc.ArgumentError, match=r"returned tuple on 'sbm.*'; training needs logits \[60, >= 3\]"):
        check_plan(Pair(), g, 2, strategy="data")

    class ThirdInput(nn.Module):  # a raw TypeError from the reference step (gc.plan and gc.train named it)
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(F_IN, C)

        def forward(self, g, x, edge_weight):
            return ops.propagate(g, self.lin(x), "gcn")

    with pytest.raises(gc.ArgumentError, match=r"ThirdInput\(g, x\) failed .*missing 1 required positional"):
        check_plan(ThirdInput(), g, 2, strategy="data")
    check_trace(make("in_place").to(torch.float64), g.replace(x=g.x.float()))
