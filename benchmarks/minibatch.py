#!/usr/bin/env python
"""Sampled mini-batch training and ``split`` (GSPLIT): accuracy, equality with the reference, bytes.

1. **Accuracy.** GraphSAGE (2 layers, hidden 64, dropout 0.5, Adam lr 0.01) on coauthor_physics and
   coauthor_cs (their seeded 60/20/20 splits): full-graph training (``gc.train``) against sampled
   mini-batch training (``gc.train(batch_size=1024, fanouts=[10, 5])``, evaluation on the whole
   graph); test accuracy at the best validation accuracy, mean over ``--seeds`` seeds.
2. **split x4 against the mini-batch reference.** The same model and mini-batches (sampling seed 0)
   trained by ``gc.train`` and by a 4-rank ``split`` plan: the two runs see the same samples and,
   with dropout 0.5 too (replicated masks: the mini-batch's), must give the same losses (float32:
   equal up to reassociation); the test accuracies over the whole run, also of mini-batch ``data``
   and of ``split`` with ``dropout="local"`` (each rank its own masks), and what replicating the
   masks costs a step.
3. **What a step moves and loads.** For the 4-rank ``split`` and mini-batch ``data`` plans: per rank,
   mean input rows loaded, rows computed and edges aggregated per step (the plan's presampled
   means), bytes sent per step measured (mean over the run) against the plan's prediction.

Usage::

    python benchmarks/minibatch.py                  # writes the "Mini-batch and split" section
    python benchmarks/minibatch.py --epochs 2 --seeds 1 --datasets coauthor_cs --no-write
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

TITLE = "Mini-batch and split"


def sage(gc: Any, graph: Any, dropout: float) -> Any:
    return gc.nn.GraphSAGE(graph.num_features, 64, graph.num_classes, num_layers=2, dropout=dropout)


def accuracy_rows(gc: Any, torch: Any, names: list[str], args: argparse.Namespace) -> list[str]:
    rows = []
    for name in names:
        graph = gc.datasets.load(name)
        full, mini, t_full, t_mini = [], [], [], []
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = sage(gc, graph, 0.5)
            h = gc.train(copy.deepcopy(model), graph, epochs=args.full_epochs, lr=0.01, seed=seed, verbose=False)
            full.append(h.test_acc_at_best_val)
            t_full.append(statistics.median(h.epoch_time))
            h = gc.train(copy.deepcopy(model), graph, epochs=args.epochs, lr=0.01, seed=seed, verbose=False,
                         batch_size=args.batch_size, fanouts=args.fanouts)
            mini.append(h.test_acc_at_best_val)
            t_mini.append(statistics.median(h.epoch_time))
            print(f"{name} seed {seed}: full {full[-1]:.4f}, mini-batch {mini[-1]:.4f}", flush=True)
        diff = (statistics.mean(mini) - statistics.mean(full)) * 100
        rows.append(f"| {name} | {statistics.mean(full):.4f} ({args.full_epochs} epochs, "
                    f"{statistics.median(t_full):.2f} s/epoch) | {statistics.mean(mini):.4f} ({args.epochs} epochs, "
                    f"{statistics.median(t_mini):.2f} s/epoch) | {diff:+.2f} |")
    return rows


def split_rows(gc: Any, torch: Any, name: str, args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    graph = gc.datasets.load(name)
    same, acc, moved = [], [], []
    for dropout in (0.0, 0.5):
        torch.manual_seed(0)
        model = sage(gc, graph, dropout)
        ref = gc.train(copy.deepcopy(model), graph, epochs=args.split_epochs, lr=0.01, seed=0, verbose=False,
                       batch_size=args.batch_size, fanouts=args.fanouts)
        plans = {}
        for strategy, masks in (("split", "replicated"), ("data", "replicated"), ("split", "local")):
            if masks == "local" and dropout == 0.0:
                continue
            t0 = time.perf_counter()
            plan = gc.plan(copy.deepcopy(model), graph, gpus=args.ranks, strategy=strategy,
                           batch_size=args.batch_size, fanouts=args.fanouts, dropout=masks)
            t_plan = time.perf_counter() - t0
            res = plan.run(epochs=args.split_epochs, lr=0.01, seed=0, timeout=1800, progress=False)
            plans[strategy if masks == "replicated" else f"{strategy} ({masks} masks)"] = (plan, res, t_plan)
            print(f"{name} dropout {dropout} {strategy} {masks}: losses {res.history.loss}", flush=True)
        plan, res, _ = plans["split"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(res.history.loss, ref.loss))
        same.append(f"| {name} | {dropout} | {args.split_epochs} x {plan.info['steps_per_epoch']} | "
                    f"{' / '.join(f'{v:.5f}' for v in ref.loss)} | "
                    f"{' / '.join(f'{v:.5f}' for v in res.history.loss)} | {rel:.1e} | "
                    f"{ref.test_acc_at_best_val:.4f} / {res.history.test_acc_at_best_val:.4f} |")
        if dropout != 0.0:
            data_res, local_res = plans["data"][1], plans["split (local masks)"][1]
            acc.append(f"| {name} | {ref.test_acc_at_best_val:.4f} | {res.history.test_acc_at_best_val:.4f} "
                       f"({(res.history.test_acc_at_best_val - ref.test_acc_at_best_val) * 100:+.2f}) | "
                       f"{data_res.history.test_acc_at_best_val:.4f} | {local_res.history.test_acc_at_best_val:.4f} |")
            for strategy, (p, r, t_plan) in plans.items():
                for k, rank in enumerate(r.ranks):
                    moved.append(
                        f"| {strategy} | {k} | {p.info['input_rows'][k]:,} | {p.info['sampled_rows'][k]:,} | "
                        f"{p.info['sampled_edges'][k]:,} | {rank.bytes_sent / 2**20:.2f} | "
                        f"{p.predictions['bytes_sent'][k] / 2**20:.2f} | {statistics.median(r.history.epoch_time):.1f} "
                        f"| {t_plan:.1f} |")
    return same, acc, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["coauthor_physics", "coauthor_cs"])
    ap.add_argument("--split-dataset", default="coauthor_cs")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10, help="mini-batch epochs")
    ap.add_argument("--full-epochs", type=int, default=100, help="full-graph epochs")
    ap.add_argument("--split-epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--fanouts", type=lambda s: [int(v) for v in s.split(",")], default=[10, 5])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    import torch

    import gnncompile as gc

    t0 = time.perf_counter()
    acc_rows = accuracy_rows(gc, torch, args.datasets, args)
    same, acc, moved = split_rows(gc, torch, args.split_dataset, args)
    fan = ",".join(map(str, args.fanouts))
    md = [f"Measured {today()} on {machine_info(torch.get_num_threads())}.",
          f"Command: `{command_line()}` ({time.perf_counter() - t0:.0f} s)", "",
          f"GraphSAGE, 2 layers, hidden 64, Adam lr 0.01, weight decay 5e-4; mini-batches of {args.batch_size} seeds, "
          f"fanouts {fan} (input layer first), evaluation on the whole graph; test accuracy at the best validation "
          f"accuracy, mean of {args.seeds} seeds.", "",
          "### Accuracy: sampled mini-batches against full-graph training", "",
          "| dataset | full graph | mini-batch | difference (points) |", "|---|---|---|---|", *acc_rows, "",
          f"### split x{args.ranks} against the single-device mini-batch reference (same samples)", "",
          "Both runs train on the same mini-batches, with the same dropout masks (replicated: the mini-batch's): "
          "losses per epoch (float32).", "",
          "| dataset | dropout | epochs x steps | reference loss | split loss | max rel. difference | "
          "test acc (ref / split) |",
          "|---|---|---|---|---|---|---|", *same, "",
          "Test accuracy with dropout 0.5 (mini-batch data: each rank its own micro-batch; local masks: each rank "
          "draws its own):", "",
          "| dataset | reference | split | mini-batch data | split, local masks |", "|---|---|---|---|---|", *acc, "",
          f"### What a step loads, computes and sends ({args.split_dataset}, {args.ranks} ranks)", "",
          "Input rows, computed rows (all layers) and edges: the plan's means over 4 presampled steps; bytes "
          "sent: measured mean per step over the run, and the plan's prediction (from the same presampled means: "
          "the shuffle's rows vary from step to step). Epoch time on this 2-core machine (ranks share the cores).", "",
          "| strategy | rank | input rows | computed rows | edges | MiB sent / step | predicted | epoch s | plan s |",
          "|---|---|---|---|---|---|---|---|---|", *moved]
    text = "\n".join(md)
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", TITLE, text)


if __name__ == "__main__":
    main()
