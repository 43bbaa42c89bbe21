"""Tests of gnncompile.from_pyg: PyG models converted to gnncompile models compute the same outputs and
gradients (float64, eval mode, graphs without self loops, symmetric for GCN-normalized convs), follow the
training mode, own (or share) their parameters, and unsupported models fail with clear TraceErrors."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

pytest.importorskip("torch_geometric")

import torch_geometric.nn as pnn  # noqa: E402
import torch_geometric.utils as pyg_utils  # noqa: E402

import gnncompile as gc  # noqa: E402
from gnncompile import nn as gnn  # noqa: E402
from gnncompile.frontend.pyg_import import PygConverted, from_pyg  # noqa: E402
from gnncompile.ops import is_primitive  # noqa: E402

ATOL = 1e-6
RTOL = 1e-6
D_IN = 5


# --------------------------------------------------------------------------- graphs and helpers
def random_graph(n: int = 20, m: int = 50, seed: int = 0, symmetric: bool = True) -> tuple[gc.Graph, Tensor]:
    """A random graph without self loops whose last 3 vertices are isolated."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n - 3, (m,), generator=gen)
    dst = torch.randint(0, n - 3, (m,), generator=gen)
    keep = src != dst
    ei = torch.stack([src[keep], dst[keep]])
    if symmetric:
        ei = torch.cat([ei, ei.flip(0)], dim=1)
    return gc.Graph.from_edge_index(ei, n), ei


def features(n: int, d: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=torch.float64).requires_grad_()


def grads(out: Tensor, inputs: list[Tensor], seed: int) -> list[Tensor]:
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    res = torch.autograd.grad(out, inputs, up, allow_unused=True)
    return [torch.zeros_like(i) if r is None else r for i, r in zip(inputs, res)]


def assert_close(a: Tensor, b: Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def check_parity(model: nn.Module, g: gc.Graph, ei: Tensor, seed: int = 0, train: bool = False) -> PygConverted:
    """``from_pyg(model)(g, x) == model(x, ei)`` with equal gradients of ``x`` and of every parameter."""
    model = model.double().train(train)
    conv = from_pyg(model)
    assert isinstance(conv, PygConverted)
    x = features(g.num_nodes, D_IN, seed)
    torch.manual_seed(seed + 2)
    out = conv(g, x)
    torch.manual_seed(seed + 2)
    out_ref = model(x, ei)
    assert_close(out, out_ref, "output")
    pc, pr = dict(conv.named_parameters()), dict(model.named_parameters())
    assert set(pc) == set(pr), f"parameter names differ: {sorted(set(pc) ^ set(pr))}"
    names = sorted(pr)
    for k in names:
        assert pc[k].dtype == pr[k].dtype and torch.equal(pc[k], pr[k]), k
        assert pc[k].untyped_storage().data_ptr() != pr[k].untyped_storage().data_ptr(), f"{k} shares storage"
    g_conv = grads(out, [x] + [pc[k] for k in names], seed)
    g_ref = grads(out_ref, [x] + [pr[k] for k in names], seed)
    for what, a, b in zip(["x"] + names, g_conv, g_ref):
        assert_close(a, b, f"grad of {what}")
    return conv


# --------------------------------------------------------------------------- PyG models
class GCNJK(nn.Module):
    """Two GCNConvs with ReLU, functional dropout and a jumping-knowledge concatenation head."""

    def __init__(self, d_in: int = D_IN, h: int = 8, d_out: int = 3, **conv_kwargs: Any) -> None:
        super().__init__()
        self.conv1 = pnn.GCNConv(d_in, h, **conv_kwargs)
        self.conv2 = pnn.GCNConv(h, h, **conv_kwargs)
        self.lin = nn.Linear(2 * h, d_out)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h1 = F.dropout(F.relu(self.conv1(x, edge_index)), p=0.5, training=self.training)
        h2 = self.conv2(h1, edge_index).relu()
        return self.lin(torch.cat([h1, h2], dim=-1))


class GCNOptions(nn.Module):
    """Unnormalized/biasless and loop-free GCNConvs with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = pnn.GCNConv(D_IN, 6, normalize=False, bias=False)
        self.conv2 = pnn.GCNConv(6, 6, add_self_loops=False, cached=True)
        self.out = nn.Linear(6, 2)

    def forward(self, x: Tensor, adj_t: Tensor) -> Tensor:
        h = torch.tanh(self.conv1(x, adj_t))
        h = h + self.conv2(h, adj_t)
        return self.out(h)


class SAGEResidual(nn.Module):
    """SAGEConv stack (configurable per layer) with nn.Dropout and a linear skip connection."""

    def __init__(self, first: dict[str, Any], second: dict[str, Any]) -> None:
        super().__init__()
        self.conv1 = pnn.SAGEConv(D_IN, 8, **first)
        self.conv2 = pnn.SAGEConv(8, 4, **second)
        self.skip = nn.Linear(D_IN, 4)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = self.dropout(F.relu(self.conv1(x, edge_index)))
        return self.conv2(h, edge_index) + self.skip(x)


class GATModel(nn.Module):
    """Multi-head GAT: concatenated heads, ELU, then averaged heads without self loops."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = pnn.GATConv(D_IN, 4, heads=3, dropout=0.4)
        self.conv2 = pnn.GATConv(12, 3, heads=2, concat=False, negative_slope=0.1, add_self_loops=False)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, p=0.6, training=self.training)
        h = F.elu(self.conv1(x, edge_index))
        return self.lin(F.relu(self.conv2(h, edge_index)))


