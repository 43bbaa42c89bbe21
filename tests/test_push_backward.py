"""Backward products that scatter from the forward CSR (``backward="push"``): the transposed
product without a transposed copy, equal to the pull through a transpose, what a graph then holds,
plans that run with it, and the planner taking it when only it fits."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import kernels, ops
from gnncompile.cost_models.model import static_memory
from gnncompile.frontend import ops as fops
from gnncompile.graph.core import topology_bytes
from gnncompile.kernels import CSR
from gnncompile.passes.driver import with_backward

from graph_strategies import small_graphs

DT = torch.float64
BACKENDS = [b for b in ("native", "scipy", "torch") if b in kernels.available_backends("cpu")]


def directed(n: int = 400, e: int = 2400, features: int = 6, classes: int = 3, seed: int = 1) -> gc.Graph:
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    mask = torch.rand(n, generator=gen) < 0.5
    return gc.Graph.from_edge_index(ei, n, x=torch.randn(n, features, generator=gen),
                                    y=torch.randint(0, classes, (n,), generator=gen), train_mask=mask,
                                    val_mask=~mask, test_mask=~mask)


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), heads=st.sampled_from([0, 1, 3]), scaled=st.booleans(), seed=st.integers(0, 99),
       backend=st.sampled_from(BACKENDS))
def test_transposed_product_equals_the_product_over_the_transpose(g: gc.Graph, heads: int, scaled: bool, seed: int,
                                                                  backend: str) -> None:
    """``spmm(A, transpose=True)`` is ``spmm(A^T)`` with the scales swapped: bit for bit on the
    native backend (same summation order), to rounding on the others."""
    gen = torch.Generator().manual_seed(seed)
    c = g.compact()
    ip_t, ix_t, perm = c.transpose()
    csr, csr_t = CSR(c.indptr, c.indices, c.num_nodes, c.num_src), CSR(ip_t, ix_t, c.num_src, c.num_nodes)
    width = (heads, 4) if heads > 1 else (5,)
    x = torch.randn(c.num_nodes, *width, generator=gen, dtype=DT)
    values = None if heads == 0 else torch.rand(c.num_edges, *((heads,) if heads > 1 else ()), generator=gen, dtype=DT)
    rs = torch.rand(c.num_nodes, generator=gen, dtype=DT) if scaled else None
    cs = torch.rand(c.num_src, generator=gen, dtype=DT) if scaled else None
    out = kernels.spmm(csr, values, x, backend, row_scale=rs, col_scale=cs, transpose=True)
    ref = kernels.spmm(csr_t, None if values is None else values[perm.long()], x, backend, row_scale=cs, col_scale=rs)
    assert out.shape == (c.num_src, *width)
    if backend == "native":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)


def test_transposed_product_checks_its_operands() -> None:
    g = directed(50, 200).compact()
    csr = CSR(g.indptr, g.indices, g.num_nodes, g.num_src)
    with pytest.raises(gc.KernelError, match="transposed product needs one per sparse matrix row"):
        kernels.spmm(csr, None, torch.randn(g.num_nodes + 1, 3), transpose=True)
    with pytest.raises(gc.KernelError, match="unknown backward product"):
        ops.set_backward_product(g, "scatter")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["gcn", "mean", "attention", "masked"])
def test_push_gradients_equal_the_transposed_ones(kind: str, backend: str) -> None:
    """On a directed graph, propagations whose backward scatters give the gradients of the pull
    through the transpose (bit for bit on the native backend), and build no transposed structure."""
    g = directed().compact()
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(g.num_nodes, 2, 4, generator=gen, dtype=DT)
    w0 = torch.rand(g.num_edges + g.num_nodes, 2, generator=gen, dtype=DT)
    mask = torch.rand(g.num_nodes, 1, generator=gen) < 0.6
    grads = []
    for mode in ("transposed", "push"):
        gg = copy.deepcopy(g)
        ops.set_backward_product(gg, mode)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if kind == "attention":
            out = ops.propagate(gg, x, norm="none", edge_weight=w, add_self_loops=True, backend=backend)
        elif kind == "masked":
            out = ops.masked_propagate(gg, x.reshape(g.num_nodes, 8), mask, norm="gcn", add_self_loops=True,
                                       backend=backend)
        else:
            out = ops.propagate(gg, x.reshape(g.num_nodes, 8), norm=kind, backend=backend)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=DT).reshape(out.shape))
        grads.append((x.grad, w.grad))
        held = {k for k in gg._cache if k in ("csr_t", "transpose", "transpose_structure")}
        assert held == set() if mode == "push" else held
    for a, b in zip(*grads):
        if a is None:
            assert b is None
        elif backend == "native":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_a_pushing_graph_holds_the_cost_models_layout() -> None:
    """After a step, a directed graph whose backward products scatter holds its CSR (and for
    attention its destinations) and nothing transposed: ``topology_bytes(push=True)``."""
    g = directed(500, 3000, features=4, classes=2)
    n = g.num_nodes
    c = g.compact()
    c.cast_scales(torch.float32)
    fops.prepare_graph(c, [gc.trace(gc.nn.GCN(4, 4, 2), c).graph], torch.float32, "push")
    gc.nn.GCN(4, 4, 2)(c, g.x).sum().backward()
    assert c.structure_bytes() == topology_bytes(n, g.num_edges, push=True) + 4 * 3 * n
    assert topology_bytes(n, g.num_edges, push=True) == 8 * (n + 1) + 4 * g.num_edges
    gat = g.compact()
    ops.set_backward_product(gat, "push")
    gc.nn.GAT(4, 2, 2, heads=2)(gat, g.x).sum().backward()
    # (its fused attention runs natively on the CPU: no edge destinations)
    assert gat.structure_bytes() == topology_bytes(n, g.num_edges, edge_values=True, push=True, edge_dst=False)
    assert gat.structure_bytes() < topology_bytes(n, g.num_edges, edge_values=True, edge_dst=False)
    # a symmetric graph: its own structure serves products without edge values; those with edge
    # values (attention) scatter, so no edge permutation is held either
    sym = gc.datasets.synthetic("rmat", num_nodes=300, avg_degree=6, num_features=4, num_classes=2, seed=0).compact()
    assert sym.is_symmetric()
    ops.set_backward_product(sym, "push")
    gc.nn.GAT(4, 2, 2, heads=2)(sym, sym.x).sum().backward()
    assert "transpose" not in sym._cache
    assert sym.structure_bytes() == topology_bytes(300, sym.num_edges, symmetric=True, edge_values=True, push=True,
                                                   edge_dst=False)


@pytest.mark.parametrize("strategy", ["data", "tensor"])
def test_a_push_plan_trains_like_the_transposed_plan(strategy: str) -> None:
    """``backward="push"`` changes no result of a plan on a directed graph, and each rank holds the
    topology the cost model predicts for it (less than with transposes)."""
    g = directed(600, 4000, features=8)
    torch.manual_seed(0)
    model = gc.nn.GCN(8, 8, 3)
    runs = {}
    for mode in ("transposed", "push"):
        plan = gc.plan(copy.deepcopy(model), g, 2, strategy=strategy, backward=mode)
        assert plan.options["backward"] == mode and all(p.backward == mode for p in plan.program)
        assert ("backward products: push" in str(plan)) == (mode == "push")
        res = plan.run(epochs=2, timeout=300)
        measured = [r.topology_bytes for r in sorted(res.ranks, key=lambda r: r.rank)]
        assert measured == [static_memory(plan, dp).topology for dp in plan.ranks]
        runs[mode] = (res.history.loss, measured)
    assert runs["push"][0] == pytest.approx(runs["transposed"][0], rel=1e-6)
    assert all(p < t for p, t in zip(runs["push"][1], runs["transposed"][1]))


def test_the_planner_pushes_only_when_the_transposes_do_not_fit() -> None:
    """A device between the push and the transposed candidate's predicted peak: the search returns
    the push plan (exact, recorded, slower backward); fixing ``backward="transposed"`` makes it
    refuse; with room for the transposes it keeps them."""
    stats = gc.GraphStats(num_nodes=2_000_000, num_edges=60_000_000, num_features=64, num_classes=8, symmetric=False)
    model = gc.nn.GCN(64, 64, 8, num_layers=2)
    base = gc.Cluster.parse("1xA100")
    roomy = gc.plan(copy.deepcopy(model), stats, base, strategy="data")
    assert roomy.options["backward"] == "transposed"
    pushed = with_backward(roomy, "push")
    assert static_memory(pushed, pushed.ranks[0]).topology < static_memory(roomy, roomy.ranks[0]).topology
    low = gc.plan(copy.deepcopy(model), stats, base, strategy="data", backward="push")
    small, large = max(low.prediction.peak_memory), max(roomy.prediction.peak_memory)
    assert small < large and low.prediction.step_time > roomy.prediction.step_time
    capped = dataclasses.replace(base, device=dataclasses.replace(base.device, memory=(small + large) // 2),
                                 name="capped")
    chosen = gc.plan(copy.deepcopy(model), stats, capped, strategy="data")
    assert chosen.options["backward"] == "push" and max(chosen.prediction.peak_memory) <= capped.device.memory
    assert "backward products: push" in str(chosen)
    with pytest.raises(gc.PlanningError, match="no plan fits"):
        gc.plan(copy.deepcopy(model), stats, capped, strategy="data", backward="transposed")


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernels need a C++ compiler to build")
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), f=st.integers(1, 30), density=st.floats(0.0, 0.6), seed=st.integers(0, 99))
def test_sparse_feature_linear_needs_no_transposed_copy(n: int, f: int, density: float, seed: int) -> None:
    """The weight gradient of a Linear on sparse CSR features is ``x^T grad`` scattered from x's own
    structure on the CPU: equal to the dense one, and no transposition is cached."""
    from gnncompile.nn import functional as nnf

    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, f, generator=gen, dtype=DT) * (torch.rand(n, f, generator=gen) < density)
    lin = nnf.Linear(f, 3).to(DT)
    grads = []
    nnf._TRANSPOSES.clear()
    for x in (dense, dense.to_sparse_csr()):
        lin.zero_grad()
        lin(x).mul(torch.linspace(-1, 1, 3 * n, dtype=DT).reshape(n, 3)).sum().backward()
        grads.append((lin.weight.grad.clone(), lin.bias.grad.clone()))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
    assert not nnf._TRANSPOSES


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_transposed_product_on_rectangular_and_skewed_structures(backend: str, dtype: torch.dtype) -> None:
    """Rectangular structures (a rank's local graph: more sources than destinations), empty rows,
    duplicate entries and a hub row: the transposed product equals the product with the dense
    transpose."""
    from test_kernels import SHAPES, random_csr, randn, values_for

    for shape, (rows, cols, nnz, feat, heads) in SHAPES.items():
        csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")
        y = randn(rows, *feat, dtype=dtype, seed=3)
        values = values_for(csr, "weighted", heads, dtype, seed=2)
        out = kernels.spmm(csr, values, y, backend, transpose=True)
        dense_rows = torch.repeat_interleave(torch.arange(rows), csr.indptr[1:] - csr.indptr[:-1])
        v = values if values is not None else torch.ones(csr.nnz, dtype=dtype)
        v = v.reshape(csr.nnz, heads)
        ref = torch.zeros(cols, *feat, dtype=dtype)
        y3 = y.reshape(rows, heads, math.prod(feat) // heads)
        contrib = (y3[dense_rows] * v[:, :, None]).reshape((csr.nnz,) + tuple(feat))
        ref.index_add_(0, csr.indices.long(), contrib)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=lambda m, s=shape: f"{s}: {m}")


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernels need a C++ compiler to build")
def test_sparse_feature_structure_is_prepared_once_per_matrix() -> None:
    """The native kernels' form of a CSR feature matrix (index form, the transposed product's thread
    parts) is cached per structure: a dropout-rescaled copy sharing the structure reuses it, another
    matrix gets its own, and the cache stays small."""
    from gnncompile.nn import functional as nnf

    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(30, 20, generator=gen) < 0.2).to(DT).to_sparse_csr()
    nnf._NATIVE_CSRS.clear()
    first = nnf._native_csr(x)
    rescaled = nnf.feature_dropout(x, p=0.5, training=True)
    assert nnf._native_csr(x) is first and nnf._native_csr(rescaled) is first
    lin = nnf.Linear(20, 4).to(DT)
    lin(rescaled).sum().backward()  # forward and transposed product both use the cached structure
    assert len(nnf._NATIVE_CSRS) == 1 and any(k.startswith("native:push_parts:") for k in first.cache)
    others = [(torch.rand(30, 20, generator=gen) < 0.2).to(DT).to_sparse_csr() for _ in range(6)]
    assert all(nnf._native_csr(o) is not first for o in others)
    assert len(nnf._NATIVE_CSRS) <= nnf._MAX_TRANSPOSES


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernels need a C++ compiler to build")
def test_prepared_sparse_features_need_nothing_built_in_a_step() -> None:
    """``prepare_sparse_features`` (the runtime calls it before the first step) leaves the native
    structure of a CSR feature matrix complete: a product and its transposed product then add
    nothing to its cache."""
    from gnncompile.nn import functional as nnf

    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(40, 30, generator=gen) < 0.2).to(DT).to_sparse_csr()
    nnf._NATIVE_CSRS.clear()
    nnf.prepare_sparse_features(x)
    nnf.prepare_sparse_features(torch.ones(3, 3))  # dense: nothing
    assert len(nnf._NATIVE_CSRS) == 1
    csr = nnf._native_csr(x)
    before = dict(csr.cache)
    assert "native:indices" in before and any(k.startswith("native:push_parts:") for k in before)
    lin = nnf.Linear(30, 5).to(DT)
    lin(x).sum().backward()
    assert csr.cache.keys() == before.keys() and all(csr.cache[k] is v for k, v in before.items())


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernels need a C++ compiler to build")
def test_prepared_sparse_features_stay_prepared_while_they_live() -> None:
    """A rank prepares the features of each of its chunks, more matrices than the structure cache
    keeps: each stays prepared (a dropout-rescaled copy of it included) while the matrix lives, and
    is dropped with it."""
    import gc as pygc

    from gnncompile.nn import functional as nnf

    gen = torch.Generator().manual_seed(2)
    chunks = [(torch.rand(30, 20, generator=gen) < 0.2).to(DT).to_sparse_csr()
              for _ in range(2 * nnf._MAX_TRANSPOSES)]
    for x in chunks:
        nnf.prepare_sparse_features(x)
    prepared = [nnf._native_csr(x) for x in chunks]
    for x, csr in zip(chunks, prepared):
        assert nnf._native_csr(nnf.feature_dropout(x, p=0.5, training=True)) is csr
        assert "native:indices" in csr.cache
    key = nnf._structure_key(chunks[0])
    assert key in nnf._PREPARED
    del x, chunks[0]
    pygc.collect()
    assert key not in nnf._PREPARED
