#!/usr/bin/env python
"""Graph bandwidth before and after reverse Cuthill–McKee, and MixGCN's pipeline granularity.

For every graph (``shared/datasets``, as :func:`gnncompile.datasets.load` gives them) measures, in
the dataset's own vertex order and after :func:`gnncompile.graph.reorder.rcm_order`:

- ``b/n``: the bandwidth ``b = max |src - dst|`` over the edges, relative to ``n`` vertices
  (MixGCN §3.2.2);
- ``p99 |src-dst|/n``: the 99th percentile of the same distance (``b`` is a maximum: one long edge
  sets it, while the pipeline mostly waits on the bulk);
- the minimum pipeline granularity ``(n - b) / 2n`` and the fewest pipeline batches ``s`` that make
  the fine-grain pipeline idle-free (Proposition 3.5: ``(n - b)/2n >= 1/s``); ``–`` when ``b`` is
  so close to ``n`` that ``s`` exceeds ``n`` (no useful pipeline);
- with ``--chunks`` contiguous chunks: the mean number of chunks a chunk's in-edges read and the
  pipeline lag (how many chunks ahead a chunk reads at most) — what the ``mop`` lowering's schedule
  depends on;
- the wall time of ``rcm_order`` (scipy, single-threaded).

Results go to a table on stdout and the "Node reordering (RCM) and pipeline granularity" section of
``benchmarks/RESULTS.md``.

Usage::

    python benchmarks/reorder.py
    python benchmarks/reorder.py --graphs cora,pubmed --chunks 8 --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

from gnncompile import datasets  # noqa: E402
from gnncompile.graph.reorder import bandwidth, min_granularity, permute, pipeline_batches, rcm_order  # noqa: E402
from gnncompile.passes.chunked import Chunking, chunk_bounds, chunk_reads  # noqa: E402

GRAPHS = ("cora", "citeseer", "pubmed", "coauthor_cs", "coauthor_physics", "amazon_computers", "amazon_photo",
          "squirrel", "chameleon", "tolokers", "facebook_pagepage", "soc_slashdot", "ego_twitter")
SECTION = "Node reordering (RCM) and pipeline granularity"


@dataclass
class Side:
    """Measurements of one vertex order."""

    b: int
    p99: float
    reads: float  # mean chunks read per chunk
    lag: int


@dataclass
class Row:
    graph: str
    nodes: int
    edges: int
    before: Side
    after: Side
    rcm_seconds: float


def measure_order(g, chunks: int) -> Side:
    d = (g.src - g.dst).abs().to(torch.float64)
    p99 = float(torch.quantile(d[torch.randperm(d.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]],
                               0.99)) if d.numel() else 0.0
    bounds = chunk_bounds(g.num_nodes, chunks)
    reads = chunk_reads(g, bounds)
    return Side(bandwidth(g), p99, sum(map(len, reads)) / len(reads), Chunking(bounds, reads).lag())


def measure(name: str, chunks: int) -> Row:
    g = datasets.load(name)
    t0 = time.perf_counter()
    order = rcm_order(g)
    seconds = time.perf_counter() - t0
    return Row(name, g.num_nodes, g.num_edges, measure_order(g, chunks), measure_order(permute(g, order), chunks),
               seconds)


def columns(chunks: int) -> list[str]:
    return ["graph", "V", "E", "b/n", "b/n RCM", "p99/n", "p99/n RCM", "(n-b)/2n", "(n-b)/2n RCM", "s", "s RCM",
            f"reads/chunk K={chunks}", f"reads RCM", "lag", "lag RCM", "RCM ms"]


def _s(n: int, b: int) -> str:
    s = pipeline_batches(n, b)
    return "–" if s is None or s > n else str(s)


def cells(r: Row) -> list[str]:
    n = r.nodes
    a, z = r.before, r.after
    return [r.graph, f"{n:,}", f"{r.edges:,}", f"{a.b / n:.3f}", f"{z.b / n:.3f}", f"{a.p99 / n:.3f}",
            f"{z.p99 / n:.3f}", f"{min_granularity(n, a.b):.4f}", f"{min_granularity(n, z.b):.4f}", _s(n, a.b),
            _s(n, z.b), f"{a.reads:.1f}", f"{z.reads:.1f}", str(a.lag), str(z.lag), f"{r.rcm_seconds * 1e3:.0f}"]


def print_table(rows: list[Row], chunks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Graph bandwidth and pipeline granularity, dataset order vs RCM")
    for i, col in enumerate(columns(chunks)):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*cells(r))
    Console(width=220).print(table)


def markdown(rows: list[Row], chunks: int, threads: int) -> str:
    cols = columns(chunks)
    lines = [
        f"- Date: {today()}",
        f"- Machine: {machine_info(threads)}",
        f"- Command: `{command_line()}`",
        "- b = max |src − dst| over the edges (MixGCN's graph bandwidth) in the dataset's vertex order and after "
        "reverse Cuthill–McKee (`scipy.sparse.csgraph.reverse_cuthill_mckee` on the symmetrized pattern, "
        "`gnncompile.graph.reorder.rcm_order`). p99 = 99th percentile of |src − dst| (over ≤1M sampled edges). "
        "(n−b)/2n = MixGCN's minimum pipeline granularity (Proposition 3.5); s = fewest pipeline batches with "
        "(n−b)/2n ≥ 1/s (idle-free fine-grain pipeline), '–' when s would exceed n. "
        f"reads/chunk = mean number of the K={chunks} contiguous chunks a chunk's in-edges read (the chunk itself "
        "included; K = every chunk); lag = how many chunks ahead a chunk reads at most (what the `mop` pipeline "
        "waits for). RCM ms = one `rcm_order` call.",
        "- Reading: in the datasets' own order b/n is 0.98–1.0 (some edge spans almost the whole id range), so "
        "Proposition 3.5 asks for hundreds to thousands of pipeline batches and every chunk reads every chunk. "
        "RCM brings b/n down to 0.12–0.76: s = 3–9 batches suffice, and p99 ≈ b after RCM (the bandwidth is not "
        "set by a few outliers). Citation graphs reorder best (CiteSeer 0.12, Cora 0.26); dense heterophilous "
        "and social graphs least (tolokers 0.76, squirrel 0.71). The `mop` planner schedules with the exact "
        "chunk reads, not with b.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|",
    ]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated dataset names (shared/datasets)")
    p.add_argument("--chunks", type=int, default=8, help="contiguous chunks for the reads/lag columns")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file whose section is updated")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    graphs = [s.strip() for s in args.graphs.split(",") if s.strip()]
    if not graphs or args.chunks < 1:
        p.error("--graphs must name at least one dataset and --chunks must be >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for name in graphs:
        rows.append(measure(name, args.chunks))
        print(f"  {name} done", flush=True)
    print_table(rows, args.chunks)
    if not args.no_write:
        update_section(args.out, SECTION, markdown(rows, args.chunks, args.threads))
        print(f"wrote section {SECTION!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
