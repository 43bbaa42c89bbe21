#!/usr/bin/env python
"""SpMM throughput of gnncompile's kernel backends vs torch.sparse.mm and PyG, with STREAM as the yardstick.

Measures, in one run on one machine:

1. STREAM triad bandwidth (``a = b + s * c`` on three 160 MB float64 arrays, numpy, split over
   ``--threads`` Python threads in L2-sized blocks so each block is one fused pass; best of 10,
   bytes counted as 3 x 8 per element as STREAM does);
2. the forward product ``out = A x`` with GCN-normalized edge values, float32, for every CPU backend
   of :mod:`gnncompile.kernels` (``native``, ``torch``, ``scipy``; scipy is single-threaded),
   ``torch.sparse.mm`` on a prebuilt CSR tensor, PyG 2.8.1's ``torch_geometric.utils.spmm`` on a
   CSR ``adj_t`` and ``EdgeIndex.matmul`` (without ``torch_sparse``/``pyg_lib`` installed, both end
   in ``torch.sparse.mm``: the fastest CPU path PyG has here), plus the transposed product
   ``A^T y`` that the native backend runs in the backward pass.

With ``--device cuda`` (issue 17's measurement) the yardstick is the device-to-device copy
bandwidth (``y.copy_(x)`` of 1 GiB, bytes counted as read + write) and the systems are the CUDA
backends of :mod:`gnncompile.kernels` (``torch``, and ``cupy`` where CuPy is installed),
``torch.sparse.mm`` on a prebuilt CSR tensor, PyG's ``EdgeIndex.matmul`` and PyG's message passing
(``index_select`` of the source rows, edge-weighted, ``scatter`` sum onto the destinations), each
timed with a CUDA synchronization before and after the call; the transposed product ``A^T y`` runs
both ways a backward can: over the transposed CSR and scattered from ``A``'s own CSR
(``transpose=True``). A product that runs out of GPU memory is a row saying so. The header names
the GPU and the torch, CUDA, CuPy and PyG versions.

Graphs: Cora and coauthor_physics from ``shared/datasets`` (their ``edge_index`` is already
symmetric) and an R-MAT graph with 100k vertices and 2M directed edges (seed 0,
``a, b, c, d = .57, .19, .19, .05``, vertex ids shuffled as Graph500 does, symmetrized, no
duplicates or self loops); ``rmat-2m``: the same generator at 2M vertices and 40M edges (for a
GPU). Every backend computes the same product; outputs are cross-checked.

Time = median of ``--repeat`` calls after two warm-up calls; the backends take turns within each
repeat, so load from elsewhere on a shared machine hits all of them alike. Throughput counts
``E * 12 + E * d * 4 + V * d * 4`` bytes (8-byte index + 4-byte value per edge, one x row read per
edge, one output row written per vertex); "% STREAM" relates it to the triad bandwidth. Results go
to a table on stdout and the "SpMM throughput" section of ``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/spmm.py
    python benchmarks/spmm.py --graphs rmat --dims 64 --repeat 5 --out /tmp/r.md
    python benchmarks/spmm.py --device cuda --graphs rmat,rmat-2m --dims 64,256 --repeat 20
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

from gnncompile import kernels  # noqa: E402
from gnncompile.kernels import CSR, cuda  # noqa: E402

GRAPHS = ("cora", "coauthor_physics", "rmat", "rmat-2m")
DEFAULT_GRAPHS = ("cora", "coauthor_physics", "rmat")
DATASETS = HERE.parent.parent / "shared" / "datasets"
SECTION = "SpMM throughput"
SECTION_CUDA = "SpMM throughput on CUDA"


# --------------------------------------------------------------------------- STREAM
def stream_triad(threads: int, n: int = 20_000_000, trials: int = 10, block: int = 1 << 15) -> float:
    """Best-of-``trials`` STREAM triad bandwidth in GB/s (numpy, ``threads`` Python threads).

    numpy's ufuncs release the GIL, so each thread streams its own slice. The slice is processed in
    ``block``-element pieces (256 KiB, L2-resident) as ``a = c * s; a += b``: DRAM sees one read of
    ``b`` and ``c`` and one write of ``a`` per element, the traffic of a fused triad.
    """
    a, b, c = np.zeros(n), np.full(n, 1.0), np.full(n, 2.0)  # touched: no first-write page faults
    s = 3.0
    bounds = np.linspace(0, n, threads + 1).astype(int)

    def part(k: int) -> None:
        for i in range(bounds[k], bounds[k + 1], block):
            j = min(i + block, bounds[k + 1])
            np.multiply(c[i:j], s, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(trials):
            t0 = time.perf_counter()
            list(pool.map(part, range(threads)))
            best = min(best, time.perf_counter() - t0)
    if not np.allclose(a[:: n // 7], 7.0):
        raise RuntimeError("STREAM triad computed a wrong result")
    return 3 * 8 * n / best / 1e9


# --------------------------------------------------------------------------- graphs
def rmat_edges(num_nodes: int = 100_000, num_edges: int = 2_000_000, seed: int = 0,
               probs: tuple[float, float, float, float] = (0.57, 0.19, 0.19, 0.05)) -> np.ndarray:
    """Symmetric R-MAT edge list ``[2, num_edges]`` without duplicates or self loops.

    Draws ``(src, dst)`` bit by bit from the quadrant probabilities on a ``2^ceil(log2 n)`` grid,
    rejects ids ``>= n`` and self loops, keeps the first ``num_edges / 2`` distinct undirected
    pairs, shuffles vertex ids with a random permutation and adds both directions.
    """
    rng = np.random.default_rng(seed)
    scale = int(math.ceil(math.log2(num_nodes)))
    a, b, c, _ = probs
    target = num_edges // 2
    keys = np.empty(0, dtype=np.int64)
    while keys.size < target:
        m = int((target - keys.size) * 1.3) + 1024
        src = np.zeros(m, dtype=np.int64)
        dst = np.zeros(m, dtype=np.int64)
        for bit in range(scale):
            r = rng.random(m)
            src |= (r >= a + b).astype(np.int64) << bit  # quadrants c, d: lower half
            dst |= (((r >= a) & (r < a + b)) | (r >= a + b + c)).astype(np.int64) << bit  # b, d: right half
        ok = (src < num_nodes) & (dst < num_nodes) & (src != dst)
        lo, hi = np.minimum(src[ok], dst[ok]), np.maximum(src[ok], dst[ok])
        merged = np.concatenate([keys, lo * num_nodes + hi])
        _, first = np.unique(merged, return_index=True)
        keys = merged[np.sort(first)]  # distinct pairs in draw order
    keys = keys[:target]
    perm = rng.permutation(num_nodes)
    u, v = perm[keys // num_nodes], perm[keys % num_nodes]
    return np.stack([np.concatenate([u, v]), np.concatenate([v, u])])


@dataclass
class BenchGraph:
    """A graph as the products need it: CSR by destination, its transpose, GCN edge values."""

    name: str
    num_nodes: int
    csr: CSR
    values: torch.Tensor        # float32 [E], GCN normalization 1/sqrt(deg_in(dst) deg_out(src))
    csr_t: CSR                  # rows = sources (the backward product)
    values_t: torch.Tensor
    row_scale: torch.Tensor     # float32 [V], deg_in^-1/2 (0 without in-edges): the same product as vertex scales
    col_scale: torch.Tensor     # float32 [V], deg_out^-1/2 (0 without out-edges)

    @property
    def num_edges(self) -> int:
        return self.csr.nnz


def build_graph(name: str, edge_index: np.ndarray, num_nodes: int) -> BenchGraph:
    """CSR (by destination) and transposed CSR of a ``[2, E]`` (source, destination) list."""
    src, dst = edge_index[0].astype(np.int64), edge_index[1].astype(np.int64)
    deg_in = np.bincount(dst, minlength=num_nodes).astype(np.float64)
    deg_out = np.bincount(src, minlength=num_nodes).astype(np.float64)
    value = 1.0 / np.sqrt(deg_in[dst] * deg_out[src])

    def csr(rows: np.ndarray, cols: np.ndarray, val: np.ndarray) -> tuple[CSR, torch.Tensor]:
        order = np.lexsort((cols, rows))
        indptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=num_nodes), out=indptr[1:])
        c = CSR(torch.from_numpy(indptr), torch.from_numpy(cols[order].copy()), num_nodes, num_nodes)
        return c, torch.from_numpy(val[order].astype(np.float32))

    fwd, values = csr(dst, src, value)
    bwd, values_t = csr(src, dst, value)

    def inv_sqrt(deg: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1.0)), 0.0).astype(np.float32))
    return BenchGraph(name, num_nodes, fwd, values, bwd, values_t, inv_sqrt(deg_in), inv_sqrt(deg_out))


def load_graph(name: str) -> BenchGraph:
    """``rmat`` (generated) or a dataset's npz edge list, read directly with numpy."""
    if name == "rmat":
        return build_graph("rmat", rmat_edges(), 100_000)
    if name == "rmat-2m":
        return build_graph("rmat-2m", rmat_edges(2_000_000, 40_000_000), 2_000_000)
    path = DATASETS / name / f"{name}.npz"
    if not path.exists():
        raise SystemExit(f"{path} not found (datasets live in shared/datasets next to the repository)")
    with np.load(path) as z:
        return build_graph(name, z["edge_index"], int(z["num_nodes"]))


