"""Graph passes (`insert_recomputation`, `decouple`/`decouple_exact`, `fuse_masked_propagate`) and the
pass infrastructure around them.

Every pass runs through a verifying :class:`PassManager`; exact passes are compared with the
un-rewritten traced module on outputs and every parameter gradient (float64, same seed, dropout
on), relaxed ones with hand-written references of the model they claim to produce. Hypothesis
draws small graphs with isolated vertices, self loops and parallel edges.
"""

from __future__ import annotations

import copy
import io
import operator
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PassError
from gnncompile.frontend import ops
from gnncompile.frontend.ops import dropout_noise, masked_propagate, plan_dropout_draws, propagate
from gnncompile.ir.tpgraph import TPGraph, TPInfo
from gnncompile.passes import PassManager, PrintIR, Timing, graph_pass, verify
from gnncompile.passes.decouple import decouple, decouple_exact, plan_decoupling
from gnncompile.passes.fuse_masked_propagate import find_masked_propagations, fuse_masked_propagate
from gnncompile.passes.recompute import Recompute, insert_recomputation, source_name, t_segments
from gnncompile.kernels import CSR
from gnncompile.kernels import masked as masked_kernels

DT = torch.float64
EXACT = dict(rtol=0.0, atol=0.0)  # same ops in the same order: bit for bit
ACCUM = dict(rtol=1e-12, atol=1e-14)  # same ops; gradients of a tensor read by several ops may add up in another order
REASSOC = dict(rtol=1e-10, atol=1e-12)  # (Â x) W vs Â (x W)
PROPS = settings(max_examples=25, deadline=None)


# --------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def graph() -> gc.Graph:
    return gc.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=8, num_classes=3, seed=0)


@st.composite
def small_graphs(draw: Callable[..., Any]) -> gc.Graph:
    """1-9 vertices plus 0-2 isolated ones; self loops and parallel edges allowed."""
    n = draw(st.integers(1, 9))
    extra = draw(st.integers(0, 2))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=24))
    ei = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t().contiguous()
    return gc.Graph.from_edge_index(ei, n + extra, x=torch.randn(n + extra, 5))


