"""gnncompile's own CUDA kernels (``kernels/csrc/spmm.cu``), checked without a GPU.

The launch plans of :mod:`gnncompile.kernels.cuda` run in a CPU emulation of the kernels
(``tests/cuda_emu.h``: every CUDA thread an OS thread, warp shuffles real exchanges that fail
when a group's lanes diverge) and are compared with the CPU backends: every config the planner
offers, forced hub splits, pushes, heads, scales and index types; the per-shape choice among
kernels; and the source compiled by ``nvcc`` for the GPUs it targets. Timing and the CuPy launch
path itself need a GPU (``tests/test_gpu_kernels.py``).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
import warnings
from typing import Optional

import numpy as np
import pytest
import torch

from gnncompile import kernels
from gnncompile.errors import KernelError
from gnncompile.kernels import CSR, cuda
from test_kernels import random_csr, randn, require_native

emu_mod = pytest.importorskip("cuda_emulator")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulation needs g++")


@pytest.fixture(scope="module")
def emulator() -> "emu_mod.Emulator":
    return emu_mod.emulator()


def device_csr(csr: CSR, int64: bool = False) -> cuda.DeviceCSR:
    indices = csr.indices.to(torch.int64 if int64 else torch.int32)
    return cuda.DeviceCSR.build(csr.indptr, indices, csr.num_rows, csr.num_cols)


def reference_spmm(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, row: Optional[torch.Tensor],
                   col: Optional[torch.Tensor], transpose: bool) -> torch.Tensor:
    """The product in float64 on the ``torch`` backend, as ``[rows, width]`` float32."""
    heads = 1 if values is None or values.dim() == 1 else values.shape[1]
    x64 = x.double().reshape(x.shape[0], heads, -1) if heads > 1 else x.double()
    f64 = (lambda t: None if t is None else t.double())
    out = kernels.spmm(csr, f64(values), x64, "torch", row_scale=f64(row), col_scale=f64(col), transpose=transpose)
    return out.reshape(out.shape[0], -1).float()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(ref.abs().max())))


# rows, cols, average degree, width, heads, hub row
GRAPHS = {
    "small_w16": (40, 30, 3.0, 16, 1, False),
    "odd_w5": (37, 23, 3.0, 5, 1, False),
    "w1": (30, 30, 4.0, 1, 1, False),
    "w64": (60, 50, 4.0, 64, 1, False),
    "w200": (30, 40, 3.0, 200, 1, False),
    "heads_4x16": (40, 30, 4.0, 64, 4, False),
    "heads_2x6": (25, 20, 3.0, 12, 2, False),
    "heads_4x64": (20, 20, 3.0, 256, 4, False),
    "hub_w32": (120, 80, 3.0, 32, 1, True),
}


def spmm_case(graph: str, transpose: bool) -> tuple[CSR, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """``(csr, values, x, row_scale, col_scale, reference product)`` of a :data:`GRAPHS` entry."""
    rows, cols, deg, width, heads, hub = GRAPHS[graph]
    csr = random_csr(rows, cols, deg, seed=len(graph), hub=hub)
    x = randn(rows if transpose else cols, width, dtype=torch.float32, seed=1)
    values = randn(csr.nnz, *((heads,) if heads > 1 else ()), dtype=torch.float32, seed=2)
    row = torch.rand(rows, generator=torch.Generator().manual_seed(3)) + 0.5
    col = torch.rand(cols, generator=torch.Generator().manual_seed(4)) + 0.5
    return csr, values, x, row, col, reference_spmm(csr, values, x, row, col, transpose)


def configs_for(csr: CSR, width: int, heads: int, sddmm: bool = False) -> list[cuda.KernelConfig]:
    """The planner's configs plus forced ones: every group for the widest vec, and a small split."""
    dcsr = device_csr(csr)
    make = cuda.sddmm_configs if sddmm else cuda.spmm_configs
    cfgs = make(width, width // heads, True, dcsr.max_degree, csr.nnz / csr.num_rows)
    vec = cfgs[0].vec if cfgs else 1
    extra = [cuda.KernelConfig(vec, g, s) for g in (1, 4, 32) for s in (0, 3)]
    if sddmm:
        extra = [c for c in extra if _sddmm_ok(c, width, heads)]
    return list(dict.fromkeys(cfgs + extra))


def _sddmm_ok(cfg: cuda.KernelConfig, width: int, heads: int) -> bool:
    return cuda._sddmm_reduce(cfg, width, width // heads) is not None


@pytest.mark.parametrize("transpose", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_spmm_configs_match_cpu(emulator, graph: str, transpose: bool) -> None:
    csr, values, x, row, col, ref = spmm_case(graph, transpose)
    width, heads = GRAPHS[graph][3:5]
    for cfg in configs_for(csr, width, heads):
        if width % cfg.vec or (width // heads) % cfg.vec:
            continue
        out = cuda.run_spmm(device_csr(csr), values, x, row, col, transpose, cfg, emulator)
        assert_close(out, ref)


@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("weights", ["none", "values"])
def test_spmm_unweighted_unscaled_and_index_types(emulator, weights: str, int64: bool) -> None:
    csr = random_csr(50, 70, 4.0, seed=5, hub=True)
    x = randn(70, 24, dtype=torch.float32, seed=6)
    values = None if weights == "none" else randn(csr.nnz, dtype=torch.float32, seed=7)
    ref = reference_spmm(csr, values, x, None, None, False)
    for cfg in (cuda.KernelConfig(4, 8), cuda.KernelConfig(2, 4, split=5), cuda.KernelConfig(1, 32, split=2)):
        assert_close(cuda.run_spmm(device_csr(csr, int64), values, x, None, None, False, cfg, emulator), ref)


def test_hub_split_launches_chunk_kernel(emulator) -> None:
    """A split smaller than the hub row's degree adds the chunk kernel; its chunks cover the hub exactly."""
    csr = random_csr(60, 60, 3.0, seed=8, hub=True)
    dcsr = device_csr(csr)
    deg = (csr.indptr[1:] - csr.indptr[:-1])
    split = 4
    chunks = dcsr.chunks(split)
    expect = int(((deg[deg > split] + split - 1) // split).sum())
    assert chunks.shape == (expect, 2)
    for r in torch.nonzero(deg > split).flatten().tolist():
        starts = chunks[chunks[:, 0] == r, 1].tolist()
        assert starts == list(range(int(csr.indptr[r]), int(csr.indptr[r + 1]), split))
    x = randn(60, 8, dtype=torch.float32, seed=9)
    emulator.launches.clear()
    out = cuda.run_spmm(dcsr, None, x, None, None, False, cuda.KernelConfig(4, 2, split), emulator)
    assert [launch.kernel.split("<")[0] for launch in emulator.launches] == ["spmm_rows", "spmm_chunks"]
    assert_close(out, reference_spmm(csr, None, x, None, None, False))


def test_empty_rows_and_zero_edges(emulator) -> None:
    indptr = torch.zeros(6, dtype=torch.int64)
    csr = CSR(indptr, torch.zeros(0, dtype=torch.int32), 5, 4)
    x = randn(4, 8, dtype=torch.float32, seed=1)
    out = cuda.run_spmm(device_csr(csr), None, x, None, None, False, cuda.KernelConfig(4, 2), emulator)
    assert torch.equal(out, torch.zeros(5, 8))  # rows without edges are written (the output is not zeroed)


@pytest.mark.parametrize("graph", ["small_w16", "w64", "w200", "heads_4x16", "heads_4x64", "hub_w32", "w1"])
def test_sddmm_configs_match_cpu(emulator, graph: str) -> None:
    rows, cols, deg, width, heads, hub = GRAPHS[graph]
    csr = random_csr(rows, cols, deg, seed=len(graph), hub=hub)
    a = randn(rows, width, dtype=torch.float32, seed=10)
    b = randn(cols, width, dtype=torch.float32, seed=11)
    ref = kernels.sddmm(csr, a.double(), b.double(), heads, "torch").float()
    cfgs = configs_for(csr, width, heads, sddmm=True)
    assert cfgs, "no SDDMM config for this shape"
    for cfg in cfgs:
        assert_close(cuda.run_sddmm(device_csr(csr), a, b, heads, cfg, emulator), ref)


def test_sddmm_rejects_heads_that_do_not_reduce() -> None:
    csr = random_csr(10, 10, 2.0, seed=1)
    a = torch.zeros(10, 12)
    out = torch.empty(csr.nnz, 2)
    with pytest.raises(KernelError, match="power of two"):
        cuda.sddmm_launches(device_csr(csr), a, a, 2, out, cuda.KernelConfig(2, 4))  # 6 columns a head: 3 lanes
    assert cuda.sddmm_configs(12, 6, True, 5, 2.0) == [c for c in cuda.sddmm_configs(12, 6, True, 5, 2.0)
                                                       if _sddmm_ok(c, 12, 2)]


def test_configs_cover_shapes() -> None:
    assert {c.vec for c in cuda.spmm_configs(64, 64, True, 10, 3.0)} == {4, 2}
    assert {c.vec for c in cuda.spmm_configs(64, 64, False, 10, 3.0)} == {2, 1}  # float4 needs alignment
    assert {c.vec for c in cuda.spmm_configs(6, 3, True, 10, 3.0)} == {1}
    assert all(c.split == 0 for c in cuda.spmm_configs(64, 64, True, 100, 3.0))  # no hub: no split
    assert {c.split for c in cuda.spmm_configs(64, 64, True, 10_000, 3.0)} == {0, 256}
    assert max(c.group for c in cuda.spmm_configs(1024, 1024, True, 10, 3.0)) == 32
    with pytest.raises(KernelError):
        cuda.KernelConfig(3, 8)
    with pytest.raises(KernelError, match="aligned"):
        x = torch.zeros(65)[1:].reshape(16, 4)
        csr = random_csr(16, 16, 2.0, seed=1)
        cuda.spmm_launches(device_csr(csr), None, 1, x, torch.zeros(16, 4), None, None, False, cuda.KernelConfig(4, 1))


def test_launch_arguments_are_sized_numpy_scalars() -> None:
    """CuPy packs a Python int as 8 bytes and a float as a double: every argument is a NumPy scalar
    whose size is the kernel parameter's."""
    csr = random_csr(20, 20, 3.0, seed=2, hub=True)
    x = torch.zeros(20, 8)
    launches = cuda.spmm_launches(device_csr(csr), torch.zeros(csr.nnz), 1, x, torch.zeros(20, 8), None, None, False,
                                  cuda.KernelConfig(4, 2, split=3))
    for launch in launches:
        assert all(isinstance(a, (np.uint64, np.int64, np.int32, np.float32)) for a in launch.args), launch.args
        assert len(launch.args) == (12 if launch.kernel.startswith("spmm_rows") else 13)


# --------------------------------------------------------------------------- dropout masks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool], ids=["f32", "f64", "bool"])
@pytest.mark.parametrize("width", [1, 3, 4, 5, 17])
def test_dropout_mask_kernel_equals_the_torch_arithmetic(emulator, dtype: torch.dtype, width: int) -> None:
    """The CUDA mask kernel, every row (a thread per Philox block) and chosen rows (a thread per
    element), is the mask of kernels.dropout's torch arithmetic bit for bit: seeds past 32 and 63
    bits, p at 0, rows whose counters pass 2^32 blocks (the counter's second word)."""
    from gnncompile.kernels import dropout

    far = torch.tensor([2**32 - 1, 7, 2**31 + 5, 0], dtype=torch.int64)  # row * width past 2^34 elements
    for seed, p in ((0, 0.5), (2**40 + 3, 0.1), (2**64 - 5, 0.9), (11, 0.0)):
        threshold = dropout.keep_threshold(p)
        key = (seed & 0xFFFFFFFF, seed >> 32)
        scale = float(torch.tensor(1 / (1 - p), dtype=torch.float64).to(dtype)) if dtype != torch.bool else 1.0
        for num_rows, rows in ((13, None), (29, torch.tensor([28, 0, 5, 5, 17])), (2**32, far)):
            if rows is None:
                got = cuda.run_dropout_mask(None, num_rows, width, key, threshold, scale, dtype, torch.device("cpu"),
                                            emulator)
            else:
                got = cuda.run_dropout_mask(rows, rows.numel(), width, key, threshold, scale, dtype,
                                            torch.device("cpu"), emulator)
            want = dropout._mask_torch(seed, p, num_rows, width, rows, dtype, torch.device("cpu"))
            assert torch.equal(got, want), (seed, p, num_rows, width, dtype)
    assert all(a.kernel == f"dropout_mask<{cuda._MASK_TYPES[dtype]}>" for a in emulator.launches[-3:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.float16, torch.bfloat16])
def test_dropout_masks_through_the_cuda_dispatch_equal_the_torch_arithmetic(emulator, monkeypatch,
                                                                           dtype: torch.dtype) -> None:
    """kernels.dropout's CUDA path (the kernel's float and bool masks; half precision cast from its
    bool mask) run by the emulator, against the torch arithmetic, every row and chosen rows."""
    from gnncompile.kernels import dropout

    monkeypatch.setattr(dropout, "_raw_runner", lambda: emulator)
    rows = torch.tensor([40, 2, 2, 0, 13])
    for seed, p, width in ((2**63 + 9, 0.3, 6), (7, 0.99, 3), (1, 0.5, 1)):
        for r in (None, rows):
            n = 41 if r is None else r.numel()
            got = dropout._mask_cuda(seed, p, n, width, r, dtype, torch.device("cpu"))
            assert torch.equal(got, dropout._mask_torch(seed, p, 41, width, r, dtype, torch.device("cpu")))


def test_a_cuda_mask_kernel_that_does_not_build_warns_once_and_falls_back(monkeypatch) -> None:
    """CuPy installed but broken (another CUDA major, no NVRTC) failed every GPU step; now masks
    come from torch operations (the same masks), with one warning naming the cause."""
    from gnncompile.kernels import dropout

    class Broken:
        def function(self, device: int, kernel: str) -> None:
            raise RuntimeError("NVRTC_ERROR_BUILTIN_OPERATION_FAILURE\nmore")

    monkeypatch.setattr(dropout, "_import_cupy", lambda: (None, None))
    monkeypatch.setattr(dropout, "_raw_runner", Broken)
    monkeypatch.setattr(dropout, "_cuda_ready", {})
    with pytest.warns(UserWarning, match=r"does not build on cuda:3 \(RuntimeError: NVRTC_ERROR_BUILTIN_OPERATION_"
                                         r"FAILURE\); masks on the GPU are drawn with torch operations"):
        assert not dropout._cuda_kernel(torch.device("cuda", 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        assert not dropout._cuda_kernel(torch.device("cuda", 3))


def test_dropout_launch_arguments_and_refusals() -> None:
    out = torch.empty(6, 5)
    (launch,) = cuda.dropout_launches(None, 5, (1, 2), 7, 2.0, out)
    assert [type(a) for a in launch.args] == [np.uint64, np.int64, np.int64, np.uint32, np.uint32, np.uint32,
                                              np.float32, np.uint64]
    assert launch.grid == (1, 1, 1)  # ceil(30 / 4) blocks of Philox: one thread block
    assert cuda.dropout_launches(None, 5, (1, 2), 7, 2.0, torch.empty(0, 5)) == []
    with pytest.raises(KernelError, match="contiguous"):
        cuda.dropout_launches(None, 5, (1, 2), 7, 2.0, torch.empty(6, 5, dtype=torch.float16))
    with pytest.raises(KernelError, match="rows must be int64"):
        cuda.dropout_launches(torch.arange(6, dtype=torch.int32), 5, (1, 2), 7, 2.0, out)


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("loops", [False, True], ids=["edges", "loops"])
@pytest.mark.parametrize("heads,deg,int64", [(1, 3.0, False), (4, 5.0, False), (8, 2.0, True), (2, 40.0, False)])
def test_attention_matches_native(emulator, heads: int, deg: float, int64: bool, loops: bool) -> None:
    """Forward coefficients and both score gradients against the native CPU kernels (with a hub row)."""
    require_native()
    rows, extra = 40, 7  # sources: the rows' own vertices at offset `extra`
    csr = random_csr(rows, rows + extra, deg, seed=heads, hub=True)
    shape = (heads,) if heads > 1 else ()
    src = randn(rows + extra, *shape, dtype=torch.float32, seed=20)
    dst = randn(rows, *shape, dtype=torch.float32, seed=21)
    dcsr = device_csr(csr, int64)
    alpha = cuda.run_attention(dcsr, src, dst, 0.2, loops, extra, emulator)
    ref = kernels.attention_scores(csr, src, dst, 0.2, loops=loops, own_offset=extra).exp_()
    kernels.edge_softmax_step(csr, ref, "normalize", loops=loops)
    torch.testing.assert_close(alpha, ref, rtol=1e-5, atol=1e-6)
    grad = randn(*alpha.shape, dtype=torch.float32, seed=22)
    gs, g_dst = cuda.run_attention_backward(dcsr, src, dst, ref, grad, 0.2, loops, extra, emulator)
    ref_gs, ref_dst = kernels.attention_backward(csr, src, dst, ref, grad, 0.2, loops=loops, own_offset=extra)
    torch.testing.assert_close(gs, ref_gs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_dst, ref_dst, rtol=1e-4, atol=1e-5)


def test_attention_groups() -> None:
    assert cuda.attention_group(1, 3.0) == 4 and cuda.attention_group(4, 3.0) == 16
    assert cuda.attention_group(8, 40.0) == 32 and cuda.attention_group(32, 1.0) == 32
    assert cuda.attention_group(3, 3.0) is None and cuda.attention_group(64, 1.0) is None
    csr = random_csr(10, 10, 2.0, seed=1)
    with pytest.raises(KernelError, match="power of two"):
        cuda.run_attention(device_csr(csr), torch.zeros(10, 3), torch.zeros(10, 3), 0.2, False, 0, lambda launch: None)


# --------------------------------------------------------------------------- choosing
def test_choose_takes_fastest_correct_and_records() -> None:
    ref = torch.arange(6.0)

    def slow() -> torch.Tensor:
        time.sleep(0.004)
        return ref.clone()

    def wrong() -> torch.Tensor:
        return ref + 1

    def broken() -> torch.Tensor:
        raise KernelError("no such kernel")

    before = len(cuda.choices())
    chosen = cuda.choose("spmm", "test shape", {"ref": slow, "fast": lambda: ref.clone(), "wrong": wrong,
                                                "broken": broken}, "ref", cuda.wall_timer)
    assert chosen == "fast"
    record = cuda.choices()[before]
    assert record.chosen == "fast" and set(record.times_ms) == {"ref", "fast"}
    assert "deviation" in record.rejected["wrong"] and "no such kernel" in record.rejected["broken"]
    assert "fast" in str(record)
    with pytest.raises(KernelError, match="no such kernel"):  # the reference's failure is the caller's
        cuda.choose("spmm", "s", {"ref": broken, "fast": lambda: ref.clone()}, "ref", cuda.wall_timer)


def test_a_fault_inside_a_candidate_kernel_is_not_a_rejection() -> None:
    """A kernel's illegal access breaks the process's CUDA context: every later candidate would
    fail too, cuSPARSE "win" and the process crash somewhere unrelated. ``choose`` re-raises it at
    the candidate that faulted (it recorded "rejected ... CUDA error")."""
    ref = torch.arange(6.0)

    def faulty() -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        cuda.choose("spmm", "s", {"ref": lambda: ref.clone(), "faulty": faulty}, "ref", cuda.wall_timer)


def test_chosen_product_through_backend_glue(emulator) -> None:
    """The cupy backend's choice (baseline cuSPARSE vs own kernels), here with the torch CPU
    backend as the baseline and the emulator as the runner: correct whatever is chosen, chosen
    once per shape, and the own kernel really runs when it wins."""
    csr = random_csr(50, 40, 3.0, seed=12)
    values = randn(csr.nnz, 2, dtype=torch.float32, seed=13)
    x = randn(40, 2, 8, dtype=torch.float32, seed=14)
    baseline = kernels.BACKENDS["torch"][0]
    slow_baseline = lambda *a: (time.sleep(0.05), baseline(*a))[1]  # noqa: E731: the own kernels must win
    glue = functools.partial(kernels._spmm_chosen, baseline=slow_baseline, run=emulator, timer=cuda.wall_timer)
    n = len(cuda.choices())
    out = glue(csr, values, x, None, None, False)
    assert out.shape == (50, 2, 8)
    assert_close(out.reshape(50, 16), reference_spmm(csr, values, x.reshape(40, 16), None, None, False))
    assert len(cuda.choices()) == n + 1 and cuda.choices()[-1].chosen.startswith("raw")
    emulator.launches.clear()
    glue(csr, values, x, None, None, False)
    assert len(cuda.choices()) == n + 1 and emulator.launches  # cached choice, own kernel ran
    a, b = randn(50, 16, dtype=torch.float32, seed=15), randn(40, 16, dtype=torch.float32, seed=16)
    slow_gather = lambda *args: (time.sleep(0.05), kernels._sddmm_gather(*args))[1]  # noqa: E731
    w = kernels._sddmm_chosen(csr, a, b, 2, baseline=slow_gather, run=emulator, timer=cuda.wall_timer)
    assert "rows:cpu" not in csr.cache  # the reference's per-edge rows are not kept when it loses
    assert_close(w, kernels._sddmm_gather(csr, a, b, 2))
    assert cuda.choices()[-1].op == "sddmm" and cuda.choices()[-1].chosen.startswith("raw")


def test_float2_loads_need_8_byte_aligned_rows(emulator) -> None:
    """A contiguous view at an odd float offset (rows of a larger tensor) is 4-byte aligned: float2
    configs were accepted for it (float4's alignment alone was checked), a misaligned-address fault
    on a GPU, which the emulator now raises too. The launches refuse it, and the chosen product
    copies such an operand to an aligned one for every vectorized config."""
    csr = random_csr(16, 16, 2.0, seed=1)
    x = torch.zeros(16 * 6 + 1)[1:].reshape(16, 6)
    assert x.is_contiguous() and x.data_ptr() % 8 == 4
    with pytest.raises(KernelError, match="float2 loads need 8-byte aligned operands"):
        cuda.spmm_launches(device_csr(csr), None, 1, x, torch.zeros(16, 6), None, None, False, cuda.KernelConfig(2, 1))
    with pytest.raises(KernelError, match="float2 loads need 8-byte aligned operands"):
        cuda.sddmm_launches(device_csr(csr), x, x, 1, torch.empty(csr.nnz, 1), cuda.KernelConfig(2, 1))
    csr = random_csr(50, 40, 3.0, seed=17)
    x = randn(40 * 6 + 1, dtype=torch.float32, seed=18)[1:].reshape(40, 6)
    baseline = kernels.BACKENDS["torch"][0]
    slow_baseline = lambda *a: (time.sleep(0.05), baseline(*a))[1]  # noqa: E731: the own kernels must win
    out = kernels._spmm_chosen(csr, None, x, None, None, False, baseline=slow_baseline, run=emulator,
                               timer=cuda.wall_timer)
    choice = cuda.choices()[-1]   # every float2 config ran (none rejected by a misaligned load)
    assert not choice.rejected and any(k.startswith("raw v2") for k in choice.times_ms), choice
    assert_close(out, reference_spmm(csr, None, x, None, None, False))


# --------------------------------------------------------------------------- compiled for a GPU
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile for a GPU")
def test_source_compiles_for_gpus(tmp_path) -> None:
    """Every kernel instance compiles for Hopper (sm_90) with no warning and no register spill."""
    src = tmp_path / "all.cu"
    src.write_text(f'#include "{cuda.SOURCE}"\nvoid* all_kernels[] = {{\n'
                   + "".join(f"  (void*)&{n},\n" for n in emu_mod.kernel_names()) + "};\n")
    proc = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v,-warn-spills",
                           "-Werror", "all-warnings", "-o", str(tmp_path / "all.cubin"), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bytes spill" in proc.stderr
    assert all(" 0 bytes spill stores, 0 bytes spill loads" in line
               for line in proc.stderr.splitlines() if "spill stores" in line)


@pytest.mark.skipif(emu_mod.nvrtc_library() is None, reason="needs NVRTC (the nvidia-cuda-nvrtc wheel of the dev "
                    "extras, Linux x86_64)")
def test_source_compiles_with_nvrtc_as_cupy_does() -> None:
    """CuPy compiles with NVRTC, which includes no header: every kernel instance compiles so, without warnings."""
    with open(cuda.SOURCE) as f:
        source = f.read()
    names = emu_mod.kernel_names()
    rc, log, lowered = emu_mod.nvrtc_compile(source, names, ["-std=c++17", "--gpu-architecture=compute_90"])
    assert rc == 0, log[-3000:]
    assert "warning" not in log.lower(), log[-3000:]
    assert all(lowered[n].startswith("_Z") for n in names)


# --------------------------------------------------------------------------- on a GPU
def _cuda_runner() -> cuda.CupyRunner:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    pytest.importorskip("cupy", reason="the own CUDA kernels run through CuPy")
    return kernels._raw_runner()


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_configs_on_gpu_match_cpu(graph: str, transpose: bool) -> None:
    """The emulated tests' products, every config, compiled by NVRTC and run on the GPU."""
    run = _cuda_runner()
    csr, values, x, row, col, ref = spmm_case(graph, transpose)
    rows, cols, _, width, heads, _ = GRAPHS[graph]
    dcsr = cuda.DeviceCSR.build(csr.indptr.cuda(), csr.indices.to(torch.int32).cuda(), rows, cols)
    for cfg in configs_for(csr, width, heads):
        if width % cfg.vec or (width // heads) % cfg.vec:
            continue
        out = cuda.run_spmm(dcsr, values.cuda(), x.cuda(), row.cuda(), col.cuda(), transpose, cfg, run)
        assert_close(out.cpu(), ref)
    a, b = randn(rows, width, dtype=torch.float32, seed=10), randn(cols, width, dtype=torch.float32, seed=11)
    ref_w = kernels.sddmm(csr, a.double(), b.double(), heads, "torch").float()
    for cfg in configs_for(csr, width, heads, sddmm=True):  # (none where a head's lanes are no power of two)
        assert_close(cuda.run_sddmm(dcsr, a.cuda(), b.cuda(), heads, cfg, run).cpu(), ref_w)
