#!/usr/bin/env python
"""Planning time: how long ``gc.plan(model, graph, gpus)`` takes (the whole search: tracing, every
candidate lowered, costed and simulated, the winner verified) for small graphs, where it is what a
user waits for before the first step and what every test that plans pays.

Each case is planned once to warm up, then ``--repeat`` times; the median is reported. With
``--baseline DIR`` the same cases also run against the gnncompile of another checkout (``DIR`` on
``PYTHONPATH``), the two alternated round by round in fresh processes, so a before/after pair shares
the machine's state.

Usage::

    python benchmarks/planning.py
    python benchmarks/planning.py --baseline /tmp/old --rounds 3 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import command_line, machine_info, today, update_section  # noqa: E402

SECTION = "Planning time"

#: name -> (graph, model, gpus)
CASES = {
    "sbm-40, GCN 2 layers, 4 ranks": ("sbm40", "gcn", 4),
    "sbm-40, GAT 2 layers x 2 heads, 4 ranks": ("sbm40", "gat", 4),
    "cora, GCN 2 layers, 4 ranks": ("cora", "gcn", 4),
    "cora, GCNII 8 layers, 4 ranks": ("cora", "gcnii", 4),
    "ogbn-papers100M statistics, GCN 3 layers, 8x8xA100-ib200": ("papers100M", "gcn3", "8x8xA100-ib200"),
}


def _measure(names: list[str], repeat: int) -> dict[str, float]:
    """Median seconds of ``gc.plan`` per case, in this process."""
    import torch

    import gnncompile as gc

    graphs = {}

    def graph(key: str):
        if key not in graphs:
            if key == "sbm40":
                graphs[key] = gc.datasets.synthetic("sbm", num_nodes=40, avg_degree=4, num_features=6, num_classes=3,
                                                    seed=1)
            elif key == "papers100M":
                graphs[key] = gc.datasets.stats("ogbn-papers100M")
            else:
                graphs[key] = gc.datasets.load(key)
        return graphs[key]

    def model(key: str, g):
        torch.manual_seed(0)
        if key == "gcn":
            return gc.nn.GCN(g.num_features, 16, g.num_classes, num_layers=2, dropout=0.0)
        if key == "gcn3":
            return gc.nn.GCN(g.num_features, 128, g.num_classes, num_layers=3)
        if key == "gat":
            return gc.nn.GAT(g.num_features, 8, g.num_classes, num_layers=2, heads=2, dropout=0.0)
        return gc.nn.GCNII(g.num_features, 16, g.num_classes, num_layers=8)

    out = {}
    for name in names:
        gkey, mkey, gpus = CASES[name]
        g = graph(gkey)
        m = model(mkey, g)
        gc.plan(m, g, gpus)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            gc.plan(m, g, gpus)
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    return out


def _child(path: str, names: list[str], repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, __file__, "--child", "--repeat", str(repeat), "--cases", *names],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"planning with {path} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    ap.add_argument("--repeat", type=int, default=5, help="plans per case and round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each a fresh process per checkout")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to compare with (its root directory)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args.cases, args.repeat)))
        return
    here = str(HERE.parent)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for r in range(args.rounds):
        if args.baseline:
            runs["baseline"].append(_child(args.baseline, args.cases, args.repeat))
        runs["this"].append(_child(here, args.cases, args.repeat))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def med(which: str, name: str) -> float:
        return statistics.median(run[name] for run in runs[which])

    head = "| case | this checkout |" + (" baseline | speed-up |" if args.baseline else "")
    rule = "|---|---:|" + ("---:|---:|" if args.baseline else "")
    rows = []
    for name in args.cases:
        row = f"| {name} | {med('this', name) * 1e3:.0f} ms |"
        if args.baseline:
            b = med("baseline", name)
            row += f" {b * 1e3:.0f} ms | {b / med('this', name):.2f}x |"
        rows.append(row)
    table = "\n".join([head, rule, *rows])
    if args.baseline:
        rev = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or args.baseline
        table += f"\n\nbaseline: commit {rev}"
    print(table)
    if args.no_write:
        return
    import torch

    text = (f"`{command_line()}` on {machine_info(torch.get_num_threads())}, {today()}: median over {args.rounds} rounds (fresh processes"
            f"{', alternated with the baseline' if args.baseline else ''}) of each round's median of {args.repeat} "
            f"plans after one warm-up.\n\n{table}\n")
    update_section(HERE / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