def features(g: gc.Graph, f: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(g.num_nodes, f, generator=torch.Generator().manual_seed(seed), dtype=DT)


def traced(model: torch.nn.Module, g: gc.Graph) -> TPGraph:
    return gc.trace(model.double(), g, dtype=DT)


def run(module: torch.nn.Module, g: gc.Graph, x: torch.Tensor, seed: int = 0
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Output, gradient of every named parameter, and gradient of ``x`` for a fixed upstream gradient."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    # F.dropout draws as dropout_noise does (as in gnncompile's training), in a recomputing replay too
    with plan_dropout_draws():
        out = module(g, x)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
        params = dict(module.named_parameters())
        got = torch.autograd.grad(out, list(params.values()) + [x], up, allow_unused=True)
    grads = {k: (torch.zeros_like(p) if gr is None else gr) for (k, p), gr in zip(params.items(), got)}
    return out.detach(), grads, got[-1]


def check_same(a: torch.nn.Module, b: torch.nn.Module, g: gc.Graph, x: torch.Tensor, tol: dict[str, float],
               seed: int = 0) -> None:
    """Outputs, every parameter gradient (matched by name) and the input gradient agree."""
    out_a, grads_a, gx_a = run(a, g, x, seed)
    out_b, grads_b, gx_b = run(b, g, x, seed)
    torch.testing.assert_close(out_b, out_a, **tol)
    assert set(grads_b) == set(grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **tol, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(gx_b, gx_a, **tol)


def saved_storage_bytes(module: torch.nn.Module, g: gc.Graph, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after one forward: unique storages, parameters and x excluded."""
    seen: dict[int, int] = {}
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st_ = t.untyped_storage()
        seen[st_.data_ptr()] = st_.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(g, x.detach().requires_grad_(True))
    return sum(v for k, v in seen.items() if k not in exclude)


def targets(tp: TPGraph) -> list[Any]:
    return [n.target for n in tp.graph.nodes if n.op in ("call_function", "call_module")]


MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 16, c, num_layers=3, dropout=0.5),
    "gat": lambda f, c: gc.nn.GAT(f, 4, c, num_layers=2, heads=2, dropout=0.3),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 12, c, num_layers=2),
    "gin": lambda f, c: gc.nn.GIN(f, 12, c, num_layers=2),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 12, c, num_layers=3, dropout=0.3),
}


# --------------------------------------------------------------------------- infrastructure
def test_pass_contracts() -> None:
    for p in (insert_recomputation, fuse_masked_propagate, decouple, decouple_exact):
        for section in ("Requires", "Ensures", "Preserves", "Exact" if p.exact else "Relaxed"):
            assert section in p.doc, f"{p.name} lacks {section}"
    for p in (insert_recomputation, fuse_masked_propagate, decouple):
        assert "Example" in p.doc and "before" in p.doc and "after" in p.doc
    assert insert_recomputation.exact and fuse_masked_propagate.exact and decouple_exact.exact
    assert not decouple.exact


def test_pass_manager_verifies_and_instruments(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    before = str(tp.graph)
    buf, timing = io.StringIO(), Timing()
    out = PassManager([fuse_masked_propagate, "insert_recomputation"], instruments=[PrintIR(before=True, stream=buf),
                                                                                     timing])(tp)
    verify(out)
    text = buf.getvalue()
    for title in ("before fuse_masked_propagate", "after fuse_masked_propagate", "before insert_recomputation",
                  "after insert_recomputation"):
        assert f"=== {title} ===" in text
    assert "masked_propagate" in text and "recomputed in backward" in text
    assert set(timing.times) == {"fuse_masked_propagate", "insert_recomputation"}
    assert "insert_recomputation" in str(timing)
    assert str(tp.graph) == before, "a pass mutated its input"
    check_same(tp, out, graph, features(graph, 8), EXACT)


def test_corrupting_pass_reported_by_name(graph: gc.Graph) -> None:
    @graph_pass(exact=True, name="test_passes_corrupts_kind")
    def corrupt(tp: TPGraph) -> TPGraph:
        """Mark a T op as a P op. Requires: anything. Ensures: broken IR. Preserves: nothing."""
        node = next(n for n in tp.graph.nodes if n.meta["tp"].kind == "T")
        node.meta["tp"] = node.meta["tp"].with_(kind="P")
        return tp

    tp = traced(MODELS["gcn"](8, 3), graph)
    with pytest.raises(PassError, match="pass test_passes_corrupts_kind produced invalid IR: node 'convs_0_lin'"):
        PassManager([insert_recomputation, corrupt])(tp)
    bad = TPGraph(tp, tp.graph, tp.stats)
    next(n for n in bad.graph.nodes if n.op == "call_module").meta.pop("tp")
    with pytest.raises(PassError, match="input IR is invalid"):
        PassManager([insert_recomputation])(bad)


def test_relaxed_pass_refused_under_exact_semantics(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    with pytest.raises(PassError, match="pass decouple is relaxed"):
        PassManager(["decouple"])
    with pytest.raises(PassError, match="pass decouple is relaxed"):
        PassManager([insert_recomputation, decouple], semantics="exact")
    verify(PassManager([decouple], semantics="relaxed")(tp))


# --------------------------------------------------------------------------- insert_recomputation
def test_t_segments_of_gcn(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    segs = t_segments(tp)
    assert [s.nodes for s in segs] == [("convs_0_lin",), ("add", "relu", "dropout", "convs_1_lin"),
                                       ("add_1", "relu_1", "dropout_1", "convs_2_lin"), ("add_2",)]
    assert segs[1].inputs == ("propagate",) and segs[1].outputs == ("convs_1_lin",) and segs[1].layer == 2
    # only the hidden layers' segments save more than they would keep
    assert [s.savings(tp) > 0 for s in segs] == [False, True, True, False]


def test_recompute_gcn_exact_and_saves_memory(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    out = PassManager([insert_recomputation])(tp)
    wrappers = [n for n in out.graph.nodes
                if n.op == "call_module" and isinstance(out.get_submodule(n.target), Recompute)]
    assert [n.target for n in wrappers] == ["recompute_0", "recompute_1"]
    assert all(n.meta["tp"].recompute and n.meta["tp"].kind == "T" for n in wrappers)
    assert [n.meta["tp"].layer for n in wrappers] == [2, 3]
    assert "relu" not in {n.name for n in out.graph.nodes}
    x = features(graph, 8)
    check_same(tp, out, graph, x, EXACT, seed=3)
    # annotations and a real run agree that less is saved for backward
    assert out.summary().activation_bytes < tp.summary().activation_bytes
    total = lambda t: sum(t.value(n.meta["tp"].saved_bytes) for n in t.ops())  # noqa: E731
    assert total(out) < total(tp)
    assert saved_storage_bytes(out, graph, x) < 0.75 * saved_storage_bytes(tp, graph, x)
    # without gradients the body runs plainly
    with torch.no_grad():
        torch.manual_seed(0)
        a = tp(graph, x)
        torch.manual_seed(0)
        b = out(graph, x)
    torch.testing.assert_close(b, a, **EXACT)
    assert {source_name(k) for k in out.state_dict()} == set(tp.state_dict())
    # the segment bodies share the graph's parameters, in copies too (each parameter listed once)
    clone = copy.deepcopy(out)
    assert clone.get_submodule("recompute_0.body.convs.1.lin").weight is clone.get_submodule("convs.1.lin").weight
    assert [k for k, _ in clone.named_parameters()] == [k for k, _ in tp.named_parameters()]


@pytest.mark.parametrize("name", ["gat", "gcnii", "gin"])
def test_recompute_multi_output_segments(graph: gc.Graph, name: str) -> None:
    tp = traced(MODELS[name](8, 3), graph)
    out = PassManager([insert_recomputation])(tp)
    assert any(isinstance(m, Recompute) for m in out.modules())
    check_same(tp, out, graph, features(graph, 8), ACCUM, seed=5)


@PROPS
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 1000))
def test_recompute_property(g: gc.Graph, name: str, seed: int) -> None:
    torch.manual_seed(seed)
    tp = traced(MODELS[name](5, 2), g)
    out = PassManager([insert_recomputation])(tp)
    check_same(tp, out, g, features(g, 5, seed), ACCUM, seed=seed)


def test_recompute_explicit_segments_and_errors(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    out = insert_recomputation(tp, segments=[["relu", "dropout"]])
    verify(out)
    assert [n.op for n in out.graph.nodes].count("call_module") == 4  # 3 Linear + 1 Recompute
    check_same(tp, out, graph, features(graph, 8), EXACT, seed=1)
    with pytest.raises(PassError, match="insert_recomputation: only T ops.*'propagate' is P"):
        insert_recomputation(tp, segments=[["relu", "propagate"]])
    with pytest.raises(PassError, match="insert_recomputation: segment .* is not convex"):
        insert_recomputation(tp, segments=[["convs_0_lin", "add"]])
    with pytest.raises(PassError, match="insert_recomputation: no node named 'nope'"):
        insert_recomputation(tp, segments=[["nope"]])
    with pytest.raises(PassError, match="overlap"):
        insert_recomputation(tp, segments=[["relu", "dropout"], ["dropout"]])
    with pytest.raises(PassError, match="empty segment"):
        insert_recomputation(tp, segments=[[]])


# --------------------------------------------------------------------------- decouple
class LinearGNN(torch.nn.Module):
    """``Â ... Â (x W_1) ... W_L`` with scalings: every T op commutes with propagation."""

    def __init__(self, dims: list[int], norm: str, loops: bool) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))
        self.norm, self.loops = norm, loops

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.lins):
            x = propagate(g, lin(x) * 0.5, self.norm, add_self_loops=self.loops)
            if i % 2:
                x = x - 0.25 * (-x)  # a sum of equally propagated terms
        return x


@PROPS
@given(g=small_graphs(), dims=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       norm=st.sampled_from(["gcn", "mean", "sum"]), loops=st.booleans(), seed=st.integers(0, 1000))
def test_decouple_exact_linear_property(g: gc.Graph, dims: list[int], norm: str, loops: bool, seed: int) -> None:
    dims = [5] + dims  # the graphs have 5 features
    torch.manual_seed(seed)
    model = LinearGNN(dims, norm, loops) if seed % 2 else gc.nn.SGC(dims[0], dims[-1], K=len(dims))
    if isinstance(model, gc.nn.SGC):
        model.conv.lin.bias = None
    tp = traced(model, g)
    plan = plan_decoupling(tp)
    assert plan.exact, plan
    out = PassManager(["decouple_exact"])(tp)
    props = [n for n in out.graph.nodes if n.target is ops.propagate]
    assert [n.meta["tp"].layer for n in props] == list(range(1, out.num_layers + 1))
    assert all(n.meta["tp"].layer == 1 for n in out.ops(("T", "E")))
    check_same(tp, out, g, features(g, dims[0], seed), REASSOC, seed=seed)


def test_decouple_plans(graph: gc.Graph) -> None:
    gcn = plan_decoupling(traced(MODELS["gcn"](8, 3), graph))
    assert not gcn.exact and len(gcn.propagations) == 3
    text = "\n".join(gcn.reasons)
    assert "'relu'" in text and "'convs_0_bias'" in text and "'dropout'" in text
    sgc = plan_decoupling(traced(gc.nn.SGC(8, 3, K=2), graph))  # Â^K x W + b: the bias would be propagated
    assert not sgc.exact and "'conv_lin_bias'" in sgc.reasons[0]
    appnp = plan_decoupling(traced(gc.nn.APPNP(8, 8, 3, K=2), graph))
    assert not appnp.exact and "propagated 0 and 1 time(s)" in appnp.reasons[0]
    gat = plan_decoupling(traced(MODELS["gat"](8, 3), graph))
    assert gat.propagations[0].edge_weight is not None and not gat.exact
    assert any("averaged over heads" in r for r in gat.reasons)
    assert any("edge op on propagated features" in r for r in gat.reasons)


def gcn_decoupled(model: gc.nn.GCN, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
    """Hand-written decoupled GCN: the MLP (every layer without its propagation), then L propagations."""
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        x = conv.lin(x) + conv.bias
        if i < last:
            x = F.dropout(F.relu(x), p=model.dropout, training=True)
    for _ in model.convs:
        x = propagate(g, x, "gcn", add_self_loops=True)
    return x


def gat_decoupled(model: gc.nn.GAT, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
    """Hand-written decoupled GAT: attention from un-propagated features, head-averaged, then propagations."""
    alphas = []
    last = len(model.convs) - 1
    for i, conv in enumerate(model.convs):
        x = F.dropout(x, p=model.dropout, training=True)
        h = conv.lin(x).view(-1, conv.heads, conv.out_channels)
        a_src, a_dst = (h * conv.att_src).sum(-1), (h * conv.att_dst).sum(-1)
        scores = ops.gather_src(g, a_src, True) + ops.gather_dst(g, a_dst, True)
        alpha = ops.edge_softmax(g, F.leaky_relu(scores, conv.negative_slope), True)
        alphas.append(F.dropout(alpha, p=conv.dropout, training=True).mean(dim=1))
        x = (h.reshape(-1, conv.heads * conv.out_channels) if conv.concat else h.mean(dim=1)) + conv.bias
        if i < last:
            x = F.elu(x)
    for alpha in alphas:
        x = propagate(g, x, "none", edge_weight=alpha, add_self_loops=True)
    return x


class Reference(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.model, g, x)


@pytest.mark.parametrize("name,reference", [("gcn", gcn_decoupled), ("gat", gat_decoupled)])
def test_decouple_relaxed_matches_handwritten_model(graph: gc.Graph, name: str, reference: Callable[..., Any]) -> None:
    model = MODELS[name](8, 3).double()
    tp = traced(model, graph)
    out = PassManager([decouple], semantics="relaxed")(tp)
    assert [n.meta["tp"].layer for n in out.ops(("P",))] == list(range(1, tp.num_layers + 1))
    ref = Reference(model, reference)
    # the reference's parameters are the model's ("model." prefix); the decoupled graph's keep their names
    x = features(graph, 8)
    out_a, grads_a, gx_a = run(out, graph, x, seed=7)
    out_b, grads_b, gx_b = run(ref, graph, x, seed=7)
    torch.testing.assert_close(out_a, out_b, **REASSOC)
    torch.testing.assert_close(gx_a, gx_b, **REASSOC)
    for k, v in grads_a.items():
        torch.testing.assert_close(v, grads_b["model." + k], **REASSOC)


def test_decouple_exact_refuses_nonlinear_models(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    with pytest.raises(PassError, match=r"pass decouple_exact failed: pass decouple_exact: decoupling .* is not "
                                        r"exact.*'relu'"):
        PassManager(["decouple_exact"])(tp)
    with pytest.raises(PassError, match="^pass decouple: decoupling .* not exact"):
        decouple(tp, semantics="exact")
    with pytest.raises(PassError, match="unknown semantics"):
        decouple(tp, semantics="loose")


def test_decouple_refuses_what_it_cannot_move(graph: gc.Graph) -> None:
    sage_max = traced(gc.nn.GraphSAGE(8, 12, 3, aggr="max"), graph)
    with pytest.raises(PassError, match="pass decouple: cannot decouple .*'aggregate'"):
        decouple(sage_max)
    tp = traced(MODELS["gcn"](8, 3), graph)
    with pytest.raises(PassError, match="before insert_recomputation"):
        decouple(insert_recomputation(tp))
    with pytest.raises(PassError, match="before fuse_masked_propagate"):
        decouple(fuse_masked_propagate(tp))


def test_decouple_then_recompute(graph: gc.Graph) -> None:
    """NeutronTask's order: decouple, then recompute the MLP's T segments."""
    tp = traced(MODELS["gcn"](8, 3), graph)
    both = PassManager([decouple, insert_recomputation], semantics="relaxed")(tp)
    only = PassManager([decouple], semantics="relaxed")(tp)
    assert any(isinstance(m, Recompute) for m in both.modules())
    check_same(only, both, graph, features(graph, 8), EXACT, seed=2)


# --------------------------------------------------------------------------- fuse_masked_propagate
def test_dropout_noise_is_f_dropout_as_plans_draw_it() -> None:
    for dtype in (torch.float32, DT):
        x = torch.randn(50, 7, dtype=dtype)
        torch.manual_seed(11)
        with plan_dropout_draws():
            a = F.dropout(x, 0.3, training=True)
        torch.manual_seed(11)
        b = x * dropout_noise(x, 0.3)
        assert torch.equal(a, b)
    with pytest.raises(gc.KernelError, match="p must be in"):
        dropout_noise(x, 1.0)


def dense_csr(csr: CSR, values: torch.Tensor) -> torch.Tensor:
    rows = torch.repeat_interleave(torch.arange(csr.num_rows), csr.indptr[1:] - csr.indptr[:-1])
    return torch.zeros(csr.num_rows, csr.num_cols, dtype=values.dtype).index_put_(
        (rows, csr.indices), values, accumulate=True)


@PROPS
@given(g=small_graphs(), seed=st.integers(0, 1000))
def test_masked_kernels_subsets(g: gc.Graph, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    csr = ops._csr(g)
    values = torch.rand(g.num_edges, generator=gen, dtype=DT)
    keep = torch.rand(g.num_nodes, generator=gen) < 0.5
    dense = dense_csr(csr, values)
    sub, sv = masked_kernels.row_subset(csr, values, keep)
    torch.testing.assert_close(dense_csr(sub, sv), dense * keep[:, None])
    sub, sv = masked_kernels.column_subset(csr, values, keep)
    torch.testing.assert_close(dense_csr(sub, sv), dense * keep[None, :])
    x = torch.randn(g.num_nodes, 3, generator=gen, dtype=DT)
    torch.testing.assert_close(masked_kernels.masked_spmm(csr, values, x, keep, index_cost=0),
                               (dense @ x) * keep[:, None])
    torch.testing.assert_close(masked_kernels.masked_spmm_t(csr, values, x * keep[:, None], keep, index_cost=0),
                               dense @ (x * keep[:, None]))


@PROPS
@given(g=small_graphs(), mask=st.sampled_from(["none", "rows", "elements"]), loops=st.booleans(),
       weights=st.sampled_from(["graph", "edge", "heads"]), subsets=st.booleans(), seed=st.integers(0, 1000))
def test_masked_propagate_is_propagate_times_mask(g: gc.Graph, mask: str, loops: bool, weights: str, subsets: bool,
                                                  seed: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        if subsets:  # force the row-subset (forward) and column-filtered (backward) kernels
            mp.setattr(masked_kernels, "FORWARD_INDEX_COST", 0)
            mp.setattr(masked_kernels, "BACKWARD_INDEX_COST", 0)
        check_masked_propagate(g, mask, loops, weights, seed)


def check_masked_propagate(g: gc.Graph, mask: str, loops: bool, weights: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = 2 if weights == "heads" else 1
    shape = (g.num_nodes, heads, 3) if heads > 1 else (g.num_nodes, 3)
    x = torch.randn(shape, generator=gen, dtype=DT, requires_grad=True)
    e = g.num_edges + (g.num_nodes if loops else 0)
    w = None
    if weights != "graph":
        w = torch.rand((e, heads) if heads > 1 else (e,), generator=gen, dtype=DT).requires_grad_(True)
    norm = "none" if heads > 1 else "gcn"
    m = None
    if mask == "rows":
        m = (torch.rand(g.num_nodes, generator=gen) < 0.5).to(DT) * 2
    elif mask == "elements":
        m = (torch.rand(shape, generator=gen) < 0.3).to(DT) * 2
    mult = 1.0 if m is None else (m.reshape((-1,) + (1,) * (len(shape) - 1)) if m.dim() == 1 else m)
    up = torch.randn(shape, generator=gen, dtype=DT)
    inputs = [x] + ([w] if w is not None else [])
    ref = propagate(g, x, norm, edge_weight=w, add_self_loops=loops) * mult
    got = masked_propagate(g, x, m, norm, edge_weight=w, add_self_loops=loops) * mult
    torch.testing.assert_close(got, ref, **EXACT)
    for a, b in zip(torch.autograd.grad(got, inputs, up), torch.autograd.grad(ref, inputs, up)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fuse_detects_gcn_pattern(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    found = find_masked_propagations(tp)
    assert [(f.propagate, f.chain, f.mask, f.dropout, f.p) for f in found] == [
        ("propagate", ("add", "relu"), "dropout", "dropout", 0.5),
        ("propagate_1", ("add_1", "relu_1"), "dropout", "dropout_1", 0.5),
    ]
    out = PassManager([fuse_masked_propagate])(tp)
    names = targets(out)
    assert names.count(ops.masked_propagate) == 2 and names.count(ops.propagate) == 1
    assert names.count(ops.dropout_noise) == 2 and F.dropout not in names
    fused = [n for n in out.graph.nodes if n.target is ops.masked_propagate]
    assert all(n.meta["tp"].kind == "P" and n.args[2].target is ops.dropout_noise for n in fused)
    check_same(tp, out, graph, features(graph, 8), EXACT, seed=4)


def test_fuse_gat_through_reshape(graph: gc.Graph) -> None:
    tp = traced(gc.nn.GAT(8, 4, 3, num_layers=3, heads=2, dropout=0.4), graph)
    found = find_masked_propagations(tp)
    assert [f.chain[0] for f in found] == ["reshape", "reshape_1"] and all(f.mask == "dropout" for f in found)
    out = PassManager([fuse_masked_propagate])(tp)
    check_same(tp, out, graph, features(graph, 8), EXACT, seed=6)


class PropThen(torch.nn.Module):
    """``lin -> propagate -> <tail>``: the tails below exercise the pattern matcher."""

    def __init__(self, tail: str) -> None:
        super().__init__()
        self.lin, self.lin2 = torch.nn.Linear(8, 6), torch.nn.Linear(6 if tail == "relu" else 8, 6)
        self.tail = tail

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        h = propagate(g, self.lin(x), "gcn", add_self_loops=True)
        if self.tail == "dropout":
            return F.dropout(h, 0.5, training=True)
        if self.tail == "relu":
            return self.lin2(F.relu(h * 2.0))
        if self.tail == "rng_between":
            other = F.dropout(self.lin2(x), 0.5, training=True)
            return F.dropout(F.relu(h), 0.5, training=True) + other
        return F.dropout(F.relu(h), 0.5, training=True) + h  # "reused": the unmasked output is read too


@pytest.mark.parametrize("tail,mask", [("dropout", "dropout"), ("relu", "relu"), ("rng_between", "relu"),
                                       ("reused", None)])
def test_fuse_patterns(graph: gc.Graph, tail: str, mask: Optional[str]) -> None:
    tp = traced(PropThen(tail), graph)
    found = find_masked_propagations(tp)
    # a random op between the propagation and the dropout blocks the dropout match (ReLU's remains)
    assert [f.mask for f in found] == ([mask] if mask else [])
    out = PassManager([fuse_masked_propagate])(tp)
    if mask == "relu":
        fused = next(n for n in out.graph.nodes if n.target is ops.masked_propagate)
        assert fused.args[2] is None
    check_same(tp, out, graph, features(graph, 8), EXACT, seed=8)


@PROPS
@given(g=small_graphs(), name=st.sampled_from(["gcn", "gat", "gcnii"]), seed=st.integers(0, 1000))
def test_fuse_property(g: gc.Graph, name: str, seed: int) -> None:
    torch.manual_seed(seed)
    tp = traced(MODELS[name](5, 2), g)
    out = PassManager([fuse_masked_propagate, insert_recomputation])(tp)
    check_same(tp, out, g, features(g, 5, seed), ACCUM, seed=seed)


def test_fused_graph_annotations(graph: gc.Graph) -> None:
    tp = traced(MODELS["gcn"](8, 3), graph)
    out = fuse_masked_propagate(tp)
    by_name = {n.name: n for n in out.graph.nodes}
    noise = by_name["dropout_noise"].meta["tp"]
    assert isinstance(noise, TPInfo) and noise.kind == "T" and noise.layer == 1 and noise.dims == (16,)
    mul = next(n for n in out.graph.nodes if n.target is operator.mul)
    assert mul.meta["tp"].layer == 2
    assert out.summary().total("P", "flops") == tp.summary().total("P", "flops")
