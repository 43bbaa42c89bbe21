#!/usr/bin/env python
"""Checkpoint write time, resume time and size on disk: GCN on coauthor_physics over 4 ranks.

For each strategy in ``--strategies`` (default ``data,task,tensor,mop``): plans a 2-layer GCN (hidden
``--hidden``, default 64) on ``coauthor_physics`` for 4 ranks, trains ``--epochs`` epochs with
``checkpoint_every=--every`` (so several checkpoints are written), then resumes the last checkpoint
for ``--every`` more epochs. Reports, per strategy:

- write time: per checkpoint, the slowest rank's wall time of the collective write
  (``RankResult.checkpoint_time``: ``torch.distributed.checkpoint`` save into the staging directory,
  ``meta.json``/``plan.json``, rename, ``latest``); median over the checkpoints of the run;
- size: bytes of one ``epoch-N`` directory (the ``.distcp`` tensor files, ``.metadata``,
  ``meta.json`` with the history, ``plan.json``) and of ``best.pt``; with the parameter bytes
  (one copy of the model) for scale: a checkpoint holds parameters, Adam's two moments and step,
  the best-validation parameters, each rank's RNG state and stale chunks if any;
- resume time: the slowest rank's load (``RankResult.restore_time``);
- the median training step, for comparison.

Results go to a table on stdout and the "Checkpoints" section of ``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/checkpoint.py
    python benchmarks/checkpoint.py --strategies data --epochs 4 --no-write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

import gnncompile as gc  # noqa: E402

SECTION = "Checkpoints"
GRAPH = "coauthor_physics"
RANKS = 4


@dataclass
class Row:
    strategy: str
    write_s: float           # median over checkpoints of the slowest rank's write
    writes: int
    dir_bytes: int           # one epoch-N directory
    distcp_bytes: int        # of which tensor files
    best_bytes: int
    param_bytes: int
    resume_s: float          # slowest rank's load on resume
    step_s: float            # median training step


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(graph: gc.Graph, strategy: str, hidden: int, epochs: int, every: int, threads: int) -> Row:
    torch.manual_seed(0)
    model = gc.nn.GCN(graph.num_features, hidden, graph.num_classes, num_layers=2)
    plan = gc.plan(model, graph, gpus=RANKS, strategy=strategy)
    with tempfile.TemporaryDirectory(prefix="gnncompile-ckpt-bench-") as d:
        res = plan.run(epochs, checkpoint_dir=d, checkpoint_every=every, progress=False, threads_per_rank=threads,
                       timeout=600)
        writes = [max(r.checkpoint_time[i] for r in res.ranks) for i in range(len(res.ranks[0].checkpoint_time))]
        last = Path(d) / f"epoch-{epochs}"
        dir_bytes = _bytes(last)
        distcp = sum(f.stat().st_size for f in last.glob("*.distcp"))
        best = (Path(d) / "best.pt").stat().st_size
        resumed = plan.run(epochs + every, checkpoint_dir=d, resume=True, progress=False, threads_per_rank=threads,
                           timeout=600)
        resume_s = max(r.restore_time or 0.0 for r in resumed.ranks)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return Row(strategy, statistics.median(writes), len(writes), dir_bytes, distcp, best, params, resume_s,
               res.history.median_epoch_time())


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_table(rows: list[Row]) -> None:
    print(f"{'strategy':<9} {'write ms':>9} {'writes':>6} {'ckpt MiB':>9} {'distcp MiB':>10} {'best MiB':>9} "
          f"{'params MiB':>10} {'resume ms':>9} {'step ms':>8}")
    for r in rows:
        print(f"{r.strategy:<9} {r.write_s * 1e3:>9.1f} {r.writes:>6} {_mib(r.dir_bytes):>9} "
              f"{_mib(r.distcp_bytes):>10} "
              f"{_mib(r.best_bytes):>9} {_mib(r.param_bytes):>10} {r.resume_s * 1e3:>9.1f} {r.step_s * 1e3:>8.1f}")


def markdown(rows: list[Row], graph: gc.Graph, hidden: int, epochs: int, every: int, threads: int,
             loads: tuple[str, str]) -> str:
    lines = [
        f"- Date: {today()}",
        f"- Machine: {machine_info(threads)}; 1-min load average {loads[0]} at start, {loads[1]} at end",
        f"- Command: `{command_line()}`",
        f"- {GRAPH}: |V|={graph.num_nodes:,}, |E|={graph.num_edges:,}, {graph.num_features:,} features, "
        f"{graph.num_classes} classes; 2-layer GCN, hidden {hidden}, float32; {RANKS} ranks on the CPU (gloo), "
        f"{threads} thread(s) each; {epochs} epochs with a checkpoint every {every}, then a resume for {every} more.",
        "- write ms: per checkpoint, the slowest rank's wall time of the whole write (torch.distributed.checkpoint "
        "save into `.staging-epochN`, meta.json and plan.json, rename to `epoch-N`, `latest`), median over the "
        "run's checkpoints. ckpt MiB: one `epoch-N` directory; distcp MiB: its tensor files (parameters, Adam's "
        "moments and step, best-validation parameters, each rank's RNG state, stale chunks); the rest is "
        "`.metadata`, meta.json (history, fingerprint) and plan.json. params MiB: one copy of the model's "
        "parameters. resume ms: the slowest rank's load. step ms: median training step of the run.",
        "",
        "| strategy | write ms | checkpoints | ckpt MiB | distcp MiB | best.pt MiB | params MiB | resume ms "
        "| step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.strategy} | {r.write_s * 1e3:.1f} | {r.writes} | {_mib(r.dir_bytes)} | "
                     f"{_mib(r.distcp_bytes)} | {_mib(r.best_bytes)} | {_mib(r.param_bytes)} | "
                     f"{r.resume_s * 1e3:.1f} | {r.step_s * 1e3:.1f} |")
    return "\n".join(lines)


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="data,task,tensor,mop",
                   help="comma-separated strategies (default: data,task,tensor,mop)")
    p.add_argument("--hidden", type=int, default=64, help="GCN hidden width (default: 64)")
    p.add_argument("--epochs", type=int, default=10, help="epochs of the checkpointed run (default: 10)")
    p.add_argument("--every", type=int, default=2, help="checkpoint every this many epochs (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file whose section is updated")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or args.every < 1 or args.epochs < args.every:
        p.error("--strategies must name one strategy, --every >= 1 and --epochs >= --every")
    graph = gc.datasets.load(GRAPH)
    load_start = load_average()
    rows = []
    for s in strategies:
        t0 = time.perf_counter()
        rows.append(measure(graph, s, args.hidden, args.epochs, args.every, args.threads))
        print(f"  {s} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(rows)
    loads = (load_start, load_average())
    if not args.no_write:
        update_section(args.out, SECTION, markdown(rows, graph, args.hidden, args.epochs, args.every, args.threads,
                                                   loads))
        print(f"wrote section {SECTION!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
