#!/usr/bin/env python
"""Feature parallelism (`tensor`, `mop`) vs graph parallelism (`data`): bytes per step and accuracy.

Part 1, communication (from the plans; the runtime's byte counters equal them, see the tests):
total bytes per training step over all ranks for `data` (METIS) and `tensor` at 2, 3 and 4 ranks on
coauthor_physics and an RMAT graph, GCN hidden 64. `data` moves halo rows, (alpha - 1)|V| per
layer, and alpha grows with the rank count; `tensor` moves (n-1)/n of every |V| x D tensor it
converts, which barely depends on n and not on the graph's structure (MixGCN Proposition 3.4,
NeutronTP §3.2). `mop` (MixGCN MoP + MoA, half the ranks aggregating, half updating) moves every
converted |V| x D tensor once between the groups, whatever the group sizes.

Part 2, accuracy: GCN trained 200 epochs with `gc.train` and with a 4-rank `tensor` plan from the
same weights, seed and (replicated) dropout masks, on cora and coauthor_physics; a 4-rank `mop`
plan (2 sparse + 2 dense ranks, 4 chunks pipelined, RCM order); and the decoupled
`tensor` plan (NeutronTP §4.1: a different, relaxed model) with its own accuracy.

Usage::

    python benchmarks/feature_parallel.py                  # both parts, 2 seeds
    python benchmarks/feature_parallel.py --seeds 1 --no-write
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

HIDDEN = {"cora": 16, "coauthor_physics": 64}


def volumes(gc, torch) -> list[str]:
    graphs = {"coauthor_physics": gc.datasets.load("coauthor_physics").normalize_features(),
              "rmat (65k, deg 16)": gc.datasets.synthetic("rmat", num_nodes=65_536, avg_degree=16, num_features=64,
                                                          num_classes=8, seed=0)}
    lines = ["| graph | ranks | data α | data bytes/step | tensor bytes/step | mop bytes/step | tensor / data | "
             "mop / data |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, g in graphs.items():
        torch.manual_seed(0)
        model = gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2)
        for n in (2, 3, 4):
            d = gc.plan(model, g, n, strategy="data", partitioner="metis", verify=False)
            t = gc.plan(model, g, n, strategy="tensor", verify=False)
            m = gc.plan(model, g, n, strategy="mop", verify=False)
            bd, bt, bm = (sum(p.predictions["bytes_sent"]) for p in (d, t, m))
            alpha = d.info["partition"]["replication_factor"]
            lines.append(f"| {name} | {n} | {alpha:.2f} | {bd / 2**20:.1f} MiB | {bt / 2**20:.1f} MiB | "
                         f"{bm / 2**20:.1f} MiB | {bt / bd:.2f} | {bm / bd:.2f} |")
            print(lines[-1], flush=True)
    return lines


def accuracy(gc, torch, seeds: int, epochs: int) -> list[str]:
    lines = ["| dataset | single-device acc | tensor x4 acc | Δ (points) | mop x4 acc | Δ (points) | "
             "decoupled tensor x4 acc (relaxed) | single ms/epoch | tensor x4 ms/epoch | mop x4 ms/epoch | "
             "decoupled x4 ms/epoch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("cora", "coauthor_physics"):
        graph = gc.datasets.load(name).normalize_features()
        ref, par, ref_t, par_t, dec, dec_t, mop, mop_t = [], [], [], [], [], [], [], []
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = gc.nn.GCN(graph.num_features, HIDDEN[name], graph.num_classes, num_layers=2, dropout=0.5)
            m_par, m_dec, m_mop = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
            h = gc.train(model, graph, epochs=epochs, lr=0.01, weight_decay=5e-4, seed=seed, verbose=False)
            res = gc.plan(m_par, graph, 4, strategy="tensor").run(epochs=epochs, lr=0.01, weight_decay=5e-4, seed=seed)
            res_dec = gc.plan(m_dec, graph, 4, strategy="tensor", decouple=True, semantics="relaxed").run(
                epochs=epochs, lr=0.01, weight_decay=5e-4, seed=seed)
            res_mop = gc.plan(m_mop, graph, 4, strategy="mop", chunks=4, reorder="rcm").run(
                epochs=epochs, lr=0.01, weight_decay=5e-4, seed=seed)
            mop.append(res_mop.history.test_acc_at_best_val)
            mop_t.append(res_mop.history.median_epoch_time())
            dec.append(res_dec.history.test_acc_at_best_val)
            dec_t.append(res_dec.history.median_epoch_time())
            ref.append(h.test_acc_at_best_val)
            par.append(res.history.test_acc_at_best_val)
            ref_t.append(h.median_epoch_time())
            par_t.append(res.history.median_epoch_time())
            print(f"{name} seed {seed}: single {ref[-1]:.4f}, tensor x4 {par[-1]:.4f}, mop x4 {mop[-1]:.4f}, "
                  f"decoupled {dec[-1]:.4f}", flush=True)
        lines.append(f"| {name} | {statistics.mean(ref):.4f} | {statistics.mean(par):.4f} | "
                     f"{100 * statistics.mean(p - r for p, r in zip(par, ref)):+.2f} | {statistics.mean(mop):.4f} | "
                     f"{100 * statistics.mean(p - r for p, r in zip(mop, ref)):+.2f} | {statistics.mean(dec):.4f} | "
                     f"{statistics.median(ref_t) * 1e3:.1f} | {statistics.median(par_t) * 1e3:.1f} | "
                     f"{statistics.median(mop_t) * 1e3:.1f} | {statistics.median(dec_t) * 1e3:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = ap.parse_args()

    import torch

    import gnncompile as gc

    text = "\n".join([
        f"{today()} · {machine_info(torch.get_num_threads())} · `{command_line()}`", "",
        "Total bytes per training step over all ranks (halo rows or all-to-all blocks, forward and backward, plus "
        "the gradient all-reduce), GCN 2 layers, hidden 64:", "",
        *volumes(gc, torch), "",
        f"GCN (2 layers, dropout 0.5, Adam lr 0.01, wd 5e-4), {args.epochs} epochs, mean over {args.seeds} seed(s) of "
        "test accuracy at best validation; same initial weights, seed and dropout masks (replicated masks):", "",
        *accuracy(gc, torch, args.seeds, args.epochs), "",
        "The ranks are processes sharing this machine's 2 cores (gloo over loopback): epoch times measure the "
        "runtime's overheads, not a speed-up.",
    ])
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", "Tensor strategy (feature parallel) vs data and single device", text)


if __name__ == "__main__":
    main()
