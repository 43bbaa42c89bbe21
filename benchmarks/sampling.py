#!/usr/bin/env python
"""Neighbour sampling throughput: `gc.graph.sample_blocks` against a numpy reference sampler.

Sampled edges per second of a whole mini-batch (all layers: drawing the in-edges, relabelling the
sources, building the blocks; no normalization coefficients) for fanouts 15, 10, 5 (input layer
first) and batches of 1024 and 4096 seeds, on coauthor_physics, soc_slashdot and an R-MAT graph of
2^20 vertices. Seeds are drawn uniformly from the training vertices (from all vertices where a
graph has no split), a fresh batch per repetition; median over repetitions after one warm-up.

The reference is the straightforward sampler: a Python loop over every destination calling
``numpy.random.Generator.choice(degree, fanout, replace=False)`` where the degree exceeds the
fanout, then ``numpy.unique`` and a lookup table to relabel the sources.

Usage::

    python benchmarks/sampling.py                   # writes the "Neighbour sampling" section
    python benchmarks/sampling.py --reps 2 --no-write
    python benchmarks/sampling.py --device cuda     # the torch sampler on a GPU (reference on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, sampling_graphs, today, update_section  # noqa: E402

import numpy as np  # noqa: E402

TITLE = "Neighbour sampling"


def reference_sample(indptr: np.ndarray, indices: np.ndarray, seeds: np.ndarray, fanouts: list[int],
                     rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """The numpy reference sampler; returns ``(destinations, sources, edges)`` per block, input first."""
    n = indptr.size - 1
    dst = seeds
    sizes = []
    for fanout in reversed(fanouts):
        starts, degs = indptr[dst], indptr[dst + 1] - indptr[dst]
        parts = []
        for s, d in zip(starts.tolist(), degs.tolist()):
            if fanout == -1 or d <= fanout:
                parts.append(np.arange(s, s + d))
            else:
                parts.append(s + rng.choice(d, fanout, replace=False))
        eids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        src = indices[eids]
        local = np.full(n, -1, dtype=np.int64)
        local[dst] = np.arange(dst.size)
        new = np.unique(src[local[src] < 0])
        local[new] = np.arange(dst.size, dst.size + new.size)
        block_src = local[src]
        block_indptr = np.concatenate([[0], np.cumsum(np.minimum(degs, fanout) if fanout != -1 else degs)])
        assert block_indptr[-1] == block_src.size
        sizes.append((dst.size, dst.size + new.size, int(eids.size)))
        dst = np.concatenate([dst, new])
    return sizes[::-1]


def timed(fn: Callable[[int], Any], reps: int, sync: Callable[[], None]) -> tuple[float, list[Any]]:
    """Median seconds of ``fn(rep)`` over ``reps`` runs after one warm-up, and the runs' results."""
    fn(-1)
    sync()
    times, results = [], []
    for rep in range(reps):
        t0 = time.perf_counter()
        results.append(fn(rep))
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), results




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fanouts", type=int, nargs="+", default=[15, 10, 5], help="input layer first")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions of the torch sampler")
    ap.add_argument("--ref-reps", type=int, default=3, help="timed repetitions of the numpy reference")
    ap.add_argument("--rmat-nodes", type=int, default=1 << 20)
    ap.add_argument("--rmat-degree", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (the numpy reference is single-threaded)")
    ap.add_argument("--device", default="cpu", help="device of the torch sampler (the reference runs on the CPU)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    import torch

    import gnncompile as gc
    from gnncompile.graph import sample_blocks

    torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fanouts = list(args.fanouts)
    rows, layer_rows = [], []
    for name, graph in sampling_graphs(gc, args.rmat_nodes, args.rmat_degree):
        pool = (torch.nonzero(graph.train_mask).flatten() if graph.train_mask is not None
                else torch.arange(graph.num_nodes))
        g = graph.to(device)
        indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
        for batch in args.batch_sizes:
            def seeds(rep: int) -> torch.Tensor:
                gen = torch.Generator().manual_seed(1000 + rep)
                return pool[torch.randperm(pool.numel(), generator=gen)[:batch]]

            def ours(rep: int) -> list[tuple[int, int, int]]:
                return sample_blocks(g, seeds(rep).to(device), fanouts, seed=rep + 1).sizes()

            def reference(rep: int) -> list[tuple[int, int, int]]:
                return reference_sample(indptr, indices, seeds(rep).numpy(), fanouts, np.random.default_rng(rep + 1))

            t_ours, sizes_ours = timed(ours, args.reps, sync)
            t_ref, sizes_ref = timed(reference, args.ref_reps, lambda: None)
            edges_ours = statistics.median(sum(e for _, _, e in s) for s in sizes_ours)
            edges_ref = statistics.median(sum(e for _, _, e in s) for s in sizes_ref)
            # the two samplers draw different samples of the same sizes up to the sources' overlap
            assert sizes_ours[0][-1][2] == sizes_ref[0][-1][2], "the seeds' hop keeps min(degree, fanout) edges"
            rows.append(f"| {name} | {graph.num_nodes:,} | {graph.num_edges:,} | {batch} | {edges_ours:,.0f} | "
                        f"{t_ours * 1e3:.1f} | {edges_ours / t_ours / 1e6:.2f} | {t_ref * 1e3:.0f} | "
                        f"{edges_ref / t_ref / 1e6:.3f} | {t_ref / t_ours * edges_ours / edges_ref:.0f}x |")
            per_layer = [tuple(statistics.mean(s[i][k] for s in sizes_ours) for k in range(3))
                         for i in range(len(fanouts))]
            layer_rows.append(f"| {name} | {batch} | " + " | ".join(
                f"{d:,.0f} / {s:,.0f} / {e:,.0f}" for d, s, e in per_layer) + f" | {per_layer[0][1]:,.0f} |")
            print(rows[-1], flush=True)

    fan = ", ".join(map(str, fanouts))
    text = "\n".join([
        f"Measured {today()} on {machine_info(torch.get_num_threads())} with `{command_line()}`; torch sampler on "
        f"{device}.", "",
        f"Sampled edges per second of a whole mini-batch, fanouts ({fan}) input layer first (the seeds keep "
        f"{fanouts[-1]} in-edges each), seeds drawn uniformly from the training vertices (all vertices without a "
        "split). `sample_blocks` (torch, vectorized: Floyd's algorithm over all rows at once, relabelling "
        "through a vertex table; blocks without normalization coefficients) against the numpy reference (a "
        "Python loop over destinations with `Generator.choice(degree, fanout, replace=False)`, then "
        f"`np.unique` relabelling). Median over {args.reps} (torch) and {args.ref_reps} (numpy) repetitions after "
        "a warm-up, a new batch each; speed-up compares edges per second.", "",
        "| graph | vertices | edges | batch | sampled edges | torch ms | torch M edges/s | numpy ms | "
        "numpy M edges/s | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "Per-block sizes of the torch sampler (destinations / sources / edges, mean over repetitions), input "
        "layer first; the last column is the number of input vertices whose features a batch loads.", "",
        "| graph | batch | " + " | ".join(f"block {i} (fanout {f})" for i, f in enumerate(fanouts))
        + " | input vertices |",
        "|---|---:|" + "---:|" * len(fanouts) + "---:|", *layer_rows])
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", TITLE, text)


if __name__ == "__main__":
    main()