# --------------------------------------------------------------------------- products
def products(g: BenchGraph, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Every way to compute ``A x`` (and the transposed ``A^T y`` a backward runs), as zero-argument
    callables on ``x``'s device."""
    dev = x.device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indptr, indices = g.csr.on(dev)
        values = g.values.to(dev)
        adj_t = torch.sparse_csr_tensor(indptr, indices, values, size=(g.num_nodes,) * 2)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    available = kernels.available_backends(dev)
    for backend in ("native", "cupy", "torch", "scipy"):
        if backend in available:
            fns[f"gnncompile {backend}"] = lambda b=backend: kernels.spmm(g.csr, values, x, backend=b)
    rs, cs = g.row_scale.to(dev), g.col_scale.to(dev)
    for backend in ("native", "cupy", "torch"):
        if backend in available:  # GCN's normalization as per-vertex scales, as gnncompile's layers pass it
            fns[f"gnncompile {backend}, vertex scales"] = \
                lambda b=backend: kernels.spmm(g.csr, None, x, backend=b, row_scale=rs, col_scale=cs)
    fns["torch.sparse.mm (CSR)"] = lambda: torch.sparse.mm(adj_t, x)
    try:
        from torch_geometric import EdgeIndex
        from torch_geometric.utils import scatter
        from torch_geometric.utils import spmm as pyg_spmm

        rows = g.csr.cached(f"rows:{dev}", lambda: torch.repeat_interleave(
            torch.arange(g.num_nodes, device=dev), indptr[1:] - indptr[:-1]))
        ei = EdgeIndex(torch.stack([rows, indices.to(torch.int64)]), sparse_size=(g.num_nodes, g.num_nodes),
                       sort_order="row")
        if dev.type == "cpu":
            fns["PyG utils.spmm (CSR adj_t)"] = lambda: pyg_spmm(adj_t, x)
        fns["PyG EdgeIndex.matmul"] = lambda: ei.matmul(x, input_value=values)
        src = indices.to(torch.int64)
        fns["PyG gather + scatter"] = lambda: scatter(x.index_select(0, src) * values[:, None], rows, 0,
                                                      dim_size=g.num_nodes, reduce="sum")
    except ImportError:
        pass
    if dev.type == "cuda" and "cupy" in available:
        # each config of gnncompile's own CUDA kernels, beside the one the cupy backend chooses
        dcsr = kernels._device_csr(g.csr, dev)
        run = kernels._raw_runner()
        configs = cuda.spmm_configs(x.shape[1], x.shape[1], x.data_ptr() % 16 == 0, dcsr.max_degree,
                                    g.num_edges / g.num_nodes)
        for cfg in configs:
            fns[f"own kernel {cfg}"] = lambda c=cfg: cuda.run_spmm(dcsr, values, x, None, None, False, c, run)
        for cfg in configs:
            fns[f"own kernel {cfg}, A^T scattered (push)"] = \
                lambda c=cfg: cuda.run_spmm(dcsr, values, x, None, None, True, c, run)
    values_t = g.values_t.to(dev)
    for backend in ("native", "cupy", "torch"):
        if backend in available:
            fns[f"gnncompile {backend}, A^T over the transposed CSR"] = \
                lambda b=backend: kernels.spmm(g.csr_t, values_t, x, backend=b)
            fns[f"gnncompile {backend}, A^T scattered (push)"] = \
                lambda b=backend: kernels.spmm(g.csr, values, x, backend=b, transpose=True)
    return fns


@dataclass
class Row:
    """One measured (graph, d, system) cell of the results table."""

    graph: str
    nodes: int
    edges: int
    dim: int
    system: str
    median_ms: float
    min_ms: float
    gbps: float
    stream_pct: float
    max_err: float


def spmm_bytes(g: BenchGraph, d: int) -> int:
    """Bytes one product moves in the model ``E*12 + E*d*4 + V*d*4``."""
    return g.num_edges * 12 + g.num_edges * d * 4 + g.num_nodes * d * 4


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(g: BenchGraph, d: int, repeat: int, stream: float, device: torch.device = torch.device("cpu"),
            warmup: int = 2) -> list[Row]:
    """Time every product of ``g`` at width ``d``: ``warmup`` untimed calls each, then ``repeat``
    rounds in turn (on CUDA each call between two synchronizations). A product that runs out of
    GPU memory gets a row with NaN times."""
    x = torch.randn(g.num_nodes, d, generator=torch.Generator().manual_seed(0)).to(device)
    fns = products(g, x)
    reference = kernels.spmm(g.csr, g.values.to(device), x, backend="torch")
    reference_t = kernels.spmm(g.csr_t, g.values_t.to(device), x, backend="torch")
    errors: dict[str, float] = {}
    failed: set[str] = set()
    for name, fn in fns.items():  # warm-up (and the cross-check)
        try:
            out = fn()
            for _ in range(warmup - 1):
                fn()
            _synchronize(device)
        except torch.cuda.OutOfMemoryError:
            failed.add(name)
            torch.cuda.empty_cache()
            continue
        ref = reference_t if "A^T" in name else reference
        errors[name] = float((out - ref).abs().max()) if out.numel() else 0.0
        del out
    times: dict[str, list[float]] = {name: [] for name in fns if name not in failed}
    for _ in range(repeat):
        for name in times:
            _synchronize(device)
            t0 = time.perf_counter()
            fns[name]()
            _synchronize(device)
            times[name].append(time.perf_counter() - t0)
    rows = []
    nbytes = spmm_bytes(g, d)
    for name in fns:
        if name in failed:
            rows.append(Row(g.name, g.num_nodes, g.num_edges, d, name, math.nan, math.nan, math.nan, math.nan,
                            math.nan))
            continue
        med = statistics.median(times[name])
        gbps = nbytes / med / 1e9
        rows.append(Row(g.name, g.num_nodes, g.num_edges, d, name, med * 1e3, min(times[name]) * 1e3, gbps,
                        100 * gbps / stream, errors[name]))
    return rows


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, trials: int = 10) -> float:
    """Best-of-``trials`` device-to-device copy bandwidth in GB/s, counting read + write."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(trials):
        _synchronize(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best / 1e9


# --------------------------------------------------------------------------- output
COLUMNS = ("graph", "V", "E", "d", "system", "median ms", "min ms", "GB/s", "% STREAM", "max abs err")
COLUMNS_CUDA = COLUMNS[:8] + ("% copy", "max abs err")


def cells(r: Row) -> tuple[str, ...]:
    """The formatted table cells of one row."""
    def ms(v: float) -> str:
        return f"{v:.3f}" if v < 1 else f"{v:.2f}"

    if math.isnan(r.median_ms):
        return (r.graph, f"{r.nodes:,}", f"{r.edges:,}", str(r.dim), r.system, "out of memory", "", "", "", "")

    return (r.graph, f"{r.nodes:,}", f"{r.edges:,}", str(r.dim), r.system, ms(r.median_ms), ms(r.min_ms),
            f"{r.gbps:.1f}", f"{r.stream_pct:.0f}%", f"{r.max_err:.1e}")


def print_table(rows: list[Row], stream: float, cuda: bool = False) -> None:
    """Print the results with rich (plain text when rich is missing)."""
    columns = COLUMNS_CUDA if cuda else COLUMNS
    yardstick = f"device copy {stream:.1f} GB/s" if cuda else f"STREAM triad {stream:.1f} GB/s"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(yardstick)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(cells(r)))
        return
    table = Table(title=f"SpMM throughput ({yardstick})")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i in (0, 4) else "right")
    previous = None
    for r in rows:
        if previous is not None and (r.graph, r.dim) != previous:
            table.add_section()
        previous = (r.graph, r.dim)
        table.add_row(*cells(r))
    Console(width=160).print(table)


def load_average() -> str:
    """1-minute load average (other processes on a shared machine skew every timing)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def table_lines(columns: tuple[str, ...], rows: list[Row]) -> list[str]:
    """The markdown table of ``rows`` under ``columns`` (graph and system left-aligned)."""
    return ["| " + " | ".join(columns) + " |",
            "|" + "|".join("---" if i in (0, 4) else "---:" for i in range(len(columns))) + "|",
            *("| " + " | ".join(cells(r)) + " |" for r in rows)]


