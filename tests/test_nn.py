"""Tests of gnncompile.nn: parity with PyTorch Geometric (outputs and gradients), model structure,
dropout, registry and traceability of every layer by torch.fx."""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable, Optional

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import nn as gnn
from gnncompile.ops import is_primitive

ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def pyg() -> Any:
    """``torch_geometric.nn`` (tests that compare against PyG are skipped without it)."""
    return pytest.importorskip("torch_geometric.nn")


# --------------------------------------------------------------------------- helpers
@st.composite
def edge_lists(draw: Callable[..., Any], symmetric: bool = False, weighted: bool = False):
    """A small random graph without self loops as ``(edge_index, num_nodes, edge_weight, seed)``.

    Parallel edges may occur; 0-2 extra isolated vertices are appended.
    """
    n = draw(st.integers(1, 8))
    extra = draw(st.integers(0, 2))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=18))
    pairs = [(u, v) for u, v in pairs if u != v]
    weights = [draw(st.floats(0.25, 2.0)) for _ in pairs] if weighted else None
    if symmetric:
        pairs = pairs + [(v, u) for u, v in pairs]
        if weights is not None:
            weights = weights + weights
    ei = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t().contiguous()
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    seed = draw(st.integers(0, 2**20))
    return ei, n + extra, w, seed


