#!/usr/bin/env python
"""GAT's edge-valued products, per formulation: the multi-head SpMM (forward and transposed) and
the SDDMM (the edge values' gradient), on the CPU or a GPU.

For ``H`` heads of width ``C`` (edge values ``[E, H]``, features ``[N, H, C]``), on the in-edge
CSR of each graph, times:

* ``spmm``: ``out[r, h] = sum_e values[e, h] x[col[e], h]``, and ``spmm^T`` (``transpose=True``,
  what a push backward runs), by
  - ``per-head loop``: the ``torch`` backend before it interleaved heads: per head a CSR of that
    head's values, the head's columns of ``x`` made contiguous, ``torch.sparse.mm``, then a stack;
  - ``interleaved``: the ``torch`` backend now (:func:`gnncompile.kernels._interleaved`: one
    ``torch.sparse.mm`` over an ``[N*H, N*H]`` structure, the values gathered into its order);
  - the device's own backend: ``native`` on the CPU, ``cupy`` on CUDA (where installed);
* ``sddmm``: ``w[e, h] = <a[row(e), h], b[col(e), h]>``, by
  - ``gather``: both operands' rows gathered per edge, multiplied and summed (in edge blocks);
  - ``sampled_addmm``: ``torch.sparse.sampled_addmm`` over the interleaved structure (cuSPARSE's
    SDDMM on CUDA);
  - ``torch backend``: what ``kernels.sddmm(..., "torch")`` runs (on CUDA its measured choice of
    the two above);
  - the device's own backend (``native``; ``cupy``: its measured choice among its kernels);
* ``attention``: GAT's coefficients ``softmax_r(LeakyReLU(src[col] + dst[r]))`` with self loops
  (the forward of ``gnncompile.ops.edge_attention``), by
  - ``torch``: gathers, LeakyReLU and the softmax's segment reductions (what the ``torch``
    backend ran on CUDA before it measured the fused kernels against it);
  - ``fused``: :func:`gnncompile.kernels.attention_coefficients` (native on the CPU, the own CUDA
    kernels where CuPy is installed);
  - ``torch backend`` (CUDA with CuPy): ``gnncompile.ops.edge_attention`` under the device's default
    backend, the faster of the two by its own measurement (forward and backward).

Each formulation's result is checked against the first's (max abs error column). Time = median of
``--repeat`` calls after ``--warmup`` (each call between two synchronizations on CUDA); one-time
structures (the interleaved copy, the transposes) are built in the warm-up. The choices measured
in the run (:func:`gnncompile.kernels.cuda.choices`: the ``torch`` backend's on CUDA, the
``cupy`` backend's per-shape kernels) are printed after the table.

Usage::

    python benchmarks/multihead.py                       # R-MAT 100k/2M on the CPU, H=4, C=64
    python benchmarks/multihead.py --device cuda --graphs cora rmat
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gnncompile as gc  # noqa: E402
from gnncompile import kernels  # noqa: E402
from gnncompile.frontend import ops as fops  # noqa: E402
from gnncompile.frontend.ops import _EdgeAttention  # noqa: E402
from gnncompile.kernels import CSR, cuda  # noqa: E402

sys.path.insert(0, str(HERE))
from _results import command_line, gpu_info, machine_info, today, update_section  # noqa: E402

SECTION = "Multi-head products (GAT)"


def per_head_loop(csr: CSR, values: torch.Tensor, x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The ``torch`` backend's multi-head product before heads were interleaved (kept here as the
    baseline): one CSR and one ``torch.sparse.mm`` per head over contiguous copies, then a stack."""
    heads, c = values.shape[1], x.shape[2]
    x2 = x.reshape(x.shape[0], heads * c)
    indptr, indices = csr.matched(x.device)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for h in range(heads):
            a = torch.sparse_csr_tensor(indptr, indices, values[:, h].contiguous(), size=(csr.num_rows, csr.num_cols),
                                        device=x.device, check_invariants=False)
            outs.append(torch.sparse.mm(a.t() if transpose else a, x2[:, h * c:(h + 1) * c].contiguous()))
    return torch.stack(outs, dim=1)


def load(name: str) -> gc.Graph:
    """``cora`` (any dataset name) or ``rmat`` (100k vertices, 2M edges, as benchmarks/epoch_time.py)."""
    if name == "rmat":
        return gc.datasets.synthetic("rmat", num_nodes=100_000, num_edges=2_000_000, num_features=1, num_classes=2,
                                     seed=0)
    return gc.datasets.load(name)


