"""Sparse kernels, graph primitives and the model zoo on CUDA, against the CPU (``pytest -m gpu``).

Every check runs on each CUDA kernel backend available here (``torch``; ``cupy`` when CuPy is
installed) and compares with the CPU computation of the same thing: kernel outputs, every
primitive's forward and backward (float64), gradcheck on CUDA, sparse input features, one training
step of every zoo model, and a step run under a guard that fails on any CPU tensor reaching an op.
Without CUDA every test skips with the reason.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gnncompile as gc
from gnncompile import Graph
from gnncompile.frontend import ops
from gnncompile.nn.functional import Linear, feature_dropout
from gnncompile import kernels
from gnncompile.kernels import CSR
from test_kernels import LOOP_CASES, SHAPES, SPMM_CASES, TOL, random_csr, randn, values_for
from test_ops import DT, GRAPHS, edge_weight_for, make_graph, norm_weight_pairs, rand, x_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]
CUDA_BACKENDS = ("torch", "cupy")
F64 = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(params=CUDA_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each CUDA kernel backend (``cupy`` skips where CuPy is not installed)."""
    if request.param not in kernels.available_backends("cuda"):
        pytest.skip(f"backend {request.param!r} unavailable here (install the CuPy build matching your CUDA)")
    return request.param


@pytest.fixture
def default_backend(backend: str) -> Iterator[str]:
    """``backend`` as the process-wide default for the test (restored afterwards)."""
    saved = kernels._default_override
    kernels.set_default_backend(backend)
    yield backend
    kernels._default_override = saved