def make_graph(ei: torch.Tensor, n: int, w: Optional[torch.Tensor] = None) -> gc.Graph:
    return gc.Graph.from_edge_index(ei, n, edge_weight=w)


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    up = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    res = torch.autograd.grad(out, inputs, up, allow_unused=True)
    return [torch.zeros_like(i) if r is None else r for i, r in zip(inputs, res)]


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def copy_by_order(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy parameters and buffers of ``src`` into ``dst`` in registration order (shapes must match)."""
    s = list(src.state_dict().values())
    d = dst.state_dict()
    assert len(s) == len(d), f"{len(s)} tensors vs {len(d)}: {list(d)}"
    for (k, v), t in zip(d.items(), s):
        assert v.shape == t.shape, f"{k}: {tuple(v.shape)} vs {tuple(t.shape)}"
    dst.load_state_dict(dict(zip(d.keys(), s)))


def features(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=torch.float64).requires_grad_()


# --------------------------------------------------------------------------- layer parity
# name -> (ours factory, PyG factory, symmetric graph needed, pass edge_weight to PyG, GCN2-style x0)
def _gin_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))


LAYER_CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[Any], torch.nn.Module], bool, bool, bool]] = {
    "gcn": (lambda: gnn.GCNConv(5, 4), lambda p: p.GCNConv(5, 4), True, True, False),
    "gcn_no_loops": (lambda: gnn.GCNConv(5, 4, add_self_loops=False),
                     lambda p: p.GCNConv(5, 4, add_self_loops=False), True, True, False),
    "gcn_sum": (lambda: gnn.GCNConv(5, 4, normalize=False, bias=False),
                lambda p: p.GCNConv(5, 4, normalize=False, bias=False), False, True, False),
    "sage_mean_transform_first": (lambda: gnn.SAGEConv(5, 3), lambda p: p.SAGEConv(5, 3), False, False, False),
    "sage_mean_propagate_first": (lambda: gnn.SAGEConv(3, 6), lambda p: p.SAGEConv(3, 6), False, False, False),
    "sage_sum": (lambda: gnn.SAGEConv(5, 3, aggr="sum"), lambda p: p.SAGEConv(5, 3, aggr="sum"), False, False, False),
    "sage_max": (lambda: gnn.SAGEConv(5, 3, aggr="max"), lambda p: p.SAGEConv(5, 3, aggr="max"), False, False, False),
    "sage_no_root_normalize": (lambda: gnn.SAGEConv(5, 3, root_weight=False, normalize=True),
                               lambda p: p.SAGEConv(5, 3, root_weight=False, normalize=True), False, False, False),
    "gat_1head": (lambda: gnn.GATConv(5, 4), lambda p: p.GATConv(5, 4), False, False, False),
    "gat_3heads_concat": (lambda: gnn.GATConv(5, 4, heads=3), lambda p: p.GATConv(5, 4, heads=3), False, False, False),
    "gat_2heads_mean_no_loops": (
        lambda: gnn.GATConv(5, 4, heads=2, concat=False, add_self_loops=False, negative_slope=0.1),
        lambda p: p.GATConv(5, 4, heads=2, concat=False, add_self_loops=False, negative_slope=0.1),
        False, False, False),
    "gin_train_eps": (lambda: gnn.GINConv(_gin_mlp(), eps=0.3, train_eps=True),
                      lambda p: p.GINConv(_gin_mlp(), eps=0.3, train_eps=True), False, False, False),
    "gin": (lambda: gnn.GINConv(_gin_mlp()), lambda p: p.GINConv(_gin_mlp()), False, False, False),
    "gcn2_shared": (lambda: gnn.GCN2Conv(5, alpha=0.2, theta=0.5, layer=2),
                    lambda p: p.GCN2Conv(5, alpha=0.2, theta=0.5, layer=2), True, True, True),
    "gcn2_separate": (lambda: gnn.GCN2Conv(5, alpha=0.1, theta=1.0, layer=3, shared_weights=False),
                      lambda p: p.GCN2Conv(5, alpha=0.1, theta=1.0, layer=3, shared_weights=False), True, True, True),
    "appnp": (lambda: gnn.APPNPConv(K=3, alpha=0.1), lambda p: p.APPNP(K=3, alpha=0.1), True, True, False),
    "sgconv": (lambda: gnn.SGConv(5, 3, K=2), lambda p: p.SGConv(5, 3, K=2), True, True, False),
}


def _run_layer_parity(pyg: Any, case: str, data: tuple, weighted: bool) -> None:
    make_ours, make_ref, _, pass_weight, with_x0 = LAYER_CASES[case]
    ei, n, w, seed = data
    torch.manual_seed(seed)
    ours = make_ours().double()
    ref = make_ref(pyg).double()
    ref.load_state_dict(ours.state_dict())  # same parameter names as PyG
    g = make_graph(ei, n, w if weighted else None)
    d = getattr(ours, "in_channels", 5)
    x = features(n, d, seed)
    x0 = features(n, d, seed + 7) if with_x0 else None
    inputs = [x] + ([x0] if x0 is not None else [])
    args_ours = (g, x, x0) if with_x0 else (g, x)
    extra = {"edge_weight": w} if (weighted and pass_weight) else {}
    args_ref = (x, x0, ei) if with_x0 else (x, ei)
    out = ours(*args_ours)
    out_ref = ref(*args_ref, **extra)
    assert_close(out, out_ref, f"{case}: output")
    p_ours = dict(ours.named_parameters())
    p_ref = dict(ref.named_parameters())
    assert p_ours.keys() == p_ref.keys()
    names = list(p_ours)
    g_ours = grads(out, inputs + [p_ours[k] for k in names], seed)
    g_ref = grads(out_ref, inputs + [p_ref[k] for k in names], seed)
    for i, (a, b) in enumerate(zip(g_ours, g_ref)):
        what = f"input {i}" if i < len(inputs) else names[i - len(inputs)]
        assert_close(a, b, f"{case}: grad of {what}")


@pytest.mark.parametrize("case", list(LAYER_CASES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_layer_parity_with_pyg(pyg: Any, case: str, data: st.DataObject) -> None:
    """Each layer equals its PyG counterpart (outputs and gradients of inputs and parameters)."""
    symmetric = LAYER_CASES[case][2]
    weighted = LAYER_CASES[case][3] and data.draw(st.booleans(), label="weighted")
    graph = data.draw(edge_lists(symmetric=symmetric, weighted=weighted), label="graph")
    _run_layer_parity(pyg, case, graph, weighted)


def test_sage_max_tied_gradient(pyg: Any) -> None:
    """Max aggregation over parallel edges (tied maxima) has the true gradient (checked by gradcheck)."""
    g = make_graph(torch.tensor([[0, 0, 2], [1, 1, 1]]), 3)
    torch.manual_seed(0)
    layer = gnn.SAGEConv(4, 3, aggr="max").double()
    x = features(3, 4, 0)
    assert torch.autograd.gradcheck(lambda t: layer(g, t), (x,))


@settings(max_examples=25, deadline=None)
@given(data=edge_lists(), heads=st.integers(1, 3), with_existing_loops=st.booleans())
def test_implicit_self_loops_equal_explicit(pyg: Any, data: tuple, heads: int, with_existing_loops: bool) -> None:
    """``add_self_loops=True`` equals PyG on the graph with one explicit loop per vertex added.

    This holds also where the graph already has self loops (PyG's own add_self_loops=True would
    replace or skip those: the documented difference).
    """
    ei, n, _, seed = data
    if with_existing_loops:
        ei = torch.cat([ei, torch.arange(0, n, 2).repeat(2, 1)], dim=1)
    loops = torch.arange(n).repeat(2, 1)
    x = features(n, 5, seed)
    torch.manual_seed(seed)
    # GCN norms need a symmetric graph for parity (module docstring of gnncompile.nn.layers)
    ei_sym = torch.cat([ei, ei.flip(0)], dim=1)
    ours, ref = gnn.GCNConv(5, 3).double(), pyg.GCNConv(5, 3, add_self_loops=False).double()
    ref.load_state_dict(ours.state_dict())
    assert_close(ours(make_graph(ei_sym, n), x), ref(x, torch.cat([ei_sym, loops], 1)), "GCNConv loops")
    ours, ref = gnn.GATConv(5, 3, heads=heads).double(), pyg.GATConv(5, 3, heads=heads, add_self_loops=False).double()
    ref.load_state_dict(ours.state_dict())
    assert_close(ours(make_graph(ei, n), x), ref(x, torch.cat([ei, loops], 1)), "GATConv loops")


# --------------------------------------------------------------------------- model parity
def _model_graph(n: int = 24, seed: int = 0) -> tuple[gc.Graph, torch.Tensor]:
    """A symmetric random graph with isolated vertices (the last 3 vertices)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n - 3, (60,), generator=gen)
    dst = torch.randint(0, n - 3, (60,), generator=gen)
    keep = src != dst
    ei = torch.stack([src[keep], dst[keep]])
    ei = torch.cat([ei, ei.flip(0)], dim=1)
    return make_graph(ei, n), ei