def markdown(rows: list[Row], stream: float, threads: int, repeat: int, loads: tuple[str, str]) -> str:
    """The body of the "SpMM throughput" section of RESULTS.md."""
    lines = [
        f"- Date: {today()}",
        f"- Machine: {machine_info(threads)}; 1-min load average {loads[0]} at start, {loads[1]} at end",
        f"- Command: `{command_line()}`",
        f"- STREAM triad (numpy, {threads} threads, best of 10): **{stream:.1f} GB/s**",
        f"- Product: `out = A x`, float32, GCN-normalized edge values; time = median of {repeat} calls after 2 "
        "warm-up calls, backends interleaved within each repeat; bytes = E·12 + E·d·4 + V·d·4. "
        "`scipy` is single-threaded. \"A^T (backward)\" is the transposed product of the backward pass. "
        "max abs err = largest deviation from the torch backend's result. Without torch_sparse/pyg_lib, "
        "`PyG utils.spmm` runs `torch.sparse.mm(adj_t, x)` (MKL) and `EdgeIndex.matmul` runs "
        "`torch.sparse.mm(adj, x, \"sum\")` (ATen's sparse-reduce kernel). The byte model counts one x row "
        "read from memory per edge; rows served from cache (x fits in the 32 MiB L3 for Cora, coauthor_physics "
        "up to d = 64 and R-MAT at d <= 64; hubs are re-read) take results above 100% of STREAM.",
    ]
    return "\n".join(lines + ["", *table_lines(COLUMNS, rows)])