def cuda(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A detached CUDA copy that keeps ``requires_grad``."""
    return None if t is None else t.detach().cuda().requires_grad_(t.requires_grad)


def assert_close_to_cpu(out: torch.Tensor, ref: torch.Tensor, **tol: float) -> None:
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **(tol or F64))


def assert_float32_sum_close(out: torch.Tensor, csr: CSR, w: torch.Tensor, x: torch.Tensor) -> None:
    """A float32 product ``A_w x`` on the GPU within rounding of the float64 product: each element
    within ``8 eps sqrt(deg * sum of its squared terms)``, 8 times the typical error of summing its
    row's ``deg`` terms in float32 in any order (a hub row's sum of thousands of terms is off by
    more than a fixed tolerance; a missing or doubled term is off by far more than this)."""
    w64, x64 = w.double(), x.double()
    ref = kernels.spmm(csr, w64, x64, backend="torch")
    squares = kernels.spmm(csr, w64 * w64, x64 * x64, backend="torch")
    deg = (csr.indptr[1:] - csr.indptr[:-1]).to(torch.float64).unsqueeze(1)
    bound = 8 * torch.finfo(torch.float32).eps * (deg * squares).sqrt() + 1e-30
    err = (out.detach().cpu().double() - ref).abs()
    assert out.device.type == "cuda" and bool((err <= bound).all()), \
        f"{int((err > bound).sum())} elements off; worst error / bound {float((err / bound).max()):.3g}"


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,weights", SPMM_CASES)
def test_spmm_matches_cpu(backend: str, shape: str, weights: str, dtype: torch.dtype) -> None:
    rows, cols, nnz, feat, heads = SHAPES[shape]
    csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")  # duplicates and empty rows
    x = randn(cols, *feat, dtype=dtype, seed=1)
    values = values_for(csr, weights, heads, dtype, seed=2)
    expected = kernels.spmm(csr, values, x, backend="torch")
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), rows, cols)
    out = kernels.spmm(gpu_csr, cuda(values), x.cuda(), backend=backend)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close_to_cpu(out, expected, **TOL[dtype])
    # a CPU structure with CUDA operands: its indices move to the device once and are cached
    out_cpu_csr = kernels.spmm(csr, cuda(values), x.cuda(), backend=backend)
    assert_close_to_cpu(out_cpu_csr, expected, **TOL[dtype])


@pytest.mark.parametrize("transpose", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("shape,weights,scaled", LOOP_CASES)
def test_self_loop_products_match_cpu(backend: str, shape: str, weights: str, scaled: bool, transpose: bool) -> None:
    """``kernels.spmm(loop=)`` on the GPU (torch: fixed loops folded into ``A + L`` for cuSPARSE;
    cupy: the loop term after the product) equals the CPU's product with its loop term, also in a
    rectangular matrix and on rows whose columns are not sorted."""
    rows, cols, nnz, feat, heads = SHAPES[shape]
    dtype = torch.float64
    csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")
    if shape == "hub":  # rows whose columns are not sorted
        csr = CSR(csr.indptr, torch.cat([csr.indices[int(csr.indptr[r]):int(csr.indptr[r + 1])].flip(0)
                                         for r in range(rows)] + [csr.indices[:0]]), rows, cols)
    x = randn(rows if transpose else cols, *feat, dtype=dtype, seed=1)
    values = values_for(csr, weights, heads, dtype, seed=2)
    row = torch.rand(rows, dtype=dtype, generator=torch.Generator().manual_seed(3)) + 0.5 if scaled else None
    col = torch.rand(cols, dtype=dtype, generator=torch.Generator().manual_seed(4)) + 0.5 if scaled else None
    at = (rows // 5, 0) if rows >= cols else (0, cols // 4)
    loop = randn(min(rows - at[0], cols - at[1]) - 1, dtype=dtype, seed=5)
    expected = kernels.spmm(csr, values, x, "torch", row_scale=row, col_scale=col, transpose=transpose, loop=loop,
                            loop_at=at)
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), rows, cols)
    out = kernels.spmm(gpu_csr, cuda(values), x.cuda(), backend, row_scale=cuda(row), col_scale=cuda(col),
                       transpose=transpose, loop=loop.cuda(), loop_at=at)
    assert_close_to_cpu(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,weights", SPMM_CASES)
def test_transposed_spmm_matches_cpu(backend: str, shape: str, weights: str, dtype: torch.dtype) -> None:
    """``transpose=True`` (a backward product scattered from A's own CSR; cuSPARSE's op(A) = A^T for
    ``cupy``) equals the CPU's transposed product, with per-vertex scales."""
    rows, cols, nnz, feat, heads = SHAPES[shape]
    csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")
    y = randn(rows, *feat, dtype=dtype, seed=3)
    values = values_for(csr, weights, heads, dtype, seed=2)
    rs, cs = randn(rows, dtype=dtype, seed=4), randn(cols, dtype=dtype, seed=5)
    expected = kernels.spmm(csr, values, y, backend="torch", row_scale=rs, col_scale=cs, transpose=True)
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), rows, cols)
    out = kernels.spmm(gpu_csr, cuda(values), y.cuda(), backend=backend, row_scale=rs.cuda(), col_scale=cs.cuda(),
                       transpose=True)
    assert out.shape == expected.shape
    assert_close_to_cpu(out, expected, **TOL[dtype])


def test_push_backward_on_cuda_matches_cpu(backend: str) -> None:
    """Propagations over a directed graph whose backward products scatter (no transposed copy) give
    the CPU's gradients, with attention-like edge values and with a normalization."""
    g = make_graph("mixed")
    n = g.num_nodes
    x0, w0 = rand(n, 2, 3, seed=1), rand(g.num_edges + n, 2, seed=2, low=0.1)
    grads = []
    for device, name in (("cpu", "torch"), ("cuda", backend)):
        gg = g.to(device)
        ops.set_backward_product(gg, "push")
        # copies: x0.to("cpu") would be x0 itself, and the GPU's x0.to("cuda") then no leaf
        x, w = x0.to(device, copy=True).requires_grad_(True), w0.to(device, copy=True).requires_grad_(True)
        out = ops.propagate(gg, x, norm="none", edge_weight=w, add_self_loops=True, backend=name)
        out2 = ops.propagate(gg, x.reshape(n, 6), norm="gcn", backend=name)
        (out.sum() + (out2 ** 2).sum()).backward()
        grads.append((x.grad.cpu(), w.grad.cpu()))
        assert not any(k in gg._cache for k in ("csr_t", "transpose", "transpose_structure"))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **F64)