class _RefGAT(torch.nn.Module):
    def __init__(self, pyg: Any, ours: gnn.GAT) -> None:
        super().__init__()
        self.p = ours.dropout
        self.convs = torch.nn.ModuleList(
            pyg.GATConv(c.in_channels, c.out_channels, heads=c.heads, concat=c.concat, dropout=c.dropout)
            for c in ours.convs)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = F.dropout(x, self.p, self.training)
            x = conv(x, ei)
            if i < len(self.convs) - 1:
                x = F.elu(x)
        return x


class _RefGCNII(torch.nn.Module):
    def __init__(self, pyg: Any, d_in: int, h: int, d_out: int, layers: int, alpha: float, theta: float,
                 p: float, shared: bool) -> None:
        super().__init__()
        self.p = p
        self.lins = torch.nn.ModuleList([torch.nn.Linear(d_in, h), torch.nn.Linear(h, d_out)])
        self.convs = torch.nn.ModuleList(
            pyg.GCN2Conv(h, alpha, theta, l + 1, shared_weights=shared) for l in range(layers))

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.p, self.training)
        x = x_0 = self.lins[0](x).relu()
        for conv in self.convs:
            x = F.dropout(x, self.p, self.training)
            x = conv(x, x_0, ei).relu()
        x = F.dropout(x, self.p, self.training)
        return self.lins[1](x)