class GINModel(nn.Module):
    """Two GIN layers (trainable and fixed eps) with a JK-cat head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = pnn.GINConv(nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, 8)), eps=0.2,
                                 train_eps=True)
        self.conv2 = pnn.GINConv(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8)),
                                 eps=0.1)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h1 = self.conv1(x, edge_index).relu()
        h2 = self.conv2(h1, edge_index).relu()
        return self.head(torch.cat([h1, h2], dim=1))


class GCNIIModel(nn.Module):
    """GCNII: input projection, GCN2Convs with the initial residual x_0, output projection."""

    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D_IN, 8), nn.Linear(8, 3)])
        self.convs = nn.ModuleList([
            pnn.GCN2Conv(8, alpha=0.1, theta=0.5, layer=1, normalize=normalize),
            pnn.GCN2Conv(8, alpha=0.2, theta=0.5, layer=2, shared_weights=False, normalize=normalize),
        ])

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = x_0 = self.lins[0](x).relu()
        for conv in self.convs:
            x = F.dropout(x, 0.5, training=self.training)
            x = conv(x, x_0, edge_index).relu()
        return self.lins[1](x)


class APPNPModel(nn.Module):
    """MLP then APPNP propagation."""

    def __init__(self, **prop_kwargs: Any) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D_IN, 8)
        self.lin2 = nn.Linear(8, 3)
        self.prop = pnn.APPNP(**prop_kwargs)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(F.relu(self.lin1(x)), p=0.5, training=self.training)
        return self.prop(self.lin2(x), edge_index)


class SGCModel(nn.Module):
    """Two SGConvs with ReLU and dropout between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = pnn.SGConv(D_IN, 8, K=2, cached=True)
        self.conv2 = pnn.SGConv(8, 3, K=1, bias=False, add_self_loops=False)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.conv2(self.dropout(self.conv1(x, edge_index).relu()), edge_index)