@pytest.mark.parametrize("rows,cols,nnz,heads,width", [(60, 60, 4.0, 1, 16), (31, 17, 3.0, 3, 15),
                                                       (50, 50, 0.2, 2, 4), (12, 0, 3.0, 1, 8)])
def test_sddmm_matches_cpu(backend: str, rows: int, cols: int, nnz: float, heads: int, width: int) -> None:
    csr = random_csr(rows, cols, nnz, seed=rows + width)
    a, b = randn(rows, width, dtype=DT, seed=1), randn(cols, width, dtype=DT, seed=2)
    expected = kernels.sddmm(csr, a, b, heads, backend="torch")
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), rows, cols)
    assert_close_to_cpu(kernels.sddmm(gpu_csr, a.cuda(), b.cuda(), heads, backend=backend), expected)


@pytest.mark.parametrize("heads", [1, 4])
def test_spmm_takes_tensors_that_require_grad(backend: str, heads: int) -> None:
    """Issue 16: ``cupy.from_dlpack`` refused tensors requiring grad, so every CUDA training crashed."""
    csr = random_csr(80, 70, 4.0, seed=5)
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), 80, 70)
    x = randn(70, heads, 8, dtype=torch.float32, seed=6)
    w = randn(csr.nnz, heads, dtype=torch.float32, seed=7)
    if heads == 1:
        x, w = x[:, 0], w[:, 0]
    out = kernels.spmm(gpu_csr, w.cuda().requires_grad_(), x.cuda().requires_grad_(), backend=backend)
    assert_close_to_cpu(out, kernels.spmm(csr, w, x, backend="torch"), **TOL[torch.float32])


def test_cupy_runs_on_torchs_current_stream_and_builds_its_structure_once() -> None:
    if "cupy" not in kernels.available_backends("cuda"):
        pytest.skip("CuPy is not installed")
    import cupy
    from cupy_backends.cuda.libs import cusparse

    csr = random_csr(3000, 3000, 8.0, seed=8, hub=True)
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), 3000, 3000)
    torch.cuda.synchronize()  # the structure's copy (default stream) is complete before `side` reads it
    side = torch.cuda.Stream()
    expected = []
    outs = []
    with torch.cuda.stream(side):
        for seed in range(3):  # everything below is queued on `side` and read only after it finishes
            x = randn(3000, 64, dtype=torch.float32, seed=seed)
            w = randn(csr.nnz, dtype=torch.float32, seed=seed + 10)
            expected.append((w, x))
            outs.append(kernels.spmm(gpu_csr, w.cuda(), x.cuda(), backend="cupy") * 2)
        with cupy.cuda.Device(torch.cuda.current_device()):
            assert cusparse.getStream(cupy.cuda.device.get_cusparse_handle()) == side.cuda_stream
    side.synchronize()
    for out, (w, x) in zip(outs, expected):
        assert_float32_sum_close(out / 2, csr, w, x)
    handles = [k for k in gpu_csr.cache if k.startswith("cusparse:")]
    assert handles == [f"cusparse:{torch.device('cuda', torch.cuda.current_device())}:torch.float32"]
    first = gpu_csr.cache[handles[0]]
    kernels.spmm(gpu_csr, None, randn(3000, 8, dtype=torch.float32, seed=9).cuda(), backend="cupy")
    assert gpu_csr.cache[handles[0]] is first and first.indptr.dtype == torch.int32