def formulations(g: gc.Graph, csr: CSR, values: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 src: torch.Tensor, dst: torch.Tensor) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """Per operation, the formulations to time (the first is the reference of the error column)."""
    heads = values.shape[1]
    dev = x.device
    own = "cupy" if dev.type == "cuda" else "native"
    have_own = own in kernels.available_backends(dev)
    ops: dict[str, dict[str, Callable[[], torch.Tensor]]] = {}
    for transpose in (False, True):
        xx = x if not transpose else a.view(a.shape[0], heads, -1)
        fns = {"per-head loop": lambda xx=xx, t=transpose: per_head_loop(csr, values, xx, t),
               "interleaved (torch)": lambda xx=xx, t=transpose: kernels.spmm(csr, values, xx, "torch", transpose=t)}
        if have_own:
            fns[own] = lambda xx=xx, t=transpose: kernels.spmm(csr, values, xx, own, transpose=t)
        ops["spmm^T" if transpose else "spmm"] = fns
    ops["sddmm"] = {"gather": lambda: kernels._sddmm_gather(csr, a, b, heads),
                    "sampled_addmm": lambda: kernels._sddmm_sampled(csr, a, b, heads),
                    "torch backend": lambda: kernels.sddmm(csr, a, b, heads, "torch")}
    if have_own:
        ops["sddmm"][own] = lambda: kernels.sddmm(csr, a, b, heads, own)
    ops["attention"] = {"torch": lambda: _EdgeAttention._unfused(g, src, dst, 0.2, True)}
    if dev.type == "cpu" and have_own or kernels.attention_fusable(src):
        ops["attention"]["fused"] = lambda: kernels.attention_coefficients(fops._csr(g), src, dst, 0.2, loops=True)
    if kernels.attention_fusable(src):   # what the default backend runs on this structure (measured once)
        ops["attention"]["torch backend"] = lambda: gc.ops.edge_attention(g, src, dst, 0.2, True)
    return ops


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(name: str, g: gc.Graph, heads: int, width: int, dev: torch.device, warmup: int, repeat: int
            ) -> list[tuple]:
    """Rows ``(graph, V, E, op, formulation, median ms, min ms, max abs err)``; a formulation that
    fails (out of memory, unsupported) is a row with its error instead of times."""
    gen = torch.Generator().manual_seed(0)
    csr = CSR(g.indptr.to(dev), g.indices.to(dev), g.num_nodes, g.num_src)
    values = torch.rand(csr.nnz, heads, generator=gen).to(dev)
    x = torch.randn(g.num_src, heads, width, generator=gen).to(dev)
    a = torch.randn(g.num_nodes, heads * width, generator=gen).to(dev)
    b = torch.randn(g.num_src, heads * width, generator=gen).to(dev)
    src = torch.randn(g.num_src, heads, generator=gen).to(dev)   # attention's per-vertex scores
    dst = torch.randn(g.num_nodes, heads, generator=gen).to(dev)
    rows = []
    g = g.to(dev)
    for op, fns in formulations(g, csr, values, x, a, b, src, dst).items():
        ref: Optional[torch.Tensor] = None
        for label, fn in fns.items():
            try:
                out = fn()
                for _ in range(warmup - 1):
                    fn()
                sync(dev)
                out = out.reshape(out.shape[0], -1)
                ref = out if ref is None else ref
                err = float((out - ref).abs().max()) if out.numel() else 0.0
                del out
                times = []
                for _ in range(repeat):
                    sync(dev)
                    t0 = time.perf_counter()
                    fn()
                    sync(dev)
                    times.append(time.perf_counter() - t0)
                rows.append((name, g.num_nodes, csr.nnz, op, label, f"{statistics.median(times) * 1e3:.3f}",
                             f"{min(times) * 1e3:.3f}", f"{err:.1e}"))
            except (RuntimeError, NotImplementedError, torch.cuda.OutOfMemoryError, gc.KernelError) as exc:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append((name, g.num_nodes, csr.nnz, op, label, "failed", "-",
                             f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"))
    return rows


COLUMNS = ("graph", "V", "E", "op", "formulation", "median ms", "min ms", "max abs err")


def table(rows: list[tuple]) -> list[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--graphs", nargs="+", default=["rmat"], help="rmat (100k/2M) or dataset names (default: rmat)")
    p.add_argument("--heads", type=int, default=4, help="attention heads H (default: 4, GAT's first layer "
                   "in benchmarks/epoch_time.py)")
    p.add_argument("--width", type=int, default=64, help="features per head C (default: 64)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per formulation (default: 2)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per formulation (default: 10)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="results file (default: benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    if args.heads < 2 or args.width < 1 or args.warmup < 1 or args.repeat < 1:
        p.error("--heads must be at least 2 (a multi-head product), --width, --warmup and --repeat at least 1")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.graphs:
        rows += measure(name, load(name), args.heads, args.width, dev, args.warmup, args.repeat)
    lines = table(rows)
    print("\n".join(lines))
    chosen = [str(c) for c in cuda.choices()]
    for c in chosen:
        print("choice:", c)
    where = gpu_info() if dev.type == "cuda" else machine_info(torch.get_num_threads())
    md = [f"`{command_line()}` ({today()}; {where}), H = {args.heads}, C = {args.width}, float32, median of "
          f"{args.repeat} calls after {args.warmup} warm-up calls:", "", *lines]
    if chosen:
        md += ["", "Choices measured in this run (`kernels.cuda.choices()`):", ""] + [f"- {c}" for c in chosen]
    update_section(args.out, f"{SECTION}, {'CUDA' if dev.type == 'cuda' else 'CPU'}", "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