# name -> (model factory, symmetric graph needed)
CASES: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "gcn_jk": (lambda: GCNJK(), True),
    "gcn_options_adj_t": (lambda: GCNOptions(), True),
    "sage_mean_max": (lambda: SAGEResidual({}, {"aggr": "max", "root_weight": False}), False),
    "sage_sum_normalize": (lambda: SAGEResidual({"aggr": "sum", "normalize": True}, {"bias": False}), False),
    "gat": (lambda: GATModel(), False),
    "gin": (lambda: GINModel(), False),
    "gcnii": (lambda: GCNIIModel(), True),
    "gcnii_unnormalized": (lambda: GCNIIModel(normalize=False), False),
    "appnp": (lambda: APPNPModel(K=3, alpha=0.1), True),
    "appnp_no_loops": (lambda: APPNPModel(K=2, alpha=0.2, add_self_loops=False), True),
    "sgc": (lambda: SGCModel(), True),
    "pyg_sequential": (lambda: pnn.Sequential("x, edge_index", [
        (pnn.GCNConv(D_IN, 8), "x, edge_index -> x"), nn.ReLU(), nn.Dropout(0.5),
        (pnn.GCNConv(8, 3), "x, edge_index -> x")]), True),
    "basic_gcn_jk": (lambda: pnn.models.GCN(D_IN, 8, 2, 3, jk="cat", dropout=0.5), True),
    "basic_sage": (lambda: pnn.models.GraphSAGE(D_IN, 8, 3, 3, dropout=0.5), False),
    "basic_gat": (lambda: pnn.models.GAT(D_IN, 4, 2, 3, heads=2), False),
    "basic_gin": (lambda: pnn.models.GIN(D_IN, 8, 2, 3, jk="max"), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity(case: str) -> None:
    """Each converted model equals its PyG original (outputs, gradients of x and of every parameter)."""
    make, symmetric = CASES[case]
    torch.manual_seed(0)
    g, ei = random_graph(symmetric=symmetric)
    conv = check_parity(make(), g, ei)
    assert conv.conversions, "no conv was converted"
    for _, module in conv.named_modules():
        assert not isinstance(module, pnn.MessagePassing), type(module).__name__


@pytest.mark.parametrize("case", ["gcn_jk", "sage_mean_max", "gcnii", "appnp", "basic_gcn_jk"])
def test_parity_train_mode(case: str) -> None:
    """In training mode the converted model draws the same dropout masks (F.dropout became nn.Dropout)."""
    make, symmetric = CASES[case]
    torch.manual_seed(1)
    g, ei = random_graph(symmetric=symmetric, seed=1)
    conv = check_parity(make(), g, ei, seed=3, train=True)
    assert conv.training


@st.composite
def small_graphs(draw: Callable[..., Any], symmetric: bool) -> tuple[gc.Graph, Tensor, int]:
    """A small random graph without self loops (parallel edges and isolated vertices may occur)."""
    n = draw(st.integers(1, 9))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20))
    pairs = [(u, v) for u, v in pairs if u != v]
    if symmetric:
        pairs = pairs + [(v, u) for u, v in pairs]
    ei = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t().contiguous()
    return gc.Graph.from_edge_index(ei, n), ei, draw(st.integers(0, 2**16))


@settings(max_examples=20, deadline=None)
@given(data=small_graphs(symmetric=True))
def test_parity_random_graphs_gcn(data: tuple[gc.Graph, Tensor, int]) -> None:
    g, ei, seed = data
    torch.manual_seed(seed)
    check_parity(GCNJK(), g, ei, seed=seed)


@settings(max_examples=20, deadline=None)
@given(data=small_graphs(symmetric=False))
def test_parity_random_graphs_gat_sage(data: tuple[gc.Graph, Tensor, int]) -> None:
    g, ei, seed = data
    torch.manual_seed(seed)
    check_parity(GATModel(), g, ei, seed=seed)
    check_parity(SAGEResidual({}, {"aggr": "max"}), g, ei, seed=seed)


