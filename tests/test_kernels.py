"""Sparse kernel backends (`gnncompile.kernels`): every backend against the torch backend.

The torch backend (``torch.sparse.mm``) is itself checked against a dense product first; the other
backends are then compared with it on random CSR matrices with empty rows, duplicate entries,
rectangular shapes, matrices without columns and features without columns, in float32 and float64,
with one head and with several.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Iterator, Optional

import numpy as np
import pytest
import torch

from gnncompile import KernelError
from gnncompile import kernels
from gnncompile.kernels import CSR

CPU_BACKENDS = ("native", "torch", "scipy")
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def require_native() -> Any:
    """The native CPU kernels' module; skips the test, quoting the build error, where the C++
    extension could not be built here (no compiler or OpenMP: the other backends still run)."""
    try:
        return kernels._load_native()
    except KernelError as e:
        pytest.skip(f"the native C++ kernels did not build on this machine: {e}")


def random_csr(rows: int, cols: int, avg_nnz: float, seed: int, hub: bool = False) -> CSR:
    """A random CSR with sorted, possibly repeated column ids per row; about 1/3 of rows are empty.

    ``hub`` gives row 0 a large share of the entries (power-law-like load imbalance).
    """
    rng = np.random.default_rng(seed)
    counts = rng.poisson(avg_nnz * 1.5, size=rows) * (rng.random(rows) < 2 / 3) if cols else np.zeros(rows, int)
    if hub and rows and cols:
        counts[0] = int(avg_nnz * rows // 4) + 1
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.concatenate(
        [np.sort(rng.integers(0, cols, size=c)) for c in counts] + [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)
    return CSR(torch.from_numpy(indptr), torch.from_numpy(indices), rows, cols)


def dense(csr: CSR, values: torch.Tensor) -> torch.Tensor:
    """``[rows, cols(, H)]`` dense matrix with duplicates summed."""
    rows = torch.repeat_interleave(torch.arange(csr.num_rows), csr.indptr[1:] - csr.indptr[:-1])
    a = torch.zeros((csr.num_rows, csr.num_cols) + tuple(values.shape[1:]), dtype=values.dtype)
    return a.index_put_((rows, csr.indices), values, accumulate=True)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded standard normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each CPU kernel backend (``native`` is skipped where the extension cannot be built)."""
    if request.param not in kernels.available_backends("cpu"):
        pytest.skip(f"backend {request.param!r} unavailable here")
    return request.param


@pytest.fixture
def restore_default() -> Iterator[None]:
    """Restore the process-wide default backend after the test."""
    saved = kernels._default_override
    yield
    kernels._default_override = saved


# (rows, cols, avg nnz per row, feature shape after the rows, heads of the edge values)
SHAPES = {
    "square": (60, 60, 4.0, (16,), 1),
    "rect_odd_width": (37, 23, 3.0, (5,), 1),
    "wide": (40, 50, 3.0, (100,), 1),  # more than one register tile (64) per row
    "width_32": (30, 30, 6.0, (32,), 1),
    "width_64": (30, 30, 6.0, (64,), 1),
    "d256": (30, 30, 6.0, (256,), 1),
    "width_1": (30, 30, 6.0, (1,), 1),
    "vector_heads_1d": (30, 30, 3.0, (3, 4), 1),  # [N, H, C] features, one weight per edge
    "heads_8x8": (50, 50, 5.0, (8, 8), 8),
    "heads_3x5": (31, 17, 3.0, (3, 5), 3),
    "heads_2x1": (20, 20, 3.0, (2, 1), 2),
    "heads_4x16": (40, 30, 4.0, (4, 16), 4),
    "heads_2x300": (20, 25, 3.0, (2, 300), 2),  # a head wider than the register window
    "empty_rows": (50, 50, 0.2, (16,), 1),
    "no_columns": (12, 0, 3.0, (8,), 1),
    "no_rows": (0, 9, 3.0, (8,), 1),
    "zero_features": (20, 20, 3.0, (0,), 1),
    "zero_features_heads": (20, 20, 3.0, (2, 0), 2),
    "hub": (400, 300, 3.0, (24,), 1),
}


def values_for(csr: CSR, kind: str, heads: int, dtype: torch.dtype, seed: int) -> Optional[torch.Tensor]:
    """Edge values: ``None`` (unweighted), ``[E]`` (weighted), ``[E, 1]`` (column) or ``[E, heads]``."""
    if kind == "unweighted":
        return None
    if heads > 1:
        return randn(csr.nnz, heads, dtype=dtype, seed=seed)
    return randn(csr.nnz, dtype=dtype, seed=seed) if kind == "weighted" else randn(csr.nnz, 1, dtype=dtype, seed=seed)


