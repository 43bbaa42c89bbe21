"""Graph primitives (`gnncompile.ops`): values against dense references, gradients, errors, fx.

Every check runs in float64 on tiny graphs that contain the awkward cases at once: an isolated
vertex, a self loop, a duplicated edge, a hub (many in- and out-edges), plus a symmetric graph
(whose backward reuses the forward CSR), a graph without edges and a graph without vertices.
``propagate`` is checked on each CPU kernel backend; the E ops do not call kernels.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile.ops
from gnncompile import Graph, GraphError, KernelError
from gnncompile.ops import (
    NORMS,
    REDUCES,
    aggregate,
    edge_attention,
    edge_softmax,
    gather_dst,
    gather_src,
    is_primitive,
    propagate,
)
from gnncompile import kernels

DT = torch.float64
CPU_BACKENDS = ("native", "torch", "scipy")
GRAPHS = ("mixed", "symmetric", "no_edges", "no_nodes")
# The stored-weight paths compute normalization coefficients in the graph's float32 before the
# cast to float64, so value checks against the float64 dense reference allow float32 rounding.
REF_TOL = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- graphs
def make_graph(name: str, weighted: bool = False) -> Graph:
    """One of the test graphs (``weighted`` stores positive edge weights on it)."""
    if name == "mixed":
        # 0->1 twice (duplicate), 2->2 (self loop), 3 is a hub (5 in-edges, 4 out-edges),
        # 6 is isolated; the graph is not symmetric.
        src = [0, 0, 2, 0, 1, 2, 4, 5, 3, 3, 3, 3, 5]
        dst = [1, 1, 2, 3, 3, 3, 3, 3, 0, 4, 5, 1, 4]
        n = 7
    elif name == "symmetric":
        # undirected star around 0 plus the edge 1-2 and a self loop at 3; vertex 4 is isolated
        pairs = [(0, 1), (0, 2), (0, 3), (1, 2)]
        src = [u for u, v in pairs] + [v for u, v in pairs] + [3]
        dst = [v for u, v in pairs] + [u for u, v in pairs] + [3]
        n = 5
    elif name == "no_edges":
        src, dst, n = [], [], 4
    elif name == "no_nodes":
        src, dst, n = [], [], 0
    else:
        raise ValueError(name)
    ei = torch.tensor([src, dst], dtype=torch.int64).reshape(2, -1)
    w = None
    if weighted:
        w = 0.5 + torch.rand(ei.shape[1], generator=torch.Generator().manual_seed(7), dtype=DT)
    g = Graph.from_edge_index(ei, n, edge_weight=w)
    if name == "symmetric":
        assert g.is_symmetric()
    if name == "mixed":
        assert not g.is_symmetric() and g.has_self_loops()
    return g


def rand(*shape: int, seed: int = 0, low: float = -1.0, high: float = 1.0, grad: bool = False) -> torch.Tensor:
    """Seeded uniform float64 tensor in ``[low, high)``, optionally requiring grad."""
    t = low + (high - low) * torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)
    return t.requires_grad_(grad)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each CPU kernel backend (``native`` is skipped where the extension cannot be built)."""
    if request.param not in kernels.available_backends("cpu"):
        pytest.skip(f"backend {request.param!r} unavailable here")
    return request.param


# --------------------------------------------------------------------------- dense references
def dense_adjacency(g: Graph, w: torch.Tensor) -> torch.Tensor:
    """``A[dst, src] += w`` (duplicates summed); ``[N, N]`` or ``[N, N, H]`` for ``[E, H]`` weights."""
    a = torch.zeros((g.num_nodes, g.num_nodes) + tuple(w.shape[1:]), dtype=DT)
    return a.index_put_((g.dst, g.indices), w.to(DT), accumulate=True)


def dense_normalize(a: torch.Tensor, norm: str) -> torch.Tensor:
    """``D_in^-1/2 A D_out^-1/2`` (gcn), ``D_in^-1 A`` (mean) or ``A``; zero degree -> zero row/column."""
    if norm in ("sum", "none"):
        return a
    deg_in, deg_out = a.sum(1), a.sum(0)

    def inv(d: torch.Tensor, p: float) -> torch.Tensor:
        return torch.where(d > 0, d.clamp_min(1e-300) ** p, torch.zeros_like(d))

    if norm == "mean":
        return inv(deg_in, -1.0)[:, None] * a
    return inv(deg_in, -0.5)[:, None] * a * inv(deg_out, -0.5)[None, :]


def dense_propagate(g: Graph, x: torch.Tensor, norm: str, edge_weight: Optional[torch.Tensor],
                    add_self_loops: bool) -> torch.Tensor:
    """What ``propagate`` means, computed with a dense (per-head) matrix."""
    n, e = g.num_nodes, g.num_edges
    if edge_weight is not None:
        w, loop = edge_weight[:e], edge_weight[e:]
    else:
        stored = g.edge_weight if norm != "none" else None
        w = torch.ones(e, dtype=DT) if stored is None else stored.to(DT)
        loop = torch.ones(n, dtype=DT)
    a = dense_adjacency(g, w)
    if add_self_loops:
        idx = torch.arange(n)
        a[idx, idx] += loop.to(DT)
    if a.dim() == 3:  # multi-head weights (norm sum/none): out[v, h] = sum_u A[v, u, h] x[u, h]
        return torch.einsum("vuh,uhc->vhc", a, x.to(DT))
    return torch.einsum("vu,u...->v...", dense_normalize(a, norm), x.to(DT))


def reference_softmax(g: Graph, e: torch.Tensor) -> torch.Tensor:
    """Per-destination softmax, one segment at a time."""
    out = torch.empty_like(e)
    for v in range(g.num_nodes):
        s, t = int(g.indptr[v]), int(g.indptr[v + 1])
        if t > s:
            out[s:t] = torch.softmax(e[s:t], dim=0)
    return out


