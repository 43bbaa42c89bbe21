#!/usr/bin/env python
"""Layer pipelining (`layer`, GNNPipe) against single-device training and `data`: accuracy, bytes, pipeline.

Part 1, accuracy: GCNII trained with `gc.train` and with a 4-rank `layer` plan (16 chunks) from the
same weights, seed and replicated dropout masks, on cora and citeseer: exact, and GNNPipe's relaxed
training on METIS chunks with its three techniques on (chunk shuffling, fixed history refreshed every
2 steps, no historical gradients) and each off in turn (the paper's ablation). Test accuracy at the
best validation epoch, mean over seeds.

Part 2, traffic: bytes per step of `data` (METIS), `layer` and the hybrid (2 stages x 2 partitions)
for GCNII at several depths on 4 ranks, from the plans (measured = predicted is checked by the tests
and in part 1's runs).

Part 3, pipeline: predicted step and bubble fraction of the 4-rank `layer` plan of coauthor_physics on
4xA5000, exact vs historical embeddings, GPipe vs 1F1B order, for 4 and 16 chunks.

Usage::

    python benchmarks/layer_pipeline.py                 # all parts
    python benchmarks/layer_pipeline.py --seeds 1 --epochs 100 --no-write
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

RELAXED = {"history": True, "chunking": "metis", "semantics": "relaxed"}
#: GNNPipe's ablation (§3.4): all three techniques on (chunk shuffling, fixed history refreshed every
#: 2 steps, no historical gradients), then each off in turn; every variant on METIS chunks
VARIANTS = {"exact": {},
            "all three": {**RELAXED, "shuffle": True, "history_refresh": 2},
            "no shuffling": {**RELAXED, "history_refresh": 2},
            "no fixed history": {**RELAXED, "shuffle": True},
            "historical gradients": {**RELAXED, "shuffle": True, "history_refresh": 2, "historical_gradients": True}}


def _gcnii(gc, g, layers: int):
    return gc.nn.GCNII(g.num_features, 64, g.num_classes, num_layers=layers, dropout=0.5)


def accuracy(gc, torch, seeds: int, epochs: int, layers: int) -> list[str]:
    lines = [f"GCNII, {layers} layers, hidden 64, dropout 0.5, {epochs} epochs, Adam lr 0.01, weight decay 5e-4; "
             "`layer` on 4 ranks, 16 chunks. Test accuracy at the best validation epoch, mean over "
             f"{seeds} seed(s).", "",
             "| dataset | single-device | " + " | ".join(f"layer x4 {v} | Δ (points)" for v in VARIANTS)
             + " | single ms/epoch | " + " | ".join(f"{v} ms/epoch" for v in VARIANTS) + " |",
             "|---|---:|" + "---:|---:|" * len(VARIANTS) + "---:|" + "---:|" * len(VARIANTS)]
    fit = dict(lr=0.01, weight_decay=5e-4)
    for name in ("cora", "citeseer"):
        graph = gc.datasets.load(name).normalize_features()
        ref, ref_t = [], []
        acc: dict[str, list[float]] = {v: [] for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = _gcnii(gc, graph, layers)
            h = gc.train(copy.deepcopy(model), graph, epochs=epochs, seed=seed, verbose=False, **fit)
            ref.append(h.test_acc_at_best_val)
            ref_t.append(h.median_epoch_time())
            for v, opts in VARIANTS.items():
                plan = gc.plan(copy.deepcopy(model), graph, 4, strategy="layer", chunks=16, **opts)
                res = plan.run(epochs=epochs, seed=seed, timeout=1800, progress=False, **fit)
                acc[v].append(res.history.test_acc_at_best_val)
                times[v].append(res.history.median_epoch_time())
            print(f"{name} seed {seed}: single {ref[-1]:.4f}, " + ", ".join(f"{v} {a[-1]:.4f}" for v, a in acc.items()),
                  flush=True)
        cells = [f"{statistics.mean(acc[v]):.4f} | {100 * statistics.mean(p - r for p, r in zip(acc[v], ref)):+.2f}"
                 for v in VARIANTS]
        lines.append(f"| {name} | {statistics.mean(ref):.4f} | " + " | ".join(cells)
                     + f" | {statistics.median(ref_t) * 1e3:.1f} | "
                     + " | ".join(f"{statistics.median(times[v]) * 1e3:.1f}" for v in VARIANTS) + " |")
    return lines


def traffic(gc, torch) -> list[str]:
    g = gc.datasets.load("coauthor_physics").normalize_features()
    lines = ["coauthor_physics, GCNII hidden 64, 4 ranks, bytes per training step summed over the ranks (from the "
             "plans). Hybrid: 2 stages of 2 ranks, METIS partitions.", "",
             "| layers | data (METIS) | layer (16 chunks) | hybrid 2x2 (16 chunks) | layer / data | hybrid / data |",
             "|---:|---:|---:|---:|---:|---:|"]
    for layers in (4, 8, 16, 32):
        torch.manual_seed(0)
        model = _gcnii(gc, g, layers)
        data = sum(gc.plan(copy.deepcopy(model), g, 4, strategy="data", partitioner="metis").predictions["bytes_sent"])
        lay = sum(gc.plan(copy.deepcopy(model), g, 4, strategy="layer", chunks=16).predictions["bytes_sent"])
        hyb = sum(gc.plan(copy.deepcopy(model), g, 4, strategy="layer", chunks=16, stages=2,
                          chunking="metis").predictions["bytes_sent"])
        lines.append(f"| {layers} | {data / 2**20:,.1f} MiB | {lay / 2**20:,.1f} MiB | {hyb / 2**20:,.1f} MiB | "
                     f"{lay / data:.2f} | {hyb / data:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", HYBRID_NOTE]
    return lines


HYBRID_NOTE = ("The hybrid's graph communication is at chunk granularity: a partition receives every chunk of "
               "another partition that one of its in-edges reaches, not only the boundary vertices as `data`'s "
               "halo exchange does, so on coauthor_physics it sends more than both pure forms; with no edge "
               "between partitions it sends exactly `2 (S - 1) N H` (tested).")


def pipeline(gc, torch) -> list[str]:
    g = gc.datasets.load("coauthor_physics").normalize_features()
    torch.manual_seed(0)
    model = _gcnii(gc, g, 16)
    lines = ["coauthor_physics, GCNII 16 layers, 4 ranks on 4xA5000 (predicted).", "",
             "| chunks | order | exact: step | bubble | history: step | bubble |", "|---:|---|---:|---:|---:|---:|"]
    for k in (4, 16):
        for order in ("gpipe", "1f1b"):
            row = [str(k), order]
            for opts in ({}, {"history": True, "semantics": "relaxed"}):
                sim = gc.plan(copy.deepcopy(model), g, "4xA5000", strategy="layer", chunks=k, schedule=order,
                              **opts).prediction.simulation
                row += [f"{sim.step_time * 1e3:.1f} ms", f"{100 * sim.bubble_fraction:.0f}%"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args()
    import torch

    import gnncompile as gc

    parts = [f"Measured {today()} on {machine_info(torch.get_num_threads())} with `{command_line()}`.", "",
             "### Accuracy against single-device training", "", *accuracy(gc, torch, args.seeds, args.epochs,
                                                                            args.layers), "",
             "### Bytes per step against data parallelism", "", *traffic(gc, torch), "",
             "### Pipeline (predicted)", "", *pipeline(gc, torch)]
    text = "\n".join(parts)
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", "Layer strategy", text)


if __name__ == "__main__":
    main()