# --------------------------------------------------------------------------- structure and state
def test_converted_structure_and_traceability() -> None:
    """forward(g, x); gnncompile layers under PyG's names; fx traces through to the graph primitives."""
    model = GCNIIModel().double().eval()
    conv = from_pyg(model)
    assert isinstance(conv, torch.fx.GraphModule)
    assert [n.target for n in conv.graph.nodes if n.op == "placeholder"] == ["g", "x"]
    assert isinstance(conv.get_submodule("convs.0"), gnn.GCN2Conv)
    assert conv.conversions == {"convs.0": ("GCN2Conv", "GCN2Conv"), "convs.1": ("GCN2Conv", "GCN2Conv")}
    assert conv.source_class.endswith("GCNIIModel")
    assert conv.get_submodule("convs.1").beta == pytest.approx(model.convs[1].beta)
    traced = torch.fx.symbolic_trace(conv)
    prims = [n for n in traced.graph.nodes if n.op == "call_function" and is_primitive(n.target)]
    assert len(prims) == 2 and all(n.args[0].name == "g" for n in prims)
    twin = copy.deepcopy(conv)
    assert twin.conversions == conv.conversions
    g, ei = random_graph()
    x = features(g.num_nodes, D_IN, 0)
    assert_close(twin(g, x), conv(g, x), "deep copy")


def test_mode_follows_train_eval_and_model_is_untouched() -> None:
    model = GCNJK().double().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    conv = from_pyg(model)
    assert not model.training and not conv.training
    assert all(not m.training for m in conv.modules())
    g, ei = random_graph()
    x = features(g.num_nodes, D_IN, 0)
    assert torch.equal(conv(g, x), conv(g, x))  # eval: no dropout
    conv.train()
    assert not torch.equal(conv(g, x), conv(g, x))  # train: the dropout module is active
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_copies_parameters_by_default_and_shares_on_request() -> None:
    model = GINModel().double()
    own = from_pyg(model)
    shared = from_pyg(model, share_parameters=True)
    p_model, p_own, p_shared = (dict(m.named_parameters()) for m in (model, own, shared))
    b_model, b_shared = dict(model.named_buffers()), dict(shared.named_buffers())
    for k, p in p_model.items():
        assert p_shared[k] is p, k
        assert p_own[k].untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), k
    for k, b in b_model.items():
        assert b_shared[k] is b, k
    with torch.no_grad():
        p_model["conv1.eps"].add_(1.0)
    assert torch.equal(p_shared["conv1.eps"], p_model["conv1.eps"])
    assert not torch.equal(p_own["conv1.eps"], p_model["conv1.eps"])


def test_state_dict_round_trip() -> None:
    """The converted model's state dict loads into the PyG model (same names and shapes)."""
    torch.manual_seed(0)
    model = pnn.models.GraphSAGE(D_IN, 8, 2, 3).double().eval()
    conv = from_pyg(model)
    with torch.no_grad():
        for p in conv.parameters():
            p.mul_(2.0)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(conv.state_dict())
    g, ei = random_graph(symmetric=False)
    x = features(g.num_nodes, D_IN, 0)
    assert_close(conv(g, x), fresh(x, ei), "after loading the converted weights")


def test_pyg_caches_are_not_copied() -> None:
    """A cached SGConv that already ran (its cache holds a non-leaf tensor) converts; caches are dropped."""
    model = SGCModel().double().eval()
    g, ei = random_graph()
    x = features(g.num_nodes, D_IN, 0)
    out_ref = model(x, ei)
    assert model.conv1._cached_x is not None and model.conv1._cached_x.grad_fn is not None
    conv = from_pyg(model)
    assert_close(conv(g, x), out_ref, "output")
    assert model.conv1._cached_x is not None


def test_frozen_parameter_stays_frozen() -> None:
    model = GCNJK().double()
    model.conv1.lin.weight.requires_grad_(False)
    conv = from_pyg(model)
    assert not conv.get_parameter("conv1.lin.weight").requires_grad
    assert conv.get_parameter("conv2.lin.weight").requires_grad