def markdown_cuda(rows: list[Row], copy: float, repeat: int, warmup: int) -> str:
    """The body of the "SpMM throughput on CUDA" section of RESULTS.md."""
    from _results import gpu_info

    lines = [
        f"- Date: {today()}",
        f"- Device: {gpu_info()}",
        f"- Command: `{command_line()}`",
        f"- Device-to-device copy (1 GiB, read + write counted, best of 10): **{copy:.1f} GB/s**",
        f"- Product: `out = A x`, float32, GCN-normalized edge values; time = median of {repeat} calls after "
        f"{warmup} warm-up calls, each between two `torch.cuda.synchronize()`, systems interleaved within each "
        "repeat; bytes = E·12 + E·d·4 + V·d·4 (effective bandwidth, \"% copy\" of the copy bandwidth). \"A^T\" "
        "rows are the transposed product of a backward: over the transposed CSR, or scattered from A's own CSR "
        "(`transpose=True`, cuSPARSE op(A) = A^T for `cupy`). max abs err = largest deviation from the torch "
        "backend's result.",
    ]
    chosen = [f"- {c}" for c in cuda.choices()]
    if chosen:
        chosen = ["", "Choices of the `cupy` backend in this run (`kernels.cuda.choose`, per shape, best of 3 "
                  "after a warm-up, by CUDA events; ms):", "", *chosen]
    return "\n".join(lines + ["", *table_lines(COLUMNS_CUDA, rows)] + chosen)


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default=",".join(DEFAULT_GRAPHS), help=f"comma-separated subset of {', '.join(GRAPHS)}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the products run")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per product before timing")
    p.add_argument("--dims", default="16,64,256", help="comma-separated feature widths d")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per product (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch (and STREAM) threads")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file whose section is updated")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    graphs = [s.strip() for s in args.graphs.split(",") if s.strip()]
    unknown = sorted(set(graphs) - set(GRAPHS))
    if unknown:
        p.error(f"unknown graphs {unknown}; valid: {', '.join(GRAPHS)}")
    dims = [int(s) for s in args.dims.split(",") if s.strip()]
    if args.repeat < 1 or any(d < 1 for d in dims):
        p.error("--repeat and every --dims entry must be >= 1")

    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured, nothing written", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    load_start = load_average()
    if cuda:
        stream = copy_bandwidth(device)
        print(f"device-to-device copy: {stream:.1f} GB/s", flush=True)
    else:
        stream = stream_triad(args.threads)
        print(f"STREAM triad: {stream:.1f} GB/s ({args.threads} threads)", flush=True)
    rows: list[Row] = []
    for name in graphs:
        g = load_graph(name)
        for d in dims:
            rows += measure(g, d, args.repeat, stream, device, args.warmup)
            print(f"  {name} d={d} done", flush=True)
    print_table(rows, stream, cuda)
    if cuda:
        if not args.no_write:
            update_section(args.out, SECTION_CUDA, markdown_cuda(rows, stream, args.repeat, args.warmup))
            print(f"wrote section {SECTION_CUDA!r} of {args.out}")
        return 0
    loads = (load_start, load_average())
    print(f"1-min load average: {loads[0]} at start, {loads[1]} at end")
    if not args.no_write:
        update_section(args.out, SECTION, markdown(rows, stream, args.threads, args.repeat, loads))
        print(f"wrote section {SECTION!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