# --------------------------------------------------------------------------- primitives: forward and backward
def cpu_and_cuda(fn: Callable[..., torch.Tensor], g: Graph, *inputs: Optional[torch.Tensor],
                 **kwargs: Any) -> None:
    """``fn(g, *inputs, **kwargs)`` on CPU and on CUDA: equal outputs and equal input gradients."""
    out = fn(g, *inputs, **kwargs)
    gg = g.to("cuda")
    cuda_inputs = [cuda(t) for t in inputs]
    out_cuda = fn(gg, *cuda_inputs, **kwargs)
    assert_close_to_cpu(out_cuda, out)
    grad = rand(*out.shape, seed=11)
    diff = [t for t in inputs if t is not None and t.requires_grad]
    if not diff:
        return
    ref = torch.autograd.grad(out, diff, grad, allow_unused=True)
    got = torch.autograd.grad(out_cuda, [t for t in cuda_inputs if t is not None and t.requires_grad],
                              grad.cuda(), allow_unused=True)
    for r, c in zip(ref, got):
        if r is None:
            assert c is None or not c.abs().sum()
        else:
            assert_close_to_cpu(c, r)


@pytest.mark.parametrize("add_self_loops", [False, True])
@pytest.mark.parametrize("graph", GRAPHS[:3])
@pytest.mark.parametrize("norm,weights", norm_weight_pairs(("none", "stored", "1d", "heads")))
def test_propagate(backend: str, graph: str, norm: str, weights: str, add_self_loops: bool) -> None:
    g = make_graph(graph, weighted=weights == "stored")
    x = x_for(g, weights, grad=True)
    w = edge_weight_for(g, "none" if weights == "stored" else weights, add_self_loops, grad=True)
    cpu_and_cuda(lambda gr, xx, ww: ops.propagate(gr, xx, norm, ww, add_self_loops,
                                                  backend if gr.device.type == "cuda" else None), g, x, w)


@pytest.mark.parametrize("add_self_loops", [False, True])
@pytest.mark.parametrize("graph", GRAPHS[:3])
def test_gather_softmax_aggregate(graph: str, add_self_loops: bool) -> None:
    g = make_graph(graph)
    x = rand(g.num_nodes, 2, 3, seed=1, grad=True)
    rows = g.num_edges + (g.num_nodes if add_self_loops else 0)
    e = rand(rows, 2, seed=2, grad=True)
    cpu_and_cuda(ops.gather_src, g, x, add_self_loops=add_self_loops)
    cpu_and_cuda(ops.gather_dst, g, x, add_self_loops=add_self_loops)
    cpu_and_cuda(ops.edge_softmax, g, e, add_self_loops=add_self_loops)
    for reduce in ("sum", "mean", "max"):
        cpu_and_cuda(ops.aggregate, g, e, reduce=reduce, add_self_loops=add_self_loops)
    # the fused attention: native kernels on the CPU, its torch formulation on CUDA
    s, t = rand(g.num_nodes, 3, seed=3, grad=True), rand(g.num_nodes, 3, seed=4, grad=True)
    cpu_and_cuda(ops.edge_attention, g, s, t, negative_slope=0.2, add_self_loops=add_self_loops)