# --------------------------------------------------------------------------- errors
class OneConv(nn.Module):
    """A model around one conv, to test how from_pyg treats that conv."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.block = nn.ModuleDict({"conv": conv})

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.block["conv"](x, edge_index)


@pytest.mark.parametrize("make", [
    lambda: pnn.ChebConv(D_IN, 4, K=2),
    lambda: pnn.GraphConv(D_IN, 4),
    lambda: pnn.TransformerConv(D_IN, 4),
    lambda: pnn.GATv2Conv(D_IN, 4),
], ids=["cheb", "graphconv", "transformer", "gatv2"])
def test_unsupported_conv(make: Callable[[], nn.Module]) -> None:
    conv = make()
    with pytest.raises(gc.TraceError) as info:
        from_pyg(OneConv(conv))
    msg = str(info.value)
    assert "'block.conv'" in msg and type(conv).__name__ in msg
    for name in ("GCNConv", "SAGEConv", "GATConv", "GINConv", "GCN2Conv", "APPNP", "SGConv"):
        assert name in msg


def test_unsupported_conv_in_basic_gnn() -> None:
    with pytest.raises(gc.TraceError, match=r"'convs\.0' is a .*GATv2Conv"):
        from_pyg(pnn.models.GAT(D_IN, 4, 2, 3, v2=True))


def test_subclass_of_supported_conv_is_rejected() -> None:
    class MyGCN(pnn.GCNConv):
        def message(self, x_j: Tensor, edge_weight: Optional[Tensor]) -> Tensor:
            return 2 * x_j

    with pytest.raises(gc.TraceError, match="MyGCN"):
        from_pyg(OneConv(MyGCN(D_IN, 4)))


@pytest.mark.parametrize("conv, pattern", [
    (lambda: pnn.GCNConv(D_IN, 4, improved=True), "improved=True"),
    (lambda: pnn.GCNConv(D_IN, 4, aggr="mean"), "aggr='mean'"),
    (lambda: pnn.GCNConv(-1, 4), "lazy"),
    (lambda: pnn.SAGEConv(D_IN, 4, project=True), "project=True"),
    (lambda: pnn.SAGEConv(D_IN, 4, aggr="min"), "aggr='min'"),
    (lambda: pnn.SAGEConv((D_IN, 3), 4), "bipartite"),
    (lambda: pnn.GATConv(D_IN, 4, edge_dim=2), "edge_dim=2"),
    (lambda: pnn.GATConv(D_IN, 4, residual=True), "residual=True"),
    (lambda: pnn.APPNP(K=2, alpha=0.1, dropout=0.5), "dropout=0.5"),
    (lambda: pnn.GCNConv(D_IN, 4, flow="target_to_source"), "flow="),
], ids=["improved", "gcn_aggr", "lazy", "sage_project", "sage_min", "sage_bipartite", "gat_edge_dim",
        "gat_residual", "appnp_dropout", "flow"])
def test_unsupported_options(conv: Callable[[], nn.Module], pattern: str) -> None:
    with pytest.raises(gc.TraceError, match=pattern) as info:
        from_pyg(OneConv(conv()))
    assert "'block.conv'" in str(info.value)


def test_conv_with_hook_is_rejected() -> None:
    conv = pnn.GCNConv(D_IN, 4)
    conv.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(gc.TraceError, match="_forward_hooks"):
        from_pyg(OneConv(conv))


class ReadsEdgeIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = self.conv(x, edge_index)
        return h * edge_index.size(1)


def test_edge_index_used_outside_convs() -> None:
    with pytest.raises(gc.TraceError, match="reads edge_index outside its convs at") as info:
        from_pyg(ReadsEdgeIndex())
    assert "edge_index.size(1)" in str(info.value)  # the offending source line


class ConvWithEdgeWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)
        self.register_buffer("w", torch.ones(10))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.conv(x, edge_index, self.w)


def test_conv_called_with_edge_weight() -> None:
    with pytest.raises(gc.TraceError, match="passes edge_weight"):
        from_pyg(ConvWithEdgeWeight())


class NeedsBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)

    def forward(self, x: Tensor, edge_index: Tensor, batch: Tensor) -> Tensor:
        return self.conv(x, edge_index)[batch]


def test_required_extra_input() -> None:
    with pytest.raises(gc.TraceError, match="'batch'"):
        from_pyg(NeedsBatch())


class BranchesOnTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        if self.training:
            x = x + torch.randn_like(x)
        return self.conv(x, edge_index)


def test_mode_dependent_branch() -> None:
    """The message points at the user's line (fx's recorded stack ends in fx's own frames)."""
    with pytest.raises(gc.TraceError, match="different operations in training and eval mode") as info:
        from_pyg(BranchesOnTraining())
    assert f"{__file__}:" in str(info.value) and "x = x + torch.randn_like(x)" in str(info.value)
    assert "torch/fx" not in str(info.value)