# --------------------------------------------------------------------------- spmm
# multi-head shapes need [E, H] weights; one-head shapes take none, [E] or [E, 1]
SPMM_CASES = [(shape, weights) for shape, spec in SHAPES.items()
              for weights in (("weighted",) if spec[4] > 1 else ("unweighted", "weighted", "column"))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,weights", SPMM_CASES)
def test_spmm_matches_torch_backend(backend: str, shape: str, weights: str, dtype: torch.dtype) -> None:
    rows, cols, nnz, feat, heads = SHAPES[shape]
    csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")
    x = randn(cols, *feat, dtype=dtype, seed=1)
    values = values_for(csr, weights, heads, dtype, seed=2)
    out = kernels.spmm(csr, values, x, backend=backend)
    expected = kernels.spmm(csr, values, x, backend="torch")
    assert out.shape == (rows,) + feat and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("heads", [1, 4])
def test_torch_backend_matches_dense_product(heads: int) -> None:
    csr = random_csr(45, 33, 4.0, seed=3)
    x = randn(33, heads, 6, dtype=torch.float64, seed=4)
    w = randn(csr.nnz, heads, dtype=torch.float64, seed=5)
    expected = torch.einsum("rch,chd->rhd", dense(csr, w), x)
    if heads == 1:
        w, x, expected = w[:, 0], x[:, 0], expected[:, 0]
    torch.testing.assert_close(kernels.spmm(csr, w, x, backend="torch"), expected)
    ones = torch.ones(csr.nnz, dtype=torch.float64)
    torch.testing.assert_close(kernels.spmm(csr, None, x, backend="torch"),
                               torch.einsum("rc,c...->r...", dense(csr, ones), x))


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("heads", [2, 3])
def test_torch_backend_interleaves_heads_into_one_product(heads: int, wide: bool, monkeypatch) -> None:
    """A multi-head product is one product over the head-interleaved structure: entry
    ``(r*H + h, c*H + h)`` per edge and head, the edge values gathered by ``perm``; forward and
    transposed equal the dense per-head products, duplicates and empty rows included. ``wide``:
    the int64 arrays of structures past int32 (the limit lowered to reach them)."""
    if wide:
        monkeypatch.setattr(kernels, "_INT32_MAX", 10)
    csr = random_csr(45, 33, 4.0, seed=heads, hub=True)
    inter, perm = kernels._interleaved(csr, heads, torch.device("cpu"))
    idt = torch.int64 if wide else torch.int32
    assert inter.indptr.dtype == inter.indices.dtype == perm.dtype == idt
    assert (inter.num_rows, inter.num_cols, inter.nnz) == (45 * heads, 33 * heads, csr.nnz * heads)
    w = randn(csr.nnz, heads, dtype=torch.float64, seed=5)
    a = dense(inter, w.reshape(-1)[perm.long()])
    for h in range(heads):   # head h's block is the graph with head h's values; nothing across heads
        torch.testing.assert_close(a[h::heads, h::heads], dense(csr, w[:, h]), rtol=0, atol=0)
        for k in range(heads):
            if k != h:
                assert not a[h::heads, k::heads].any()
    x = randn(33, heads, 6, dtype=torch.float64, seed=4)
    expected = torch.einsum("rch,chd->rhd", dense(csr, w), x)
    torch.testing.assert_close(kernels.spmm(csr, w, x, backend="torch"), expected)
    y = randn(45, heads, 6, dtype=torch.float64, seed=6)
    torch.testing.assert_close(kernels.spmm(csr, w, y, backend="torch", transpose=True),
                               torch.einsum("rch,rhd->chd", dense(csr, w), y))
    assert kernels._interleaved(csr, heads, torch.device("cpu"))[0] is inter   # built once per heads


@pytest.mark.parametrize("blocked", [False, True], ids=["one_call", "row_blocks"])
@pytest.mark.parametrize("heads", [1, 3])
def test_torch_backend_sddmm_samples_the_dense_product(heads: int, blocked: bool, monkeypatch) -> None:
    """The torch backend's SDDMM (``sampled_addmm`` over the structure, interleaved for several heads)
    is ``<a[row], b[col]>`` per edge and head, duplicates and empty rows included, also in row
    blocks (a bound of 7 entries: a hub row longer than that is a block alone); nothing per edge is
    kept beside the structure."""
    if blocked:
        monkeypatch.setattr(kernels, "_SAMPLED_BLOCK", 7)
    csr = random_csr(40, 30, 4.0, seed=9 + heads, hub=True)
    a = randn(40, heads, 5, dtype=torch.float64, seed=1)
    b = randn(30, heads, 5, dtype=torch.float64, seed=2)
    rows = torch.repeat_interleave(torch.arange(40), csr.indptr[1:] - csr.indptr[:-1])
    expected = (a[rows] * b[csr.indices]).sum(-1)
    torch.testing.assert_close(kernels.sddmm(csr, a, b, heads, backend="torch"), expected)
    assert not any(k.startswith("rows:") for k in csr.cache)
    structure = csr if heads == 1 else kernels._interleaved(csr, heads, torch.device("cpu"))[0]
    blocks = kernels._row_blocks(structure, kernels._SAMPLED_BLOCK)
    assert (len(blocks) > 1) == blocked and blocks[0][0] == 0 and blocks[-1][1] == structure.num_rows
    assert all(b[1] == c[0] and b[3] == c[2] for b, c in zip(blocks, blocks[1:]))   # consecutive, covering


def test_sddmm_measurement_keeps_the_faster_correct_formulation(monkeypatch) -> None:
    """On CUDA the torch backend measures ``sampled_addmm`` against gathering (the reference) once per
    structure and shape: the faster correct one is kept and recorded, a wrong one is rejected, and
    the reference's per-edge rows are dropped when it loses (here on the CPU, by wall time)."""
    import time

    from gnncompile.kernels import cuda

    csr = random_csr(50, 50, 4.0, seed=3)
    a, b = randn(50, 8, dtype=torch.float32, seed=1), randn(50, 8, dtype=torch.float32, seed=2)
    gather, sampled = kernels._sddmm_gather, kernels._sddmm_sampled
    monkeypatch.setattr(kernels, "_sddmm_gather", lambda *args: (time.sleep(0.02), gather(*args))[1])
    w = kernels._sddmm_measured(csr, a, b, 2, cuda.wall_timer)
    choice = cuda.choices()[-1]
    assert choice.op == "sddmm" and choice.chosen == "sampled_addmm" and "2 heads" in choice.shape, choice
    assert not any(k.startswith("rows:") for k in csr.cache)
    torch.testing.assert_close(w, gather(csr, a, b, 2))
    csr2 = random_csr(50, 50, 4.0, seed=4)
    monkeypatch.setattr(kernels, "_sddmm_gather", gather)
    monkeypatch.setattr(kernels, "_sddmm_sampled", lambda *args: sampled(*args) + 1)
    w = kernels._sddmm_measured(csr2, a, b, 2, cuda.wall_timer)
    choice = cuda.choices()[-1]
    assert choice.chosen == "gather" and "sampled_addmm" in choice.rejected, choice
    torch.testing.assert_close(w, gather(csr2, a, b, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_spmm_large_power_law_matrix(backend: str, dtype: torch.dtype) -> None:
    """Thousands of rows with a hub: exercises the edge-balanced row blocks of the parallel loop."""
    csr = random_csr(6000, 6000, 8.0, seed=11, hub=True)
    x = randn(6000, 48, dtype=dtype, seed=12)
    w = randn(csr.nnz, dtype=dtype, seed=13)
    expected = kernels.spmm(csr, w, x, backend="torch")
    torch.testing.assert_close(kernels.spmm(csr, w, x, backend=backend), expected, **TOL[dtype])


def test_spmm_output_above_huge_page_threshold(backend: str) -> None:
    """A >= 32 MiB output takes the native backend's huge-page path; values must not change."""
    csr = random_csr(33_000, 2_000, 1.0, seed=14)
    x = randn(2_000, 256, dtype=torch.float32, seed=15)
    w = randn(csr.nnz, dtype=torch.float32, seed=16)
    out = kernels.spmm(csr, w, x, backend=backend)
    assert out.numel() * 4 >= 32 << 20
    torch.testing.assert_close(out, kernels.spmm(csr, w, x, backend="torch"), **TOL[torch.float32])


def test_native_feature_tiles_give_identical_results() -> None:
    mod = require_native()
    csr = random_csr(500, 400, 6.0, seed=17, hub=True)
    idx = kernels._native_index(csr)
    for heads, width in ((1, 200), (4, 48), (8, 8)):
        x = randn(400, heads * width, dtype=torch.float32, seed=18)
        w = randn(csr.nnz, heads, dtype=torch.float32, seed=19)
        w = w[:, 0].contiguous() if heads == 1 else w
        whole = mod.spmm(csr.indptr, idx, w, x, heads, 0)
        for tile in (1, 16, 64, 1000):
            assert torch.equal(mod.spmm(csr.indptr, idx, w, x, heads, tile), whole), (heads, width, tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_native_spmm_every_window_width(dtype: torch.dtype) -> None:
    """Every width up to past two register windows, in particular the ones that are no power of two
    (one masked window in the accumulator of the next power of two; a partial last window past the
    widest): equal to the torch backend, for each kind of edge values; the gathered rows include the
    last row of ``x`` (a masked window must not read past it)."""
    require_native()
    csr = random_csr(40, 30, 4.0, seed=21)
    last = torch.full((3,), 29, dtype=csr.indices.dtype)  # row 0 also gathers x's last row
    csr = CSR(torch.cat([csr.indptr[:1], csr.indptr[1:] + 3]), torch.cat([last, csr.indices]), csr.num_rows,
              csr.num_cols)
    for width in list(range(1, 21)) + [31, 47, 100, 130, 257, 300]:
        x = randn(30, width, dtype=dtype, seed=width)
        for weights in ("unweighted", "weighted", "column"):
            values = values_for(csr, weights, 1, dtype, seed=width + 1)
            torch.testing.assert_close(kernels.spmm(csr, values, x, backend="native"),
                                       kernels.spmm(csr, values, x, backend="torch"), **TOL[dtype],
                                       msg=lambda m, w=width, k=weights: f"width {w}, {k}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_native_narrow_widths_padded_equal_the_kernel_unpadded(dtype: torch.dtype) -> None:
    """Narrow widths that are no power of two run zero-padded (``kernels._PADDED_WIDTHS``): the same
    sums, bit for bit, as the kernel on the unpadded rows (its masked window, which reads whole
    accumulator widths except from the last rows of ``x``), forward and transposed, with scales."""
    mod = require_native()
    csr = random_csr(40, 30, 8.0, seed=23)  # enough edges per row that padding pays (kernels._padded_width)
    last = torch.full((3,), 29, dtype=csr.indices.dtype)  # row 0 also gathers x's last row
    csr = CSR(torch.cat([csr.indptr[:1], csr.indptr[1:] + 3]), torch.cat([last, csr.indices]), csr.num_rows,
              csr.num_cols)
    idx = kernels._native_index(csr)
    rs, cs = randn(40, dtype=dtype, seed=3), randn(30, dtype=dtype, seed=4)
    parts = kernels._push_parts(csr, torch.get_num_threads())
    assert set(kernels._PADDED_WIDTHS) >= {3, 5, 7, 12, 20, 31}
    for width in sorted(kernels._PADDED_WIDTHS):
        assert kernels._padded_width(csr, width, False) == kernels._PADDED_WIDTHS[width]
        assert kernels._padded_width(csr, width, True) == kernels._PADDED_WIDTHS[width]
        x = randn(30, width, dtype=dtype, seed=width)
        for values in (None, randn(csr.nnz, dtype=dtype, seed=width + 1)):
            unpadded = mod.spmm(csr.indptr, idx, values, x, 1, 0, rs, cs)
            assert torch.equal(kernels.spmm(csr, values, x, backend="native", row_scale=rs, col_scale=cs),
                               unpadded), width
            torch.testing.assert_close(unpadded, kernels.spmm(csr, values, x, backend="torch", row_scale=rs,
                                                              col_scale=cs), **TOL[dtype])
            y = randn(40, width, dtype=dtype, seed=width + 2)
            pushed = mod.spmm_t(csr.indptr, idx, values, y, 1, 30, parts, rs, cs)
            assert torch.equal(kernels.spmm(csr, values, y, backend="native", row_scale=rs, col_scale=cs,
                                            transpose=True), pushed), width


def test_native_chunk_products_run_unpadded() -> None:
    """A product over a few rows of a graph against all its sources (a chunk of a ``task`` plan) is
    not padded: padding would copy every source row for few edges. The whole graph's product is."""
    csr = random_csr(2000, 2000, 8.0, seed=5)
    chunk = CSR(csr.indptr[:101] - csr.indptr[0], csr.indices[:int(csr.indptr[100])], 100, 2000)
    assert kernels._padded_width(csr, 5, False) == 8 and kernels._padded_width(csr, 5, True) == 8
    assert kernels._padded_width(chunk, 5, False) is None and kernels._padded_width(chunk, 5, True) is None
    assert kernels._padded_width(csr, 8, False) is None  # a power of two runs as it is


def test_native_spmm_is_deterministic() -> None:
    require_native()
    csr = random_csr(5000, 5000, 10.0, seed=21, hub=True)
    x = randn(5000, 40, dtype=torch.float32, seed=22)
    w = randn(csr.nnz, dtype=torch.float32, seed=23)
    first = kernels.spmm(csr, w, x, backend="native")
    for threads in (1, 2, torch.get_num_threads()):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert torch.equal(kernels.spmm(csr, w, x, backend="native"), first)
        finally:
            torch.set_num_threads(saved)


def test_products_are_no_views(backend: str) -> None:
    """A product's result owns its storage (no ``_base``), multi-head ``[N, H, C]`` too: a view would
    keep a base that a plan's ``Free`` cannot release (the executor swaps a freed stage output's
    storage, which only a tensor of its own gives back)."""
    csr = random_csr(40, 30, 4.0, seed=9)
    for values, x in ((None, randn(30, 5, dtype=torch.float64, seed=1)),
                      (randn(csr.nnz, 3, dtype=torch.float64, seed=2), randn(30, 3, 4, dtype=torch.float64, seed=3))):
        for transpose in (False, True):
            xx = x if not transpose else randn(40, *x.shape[1:], dtype=torch.float64, seed=4)
            out = kernels.spmm(csr, values, xx, backend=backend, transpose=transpose)
            assert out._base is None and out.is_contiguous()
            assert out.shape == ((30 if transpose else 40),) + tuple(x.shape[1:])
            want = kernels.spmm(csr, values, xx, backend="torch", transpose=transpose)
            torch.testing.assert_close(out, want)


# --------------------------------------------------------------------------- sddmm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "rows,cols,nnz,heads,width",
    [(60, 60, 4.0, 1, 16), (37, 23, 3.0, 1, 7), (50, 50, 5.0, 8, 64), (31, 17, 3.0, 3, 15), (50, 50, 0.2, 2, 4),
     (12, 0, 3.0, 1, 8), (0, 9, 3.0, 1, 8), (20, 20, 3.0, 2, 0), (400, 300, 3.0, 4, 256)],
)
def test_sddmm_matches_torch_backend(backend: str, rows: int, cols: int, nnz: float, heads: int, width: int,
                                     dtype: torch.dtype) -> None:
    csr = random_csr(rows, cols, nnz, seed=rows + width, hub=rows > 100)
    a = randn(rows, width, dtype=dtype, seed=1)
    b = randn(cols, width, dtype=dtype, seed=2)
    out = kernels.sddmm(csr, a, b, heads, backend=backend)
    assert out.shape == (csr.nnz, heads) and out.dtype == dtype
    torch.testing.assert_close(out, kernels.sddmm(csr, a, b, heads, backend="torch"), **TOL[dtype])


def test_sddmm_accepts_head_shaped_inputs(backend: str) -> None:
    csr = random_csr(25, 25, 4.0, seed=6)
    a = randn(25, 4, 3, dtype=torch.float64, seed=7)
    b = randn(25, 4, 3, dtype=torch.float64, seed=8)
    rows = torch.repeat_interleave(torch.arange(25), csr.indptr[1:] - csr.indptr[:-1])
    expected = (a[rows] * b[csr.indices]).sum(-1)
    torch.testing.assert_close(kernels.sddmm(csr, a, b, 4, backend=backend), expected)


# --------------------------------------------------------------------------- native index paths
def test_native_int32_and_int64_indices_agree() -> None:
    mod = require_native()
    csr = random_csr(300, 200, 5.0, seed=31, hub=True)
    assert kernels._native_index(csr).dtype == torch.int32  # what the backend passes
    idx32, idx64 = csr.indices.to(torch.int32), csr.indices
    for heads, feat in ((1, 16), (1, 70), (4, 24)):
        x = randn(200, feat, dtype=torch.float32, seed=heads)
        w = randn(csr.nnz, heads, dtype=torch.float32, seed=feat).contiguous()
        w = w[:, 0].contiguous() if heads == 1 else w
        out32 = mod.spmm(csr.indptr, idx32, w, x, heads, 0)
        out64 = mod.spmm(csr.indptr, idx64, w, x, heads, 0)
        assert torch.equal(out32, out64)
        assert torch.equal(mod.spmm(csr.indptr, idx32, None, x, heads, 0),
                           mod.spmm(csr.indptr, idx64, None, x, heads, 0))
        a = randn(300, feat, dtype=torch.float32, seed=5)
        assert torch.equal(mod.sddmm(csr.indptr, idx32, a, x, heads), mod.sddmm(csr.indptr, idx64, a, x, heads))
        expected = kernels.spmm(csr, w, x.reshape(200, heads, -1) if heads > 1 else x, backend="torch")
        torch.testing.assert_close(out32.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


def test_native_rejects_malformed_arguments() -> None:
    mod = require_native()
    csr = random_csr(10, 10, 3.0, seed=41)
    x = torch.randn(10, 4)
    with pytest.raises(RuntimeError, match="E \\* heads"):
        mod.spmm(csr.indptr, csr.indices, torch.ones(csr.nnz + 1), x, 1, 0)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        mod.spmm(csr.indptr, csr.indices.to(torch.int16), None, x, 1, 0)
    with pytest.raises(RuntimeError, match="divisible by heads"):
        mod.spmm(csr.indptr, csr.indices, None, torch.randn(10, 5), 2, 0)


# --------------------------------------------------------------------------- edge reductions
def _edge_rows_of(csr: CSR) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(csr.num_rows), csr.indptr[1:] - csr.indptr[:-1])


def _softmax_reference(csr: CSR, e: torch.Tensor, loops: bool) -> torch.Tensor:
    """Softmax per row over its edges (and its loop, row ``E + r``) by a dense masked softmax."""
    rows, nnz = _edge_rows_of(csr), csr.nnz
    out = torch.empty_like(e)
    for r in range(csr.num_rows):
        idx = torch.nonzero(rows == r).flatten()
        if loops:
            idx = torch.cat([idx, torch.tensor([nnz + r])])
        if idx.numel():
            out[idx] = torch.softmax(e[idx], dim=0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("width", [1, 3, 8, 20])
def test_native_edge_reductions_match_their_definitions(dtype: torch.dtype, width: int) -> None:
    require_native()
    csr = random_csr(120, 90, 4.0, seed=width, hub=True)
    t = randn(csr.nnz, width, dtype=dtype, seed=1)
    rows = _edge_rows_of(csr)
    expect_rows = torch.zeros(csr.num_rows, width, dtype=dtype).index_add_(0, rows, t)
    torch.testing.assert_close(kernels.segment_sum(csr, t), expect_rows, **TOL[dtype])
    expect_cols = torch.zeros(csr.num_cols, width, dtype=dtype).index_add_(0, csr.indices, t)
    torch.testing.assert_close(kernels.scatter_sum(csr, t), expect_cols, **TOL[dtype])
    for loops in (False, True):
        e = randn(csr.nnz + (csr.num_rows if loops else 0), width, dtype=dtype, seed=2)
        shifted = kernels.edge_softmax_step(csr, e, "shift", loops=loops)
        s = kernels.edge_softmax_step(csr, shifted.exp_(), "normalize", loops=loops)
        ref = _softmax_reference(csr, e, loops)
        covered = rows if not loops else torch.cat([rows, torch.arange(csr.num_rows)])
        torch.testing.assert_close(s[: covered.numel()], ref[: covered.numel()], **TOL[dtype])
        g = randn(*e.shape, dtype=dtype, seed=3)
        e_ = e.clone().requires_grad_(True)
        (_softmax_reference(csr, e_, loops) * g).sum().backward()
        got = kernels.edge_softmax_step(csr, s, "backward", loops=loops, grad=g)
        torch.testing.assert_close(got, e_.grad, **TOL[dtype])


def test_native_edge_reductions_are_deterministic_across_thread_counts() -> None:
    require_native()
    csr = random_csr(2000, 1500, 8.0, seed=7, hub=True)
    t = randn(csr.nnz, 4, dtype=torch.float32, seed=4)
    e = randn(csr.nnz + csr.num_rows, 4, dtype=torch.float32, seed=5)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            s = kernels.edge_softmax_step(csr, kernels.edge_softmax_step(csr, e, "shift", loops=True).exp_(),
                                          "normalize", loops=True)
            results.append((kernels.segment_sum(csr, t), kernels.scatter_sum(csr, t), s,
                            kernels.edge_softmax_step(csr, s, "backward", loops=True, grad=e)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("width", [1, 5, 8, 64])
def test_gather_rows_is_index_select(width: int) -> None:
    require_native()
    t = randn(500, width, dtype=torch.float32, seed=width)
    index = torch.randint(0, 500, (3000,), generator=torch.Generator().manual_seed(0))
    for idx in (index, index.to(torch.int32)):
        assert torch.equal(kernels.gather_rows(t, idx), t.index_select(0, index))
    out = torch.full((3100, width), 7.0)
    assert kernels.gather_rows(t, index.to(torch.int32), out) is out
    assert torch.equal(out[:3000], t[index]) and bool((out[3000:] == 7.0).all())
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gather_rows(t, torch.tensor([500]))
    with pytest.raises(KernelError, match="at least 3000 rows"):
        kernels.gather_rows(t, index, torch.empty(10, width))


def test_edge_reductions_validate_inputs() -> None:
    require_native()
    csr = random_csr(10, 10, 3.0, seed=41)
    with pytest.raises(KernelError, match=f"{csr.nnz} rows"):
        kernels.segment_sum(csr, torch.randn(csr.nnz + 1, 2))
    with pytest.raises(KernelError, match="self loops"):
        kernels.edge_softmax_step(csr, torch.randn(csr.nnz, 2), "shift", loops=True)
    with pytest.raises(KernelError, match="float32/float64"):
        kernels.scatter_sum(csr, torch.ones(csr.nnz, 2, dtype=torch.int64))
    with pytest.raises(KernelError, match="unknown step"):
        kernels.edge_softmax_step(csr, torch.randn(csr.nnz, 2), "exp")
    with pytest.raises(KernelError, match="needs grad"):
        kernels.edge_softmax_step(csr, torch.randn(csr.nnz, 2), "backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_keep_times_is_x_times_its_noise_bit_for_bit(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from gnncompile.kernels import dropout

    x = randn(1000, 7, dtype=dtype, seed=9)
    x[0, 0], x[1, 1] = float("inf"), float("nan")
    keep = torch.rand(1000, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    noise = torch.where(keep, torch.tensor(1 / 0.7, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    expected = x * noise
    assert torch.equal(dropout.keep_times(x, keep, 1 / 0.7).nan_to_num(), expected.nan_to_num())
    monkeypatch.setattr(dropout, "native_edge_ops", lambda t: False)  # the torch formulation
    assert torch.equal(dropout.keep_times(x, keep, 1 / 0.7).nan_to_num(), expected.nan_to_num())
    with pytest.raises(KernelError, match="bool tensor"):
        dropout.keep_times(x, keep.to(torch.uint8), 2.0)


# --------------------------------------------------------------------------- validation
def test_spmm_and_sddmm_validate_inputs() -> None:
    csr = random_csr(10, 8, 3.0, seed=51)
    x = torch.randn(8, 4)
    with pytest.raises(KernelError, match="x has 9 rows but the sparse matrix has 8 columns"):
        kernels.spmm(csr, None, torch.randn(9, 4))
    with pytest.raises(KernelError, match=f"{csr.nnz + 1} edge values for {csr.nnz} edges"):
        kernels.spmm(csr, torch.ones(csr.nnz + 1), x)
    with pytest.raises(KernelError, match="values dtype torch.float64 differs"):
        kernels.spmm(csr, torch.ones(csr.nnz, dtype=torch.float64), x)
    with pytest.raises(KernelError, match=r"x must be \[N, 2, C\]"):
        kernels.spmm(csr, torch.ones(csr.nnz, 2), x)
    with pytest.raises(KernelError, match="a has 8 rows \\(need 10\\)"):
        kernels.sddmm(csr, x, x)
    with pytest.raises(KernelError, match="divisible by heads=3"):
        kernels.sddmm(csr, torch.randn(10, 4), x, heads=3)
    with pytest.raises(KernelError, match="equal feature sizes"):
        kernels.sddmm(csr, torch.randn(10, 5), x)
    with pytest.raises(KernelError, match="a dtype torch.float64 differs"):
        kernels.sddmm(csr, torch.randn(10, 4, dtype=torch.float64), x)


def test_unknown_backend_lists_valid_names(restore_default: None) -> None:
    csr = random_csr(5, 5, 2.0, seed=61)
    x = torch.randn(5, 3)
    pattern = r"unknown kernel backend 'gpu2'; valid: native, torch, scipy, cupy"
    with pytest.raises(KernelError, match=pattern):
        kernels.spmm(csr, None, x, backend="gpu2")
    with pytest.raises(KernelError, match=pattern):
        kernels.sddmm(csr, x, x, backend="gpu2")
    with pytest.raises(KernelError, match=pattern):
        kernels.set_default_backend("gpu2")


def test_cuda_only_backend_rejects_cpu_tensors() -> None:
    csr = random_csr(5, 5, 2.0, seed=62)
    with pytest.raises(KernelError, match="cupy backend"):
        kernels.spmm(csr, None, torch.randn(5, 3), backend="cupy")


# --------------------------------------------------------------------------- default backend
def test_available_backends() -> None:
    cpu = kernels.available_backends("cpu")
    assert {"torch", "scipy"} <= set(cpu) and "cupy" not in cpu
    assert "native" not in kernels.available_backends("cuda") and "torch" in kernels.available_backends("cuda")


def test_set_default_backend(restore_default: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("torch", "scipy"):
        fwd, bwd = kernels.BACKENDS[name]

        def spy(*args: object, _fwd=fwd, _name=name) -> torch.Tensor:
            calls.append(_name)
            return _fwd(*args)

        monkeypatch.setitem(kernels.BACKENDS, name, (spy, bwd))
    csr = random_csr(6, 6, 2.0, seed=71)
    x = torch.randn(6, 2)
    kernels.set_default_backend("scipy")
    assert kernels.default_backend() == "scipy" and kernels.default_backend("cuda") == "scipy"
    kernels.spmm(csr, None, x)
    kernels.spmm(csr, None, x, backend="torch")  # an explicit name wins over the default
    assert calls == ["scipy", "torch"]
    kernels.set_default_backend(None)
    expected = "native" if "native" in kernels.available_backends("cpu") else "torch"
    assert kernels.default_backend("cpu") == expected


def test_default_falls_back_to_torch_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                      restore_default: None) -> None:
    kernels.set_default_backend(None)
    monkeypatch.setattr(kernels, "_native_module", None)
    monkeypatch.setattr(kernels, "_native_error", "RuntimeError: no compiler")
    monkeypatch.setattr(kernels, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning, match="native backend unavailable: RuntimeError: no compiler"):
        assert kernels.default_backend("cpu") == "torch"
    assert kernels._warned_fallback
    assert kernels.available_backends("cpu") == ["torch", "scipy"]
    with pytest.raises(KernelError, match="native backend unavailable"):
        kernels.spmm(random_csr(4, 4, 1.0, seed=1), None, torch.randn(4, 2), backend="native")


def test_environment_variable_sets_the_default() -> None:
    script = textwrap.dedent(
        """
        import importlib, os
        from gnncompile import KernelError
        from gnncompile import kernels
        assert kernels.default_backend("cpu") == "scipy", kernels.default_backend("cpu")
        os.environ["GNNCOMPILE_BACKEND"] = "torch"  # read at each call, not once at import
        assert kernels.default_backend("cpu") == "torch", kernels.default_backend("cpu")
        kernels.set_default_backend("scipy")  # forcing wins over the variable, and None returns to it
        assert kernels.default_backend("cpu") == "scipy"
        kernels.set_default_backend(None)
        assert kernels.default_backend("cpu") == "torch"
        os.environ["GNNCOMPILE_BACKEND"] = "bogus"
        importlib.reload(kernels)
        try:
            kernels.default_backend("cpu")
        except KernelError as exc:
            assert "unknown kernel backend 'bogus'" in str(exc), exc
        else:
            raise AssertionError("GNNCOMPILE_BACKEND=bogus was accepted")
        print("ok")
        """
    )
    env = dict(os.environ, GNNCOMPILE_BACKEND="scipy")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# --------------------------------------------------------------------------- cupy (CUDA)
def _cupy_available() -> bool:
    """Whether a CUDA device and CuPy are both present."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _cupy_available(), reason="no GPU on this machine (needs CUDA and CuPy)")
@pytest.mark.parametrize("heads", [1, 4])
def test_cupy_backend_matches_torch_backend(heads: int) -> None:
    csr = random_csr(500, 400, 6.0, seed=81, hub=True)
    x = randn(400, heads, 16, dtype=torch.float32, seed=82).cuda()
    w = randn(csr.nnz, heads, dtype=torch.float32, seed=83).cuda()
    if heads == 1:
        x, w = x[:, 0], w[:, 0]
    gpu_csr = CSR(csr.indptr.cuda(), csr.indices.cuda(), csr.num_rows, csr.num_cols)
    assert kernels.available_backends("cuda")[0] == "cupy"
    out = kernels.spmm(gpu_csr, w, x, backend="cupy")
    assert out.device.type == "cuda"
    expected = kernels.spmm(csr, w.cpu(), x.cpu(), backend="torch")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.spmm(gpu_csr, None, x, backend="cupy").cpu(),
                               kernels.spmm(csr, None, x.cpu(), backend="torch"), rtol=1e-4, atol=1e-4)


def test_scales_fold_into_edge_values_without_a_copy_of_x() -> None:
    """Backends without scales (torch, scipy) multiply by edge values with the scales folded in:
    the scaled product holds no more than the unscaled one plus one edge tensor (no temporary of
    x's size), and the cached per-edge factors follow in-place changes of the scales."""
    from gnncompile.runtime.memory import PeakMemory

    csr = random_csr(300, 300, 2.0, seed=3)
    x = randn(300, 512, dtype=torch.float32, seed=4)
    row = torch.rand(300, generator=torch.Generator().manual_seed(5)) + 0.5
    col = torch.rand(300, generator=torch.Generator().manual_seed(6)) + 0.5
    values = randn(csr.nnz, dtype=torch.float32, seed=7)
    for backend in ("torch", "scipy"):
        for v in (None, values):
            expected = kernels.spmm(csr, v, x * col[:, None], backend) * row[:, None]
            kernels.spmm(csr, v, x, backend, row_scale=row, col_scale=col)  # caches the factors
            with PeakMemory("cpu") as plain:
                kernels.spmm(csr, v, x, backend)
            with PeakMemory("cpu") as pm:
                out = kernels.spmm(csr, v, x, backend, row_scale=row, col_scale=col)
            torch.testing.assert_close(out, expected, **TOL[torch.float32])
            assert pm.peak_bytes <= plain.peak_bytes + 4 * csr.nnz, (backend, v is None, pm.peak_bytes, plain.peak_bytes)
            assert x.nbytes > 100 * 4 * csr.nnz  # (a copy of x would show)
    row.mul_(2.0)  # in place: the cached factors are rebuilt
    out = kernels.spmm(csr, None, x, "torch", row_scale=row, col_scale=col)
    torch.testing.assert_close(out, kernels.spmm(csr, None, x * col[:, None], "torch") * row[:, None],
                               **TOL[torch.float32])


# --------------------------------------------------------------------------- self loops
# (shape, weights, scaled): products whose matrix also has self-loop entries
LOOP_CASES = [("square", "weighted", True), ("rect_odd_width", "unweighted", False), ("wide", "column", True),
              ("width_1", "weighted", False), ("vector_heads_1d", "unweighted", True), ("heads_3x5", "weighted", True),
              ("heads_4x16", "weighted", False), ("heads_2x300", "weighted", True), ("empty_rows", "unweighted", True),
              ("hub", "weighted", False)]


def dense_with_loops(csr: CSR, values: Optional[torch.Tensor], heads: int, row: Optional[torch.Tensor],
                     col: Optional[torch.Tensor], loop: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
    """``diag(row) A diag(col) + L`` as a dense ``[rows, cols, heads]`` matrix, ``L``'s entries
    ``loop[i]`` (per head where it has heads) at ``(at[0] + i, at[1] + i)``."""
    v = torch.ones(csr.nnz, dtype=loop.dtype) if values is None else values
    m = dense(csr, v.reshape(csr.nnz, -1)).expand(csr.num_rows, csr.num_cols, heads).clone()
    if row is not None:
        m *= row[:, None, None]
    if col is not None:
        m *= col[None, :, None]
    i = torch.arange(loop.shape[0])
    m[at[0] + i, at[1] + i] += loop.reshape(loop.shape[0], -1)
    return m


@pytest.mark.parametrize("transpose", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("per_head", [False, True], ids=["row_factor", "head_factors"])
@pytest.mark.parametrize("shape,weights,scaled", LOOP_CASES)
def test_spmm_self_loops_match_the_dense_product(backend: str, shape: str, weights: str, scaled: bool,
                                                 per_head: bool, transpose: bool) -> None:
    """``loop=`` adds the self-loop entries of ``A + L`` (unscaled, anywhere in a rectangular matrix:
    ``loop_at``) in the same call, per row or per head, pulled and pushed."""
    rows, cols, nnz, feat, heads = SHAPES[shape]
    dtype = torch.float64
    csr = random_csr(rows, cols, nnz, seed=len(shape), hub=shape == "hub")
    x = randn(rows if transpose else cols, *feat, dtype=dtype, seed=1)
    values = values_for(csr, weights, heads, dtype, seed=2)
    row = torch.rand(rows, dtype=dtype, generator=torch.Generator().manual_seed(3)) + 0.5 if scaled else None
    col = torch.rand(cols, dtype=dtype, generator=torch.Generator().manual_seed(4)) + 0.5 if scaled else None
    at = (rows // 5, 0) if rows >= cols else (0, cols // 4)
    n = min(rows - at[0], cols - at[1]) - 1
    lh = feat[0] if per_head and len(feat) == 2 else 1
    loop = randn(n, *((lh,) if per_head else ()), dtype=dtype, seed=5)
    out = kernels.spmm(csr, values, x, backend, row_scale=row, col_scale=col, transpose=transpose, loop=loop,
                       loop_at=at)
    lh_all = feat[0] if len(feat) == 2 else 1
    m = dense_with_loops(csr, values, lh_all if (heads > 1 or lh > 1) else 1, row, col, loop, at)
    x3 = x.reshape(x.shape[0], m.shape[2], -1)
    expected = torch.einsum("rch,chd->rhd", m, x3) if not transpose else torch.einsum("rch,rhd->chd", m, x3)
    assert out.shape == expected.reshape(out.shape).shape
    torch.testing.assert_close(out, expected.reshape(out.shape), **TOL[dtype])


def test_spmm_rejects_misplaced_self_loops() -> None:
    csr = random_csr(10, 8, 3.0, seed=51)
    x = torch.randn(8, 4)
    with pytest.raises(KernelError, match=r"8 self loops from \(3, 0\) do not fit the 10 x 8 matrix"):
        kernels.spmm(csr, None, x, loop=torch.ones(8), loop_at=(3, 0))
    with pytest.raises(KernelError, match=r"loop must be a torch.float32 tensor .* got torch.float64"):
        kernels.spmm(csr, None, x, loop=torch.ones(8, dtype=torch.float64))
    with pytest.raises(KernelError, match=r"shape \[n\] or \[n, H\]"):
        kernels.spmm(csr, None, x, loop=torch.ones(8, 4))


@pytest.mark.parametrize("transpose", [False, True], ids=["pull", "push"])
def test_self_loops_join_unsorted_rows(backend: str, transpose: bool) -> None:
    """Rows whose columns are not sorted (a rank's graph: halo sources renumbered) take their loop
    entries too: the loop-augmented structure of the torch and scipy backends
    (``kernels._looped_csr``) is a permutation of the edges and the loops whatever the order, and
    keeps a sorted row sorted."""
    csr = random_csr(60, 80, 4.0, seed=9)
    rng = np.random.default_rng(10)
    shuffled = csr.indices.clone()
    for r in range(csr.num_rows):
        a, b = int(csr.indptr[r]), int(csr.indptr[r + 1])
        shuffled[a:b] = shuffled[a:b][torch.from_numpy(rng.permutation(b - a))]
    dtype = torch.float64
    at = (0, 15)
    loop = torch.rand(60, dtype=dtype, generator=torch.Generator().manual_seed(11)) + 0.5
    for c in (csr, CSR(csr.indptr, shuffled, 60, 80)):
        x = randn(60 if transpose else 80, 7, dtype=dtype, seed=12)
        out = kernels.spmm(c, None, x, backend, transpose=transpose, loop=loop, loop_at=at)
        m = dense_with_loops(c, None, 1, None, None, loop, at)[:, :, 0]
        torch.testing.assert_close(out, (m.t() if transpose else m) @ x, **TOL[dtype])
    looped = kernels._looped_csr(csr, at, 60, torch.device("cpu"))
    for r in range(60):
        row = looped.indices[int(looped.indptr[r]): int(looped.indptr[r + 1])]
        assert torch.equal(row, row.sort().values) and (row == 15 + r).sum() >= 1


def test_torch_backend_sddmm_of_blocks_denser_than_dense() -> None:
    """Rows that repeat columns can hold more entries than a dense block of their rows has (torch's
    ``sampled_addmm`` then fails): every entry still gets its product (random structures with
    repeats, one call and row blocks)."""
    for seed in range(60):
        rows, cols = 1 + seed % 9, 1 + (seed * 7) % 5
        csr = random_csr(rows, cols, 3.0, seed=seed, hub=seed % 2 == 0)
        for heads in (1, 2):
            a = randn(rows, heads * 3, dtype=torch.float64, seed=1)
            b = randn(cols, heads * 3, dtype=torch.float64, seed=2)
            expected = kernels._sddmm_gather(csr, a, b, heads)
            torch.testing.assert_close(kernels.sddmm(csr, a, b, heads, backend="torch"), expected)
    csr = CSR(torch.tensor([0, 4]), torch.tensor([2, 2, 0, 2]), 1, 3)   # one row of 4 entries, 3 columns
    a, b = randn(1, 5, dtype=torch.float64, seed=1), randn(3, 5, dtype=torch.float64, seed=2)
    torch.testing.assert_close(kernels.sddmm(csr, a, b, 1, backend="torch"),
                               (a[[0, 0, 0, 0]] * b[[2, 2, 0, 2]]).sum(-1, keepdim=True))