@pytest.mark.parametrize("add_self_loops", [False, True])
@pytest.mark.parametrize("heads", [1, 4])
def test_edge_attention_float32(default_backend: str, heads: int, add_self_loops: bool) -> None:
    """float32 attention on CUDA (``cupy``: gnncompile's fused kernels; ``torch``: the torch
    formulation) against the CPU's native kernels: coefficients and both score gradients."""
    g = make_graph(GRAPHS[0])
    shape = (heads,) if heads > 1 else ()
    s = randn(g.num_src, *shape, dtype=torch.float32, seed=3).requires_grad_()
    t = randn(g.num_nodes, *shape, dtype=torch.float32, seed=4).requires_grad_()
    assert kernels.fused_attention(s.detach().cuda()) == (default_backend == "cupy")
    out = ops.edge_attention(g, s, t, 0.2, add_self_loops)
    sc, tc = cuda(s), cuda(t)
    out_cuda = ops.edge_attention(g.to("cuda"), sc, tc, 0.2, add_self_loops)
    assert_close_to_cpu(out_cuda, out, rtol=1e-5, atol=1e-6)
    grad = randn(*out.shape, dtype=torch.float32, seed=5)
    ref = torch.autograd.grad(out, (s, t), grad)
    got = torch.autograd.grad(out_cuda, (sc, tc), grad.cuda())
    for r, c in zip(ref, got):
        assert_close_to_cpu(c, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("add_self_loops", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_masked_propagate(backend: str, weighted: bool, add_self_loops: bool) -> None:
    g = make_graph("mixed")
    x = rand(g.num_nodes, 3, seed=1, grad=True)
    mask = (rand(g.num_nodes, 3, seed=4) > 0).to(DT)
    w = edge_weight_for(g, "1d" if weighted else "none", add_self_loops, grad=True)
    for index_cost in (None, 0):  # full product, and the row-subset path whenever a row is dropped
        saved = kernels.masked.FORWARD_INDEX_COST, kernels.masked.BACKWARD_INDEX_COST
        if index_cost == 0:
            kernels.masked.FORWARD_INDEX_COST = kernels.masked.BACKWARD_INDEX_COST = 0
        try:
            cpu_and_cuda(lambda gr, xx, mm, ww: ops.masked_propagate(gr, xx, mm, "mean", ww, add_self_loops,
                                                                     backend if gr.device.type == "cuda" else None),
                         g, x, mask, w)
        finally:
            kernels.masked.FORWARD_INDEX_COST, kernels.masked.BACKWARD_INDEX_COST = saved


def test_dropout_rows_and_noise_on_cuda() -> None:
    x = torch.ones(50, 4, dtype=DT, device="cuda")
    index = torch.arange(10, 30, device="cuda")
    out = ops.dropout_rows(x[10:30], 0.5, index, 50)
    assert out.device.type == "cuda" and set(out.unique().tolist()) <= {0.0, 2.0}
    noise = ops.dropout_noise(x, 0.25)
    assert noise.device.type == "cuda" and set(noise.unique().tolist()) <= {0.0, 1 / 0.75}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.float16, torch.bfloat16])
def test_dropout_masks_on_cuda_equal_the_cpu_masks(dtype: torch.dtype) -> None:
    """A mask drawn on the GPU (the CUDA kernel; torch operations with native=False) is the CPU's
    bit for bit, for every row and for chosen rows."""
    from gnncompile.kernels.dropout import _cuda_kernel, dropout_mask

    if "cupy" in kernels.available_backends("cuda"):  # (else both are torch operations)
        assert _cuda_kernel(torch.device("cuda")), "the CUDA mask kernel did not build"
    rows = torch.tensor([70_000, 3, 3, 99_999, 0])
    for p, shape, seed in ((0.5, (130,), 2**40 + 1), (0.2, (3, 5), 9), (0.0, (1,), 2**64 - 1)):
        cpu_all = dropout_mask(seed, p, 100_000, shape, dtype=dtype)
        cpu_rows = dropout_mask(seed, p, 100_000, shape, rows=rows, dtype=dtype)
        for native in (None, False):
            got = dropout_mask(seed, p, 100_000, shape, dtype=dtype, device="cuda", native=native)
            assert got.device.type == "cuda" and torch.equal(got.cpu(), cpu_all), (p, shape, native)
            got = dropout_mask(seed, p, 100_000, shape, rows=rows.cuda(), dtype=dtype, device="cuda", native=native)
            assert torch.equal(got.cpu(), cpu_rows), (p, shape, native)