class DropsEdges(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        edge_index, _ = pyg_utils.dropout_edge(edge_index, p=0.2, training=self.training)
        return self.conv(x, edge_index)


def test_edge_dropout_is_named_at_the_users_line() -> None:
    """PyG's dropout_edge changes the graph each step: refused as such, at the line calling it."""
    with pytest.raises(gc.TraceError, match=r"drops edges or nodes at random.*one fixed graph") as info:
        from_pyg(DropsEdges())
    assert "pyg_utils.dropout_edge(edge_index" in str(info.value) and "torch_geometric/" not in str(info.value)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = pnn.GCNConv(D_IN, 4)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = self.conv(x, edge_index)
        if h.sum() > 0:
            h = -h
        return h


def test_untraceable_forward() -> None:
    with pytest.raises(gc.TraceError, match="cannot trace DataDependent.forward") as info:
        from_pyg(DataDependent())
    assert "h.sum() > 0" in str(info.value)


def test_bad_inputs() -> None:
    with pytest.raises(gc.TraceError, match="not a single GCNConv"):
        from_pyg(pnn.GCNConv(D_IN, 4))
    with pytest.raises(gc.TraceError, match="expects a torch.nn.Module"):
        from_pyg(lambda x, ei: x)  # type: ignore[arg-type]

    class DataInput(nn.Module):
        def forward(self, data: Any) -> Tensor:
            return data.x

    with pytest.raises(gc.TraceError, match="forward\\(x, edge_index\\)"):
        from_pyg(DataInput())


# --------------------------------------------------------------------------- issue 18: modes through gc.trace
def test_traced_pyg_gat_with_batch_norm_follows_the_mode() -> None:
    """torch_geometric's GAT(norm="batch_norm") put in eval(), converted and traced with gc.trace: the
    traced graph starts in eval mode and normalizes with the running statistics (it used batch
    statistics: 0.20 off PyG's output); in training mode it computes what the converted model does."""
    g, ei = random_graph(24, 70, seed=5)
    torch.manual_seed(0)
    pyg = pnn.models.GAT(D_IN, 4, 3, 3, norm="batch_norm", dropout=0.3).double()
    with torch.no_grad():
        for m in pyg.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    pyg.eval()
    converted = from_pyg(pyg)
    tp = gc.trace(converted, gc.GraphStats.from_graph(g.replace(x=features(24, D_IN, 0).detach())))
    assert not tp.training and not pyg.training and not converted.training
    x = features(24, D_IN, 1)
    ref = pyg(x, ei)
    assert_close(tp(g, x), ref, "traced, eval mode")
    assert_close(converted(g, x), ref, "converted, eval mode")
    # training mode, same seed: the converted model's dropout masks and batch statistics (PyG's GATConv
    # draws its attention dropout in another edge order, see test_nn)
    converted.train(), tp.train()
    torch.manual_seed(3)
    ref = converted(g, x)
    torch.manual_seed(3)
    assert_close(tp(g, x), ref, "traced, training mode (same seed)")
    assert not torch.equal(ref, pyg(x, ei))