def reference_aggregate(g: Graph, msg: torch.Tensor, reduce: str) -> torch.Tensor:
    """Per-destination sum/mean/max, one segment at a time; empty segments give 0."""
    out = torch.zeros((g.num_nodes,) + tuple(msg.shape[1:]), dtype=msg.dtype)
    for v in range(g.num_nodes):
        s, t = int(g.indptr[v]), int(g.indptr[v + 1])
        if t > s:
            seg = msg[s:t]
            out[v] = {"sum": seg.sum(0), "mean": seg.mean(0), "max": seg.max(0).values}[reduce]
    return out


def loop_layout(g: Graph, t: torch.Tensor) -> tuple[Graph, torch.Tensor]:
    """The graph with explicit self loops and ``t`` (``[E + N, ...]``, loops last) in its edge order.

    ``Graph.add_self_loops`` appends loop ``v -> v`` as edge ``E + v`` and the stable sort puts it
    after every existing in-edge of ``v`` from a source ``<= v``; matching ``(dst, src, is_loop)``
    keys recovers the permutation.
    """
    gl = g.add_self_loops()
    n, e = g.num_nodes, g.num_edges
    dst = torch.cat([g.dst, torch.arange(n)])
    src = torch.cat([g.indices, torch.arange(n)])
    is_loop = torch.cat([torch.zeros(e, dtype=torch.int64), torch.ones(n, dtype=torch.int64)])
    key = (dst * max(n, 1) + src) * 2 + is_loop
    order = torch.argsort(key, stable=True)
    assert torch.equal(src[order], gl.indices) and torch.equal(dst[order], gl.dst)
    return gl, t[order]


# --------------------------------------------------------------------------- propagate: values
def edge_weight_for(g: Graph, kind: str, add_self_loops: bool, heads: int = 2,
                    grad: bool = False) -> Optional[torch.Tensor]:
    """``None``, ``[E(+N)]`` or ``[E(+N), heads]`` positive weights (``kind``: none, 1d, heads)."""
    rows = g.num_edges + (g.num_nodes if add_self_loops else 0)
    if kind == "none":
        return None
    shape = (rows,) if kind == "1d" else (rows, heads)
    return rand(*shape, seed=3, low=0.5, high=1.5, grad=grad)


def x_for(g: Graph, kind: str, grad: bool = False) -> torch.Tensor:
    """Vertex features: ``[N, 2, 3]`` for multi-head weights, else ``[N, 3]``."""
    return rand(g.num_nodes, 2, 3, seed=1, grad=grad) if kind == "heads" else rand(g.num_nodes, 3, seed=1, grad=grad)