# --------------------------------------------------------------------------- gradcheck on CUDA (float64)
@pytest.mark.parametrize("add_self_loops", [False, True])
def test_gradcheck(backend: str, add_self_loops: bool) -> None:
    g = make_graph("mixed").to("cuda")
    rows = g.num_edges + (g.num_nodes if add_self_loops else 0)
    x = rand(g.num_nodes, 3, seed=1).cuda().requires_grad_()
    xh = rand(g.num_nodes, 2, 3, seed=1).cuda().requires_grad_()
    w = rand(rows, seed=2, low=0.5, high=1.5).cuda().requires_grad_()
    wh = rand(rows, 2, seed=3, low=0.5, high=1.5).cuda().requires_grad_()
    e = rand(rows, 2, seed=4).cuda().requires_grad_()
    mask = (x[:, :1] > 0).detach().to(DT)
    checks = [
        (lambda a: ops.propagate(g, a, "gcn", add_self_loops=add_self_loops, backend=backend), (x,)),
        (lambda a, b: ops.propagate(g, a, "mean", b, add_self_loops, backend=backend), (x, w)),
        (lambda a, b: ops.propagate(g, a, "none", b, add_self_loops, backend=backend), (xh, wh)),
        (lambda a: ops.edge_softmax(g, a, add_self_loops), (e,)),
        (lambda a: ops.aggregate(g, a, "max", add_self_loops), (e,)),
        (lambda a: ops.gather_src(g, a, add_self_loops) * ops.gather_dst(g, a, add_self_loops), (x,)),
        (lambda a, b: ops.masked_propagate(g, a, mask, "sum", b, add_self_loops, backend=backend), (x, w)),
    ]
    for fn, args in checks:
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- sparse input features
def sparse_graph(num_features: int = 20) -> Graph:
    base = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=4, num_classes=3, seed=2)
    x = sp.random(120, num_features, density=0.15, random_state=3, format="csr", dtype="float64")
    return base.replace(x=x)


def test_sparse_feature_linear_and_dropout_on_cuda() -> None:
    g = sparse_graph()
    x = g.x.to(DT)
    torch.manual_seed(0)
    lin = Linear(20, 5).to(DT)
    lin_c = Linear(20, 5).to(DT).cuda()
    lin_c.load_state_dict(lin.state_dict())
    out, out_c = lin(x), lin_c(x.cuda())
    assert_close_to_cpu(out_c, out)
    grad = rand(120, 5, seed=3)
    out.backward(grad)
    out_c.backward(grad.cuda())
    for p, q in zip(lin.parameters(), lin_c.parameters()):
        assert_close_to_cpu(q.grad, p.grad)
    dropped = feature_dropout(x.cuda(), 0.5, training=True)
    assert dropped.layout == torch.sparse_csr and dropped.device.type == "cuda"
    assert torch.equal(dropped.col_indices().cpu(), x.col_indices())
    assert set(dropped.values().unique().cpu().tolist()) <= {0.0} | set((x.values() * 2).tolist())
    rows = ops.dropout_rows(x.cuda(), 0.5, torch.arange(x.values().numel(), device="cuda"), x.values().numel())
    assert rows.layout == torch.sparse_csr and rows.device.type == "cuda"


def test_graph_to_cuda_moves_sparse_features_and_caches() -> None:
    g = sparse_graph()
    x = rand(g.num_nodes, 3, grad=True)
    (ops.propagate(g, x) + ops.propagate(g, x, "mean", add_self_loops=True)).sum().backward()
    gg = g.to("cuda")
    assert gg.x.device.type == "cuda" and gg.x.layout == torch.sparse_csr
    for key, value in gg._cache.items():
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cuda", key


