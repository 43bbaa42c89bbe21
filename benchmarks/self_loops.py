#!/usr/bin/env python
"""Self loops in the product: a propagation over ``A + I`` with the loop term in the same call
(``kernels.spmm(..., loop=)``) against the product followed by the loop term as two more passes
(``loop * x``, then added: what every propagation with ``add_self_loops=True`` ran before).

GCN's normalization (per-vertex scales) and its self-loop factors, as gnncompile's layers pass
them, on each graph and width; pulled (forward) and pushed (the transposed product a backward
scatters). Backends: ``native`` adds the term as it stores each output row; ``torch`` (CUDA's
default; MKL on this CPU) multiplies by ``A + L`` with its entries folded once per graph
(``kernels._looped_csr``); on CUDA (``--device cuda``) ``torch`` (cuSPARSE) and ``cupy`` (the loop
term after the product). Median of ``--repeat`` calls, the two formulations alternated (each call
ended by a CUDA synchronization on a GPU).

Usage::

    python benchmarks/self_loops.py                        # cora, coauthor_physics, R-MAT 100k/2M
    python benchmarks/self_loops.py --graphs cora --dims 16 --no-write
    python benchmarks/self_loops.py --device cuda --graphs rmat --dims 64,256 --backends torch cupy
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from _results import command_line, gpu_info, machine_info, today, update_section  # noqa: E402

SECTION = "Self loops in the product (A + I)"


def _load(name: str):
    import gnncompile as gc

    if name == "rmat":
        return gc.datasets.synthetic("rmat", num_nodes=100_000, num_edges=2_000_000, num_features=1, num_classes=2,
                                     seed=0)
    return gc.datasets.load(name)


def _median_ms(fns: dict[str, Callable[[], object]], repeat: int, device: torch.device) -> dict[str, float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeat):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", nargs="+", default=["cora", "coauthor_physics", "rmat"])
    p.add_argument("--dims", default="16,64,256", help="comma-separated feature widths")
    p.add_argument("--backends", nargs="+", default=["native", "torch"])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the products run")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file whose section is updated")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device")

    from gnncompile import kernels
    from gnncompile.frontend import ops

    rows = []
    for name in args.graphs:
        g = _load(name).compact()
        g.cast_scales(torch.float32)
        g = g.to(device)
        csr = ops._csr(g)
        values, row, col, loop = ops._stored_terms(g, "gcn", True, torch.float32)
        for d in (int(v) for v in args.dims.split(",")):
            x = torch.randn(g.num_nodes, d, generator=torch.Generator().manual_seed(0)).to(device)
            for backend in args.backends:
                if backend not in kernels.available_backends(device):
                    continue
                for transpose in (False, True):
                    def separate() -> torch.Tensor:
                        out = kernels.spmm(csr, values, x, backend, row_scale=row, col_scale=col, transpose=transpose)
                        kernels._add_loop_terms(out, loop, x, (0, 0), transpose)
                        return out

                    def joined() -> torch.Tensor:
                        return kernels.spmm(csr, values, x, backend, row_scale=row, col_scale=col,
                                            transpose=transpose, loop=loop)

                    err = float((separate() - joined()).abs().max())
                    t = _median_ms({"separate": separate, "joined": joined}, args.repeat, device)
                    rows.append((name, g.num_nodes, g.num_edges, d, backend, "push" if transpose else "pull",
                                 t["separate"], t["joined"], err))
                    r = rows[-1]
                    print(f"{r[0]:>17} d={d:<3} {backend:>6} {r[5]}: loop term apart {r[6]:8.2f} ms, "
                          f"in the product {r[7]:8.2f} ms ({r[6] / r[7]:.2f}x), max |diff| {err:.1e}", flush=True)

    header = ("| graph | V | E | d | backend | product | loop term apart (ms) | in the product (ms) | speed-up "
              "| max abs diff |")
    where = gpu_info() if device.type == "cuda" else machine_info(args.threads)
    lines = [f"{today()} · {where} · `{command_line()}`", "",
             "GCN-normalized propagation over A + I (float32, median of "
             f"{args.repeat} alternated calls): the loop term as two more passes over vertex tensors (before) "
             "against the loop term in the same call (`kernels.spmm(loop=)`: native adds it as it stores a row, "
             "torch multiplies by A + L with its entries folded once).", "", header,
             "|" + "---|" * 10]
    for name, v, e, d, backend, kind, a, b, err in rows:
        lines.append(f"| {name} | {v} | {e} | {d} | {backend} | {kind} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {err:.1e} |")
    if not args.no_write:
        update_section(args.out, SECTION + (" on CUDA" if device.type == "cuda" else ""), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