def norm_weight_pairs(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(norm, weight kind) combinations that propagate accepts: multi-head weights only unnormalized
    (the normalized ones are rejected, see ``test_errors_name_the_argument``)."""
    return [(n, k) for n in NORMS for k in kinds if not (k == "heads" and n in ("gcn", "mean"))]


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("norm,weights", norm_weight_pairs(("none", "stored", "1d", "heads")))
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_propagate_matches_dense_reference(backend: str, graph: str, norm: str, weights: str,
                                           add_self_loops: bool) -> None:
    g = make_graph(graph, weighted=weights == "stored")
    ew = edge_weight_for(g, weights if weights != "stored" else "none", add_self_loops)
    x = x_for(g, weights)
    out = propagate(g, x, norm=norm, edge_weight=ew, add_self_loops=add_self_loops, backend=backend)
    assert out.shape == x.shape and out.dtype == DT
    torch.testing.assert_close(out, dense_propagate(g, x, norm, ew, add_self_loops), **REF_TOL)


@pytest.mark.parametrize("graph", ["mixed", "symmetric", "no_edges"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("weighted", [False, True])
def test_propagate_self_loops_equal_explicit_loops(backend: str, graph: str, norm: str, weighted: bool) -> None:
    g = make_graph(graph, weighted=weighted)
    x = rand(g.num_nodes, 4, seed=5)
    implicit = propagate(g, x, norm=norm, add_self_loops=True, backend=backend)
    explicit = propagate(g.add_self_loops(), x, norm=norm, backend=backend)
    torch.testing.assert_close(implicit, explicit, **REF_TOL)


@pytest.mark.parametrize("norm", NORMS)
def test_propagate_self_loops_with_edge_weight_equal_explicit_loops(backend: str, norm: str) -> None:
    g = make_graph("mixed")
    ew = rand(g.num_edges + g.num_nodes, seed=9, low=0.5, high=1.5)
    x = rand(g.num_nodes, 4, seed=5)
    gl, ew_loops = loop_layout(g, ew)
    implicit = propagate(g, x, norm=norm, edge_weight=ew, add_self_loops=True, backend=backend)
    explicit = propagate(gl, x, norm=norm, edge_weight=ew_loops, backend=backend)
    torch.testing.assert_close(implicit, explicit)


def test_propagate_backends_agree_on_float32() -> None:
    g = make_graph("mixed", weighted=True)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(0))
    outs = {b: propagate(g, x, backend=b) for b in kernels.available_backends("cpu")}
    for b, out in outs.items():
        assert out.dtype == torch.float32, b
        torch.testing.assert_close(out, outs["torch"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- propagate: gradients
@pytest.mark.parametrize("graph", ["mixed", "symmetric", "no_edges"])
@pytest.mark.parametrize("norm,weights", norm_weight_pairs(("none", "1d", "heads")))
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_propagate_gradcheck(backend: str, graph: str, norm: str, weights: str, add_self_loops: bool) -> None:
    g = make_graph(graph)
    x = x_for(g, weights, grad=True)
    ew = edge_weight_for(g, weights, add_self_loops, grad=True)
    inputs = (x,) if ew is None else (x, ew)

    def fn(x: torch.Tensor, ew: Optional[torch.Tensor] = None) -> torch.Tensor:
        return propagate(g, x, norm=norm, edge_weight=ew, add_self_loops=add_self_loops, backend=backend)

    # Fast mode checks random projections of the Jacobian (the full matrix for the mixed graph is
    # checked below); it keeps this 200-case matrix within the test budget.
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
    if graph == "mixed" and norm in ("gcn", "none"):
        assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("norm", ["gcn", "sum"])
def test_propagate_gradcheck_stored_weights(backend: str, norm: str) -> None:
    g = make_graph("mixed", weighted=True)
    x = rand(g.num_nodes, 3, seed=2, grad=True)
    for loops in (False, True):
        assert torch.autograd.gradcheck(
            lambda x: propagate(g, x, norm=norm, add_self_loops=loops, backend=backend), (x,))


@pytest.mark.parametrize("add_self_loops", [False, True])
def test_propagate_on_graph_without_vertices(backend: str, add_self_loops: bool) -> None:
    g = make_graph("no_nodes")
    x = rand(0, 3, grad=True)
    ew = rand(0, grad=True)
    out = propagate(g, x, norm="gcn", edge_weight=ew, add_self_loops=add_self_loops, backend=backend)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3)


def test_propagate_backward_without_edges_reaches_inputs(backend: str) -> None:
    g = make_graph("no_edges")
    x = rand(g.num_nodes, 3, grad=True)
    ew = rand(0, grad=True)
    propagate(g, x, norm="sum", edge_weight=ew, backend=backend).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert ew.grad is not None and ew.grad.shape == (0,)


# --------------------------------------------------------------------------- E ops
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_gather(graph: str, add_self_loops: bool) -> None:
    g = make_graph(graph)
    x = rand(g.num_nodes, 2, 3, seed=4, grad=True)
    src, dst = gather_src(g, x, add_self_loops), gather_dst(g, x, add_self_loops)
    exp_src, exp_dst = x[g.indices], x[g.dst]
    if add_self_loops:
        exp_src, exp_dst = torch.cat([exp_src, x]), torch.cat([exp_dst, x])
    assert torch.equal(src, exp_src) and torch.equal(dst, exp_dst)
    assert torch.autograd.gradcheck(lambda x: gather_src(g, x, add_self_loops), (x,))
    assert torch.autograd.gradcheck(lambda x: gather_dst(g, x, add_self_loops), (x,))


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_edge_softmax(graph: str, heads: Optional[int], add_self_loops: bool) -> None:
    g = make_graph(graph)
    rows = g.num_edges + (g.num_nodes if add_self_loops else 0)
    e = rand(*((rows,) if heads is None else (rows, heads)), seed=6, low=-3.0, high=3.0, grad=True)
    out = edge_softmax(g, e, add_self_loops)
    if add_self_loops:
        gl, e_loops = loop_layout(g, e.detach())
        _, out_loops = loop_layout(g, out.detach())
        torch.testing.assert_close(out_loops, reference_softmax(gl, e_loops))
    else:
        torch.testing.assert_close(out, reference_softmax(g, e.detach()))
    assert torch.autograd.gradcheck(lambda e: edge_softmax(g, e, add_self_loops), (e,))


def test_edge_softmax_is_shift_invariant_and_stable() -> None:
    g = make_graph("mixed")
    e = rand(g.num_edges, seed=8)
    torch.testing.assert_close(edge_softmax(g, e + 1000.0), edge_softmax(g, e))
    # in-degree-1 destinations get exactly 1; segments sum to 1
    sums = aggregate(g, edge_softmax(g, e).unsqueeze(1), "sum").squeeze(1)
    has_in = g.in_degree() > 0
    torch.testing.assert_close(sums[has_in], torch.ones(int(has_in.sum()), dtype=DT))


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_aggregate(graph: str, reduce: str, add_self_loops: bool) -> None:
    g = make_graph(graph)
    rows = g.num_edges + (g.num_nodes if add_self_loops else 0)
    msg = rand(rows, 2, 2, seed=10, grad=True)  # distinct values: max has no ties
    out = aggregate(g, msg, reduce, add_self_loops)
    assert out.shape == (g.num_nodes, 2, 2)
    if add_self_loops:
        gl, m_loops = loop_layout(g, msg.detach())
        torch.testing.assert_close(out, reference_aggregate(gl, m_loops, reduce))
    else:
        torch.testing.assert_close(out, reference_aggregate(g, msg.detach(), reduce))
    assert torch.autograd.gradcheck(lambda m: aggregate(g, m, reduce, add_self_loops), (msg,))


@pytest.mark.parametrize("reduce", REDUCES)
def test_aggregate_without_edges_keeps_autograd_graph(reduce: str) -> None:
    g = make_graph("no_edges")
    msg = rand(0, 3, grad=True)
    out = aggregate(g, msg, reduce)
    assert torch.equal(out, torch.zeros(g.num_nodes, 3, dtype=DT))
    out.sum().backward()
    assert msg.grad is not None


def test_gat_style_pipeline_gradcheck(backend: str) -> None:
    """gather -> edge_softmax -> propagate with multi-head attention weights, end to end."""
    g = make_graph("mixed")
    h = rand(g.num_nodes, 2, 3, seed=11, grad=True)
    att = rand(2, 3, seed=12, grad=True)

    def gat(h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        s = (gather_src(g, h, True) * att).sum(-1) + (gather_dst(g, h, True) * att).sum(-1)
        alpha = edge_softmax(g, torch.nn.functional.leaky_relu(s, 0.2), True)
        return propagate(g, h, norm="none", edge_weight=alpha, add_self_loops=True, backend=backend)

    assert torch.autograd.gradcheck(gat, (h, att))


# --------------------------------------------------------------------------- fused attention
@st.composite
def small_graphs_for_attention(draw: st.DrawFn) -> tuple[Graph, int]:
    """A random multigraph (self loops, duplicates, isolated vertices) and a seed."""
    n = draw(st.integers(1, 8))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=24))
    ei = torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).t()
    return Graph.from_edge_index(ei, n), draw(st.integers(0, 2**31 - 1))


def unfused_attention(g: Graph, s: torch.Tensor, t: torch.Tensor, slope: float, loops: bool) -> torch.Tensor:
    """What ``edge_attention`` fuses, written with the other primitives."""
    e = gather_src(g, s, loops) + gather_dst(g, t, loops)
    return edge_softmax(g, torch.nn.functional.leaky_relu(e, slope), loops)


def _attention_both_ways(g: Graph, heads: Optional[int], loops: bool, slope: float, seed: int,
                         dtype: torch.dtype = DT) -> None:
    """``edge_attention`` against the unfused chain on the default backend: the same forward values
    (bit for bit: the same operations in the same order) and gradients up to rounding."""
    tail = () if heads is None else (heads,)
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn((g.num_src,) + tail, generator=gen, dtype=dtype, requires_grad=True)
    t = torch.randn((g.num_nodes,) + tail, generator=gen, dtype=dtype, requires_grad=True)
    rows = g.num_edges + (g.num_nodes if loops else 0)
    w = torch.randn((rows,) + tail, generator=gen, dtype=dtype)
    want = unfused_attention(g, s, t, slope, loops)
    want_s, want_t = torch.autograd.grad((want * w).sum(), (s, t))
    got = edge_attention(g, s, t, slope, loops)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got, want)
    got_s, got_t = torch.autograd.grad((got * w).sum(), (s, t))
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_s, want_s, **tol)
    torch.testing.assert_close(got_t, want_t, **tol)


@pytest.fixture
def edge_backend(backend: str):
    """``backend`` as the default for the edge ops too (``native`` runs the fused kernels; the others
    the torch formulation)."""
    kernels.set_default_backend(backend)
    yield backend
    kernels.set_default_backend(None)


@pytest.mark.parametrize("case", ["fused wins", "fused forward wrong", "fused backward wrong"])
def test_attention_measures_the_fused_kernels_against_torch_where_they_are_optional(case: str, monkeypatch) -> None:
    """Where the fused kernels can run but the backend does not mandate them (CUDA with the ``torch``
    backend), the first ``edge_attention`` times them, forward and backward, against the torch
    formulation on the structure: the faster correct one runs both and is recorded; fused kernels
    whose coefficients or gradients are wrong are rejected. (On the CPU: the native kernels as the
    fused ones, by wall time.)"""
    fused_wins = case == "fused wins"
    import time

    from gnncompile.frontend import ops as fops
    from gnncompile.kernels import cuda

    try:
        kernels._load_native()
    except KernelError as exc:
        pytest.skip(f"the native kernels stand in for the fused ones: {exc}")
    monkeypatch.setattr(kernels, "fused_attention", lambda t: False)
    monkeypatch.setattr(kernels, "attention_fusable", lambda t: True)
    unfused, fused = fops._EdgeAttention._unfused, kernels.attention_coefficients
    backward = kernels.attention_backward
    if fused_wins:   # the torch formulation made slow
        monkeypatch.setattr(fops._EdgeAttention, "_unfused", staticmethod(lambda *a: (time.sleep(0.02), unfused(*a))[1]))
    elif case == "fused forward wrong":
        monkeypatch.setattr(kernels, "attention_coefficients", lambda *a, **k: fused(*a, **k) * 2)
    calls = []

    def counted(*a, **k):
        calls.append(1)
        gs, g_dst = backward(*a, **k)
        return (gs * 2, g_dst * 2) if case == "fused backward wrong" else (gs, g_dst)
    monkeypatch.setattr(kernels, "attention_backward", counted)
    g = make_graph("mixed")
    _attention_both_ways(g, 4, True, 0.2, seed=5)   # measured here (forward and backward of each)
    choice = cuda.choices()[-1]
    assert choice.op == "attention" and "4 heads" in choice.shape, choice
    assert choice.chosen == ("fused" if fused_wins else "torch"), choice
    assert fused_wins or "fused" in choice.rejected, choice
    before, measured = len(cuda.choices()), len(calls)
    _attention_both_ways(g, 4, True, 0.2, seed=6)   # decided once per structure
    assert len(cuda.choices()) == before
    assert (len(calls) > measured) == fused_wins   # the fused backward runs only where it was chosen


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("heads", [None, 1, 3, 8])
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_edge_attention_equals_the_unfused_ops(edge_backend: str, graph: str, heads: Optional[int],
                                               add_self_loops: bool) -> None:
    _attention_both_ways(make_graph(graph), heads, add_self_loops, 0.2, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_attention_float32_and_slopes(edge_backend: str, dtype: torch.dtype) -> None:
    """Slopes 0 (ReLU), between 0 and 1 and above 1, on a larger graph with hubs."""
    g = gnncompile.datasets.synthetic("rmat", num_nodes=300, avg_degree=6, num_features=2, num_classes=2, seed=4)
    for slope in (0.0, 0.2, 1.5):
        _attention_both_ways(g, 4, True, slope, seed=5, dtype=dtype)


def test_edge_attention_on_a_rank_graph_with_halo_rows(edge_backend: str) -> None:
    """A rank's local graph: sources are halo rows with the destinations at ``own_offset``, where
    each self loop reads its score."""
    gen = torch.Generator().manual_seed(6)
    n, num_src, own = 5, 14, 6
    deg = torch.randint(0, 4, (n,), generator=gen)
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(deg, 0)
    indices = torch.randint(0, num_src, (int(indptr[-1]),), generator=gen)
    local = gnncompile.graph.LocalGraph(indptr, indices, n, num_src, own_offset=own)
    for loops in (False, True):
        _attention_both_ways(local, 2, loops, 0.2, seed=7)


def test_destination_side_ops_take_the_own_rows_of_source_rows() -> None:
    """gather_dst's x and edge_attention's dst_scores may have a row per source of a rank's (or
    chunk's) graph, as its propagations' inputs do: the destinations' own rows are used, and only
    they get gradients (a task or layer chunk reads one value on both sides of its edges)."""
    gen = torch.Generator().manual_seed(8)
    n, num_src, own = 5, 14, 6
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.randint(1, 4, (n,), generator=gen), 0)
    indices = torch.randint(0, num_src, (int(indptr[-1]),), generator=gen)
    local = gnncompile.graph.LocalGraph(indptr, indices, n, num_src, own_offset=own)
    x = rand(num_src, 3, seed=9, grad=True)
    for loops in (False, True):
        x.grad = None
        out = gather_dst(local, x, loops)
        assert torch.equal(out, gather_dst(local, x.detach()[own:own + n], loops))
        out.sum().backward()
        assert x.grad[own:own + n].abs().sum() > 0
        assert not x.grad[:own].any() and not x.grad[own + n:].any()
    s, t = rand(num_src, 2, seed=10), rand(num_src, 2, seed=11)
    torch.testing.assert_close(edge_attention(local, s, t, 0.2, True), edge_attention(local, s, t[own:own + n], 0.2, True))
    with pytest.raises(KernelError, match=r"gather_dst: x must have 5 rows"):
        gather_dst(local, rand(num_src - 1, 3))


def test_edge_attention_gradcheck(edge_backend: str) -> None:
    g = make_graph("mixed")
    s, t = rand(g.num_nodes, 2, seed=21, grad=True), rand(g.num_nodes, 2, seed=22, grad=True)
    for loops in (False, True):
        assert torch.autograd.gradcheck(lambda a, b: edge_attention(g, a, b, 0.2, loops), (s, t))


@settings(max_examples=30, deadline=None)
@given(case=small_graphs_for_attention(), heads=st.sampled_from([None, 1, 2, 5]), loops=st.booleans(),
       slope=st.sampled_from([0.0, 0.2, 2.0]))
def test_edge_attention_property(case: tuple[Graph, int], heads: Optional[int], loops: bool, slope: float) -> None:
    """Random multigraphs, every CPU backend: fused == unfused."""
    g, seed = case
    for name in CPU_BACKENDS:
        if name not in kernels.available_backends("cpu"):
            continue
        kernels.set_default_backend(name)
        try:
            _attention_both_ways(g, heads, loops, slope, seed)
        finally:
            kernels.set_default_backend(None)


@pytest.mark.parametrize("case", ["trailing shape", "dst rows", "dtypes", "integer"])
def test_edge_attention_errors(case: str) -> None:
    g = make_graph("mixed")
    n = g.num_nodes
    s, t = {
        "trailing shape": (rand(n, 2), rand(n, 3)),
        "dst rows": (rand(n, 2), rand(n + 1, 2)),
        "dtypes": (rand(n, 2), rand(n, 2).float()),
        "integer": (torch.ones(n, 2, dtype=torch.int64), torch.ones(n, 2, dtype=torch.int64)),
    }[case]
    with pytest.raises(KernelError, match="edge_attention: "):
        edge_attention(g, s, t)


# --------------------------------------------------------------------------- property test
@st.composite
def small_graphs(draw: st.DrawFn) -> tuple[Graph, int]:
    """A random multigraph (self loops, duplicates, isolated vertices allowed) and a feature seed."""
    n = draw(st.integers(1, 8))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=24))
    ei = torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).t()
    weighted = draw(st.booleans())
    w = None
    if weighted:
        w = torch.tensor(draw(st.lists(st.floats(0.25, 4.0), min_size=len(edges), max_size=len(edges))), dtype=DT)
    return Graph.from_edge_index(ei, n, edge_weight=w), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None)
@given(case=small_graphs(), norm=st.sampled_from(NORMS), add_self_loops=st.booleans(),
       width=st.integers(1, 5))
def test_backends_agree_with_dense_reference(case: tuple[Graph, int], norm: str, add_self_loops: bool,
                                             width: int) -> None:
    g, seed = case
    x = rand(g.num_nodes, width, seed=seed)
    expected = dense_propagate(g, x, norm, None, add_self_loops)
    for backend in kernels.available_backends("cpu"):
        out = propagate(g, x, norm=norm, add_self_loops=add_self_loops, backend=backend)
        torch.testing.assert_close(out, expected, **REF_TOL, msg=lambda m: f"backend {backend}: {m}")


# --------------------------------------------------------------------------- errors
ErrorCase = tuple[type, str, Callable[[Graph, torch.Tensor], object]]
ERROR_CASES: dict[str, ErrorCase] = {
    "x rows": (KernelError, r"x must have 7 rows", lambda g, x: propagate(g, x[:-1])),
    "x scalar": (KernelError, r"x must have 7 rows", lambda g, x: propagate(g, torch.tensor(1.0))),
    "x integer": (KernelError, r"x must be floating point", lambda g, x: propagate(g, x.long())),
    "edge_weight rows": (KernelError, r"edge_weight must have 13 rows",
                         lambda g, x: propagate(g, x, edge_weight=torch.ones(12, dtype=DT))),
    "edge_weight rows with loops": (
        KernelError, r"edge_weight must have 20 rows",
        lambda g, x: propagate(g, x, edge_weight=torch.ones(13, dtype=DT), add_self_loops=True)),
    "norm": (KernelError, r"unknown norm 'bogus'.*'gcn'", lambda g, x: propagate(g, x, norm="bogus")),
    "norm with loops": (KernelError, r"unknown norm 'bogus'",
                        lambda g, x: propagate(g, x, norm="bogus", add_self_loops=True)),
    "normalized heads": (KernelError, r"norm='gcn' needs 1-d edge weights",
                         lambda g, x: propagate(g, x.reshape(7, 2, 2), edge_weight=torch.ones(13, 2, dtype=DT))),
    "normalized heads with loops": (
        KernelError, r"norm='mean' needs 1-d edge weights",
        lambda g, x: propagate(g, x.reshape(7, 2, 2), norm="mean", edge_weight=torch.ones(20, 2, dtype=DT),
                               add_self_loops=True)),
    "heads vs x": (KernelError, r"x must be \[N, 2, C\]",
                   lambda g, x: propagate(g, x, norm="none", edge_weight=torch.ones(13, 2, dtype=DT))),
    "backend": (KernelError, r"unknown kernel backend 'bogus'.*native", lambda g, x: propagate(g, x, backend="bogus")),
    "graph": (GraphError, r"expected a gnncompile.Graph", lambda g, x: propagate(x, x)),
    "gather_src rows": (KernelError, r"gather_src: x must have 7 rows", lambda g, x: gather_src(g, x[:3])),
    "gather_dst rows": (KernelError, r"gather_dst: x must have 7 rows", lambda g, x: gather_dst(g, x[:3])),
    "gather graph": (GraphError, r"gather_dst: expected a gnncompile.Graph", lambda g, x: gather_dst(None, x)),
    "edge_softmax rows": (KernelError, r"edge_softmax: e must have 13 rows", lambda g, x: edge_softmax(g, x)),
    "edge_softmax rows with loops": (KernelError, r"edge_softmax: e must have 20 rows",
                                     lambda g, x: edge_softmax(g, torch.ones(13, dtype=DT), True)),
    "reduce": (KernelError, r"unknown reduce 'min'.*'max'", lambda g, x: aggregate(g, torch.ones(13, 2), "min")),
    "aggregate rows": (KernelError, r"aggregate: msg must have 13 rows", lambda g, x: aggregate(g, x)),
    "aggregate rows with loops": (KernelError, r"aggregate: msg must have 20 rows",
                                  lambda g, x: aggregate(g, torch.ones(13, 2), add_self_loops=True)),
    "graph norm": (GraphError, r"unknown normalization 'bogus'", lambda g, x: g.norm_coefficients("bogus")),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_name_the_argument(case: str) -> None:
    exc, pattern, call = ERROR_CASES[case]
    g = make_graph("mixed")
    with pytest.raises(exc, match=pattern):
        call(g, rand(g.num_nodes, 4))


# --------------------------------------------------------------------------- torch.fx
class ImportedName(torch.nn.Module):
    """Calls the primitive through ``from gnncompile.ops import propagate``."""

    def forward(self, g: Graph, x: torch.Tensor) -> torch.Tensor:
        return propagate(g, x)


class QualifiedName(torch.nn.Module):
    """Calls the primitive through the module attribute ``gnncompile.ops.propagate``."""

    def forward(self, g: Graph, x: torch.Tensor) -> torch.Tensor:
        return gnncompile.ops.propagate(g, x)


@pytest.mark.parametrize("module", [ImportedName, QualifiedName])
def test_fx_records_propagate_as_one_leaf(module: type[torch.nn.Module]) -> None:
    gm = torch.fx.symbolic_trace(module())
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1
    (node,) = calls
    assert node.target is gnncompile.ops.propagate and is_primitive(node.target)
    assert node.target.__gnncompile_kind__ == "P"
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "placeholder", "call_function", "output"]
    g = make_graph("mixed")
    x = rand(g.num_nodes, 3)
    torch.testing.assert_close(gm(g, x), propagate(g, x))


def test_fx_records_one_node_per_primitive() -> None:
    class Gat(torch.nn.Module):
        def forward(self, g: Graph, h: torch.Tensor) -> torch.Tensor:
            s = gnncompile.ops.gather_src(g, h).sum(-1) + gather_dst(g, h).sum(-1)
            alpha = edge_softmax(g, s)
            msg = gather_src(g, h) * alpha.unsqueeze(-1)
            return aggregate(g, msg, reduce="max") + propagate(g, h, norm="none", edge_weight=alpha)

    gm = torch.fx.symbolic_trace(Gat())
    prims = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and is_primitive(n.target)]
    assert prims == ["gather_src", "gather_dst", "edge_softmax", "gather_src", "aggregate", "propagate"]
    g = make_graph("mixed")
    h = rand(g.num_nodes, 3)
    torch.testing.assert_close(gm(g, h), Gat()(g, h))


# --------------------------------------------------------------------------- devices (checked on CPU)
from gnncompile.frontend import ops as fops  # noqa: E402  (the primitives' private helpers)
from gnncompile.graph.core import NormScales  # noqa: E402


def _tensors_in(value: object, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from a cache entry (tuples, lists, dicts, cached graphs), with its path."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, Graph):
        out = [(f"{path}.{f}", t) for f in ("indptr", "indices", "edge_weight", "x")
               if (t := getattr(value, f)) is not None]
        return out + [t for k, v in value._cache.items() for t in _tensors_in(v, f"{path}[{k}]")]
    if isinstance(value, NormScales):
        return [(f"{path}.{f}", t) for f in ("row", "col", "loop") if (t := getattr(value, f)) is not None]
    if isinstance(value, (tuple, list)):
        return [t for i, v in enumerate(value) for t in _tensors_in(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _tensors_in(v, f"{path}[{k}]")]
    return []


def _warm_caches(g: Graph) -> None:
    """Run every primitive forward and backward so the graph caches all its derived structures."""
    x = rand(g.num_nodes, 3, grad=True)
    w = rand(g.num_edges, low=0.5, high=1.5, grad=True)
    out = (propagate(g, x) + propagate(g, x, norm="mean", add_self_loops=True) + propagate(g, x, edge_weight=w)
           + propagate(g, x, norm="sum")
           + aggregate(g, gather_src(g, x) * gather_dst(g, x), reduce="max")
           + fops.masked_propagate(g, x, mask=(x[:, :1] > 0).to(DT)))
    s = edge_softmax(g, gather_src(g, x, add_self_loops=True).sum(-1), add_self_loops=True)
    s = s + aggregate(g, gather_src(g, x, add_self_loops=True), add_self_loops=True).sum()  # A + I's structure
    out.sum().backward()
    s.sum().backward()


def test_graph_to_moves_every_cached_structure() -> None:
    import scipy.sparse as sp

    g = make_graph("mixed", weighted=True)
    g = g.replace(x=sp.random(g.num_nodes, 4, density=0.5, random_state=0, format="csr"))
    g._cache = {}
    _warm_caches(g)
    # kernel handles (CSR objects holding backend state) are dropped: rebuilt from the moved tensors
    cached = {p: t for p, t in _tensors_in(g._cache) if not p.startswith(("[csr]", "[csr_t]"))}
    assert {"[transpose][0]", "[transpose][2]", "[dst]", "[with_loops][order]", "[scales:gcn:0].row",
            "[scales:gcn:0].col", "[terms:gcn:0:torch.float64][1]"} <= set(cached)
    m = g.to("meta")
    assert m.device.type == "meta" and m.x.device.type == "meta" and m.x.layout == torch.sparse_csr
    moved = dict(_tensors_in(m._cache))
    assert set(cached) <= set(moved), sorted(set(cached) - set(moved))
    for path, t in moved.items():
        assert t.device.type == "meta", f"cache entry {path} stayed on {t.device}"
        assert t.shape == cached[path].shape and t.dtype == cached[path].dtype, path
    assert "csr" not in m._cache and "csr_t" not in m._cache
    # a tensor shared by two entries stays one tensor (float64 weights are their own "sum" values)
    assert g._cache["terms:sum:0:torch.float64"][0] is g.edge_weight
    assert m._cache["terms:sum:0:torch.float64"][0] is m.edge_weight
    assert g.to("cpu") is g and g.device.type == "cpu" and g._cache


@pytest.mark.parametrize("op", ["propagate", "gather_src", "gather_dst", "edge_softmax", "aggregate",
                                "masked_propagate"])
def test_tensors_on_another_device_than_the_graph_are_refused(op: str) -> None:
    g = make_graph("mixed")
    x = torch.empty(g.num_nodes, 3, dtype=DT, device="meta")
    e = torch.empty(g.num_edges, dtype=DT, device="meta")
    call = {
        "propagate": lambda: propagate(g, x), "gather_src": lambda: gather_src(g, x),
        "gather_dst": lambda: gather_dst(g, x), "edge_softmax": lambda: edge_softmax(g, e),
        "aggregate": lambda: aggregate(g, e), "masked_propagate": lambda: fops.masked_propagate(g, x),
    }[op]
    with pytest.raises(KernelError, match=r"is on meta but the graph is on cpu; move the graph with "
                                          r"graph.to\('meta'\)"):
        call()
    with pytest.raises(KernelError, match="edge_weight is on meta but the graph is on cpu"):
        propagate(g, rand(g.num_nodes, 3), edge_weight=e)
    with pytest.raises(KernelError, match="index is on meta but x is on cpu"):
        fops.dropout_rows(rand(4, 2), 0.5, torch.arange(2, device="meta"), 4)


ZOO = ("GCN", "GraphSAGE", "GAT", "GIN", "GCNII", "APPNP", "SGC", "ResGCN")


@pytest.mark.parametrize("features", ["dense", "sparse"])
@pytest.mark.parametrize("model", ZOO)
def test_no_tensor_is_created_on_a_hard_coded_device(model: str, features: str) -> None:
    """A forward pass with ``meta`` as torch's default device: a tensor created without an explicit
    device (the bug that made sparse-feature backward fail on CUDA) would land on ``meta`` and
    break the CPU computation or its result. (Default devices do not reach the backward pass; its
    helpers are called directly in the next test.)"""
    import scipy.sparse as sp

    if model == "GIN" and features == "sparse":
        pytest.skip("GIN propagates the raw features: sparse features are refused by design")
    base = gnncompile.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=8, num_classes=3, seed=0)
    if features == "sparse":
        base = base.replace(x=sp.random(60, 8, density=0.3, random_state=1, format="csr", dtype="float32"))
    g = Graph(base.indptr, base.indices, x=base.x, y=base.y, train_mask=base.train_mask)  # empty caches
    torch.manual_seed(0)
    m = getattr(gnncompile.nn, model)(8, 4, 3)
    with torch.device("meta"):
        out = m(g, g.x)
        loss = torch.nn.functional.cross_entropy(out[g.train_mask], g.y[g.train_mask])
    assert out.device.type == "cpu" and torch.isfinite(out).all()
    loss.backward()
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in m.parameters())
    assert all(t.device.type == "cpu" for _, t in _tensors_in(g._cache))


def test_backward_passes_create_tensors_on_their_inputs_device() -> None:
    """The hand-written backward passes, called directly with ``meta`` as the default device (the
    default device does not reach a backward run by autograd): every result is on the CPU."""
    import scipy.sparse as sp
    from types import SimpleNamespace

    from gnncompile.nn.functional import _csr_transpose, _SparseLinear

    g = make_graph("mixed", weighted=True)
    g._cache = {}
    x = Graph._convert_features(sp.random(g.num_nodes, 5, density=0.4, random_state=2, format="csr"))
    a, b, e = rand(g.num_nodes, 4), rand(g.num_nodes, 4), rand(g.num_edges, 2)
    w, gv, glin = rand(g.num_edges, seed=3), rand(g.num_nodes, 4, seed=4), rand(g.num_nodes, 3, seed=5).float()
    smax = fops._SegmentMax.apply(g, e)
    soft = fops._EdgeSoftmax.apply(g, torch.cat([e, rand(g.num_nodes, 2, seed=6)]), True)  # with self loops
    keep = torch.arange(g.num_nodes) % 2 == 0

    def ctx(*saved: torch.Tensor, grads: tuple[bool, ...] = (False, True, True, False, False)) -> SimpleNamespace:
        return SimpleNamespace(g=g, backend=None, saved_tensors=saved, needs_input_grad=grads, all_kept=False,
                               x=x, has_bias=True, loops=True, row=None, col=None, loop=None)

    with torch.device("meta"):
        results = [
            _csr_transpose(x), *g.transpose(), fops._csr_t(g, True)[1],
            kernels.sddmm(fops._csr(g), a, b, backend="torch"),
            fops._SegmentMax.backward(ctx(e, smax), torch.ones_like(smax))[1],
            fops._EdgeSoftmax.backward(ctx(soft), torch.ones_like(soft))[1],
            *fops._SpMM.backward(ctx(w, a, None), gv)[1:3],
            *fops._MaskedSpMM.backward(ctx(w, a, keep, None, None), gv)[1:3],
            *_SparseLinear.backward(ctx(), glin)[1:],
        ]
    for t in results + [t for _, t in _tensors_in(g._cache)]:
        assert t.device.type == "cpu"
    torch.testing.assert_close(results[0].to_dense(), x.to_dense().t())


def test_plan_dropout_draws_redirects_dropout(monkeypatch) -> None:
    """On every device, F.dropout and nn.Dropout draw their masks with dropout_noise (as plans do);
    inactive dropout is left alone."""
    import torch.nn.functional as F

    from gnncompile.frontend import ops as ops_module

    calls = []
    real = ops_module.dropout_noise
    monkeypatch.setattr(ops_module, "dropout_noise", lambda x, p: calls.append((x.device.type, p)) or real(x, p))
    x = torch.randn(6, 3, device="meta")
    cpu = torch.randn(6, 3)
    with ops_module.plan_dropout_draws():
        F.dropout(x, 0.25)
        torch.nn.Dropout(0.5)(x)
        F.dropout(x, 0.25, training=False)
        F.dropout(x, 0.0)
        torch.manual_seed(0)
        a = F.dropout(cpu, 0.3)
    torch.manual_seed(0)
    assert torch.equal(a, cpu * real(cpu, 0.3))
    assert calls == [("meta", 0.25), ("meta", 0.5), ("cpu", 0.3)]


def test_primitives_run_outside_the_dropout_redirection() -> None:
    """Under plan_dropout_draws the graph primitives run with the redirection suspended: the mode sees
    the model's own torch calls (its dropouts, redirected), none made inside propagate or
    edge_attention (a torch function mode sees every call and attribute read: ~230 in a small GAT
    forward, most of them in the primitives, which doubled its host time). Under another torch
    function mode entered inside it nothing is suspended, and the outputs agree."""
    import sys as _sys

    from gnncompile.frontend import ops as ops_module

    g = gnncompile.datasets.synthetic("sbm", num_nodes=40, avg_degree=4, num_features=6, num_classes=3, seed=0)
    model = gnncompile.nn.GAT(6, 4, 3, heads=2, dropout=0.5).train()
    real = ops_module.plan_dropout_draws.__torch_function__

    def callers(inner: bool) -> tuple[list[str], torch.Tensor]:
        seen: list[str] = []

        def spy(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            frame = _sys._getframe(1)
            while frame is not None and (f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
                                         or frame.f_code.co_name == "__torch_function__"):  # (Passing's)
                frame = frame.f_back
            seen.append("" if frame is None else frame.f_code.co_filename)
            return real(self, func, types, args, kwargs)

        class Passing(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return func(*args, **(kwargs or {}))

        ops_module.plan_dropout_draws.__torch_function__ = spy
        try:
            torch.manual_seed(0)
            with ops_module.plan_dropout_draws():
                if inner:
                    with Passing():
                        out = model(g, g.x)
                else:
                    out = model(g, g.x)
        finally:
            ops_module.plan_dropout_draws.__torch_function__ = real
        return seen, out

    inside = (os.path.join("gnncompile", "frontend", "ops.py"), os.path.join("gnncompile", "kernels", ""))
    seen, out = callers(inner=False)
    assert seen and not [f for f in seen if any(part in f for part in inside)]
    assert any(os.path.join("gnncompile", "nn", "") in f for f in seen)  # the model's own calls
    seen_nested, out_nested = callers(inner=True)
    assert [f for f in seen_nested if any(part in f for part in inside)]  # nothing suspended
    assert torch.equal(out, out_nested)  # (the same dropout masks: the same seeds drawn)


def test_functional_linear_takes_sparse_features_without_a_transposed_copy() -> None:
    """``gnncompile.nn.functional.linear`` (SAGE's first layer, ``transform_first``) on sparse CSR
    features: the value and the weight's gradient of ``F.linear`` on the dense features, through
    :class:`_SparseLinear` (torch's backward of ``F.linear`` on a CSR input transposes it every
    step); traced, it is one node costed as a GEMM on the stored entries."""
    import scipy.sparse as sp

    from gnncompile.nn.functional import linear

    x = Graph._convert_features(sp.random(40, 12, density=0.25, random_state=3, format="csr", dtype="float32"))
    w = torch.randn(5, 12, requires_grad=True)
    out = linear(x, w)
    out.square().sum().backward()
    assert out.grad_fn.name().startswith("_SparseLinear")
    w_dense = w.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(x.to_dense(), w_dense)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.grad, w_dense.grad)
    base = gnncompile.datasets.synthetic("sbm", num_nodes=60, avg_degree=4, num_features=12, num_classes=3, seed=0)
    g = base.replace(x=sp.random(60, 12, density=0.25, random_state=1, format="csr", dtype="float32"))
    tp = gnncompile.trace(gnncompile.nn.GraphSAGE(12, 4, 3, num_layers=2), g, training=True)
    node = next(n for n in tp.graph.nodes if n.target is linear)  # the first layer's, on the features
    t = node.meta["tp"]
    assert t.kind == "T" and t.flops.v > 0 and t.bytes_read.c >= 12 * 4 * 4  # reads the weight: a GEMM


def test_self_loop_term_is_one_product_and_one_add_per_block() -> None:
    """``_add_scaled_rows`` (the self-loop term of every propagation over ``A + I``) launches a
    product and an in-place add per block of rows: no copy of the block onto itself (what
    ``out[a:b] += ...`` also does), which on a GPU is one more kernel and pass per block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    out, x, f = torch.zeros(3000, 128), torch.randn(3000, 128), torch.rand(3000)
    expected = out + f[:, None] * x
    with Ops() as mode:
        kernels._add_scaled_rows(out, f, x)
    assert torch.equal(out, expected)
    computing = [n for n in mode.names if n not in ("aten.slice", "aten.view", "aten.unsqueeze", "aten.reshape",
                                                    "aten.expand", "aten.as_strided")]
    blocks = -(-3000 * 128 * 4 // kernels._ROW_BLOCK_BYTES["cpu"])
    assert computing == ["aten.mul", "aten.add_"] * blocks, mode.names