# --------------------------------------------------------------------------- the zoo: one step on CUDA == CPU
MAKERS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "GCN": lambda f, c: gc.nn.GCN(f, 8, c, dropout=0.0),
    "GraphSAGE": lambda f, c: gc.nn.GraphSAGE(f, 8, c, dropout=0.0),
    "GAT": lambda f, c: gc.nn.GAT(f, 4, c, heads=2, dropout=0.0),
    "GIN": lambda f, c: gc.nn.GIN(f, 8, c, dropout=0.0),
    "GCNII": lambda f, c: gc.nn.GCNII(f, 8, c, num_layers=4, dropout=0.0),
    "APPNP": lambda f, c: gc.nn.APPNP(f, 8, c, K=3, dropout=0.0),
    "SGC": lambda f, c: gc.nn.SGC(f, c, K=2),
    "ResGCN": lambda f, c: gc.nn.ResGCN(f, 8, c, num_layers=3, dropout=0.0),
}
SPARSE_MODELS = tuple(name for name in MAKERS if name != "GIN")  # GIN propagates its raw input


def step(model: torch.nn.Module, g: Graph) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step's loss and parameter gradients (train mode; no optimizer)."""
    model.train()
    model.zero_grad(set_to_none=True)
    x = g.x if g.x.layout != torch.strided else g.x.to(DT)
    loss = F.cross_entropy(model(g, x)[g.train_mask], g.y[g.train_mask])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("features", ["dense", "sparse"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_zoo_training_step_on_cuda_equals_cpu(default_backend: str, name: str, features: str) -> None:
    if features == "sparse" and name not in SPARSE_MODELS:
        pytest.skip(f"{name} propagates its raw input: sparse features are refused by design")
    g = sparse_graph() if features == "sparse" else gc.datasets.synthetic(
        "sbm", num_nodes=150, avg_degree=5, num_features=12, num_classes=3, seed=4)
    if features == "sparse":
        g = g.replace(x=g.x.to(DT))
    torch.manual_seed(0)
    model = MAKERS[name](g.num_features, g.num_classes).to(DT)
    model_c = MAKERS[name](g.num_features, g.num_classes).to(DT).cuda()
    model_c.load_state_dict(model.state_dict())
    saved = kernels._default_override
    kernels.set_default_backend(None)  # CPU reference on the CPU default backend
    try:
        loss, grads = step(model, g)
    finally:
        kernels._default_override = saved
    loss_c, grads_c = step(model_c, g.to("cuda"))
    assert_close_to_cpu(loss_c, loss, rtol=1e-9, atol=1e-11)
    assert grads.keys() == grads_c.keys()
    for k in grads:
        assert_close_to_cpu(grads_c[k], grads[k], rtol=1e-8, atol=1e-10)


# --------------------------------------------------------------------------- no CPU tensor in a CUDA step
class OnlyCuda(TorchDispatchMode):
    """Fails any op (forward or backward) that receives or returns a tensor not on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                raise AssertionError(f"{func} received a tensor on {t.device} (shape {list(t.shape)})")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                raise AssertionError(f"{func} produced a tensor on {t.device}")
        self.ops += 1
        return out


@pytest.mark.parametrize("features", ["dense", "sparse"])
@pytest.mark.parametrize("name", ["GCN", "GraphSAGE", "GAT"])
def test_a_cuda_step_touches_no_cpu_tensor(default_backend: str, name: str, features: str) -> None:
    g = sparse_graph() if features == "sparse" else gc.datasets.synthetic(
        "sbm", num_nodes=150, avg_degree=5, num_features=12, num_classes=3, seed=4)
    gg = g.to("cuda")
    torch.manual_seed(0)
    # default dropouts: input dropout on (sparse) features and attention dropout run too
    model = getattr(gc.nn, name)(g.num_features, 4, g.num_classes).cuda()
    model.train()
    x = gg.x if gg.x.layout != torch.strided else gg.x.float()
    torch.cuda.synchronize()
    guard = OnlyCuda()
    with guard:
        logits = model(gg, x)
        loss = F.cross_entropy(logits[gg.train_mask], gg.y[gg.train_mask])
        loss.backward()
    torch.cuda.synchronize()
    assert guard.ops > 10 and all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())