class _RefAPPNP(torch.nn.Module):
    def __init__(self, pyg: Any, d_in: int, h: int, d_out: int, K: int, alpha: float, p: float) -> None:
        super().__init__()
        self.p = p
        self.lins = torch.nn.ModuleList([torch.nn.Linear(d_in, h), torch.nn.Linear(h, d_out)])
        self.prop = pyg.APPNP(K, alpha)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.p, self.training)
        x = self.lins[0](x).relu()
        x = F.dropout(x, self.p, self.training)
        return self.prop(self.lins[1](x), ei)


class _RefSGC(torch.nn.Module):
    def __init__(self, pyg: Any, d_in: int, d_out: int, K: int) -> None:
        super().__init__()
        self.conv = pyg.SGConv(d_in, d_out, K=K)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        return self.conv(x, ei)


class _RefResGCN(torch.nn.Module):
    """PyG ``examples/ogbn_proteins_deepgcn.py`` with GCNConv and LayerNorm."""

    def __init__(self, pyg: Any, d_in: int, h: int, d_out: int, layers: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.encoder = torch.nn.Linear(d_in, h)
        self.layers = torch.nn.ModuleList(
            pyg.DeepGCNLayer(pyg.GCNConv(h, h), torch.nn.LayerNorm(h), torch.nn.ReLU(), block="res+", dropout=p)
            for _ in range(layers))
        self.decoder = torch.nn.Linear(h, d_out)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        x = self.layers[0].conv(x, ei)
        for layer in self.layers[1:]:
            x = layer(x, ei)
        x = self.layers[0].act(self.layers[0].norm(x))
        x = F.dropout(x, self.p, self.training)
        return self.decoder(x)


def _resgcn_to_ref(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    sd = {}
    for k, v in ours.state_dict().items():
        parts = k.split(".")
        if parts[0] in ("convs", "norms"):
            k = f"layers.{parts[1]}.{'conv' if parts[0] == 'convs' else 'norm'}." + ".".join(parts[2:])
        sd[k] = v
    ref.load_state_dict(sd)


RefFactory = Callable[[Any, torch.nn.Module], torch.nn.Module]
MODEL_CASES: dict[str, tuple[Callable[[], torch.nn.Module], RefFactory, bool]] = {
    # name -> (ours, PyG reference built from ours (weights copied), train-mode dropout draws identical)
    "gcn": (lambda: gnn.GCN(6, 10, 3, num_layers=3, dropout=0.5),
            lambda p, o: p.models.GCN(6, 10, 3, 3, dropout=0.5), True),
    "sage": (lambda: gnn.GraphSAGE(6, 10, 3, num_layers=2, dropout=0.5),
             lambda p, o: p.models.GraphSAGE(6, 10, 2, 3, dropout=0.5), True),
    "gin": (lambda: gnn.GIN(6, 10, 3, num_layers=3, dropout=0.5),
            lambda p, o: p.models.GIN(6, 10, 3, 3, dropout=0.5), True),
    "gat": (lambda: gnn.GAT(6, 4, 3, num_layers=3, heads=3, dropout=0.6, out_heads=2),
            lambda p, o: _RefGAT(p, o), False),
    "gcnii": (lambda: gnn.GCNII(6, 10, 3, num_layers=4, alpha=0.1, theta=0.5, dropout=0.6),
              lambda p, o: _RefGCNII(p, 6, 10, 3, 4, 0.1, 0.5, 0.6, True), True),
    "gcnii_separate": (lambda: gnn.GCNII(6, 10, 3, num_layers=3, shared_weights=False, dropout=0.6),
                       lambda p, o: _RefGCNII(p, 6, 10, 3, 3, 0.1, 0.5, 0.6, False), True),
    "appnp": (lambda: gnn.APPNP(6, 10, 3, K=5, alpha=0.1, dropout=0.5),
              lambda p, o: _RefAPPNP(p, 6, 10, 3, 5, 0.1, 0.5), True),
    "sgc": (lambda: gnn.SGC(6, 3, K=2), lambda p, o: _RefSGC(p, 6, 3, 2), True),
    "resgcn": (lambda: gnn.ResGCN(6, 10, 3, num_layers=4, dropout=0.1),
               lambda p, o: _RefResGCN(p, 6, 10, 3, 4, 0.1), True),
}


def _param_pairs(case: str, ours: torch.nn.Module, ref: torch.nn.Module) -> list[tuple[str, str]]:
    """(our parameter name, PyG parameter name) pairs, mapped as the weights were copied."""
    names = [k for k, _ in ours.named_parameters()]
    if case == "resgcn":
        def rename(k: str) -> str:
            parts = k.split(".")
            if parts[0] in ("convs", "norms"):
                return f"layers.{parts[1]}.{'conv' if parts[0] == 'convs' else 'norm'}." + ".".join(parts[2:])
            return k
        return [(k, rename(k)) for k in names]
    if case in ("gin", "sgc"):
        return list(zip(names, [k for k, _ in ref.named_parameters()]))
    return [(k, k) for k in names]


def _load_ref(case: str, ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    if case == "resgcn":
        _resgcn_to_ref(ours, ref)
    elif case in ("gin", "sgc"):
        copy_by_order(ours, ref)
    else:
        ref.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_parity_with_pyg(pyg: Any, case: str, train: bool) -> None:
    """Models equal their PyG reference stacks: eval mode always; train mode (same seed, same
    dropout draws) where both draw the same dropout masks in the same order (not GAT: attention
    dropout masks are drawn over differently ordered edges)."""
    make_ours, make_ref, same_draws = MODEL_CASES[case]
    if train and not same_draws:
        pytest.skip("attention dropout masks are drawn in a different edge order than PyG's")
    torch.manual_seed(0)
    ours = make_ours().double()
    ref = make_ref(pyg, ours).double()
    _load_ref(case, ours, ref)
    ours.train(train)
    ref.train(train)
    g, ei = _model_graph()
    x = features(g.num_nodes, 6, 3)
    torch.manual_seed(123)
    out = ours(g, x)
    torch.manual_seed(123)
    out_ref = ref(x, ei)
    assert_close(out, out_ref, f"{case}: logits")
    pairs = _param_pairs(case, ours, ref)
    assert len(pairs) == len(list(ours.parameters())) == len(list(ref.parameters()))
    po, pr = dict(ours.named_parameters()), dict(ref.named_parameters())
    g_ours = grads(out, [x] + [po[a] for a, _ in pairs], 0)
    g_ref = grads(out_ref, [x] + [pr[b] for _, b in pairs], 0)
    assert_close(g_ours[0], g_ref[0], f"{case}: grad of x")
    for (a, _), ga, gb in zip(pairs, g_ours[1:], g_ref[1:]):
        assert_close(ga, gb, f"{case}: grad of {a}")


# --------------------------------------------------------------------------- structure
def _small_graph() -> tuple[gc.Graph, torch.Tensor]:
    g, _ = _model_graph(n=16, seed=1)
    return g, torch.randn(g.num_nodes, 6)


def _all_models(dropout: float = 0.5) -> dict[str, torch.nn.Module]:
    out = {}
    for name in gnn.MODELS:
        kw: dict[str, Any] = {"dropout": dropout}
        if name in ("gcnii", "resgcn"):
            kw["num_layers"] = 3
        out[name] = gnn.build_model(name, 6, 8, 3, **kw)
    return out


def test_forward_signature() -> None:
    for name, cls in gnn.MODELS.items():
        assert list(inspect.signature(cls.forward).parameters) == ["self", "g", "x"], name
    for cls in (gnn.GCNConv, gnn.SAGEConv, gnn.GATConv, gnn.GINConv, gnn.APPNPConv, gnn.SGConv):
        assert list(inspect.signature(cls.forward).parameters) == ["self", "g", "x"], cls.__name__
    assert list(inspect.signature(gnn.GCN2Conv.forward).parameters) == ["self", "g", "x", "x0"]


def test_exports() -> None:
    for name in ("GCNConv", "SAGEConv", "GATConv", "GINConv", "GCN2Conv", "APPNPConv", "SGConv", "GCN",
                 "GraphSAGE", "GAT", "GIN", "GCNII", "APPNP", "SGC", "ResGCN", "MODELS", "build_model"):
        assert hasattr(gc.nn, name) and name in gc.nn.__all__, name
    assert gnn.MODELS == {"gcn": gnn.GCN, "sage": gnn.GraphSAGE, "gat": gnn.GAT, "gin": gnn.GIN,
                          "gcnii": gnn.GCNII, "appnp": gnn.APPNP, "sgc": gnn.SGC, "resgcn": gnn.ResGCN}


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_parameter_counts() -> None:
    assert _count(gnn.GCN(16, 32, 7)) == (16 * 32 + 32) + (32 * 7 + 7)
    assert _count(gnn.GCN(16, 32, 7, num_layers=1)) == 16 * 7 + 7
    assert _count(gnn.GraphSAGE(16, 32, 7)) == (2 * 16 * 32 + 32) + (2 * 32 * 7 + 7)
    assert _count(gnn.GAT(16, 8, 7, heads=8)) == (16 * 64 + 2 * 64 + 64) + (64 * 7 + 2 * 7 + 7)
    assert _count(gnn.GIN(16, 32, 7)) == (16 * 32 + 32 + 32 * 32 + 32) + (32 * 7 + 7 + 7 * 7 + 7)
    assert _count(gnn.GIN(16, 32, 7, train_eps=True)) == _count(gnn.GIN(16, 32, 7)) + 2
    assert _count(gnn.GCNII(16, 32, 7, num_layers=4)) == (16 * 32 + 32) + (32 * 7 + 7) + 4 * 32 * 32
    assert _count(gnn.GCNII(16, 32, 7, num_layers=4, shared_weights=False)) == (
        (16 * 32 + 32) + (32 * 7 + 7) + 8 * 32 * 32)
    assert _count(gnn.APPNP(16, 32, 7)) == (16 * 32 + 32) + (32 * 7 + 7)
    assert _count(gnn.SGC(16, 7)) == 16 * 7 + 7
    assert _count(gnn.ResGCN(16, 32, 7, num_layers=3)) == (
        (16 * 32 + 32) + 3 * (32 * 32 + 32) + 3 * 2 * 32 + (32 * 7 + 7))
    assert _count(gnn.ResGCN(16, 32, 7, num_layers=3, norm="none", conv="sage")) == (
        (16 * 32 + 32) + 3 * (2 * 32 * 32 + 32) + (32 * 7 + 7))


def test_outputs_and_backward_every_model() -> None:
    g, x = _small_graph()
    for name, model in _all_models().items():
        out = model(g, x)
        assert out.shape == (g.num_nodes, 3), name
        assert torch.isfinite(out).all(), name
        out.logsumexp(-1).sum().backward()
        for pname, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}.{pname}"


def test_resgcn_variants() -> None:
    g, x = _small_graph()
    for conv in ("gcn", "sage", "gin"):
        for norm in ("layer", "batch", "none"):
            m = gnn.ResGCN(6, 8, 3, num_layers=3, conv=conv, norm=norm)
            assert m(g, x).shape == (g.num_nodes, 3)
            m.eval()
            assert torch.isfinite(m(g, x)).all()
    m = gnn.ResGCN(6, 8, 3, num_layers=1)
    assert m(g, x).shape == (g.num_nodes, 3)


def test_dropout_determinism() -> None:
    g, x = _small_graph()
    for name, model in _all_models(dropout=0.5).items():
        model.train()
        torch.manual_seed(7)
        a = model(g, x)
        torch.manual_seed(7)
        b = model(g, x)
        torch.manual_seed(8)
        c = model(g, x)
        assert torch.equal(a, b), f"{name}: same seed, different outputs"
        assert not torch.equal(a, c), f"{name}: dropout had no effect in training mode"
        model.eval()
        torch.manual_seed(9)
        e1 = model(g, x)
        e2 = model(g, x)
        assert torch.equal(e1, e2), f"{name}: eval mode is not deterministic"
        with torch.no_grad():
            assert torch.equal(model(g, x), e1), name


def test_dropout_zero_train_equals_eval() -> None:
    g, x = _small_graph()
    for name, model in _all_models(dropout=0.0).items():
        model.train()
        a = model(g, x)
        model.eval()
        torch.testing.assert_close(a, model(g, x), msg=name)


def test_reset_parameters() -> None:
    for name, model in _all_models().items():
        before = copy.deepcopy(model.state_dict())
        torch.manual_seed(11)
        model.reset_parameters()
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert changed, f"{name}: reset_parameters changed nothing"
    gin = gnn.GINConv(torch.nn.Linear(3, 3), eps=0.25, train_eps=True)
    with torch.no_grad():
        gin.eps.fill_(3.0)
    gin.reset_parameters()
    assert float(gin.eps.detach()) == 0.25


def test_sage_order_choice() -> None:
    assert gnn.SAGEConv(16, 4).transform_first
    assert not gnn.SAGEConv(4, 16).transform_first
    assert not gnn.SAGEConv(16, 4, aggr="max").transform_first


def test_gcn2_beta() -> None:
    assert gnn.GCN2Conv(4, 0.1, theta=0.5, layer=3).beta == pytest.approx(math.log(0.5 / 3 + 1))
    assert gnn.GCN2Conv(4, 0.1).beta == 1.0
    assert gnn.GCNII(4, 8, 2, num_layers=3, theta=0.5).convs[2].beta == pytest.approx(math.log(0.5 / 3 + 1))


# --------------------------------------------------------------------------- registry and validation
def test_build_model_unknown_name() -> None:
    with pytest.raises(ValueError) as exc:
        gnn.build_model("transformer", 4, 8, 2)
    msg = str(exc.value)
    assert "transformer" in msg
    for name in gnn.MODELS:
        assert name in msg


def test_build_model_arguments() -> None:
    m = gnn.build_model("GCN", 4, 8, 2, num_layers=3, dropout=0.1)
    assert isinstance(m, gnn.GCN) and len(m.convs) == 3 and m.dropout == 0.1
    sgc = gnn.build_model("sgc", 4, 999, 2, K=3)
    assert isinstance(sgc, gnn.SGC) and sgc.conv.K == 3 and _count(sgc) == 4 * 2 + 2
    gat = gnn.build_model("gat", 4, 8, 2, heads=4)
    assert gat.convs[0].heads == 4
    with pytest.raises(ValueError, match="bogus"):
        gnn.build_model("gcn", 4, 8, 2, bogus=1)
    # the CLI passes num_layers to every model; SGC takes it as its number of hops K
    assert gnn.build_model("sgc", 4, 8, 2, num_layers=3, dropout=0.5).conv.K == 3
    with pytest.raises(ValueError, match="num_layers"):
        gnn.build_model("sgc", 4, 8, 2, num_layers=0)
    with pytest.raises(ValueError, match="not both"):
        gnn.build_model("sgc", 4, 8, 2, num_layers=2, K=2)
    with pytest.raises(ValueError, match="heads"):
        gnn.build_model("gcn", 4, 8, 2, heads=4)


@pytest.mark.parametrize("name", list(gnn.MODELS))
def test_num_layers_and_dropout_validated(name: str) -> None:
    cls = gnn.MODELS[name]
    params = inspect.signature(cls.__init__).parameters
    if "num_layers" in params or "K" in params:
        for bad in (0, -1):
            with pytest.raises(ValueError, match="num_layers"):
                gnn.build_model(name, 4, 8, 2, num_layers=bad)
        with pytest.raises(ValueError, match="num_layers"):
            gnn.build_model(name, 4, 8, 2, num_layers=2.5)
        m = gnn.build_model(name, 4, 8, 2, num_layers=1)
        g, _ = _model_graph(n=10)
        assert m(g, torch.randn(10, 4)).shape == (10, 2)
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="dropout"):
            gnn.build_model(name, 4, 8, 2, dropout=bad)
    with pytest.raises(ValueError, match="in_channels"):
        gnn.build_model(name, 0, 8, 2)


def test_layer_argument_validation() -> None:
    with pytest.raises(ValueError, match="heads"):
        gnn.GATConv(4, 4, heads=0)
    with pytest.raises(ValueError, match="aggr"):
        gnn.SAGEConv(4, 4, aggr="lstm")
    with pytest.raises(ValueError, match="K"):
        gnn.APPNPConv(0, 0.1)
    with pytest.raises(ValueError, match="K"):
        gnn.SGConv(4, 2, K=0)
    with pytest.raises(ValueError, match="alpha"):
        gnn.APPNPConv(3, 1.5)
    with pytest.raises(ValueError, match="conv"):
        gnn.ResGCN(4, 8, 2, conv="gat")
    with pytest.raises(ValueError, match="norm"):
        gnn.ResGCN(4, 8, 2, norm="group")
    with pytest.raises(ValueError, match="out_heads"):
        gnn.GAT(4, 8, 2, out_heads=0)


def test_self_loop_defaults_follow_pyg() -> None:
    assert gnn.GCNConv(4, 4).add_self_loops
    assert not gnn.GCNConv(4, 4, normalize=False).add_self_loops
    assert gnn.GCNConv(4, 4, normalize=False, add_self_loops=True).add_self_loops
    assert not gnn.GCN2Conv(4, 0.1, normalize=False).add_self_loops
    assert not gnn.APPNPConv(2, 0.1, normalize=False).add_self_loops


# --------------------------------------------------------------------------- fx traceability
def _graph_users_are_primitives(gm: torch.fx.GraphModule) -> int:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gnode = placeholders[0]
    assert gnode.name == "g"
    for user in gnode.users:
        assert user.op == "call_function" and is_primitive(user.target), (
            f"the graph is used by {user.op} {user.target}: layers may only pass g to gnncompile.ops")
    return len(gnode.users)


@pytest.mark.parametrize("name", list(gnn.MODELS))
def test_models_trace_with_fx(name: str) -> None:
    """Every model traces with torch.fx; the graph input reaches only the primitives, and the traced
    module computes the same function."""
    model = _all_models()[name].eval()
    gm = torch.fx.symbolic_trace(model)
    assert _graph_users_are_primitives(gm) >= 1
    g, x = _small_graph()
    torch.testing.assert_close(gm(g, x), model(g, x))


def test_layers_trace_with_fx() -> None:
    g, x = _small_graph()
    layers: list[torch.nn.Module] = [
        gnn.GCNConv(6, 4), gnn.SAGEConv(6, 4), gnn.SAGEConv(6, 8), gnn.SAGEConv(6, 4, aggr="max"),
        gnn.GATConv(6, 4, heads=2), gnn.GINConv(torch.nn.Linear(6, 4)), gnn.APPNPConv(2, 0.1), gnn.SGConv(6, 3, K=2),
    ]
    for layer in layers:
        gm = torch.fx.symbolic_trace(layer)
        _graph_users_are_primitives(gm)
        torch.testing.assert_close(gm(g, x), layer(g, x), msg=type(layer).__name__)
    gcn2 = gnn.GCN2Conv(6, 0.1, 0.5, 1)
    gm = torch.fx.symbolic_trace(gcn2)
    _graph_users_are_primitives(gm)
    x0 = torch.randn_like(x)
    torch.testing.assert_close(gm(g, x, x0), gcn2(g, x, x0))


def test_gat_attention_stays_per_head() -> None:
    """GATConv propagates [N, H, C] features with [E', H] weights: no edge tensor has a channel axis."""
    layer = gnn.GATConv(6, 5, heads=3)
    gm = torch.fx.symbolic_trace(layer)
    g, x = _small_graph()
    shapes: dict[str, tuple[int, ...]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n.name] = tuple(out.shape)
            return out

    Recorder(gm).run(g, x)
    e_rows = g.num_edges + g.num_nodes
    edge_shapes = [s for s in shapes.values() if s and s[0] == e_rows]
    assert edge_shapes and all(s == (e_rows, 3) for s in edge_shapes), edge_shapes
