#!/usr/bin/env python
"""Dropout masks: draws per second of the counter-based generator against torch's ``bernoulli_``,
and what it does to training steps.

Part 1 (``kernel``): seconds to draw one mask of a GNN's hidden layer (cora 2708 x 16,
coauthor_physics 34493 x 64, an R-MAT-1M-sized 1048576 x 64), at 1 and 2 threads: torch's
``empty(...).bernoulli_(1 - p).div_(1 - p)`` (what ``F.dropout`` runs on a CPU), the whole mask from
:func:`gnncompile.kernels.dropout.dropout_mask`, and a quarter of its rows (a random quarter: what
a rank of four needs). Median of 20 calls after one warm-up.

Part 2 (``steps``): the median training step of GCN-2 plans (hidden 16 on cora, 64 on
coauthor_physics, dropout 0.5) with each generator, switched by ``GNNCOMPILE_DROPOUT_MASKS``
(``torch``: ``bernoulli_``; ``philox``: the default) in the same process, alternating the two.

Usage::

    python benchmarks/dropout_masks.py                 # both parts, updates RESULTS.md
    python benchmarks/dropout_masks.py --parts kernel --no-write
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

SECTION = "Dropout masks"
SHAPES = [("cora hidden", 2708, 16), ("coauthor_physics hidden", 34493, 64), ("1M x 64", 1_048_576, 64)]
PLANS = [("cora", 1, "data"), ("cora", 4, "data"), ("coauthor_physics", 1, "data"),
         ("coauthor_physics", 2, "data"), ("coauthor_physics", 4, "data"), ("coauthor_physics", 4, "tensor")]


def _median_seconds(fn, calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_table() -> str:
    import torch

    from gnncompile.kernels.dropout import dropout_mask

    rows_out = ["| mask | elements | threads | `bernoulli_` | Philox, whole | Philox, a quarter of the rows | speed-up (whole) |",
                "|---|---:|---:|---:|---:|---:|---:|"]
    saved = torch.get_num_threads()
    try:
        for name, n, w in SHAPES:
            quarter = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: n // 4].sort().values
            for t in (1, 2):
                torch.set_num_threads(t)
                b = _median_seconds(lambda: torch.empty(n, w).bernoulli_(0.5).div_(0.5))
                p = _median_seconds(lambda: dropout_mask(7, 0.5, n, (w,)))
                q = _median_seconds(lambda: dropout_mask(7, 0.5, n, (w,), rows=quarter))
                line = (f"| {name} | {n * w:,} | {t} | {b * 1e3:.3f} ms ({n * w / b / 1e6:.0f} M/s) | "
                        f"{p * 1e3:.3f} ms ({n * w / p / 1e6:.0f} M/s) | {q * 1e3:.3f} ms | {b / p:.1f}x |")
                print(line, flush=True)
                rows_out.append(line)
    finally:
        torch.set_num_threads(saved)
    return "\n".join(rows_out)


def steps_table(epochs: int, repeats: int) -> str:
    import torch

    import gnncompile as gc

    out = ["| dataset | ranks | strategy | step, `bernoulli_` masks | step, Philox masks | ratio |",
           "|---|---:|---|---:|---:|---:|"]
    graphs = {}
    for name, ranks, strategy in PLANS:
        if name not in graphs:
            graphs[name] = gc.datasets.load(name).normalize_features()
        graph = graphs[name]
        torch.manual_seed(0)
        model = gc.nn.GCN(graph.num_features, 16 if name == "cora" else 64, graph.num_classes, num_layers=2,
                          dropout=0.5)
        plan = gc.plan(copy.deepcopy(model), graph, f"{ranks}xcpu", strategy=strategy,
                       partitioner="metis" if strategy == "data" else None)
        got: dict[str, list[float]] = {"torch": [], "philox": []}
        for _ in range(repeats):
            for generator in ("torch", "philox"):
                os.environ["GNNCOMPILE_DROPOUT_MASKS"] = generator
                res = plan.run(epochs=epochs, lr=0.01, seed=0, eval_every=epochs)
                steps = list(zip(*[r.epoch_time for r in res.ranks]))[2:]  # skip warm-up steps
                got[generator].append(statistics.median(max(s) for s in steps))
        os.environ.pop("GNNCOMPILE_DROPOUT_MASKS", None)
        b, p = statistics.median(got["torch"]), statistics.median(got["philox"])
        line = f"| {name} | {ranks} | {strategy} | {b * 1e3:.2f} ms | {p * 1e3:.2f} ms | {p / b:.2f} |"
        print(line, flush=True)
        out.append(line)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="kernel,steps", help="comma-separated: kernel, steps")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each plan with each generator")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of updating RESULTS.md")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    text = [f"{today()} · {machine_info(2)} · `{command_line()}`", ""]
    if "kernel" in parts:
        text += ["One mask of p = 0.5, float32; median of 20 calls after one warm-up:", "", kernel_table(), ""]
    if "steps" in parts:
        text += [f"Median training step (slowest rank; {args.epochs} epochs, the first two skipped, median of "
                 f"{args.repeats} runs per generator, the generators alternating), GCN-2 with dropout 0.5, "
                 "local gloo ranks on this machine's cores:", "", steps_table(args.epochs, args.repeats), ""]
    markdown = "\n".join(text)
    if args.no_write:
        print(markdown)
    else:
        update_section(HERE / "RESULTS.md", SECTION, markdown)
        print(f"wrote section {SECTION!r} of {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
