#!/usr/bin/env python
"""Split partitioning (GSPLIT Fig. 5): load balance and cross-split edges of offline partitions.

GSPLIT splits every sampled mini-batch across the ranks by a static vertex -> rank map. This
compares the maps of the paper's Fig. 5 on our graphs, 4 parts, batches of 4096 targets, fanouts
15, 10, 5 (input layer first):

* **GSplit**: METIS on the presampling-weighted graph (vertex weights ``k_v``, edge weights ``k_e``
  counted over ``--presample-epochs`` epochs of the same sampler; the paper's Eq. 2);
* **GSplit-edges** / **GSplit-both**: the same edge weights, balancing each vertex's sampled
  in-edges (sum of ``k_e``) instead of ``k_v`` / both as two METIS constraints (not in the paper);
* **Node**: METIS with the presampled vertex weights only (plain edge cut);
* **Edge**: METIS balancing target vertices and in-edges (two constraints), no presampling, as
  the paper's Edge baseline ("as commonly done in data-parallel GNN training systems");
* **METIS**: plain unweighted METIS (vertex counts balanced);
* **Rand**: a random balanced assignment.

Each is measured on ``--batches`` fresh mini-batches (seeds different from the presampling's) with
:func:`gnncompile.graph.split_stats`: load imbalance = max/mean over parts of the sampled vertices
at layers l > 0 (block destinations) summed over the layers, the same for edges (the paper's Fig. 5
measure), the cross-split edge ratio (edges whose endpoints are in different parts / all edges of
the batch), and the rows shuffled per batch (all layers, one direction). Means over the batches.

Usage::

    python benchmarks/split_balance.py                  # writes the "Split partitioning" section
    python benchmarks/split_balance.py --batches 3 --presample-epochs 2 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, sampling_graphs, today, update_section  # noqa: E402

TITLE = "Split partitioning (GSPLIT Fig. 5)"
METHODS = ("GSplit", "GSplit-edges", "GSplit-both", "Node", "Edge", "METIS", "Rand")




def make_partitions(graph: Any, pool: Any, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    """The vertex -> part maps of :data:`METHODS` and the seconds each took (presampling included where used)."""
    import torch

    from gnncompile.graph import partition, presample, presampled_partition

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    weights = presample(graph, args.fanouts, args.batch_size, epochs=args.presample_epochs, targets=pool, seed=0)
    t_pre = time.perf_counter() - t0
    print(f"  presample: {weights} in {t_pre:.1f} s", flush=True)
    parts: dict[str, Any] = {}
    for name, fn in (
        ("GSplit", lambda: presampled_partition(graph, args.parts, weights, seed=args.seed)),
        ("GSplit-edges", lambda: presampled_partition(graph, args.parts, weights, balance="edges", seed=args.seed)),
        ("GSplit-both", lambda: presampled_partition(graph, args.parts, weights, balance="both", seed=args.seed)),
        ("Node", lambda: presampled_partition(graph, args.parts, weights, edge_weights=False, seed=args.seed)),
        ("Edge", lambda: partition(graph, args.parts, "metis", seed=args.seed, vertex_weights=torch.stack(
            [torch.zeros(graph.num_nodes, dtype=torch.int64).index_fill_(0, pool, 1), graph.in_degree()], dim=1),
            name="metis-targets+edges")),
        ("METIS", lambda: partition(graph, args.parts, "metis", seed=args.seed)),
        ("Rand", lambda: partition(graph, args.parts, "random", seed=args.seed)),
    ):
        t0 = time.perf_counter()
        parts[name] = fn().parts
        times[name] = time.perf_counter() - t0 + (t_pre if name.startswith(("GSplit", "Node")) else 0.0)
        print(f"  {name}: partitioned in {times[name]:.1f} s", flush=True)
    return parts, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fanouts", type=int, nargs="+", default=[15, 10, 5], help="input layer first")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--batches", type=int, default=10, help="fresh evaluation mini-batches per graph")
    ap.add_argument("--presample-epochs", type=int, default=10, help="the paper finds 10 sufficient")
    ap.add_argument("--seed", type=int, default=1, help="METIS and random-partition seed")
    ap.add_argument("--rmat-nodes", type=int, default=1 << 18)
    ap.add_argument("--rmat-degree", type=float, default=16.0)
    ap.add_argument("--no-rmat", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    import torch

    import gnncompile as gc
    from gnncompile.graph import sample_blocks, split_stats

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for gname, graph in sampling_graphs(gc, args.rmat_nodes, args.rmat_degree, not args.no_rmat):
        print(f"{gname}: {graph.num_nodes:,} vertices, {graph.num_edges:,} edges", flush=True)
        pool = (torch.nonzero(graph.train_mask).flatten() if graph.train_mask is not None
                else torch.arange(graph.num_nodes))
        parts, times = make_partitions(graph, pool, args)
        stats: dict[str, list[Any]] = {m: [] for m in METHODS}
        for rep in range(args.batches):
            gen = torch.Generator().manual_seed(10_000 + rep)  # seeds unlike the presampling's
            seeds = pool[torch.randperm(pool.numel(), generator=gen)[:args.batch_size]]
            batch = sample_blocks(graph, seeds, args.fanouts, seed=20_000 + rep)
            for m in METHODS:
                stats[m].append(split_stats(batch, parts[m], args.parts))
        for m in METHODS:
            ss = stats[m]
            vi = statistics.mean(s.imbalance("vertices") for s in ss)
            ei = statistics.mean(s.imbalance("edges") for s in ss)
            ii = statistics.mean(s.imbalance("inputs") for s in ss)
            cr = statistics.mean(s.cross_ratio for s in ss)
            rows_shuffled = statistics.mean(int(s.shuffle_rows.sum()) for s in ss)
            computed = statistics.mean(int(s.dst.sum()) for s in ss)
            rows.append(f"| {gname} | {m} | {vi:.3f} | {ei:.3f} | {ii:.3f} | {100 * cr:.1f}% | "
                        f"{rows_shuffled:,.0f} | {computed:,.0f} | {times[m]:.1f} |")
            print(rows[-1], flush=True)

    fan = ", ".join(map(str, args.fanouts))
    text = "\n".join([
        f"Measured {today()} on {machine_info(torch.get_num_threads())} with `{command_line()}`.", "",
        f"{args.parts} parts, mini-batches of {args.batch_size} targets (training vertices; all vertices where a "
        f"graph has no split), fanouts ({fan}) input layer first. Offline maps: **GSplit** = METIS on the "
        f"presampling-weighted graph (vertex weight k_v = times sampled at a layer l > 0, edge weight k_e = "
        f"times sampled, over {args.presample_epochs} presampling epochs; the paper's Eq. 2), **GSplit-edges** / "
        "**GSplit-both** = the same edge weights balancing each vertex's sampled in-edges (sum of k_e) instead of "
        "k_v / both as two METIS constraints (our variants, not in the paper), **Node** = presampled "
        "vertex weights only, **Edge** = METIS balancing targets and in-edges (two constraints, the paper's "
        "baseline), **METIS** = unweighted METIS, **Rand** = random. Each is applied to the same "
        f"{args.batches} fresh mini-batches (`split_stats`); means over them. Imbalance = max/mean over parts, "
        "summed over layers, of the vertices computed (layer l > 0, the paper's X_i), of the edges aggregated "
        "(Fig. 5's measure), and of the input features loaded (block 0's sources). Cross-split = edges whose "
        "endpoints are in different parts / all sampled edges. Shuffled rows: distinct remote rows received, "
        "all layers, one direction. Time: presampling + partitioning, seconds.", "",
        "| graph | map | vertex imbalance | edge imbalance | input imbalance | cross-split edges | shuffled rows "
        "| computed vertices | time s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|", *rows])
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", TITLE, text)


if __name__ == "__main__":
    main()
