#!/usr/bin/env python
"""Topology bytes per edge: what the training graph holds, measured, against the cost model.

Part 1, single device (in-process): a model runs one forward and backward on the training graph
(:meth:`gnncompile.Graph.compact` with float32 scales, as ``gc.train`` holds it, where the checkout
has it; the graph itself otherwise), then every
tensor reachable from the graph's structure, weights and caches (kernel handles included; node
features, labels and masks excluded) is counted once per storage. The same walker runs on any
checkout, so ``--json FILE`` run at an older commit gives the "before" column (``--before FILE``).

Part 2, plans on 4 local ranks (this checkout only): each rank reports the bytes its graph inputs
hold after the first training step (``RankResult.topology_bytes``); beside it the cost model's
``static_memory(...).topology`` of that rank. Bytes per edge divide by the rank's edges.

Both parts measure each graph twice where the checkout can: with backward products that pull
through a held transpose (``backward="transposed"``, the default) and with products that scatter
from the forward CSR (``backward="push"``: no transposed copy of a directed graph or of a rank's
partition or chunk).

Usage::

    python benchmarks/topology_bytes.py                      # both parts, writes RESULTS.md
    python benchmarks/topology_bytes.py --part single --json /tmp/before.json --no-write
    python benchmarks/topology_bytes.py --before /tmp/before.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

NODE_DATA = {"x", "y", "train_mask", "val_mask", "test_mask"}


def held_bytes(graph) -> int:
    """Bytes of every tensor reachable from ``graph`` except its node data, each storage once."""
    import torch

    seen: set[tuple[int, int]] = set()
    visited: set[int] = set()
    total = 0

    def walk(v) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                return
            st = v.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
            return
        if v is None or isinstance(v, (bool, int, float, str)) or id(v) in visited:
            return
        visited.add(id(v))
        if isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif hasattr(v, "__dict__"):
            for k, item in vars(v).items():
                if k not in NODE_DATA:
                    walk(item)

    walk(graph)
    return total


def _graphs(gc):
    import torch

    slash = gc.datasets.load("soc_slashdot", symmetrize=False)  # no node data: random features and labels
    gen = torch.Generator().manual_seed(0)
    slash = slash.replace(x=torch.randn(slash.num_nodes, 64, generator=gen),
                          y=torch.randint(0, 8, (slash.num_nodes,), generator=gen),
                          train_mask=torch.rand(slash.num_nodes, generator=gen) < 0.5, num_classes=8)
    return {"coauthor_physics (symmetric)": gc.datasets.load("coauthor_physics").normalize_features(),
            "soc_slashdot (directed)": slash,
            "rmat 65k (symmetric)": gc.datasets.synthetic("rmat", num_nodes=65_536, avg_degree=16, num_features=64,
                                                          num_classes=8, seed=0)}


def _model(gc, kind: str, g):
    if kind == "GCN":
        return gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2)
    return gc.nn.GAT(g.num_features, 16, g.num_classes, heads=4, num_layers=2)


def _modes(gc) -> tuple[str, ...]:
    """The backward products this checkout has (``push`` since issue 22)."""
    return tuple(getattr(gc.ops, "BACKWARD_PRODUCTS", ("transposed",)))


def single(gc, torch) -> dict[str, dict[str, float]]:
    """Bytes per edge the single-device training graph holds after one forward and backward, per
    backward product (keys ``graph | model`` for the default, ``graph | model | push``)."""
    out: dict[str, dict[str, float]] = {}
    for name, g in _graphs(gc).items():
        for kind in ("GCN", "GAT"):
            for mode in _modes(gc):
                torch.manual_seed(0)
                train_graph = g.compact() if hasattr(g, "compact") else g
                train_graph._cache = {}
                if hasattr(train_graph, "cast_scales"):  # as gc.train does: scales in the model's dtype
                    train_graph.cast_scales(torch.float32)
                if mode != "transposed":
                    gc.ops.set_backward_product(train_graph, mode)
                model = _model(gc, kind, g)
                model(train_graph, g.x).sum().backward()
                b = held_bytes(train_graph)
                key = f"{name} | {kind}" + ("" if mode == "transposed" else f" | {mode}")
                out[key] = {"bytes": b, "edges": g.num_edges, "per_edge": b / g.num_edges}
    return out


def single_table(now: dict, before: dict | None) -> list[str]:
    head = "| graph | model | edges | held now | bytes/edge now |"
    rule = "|---|---|---:|---:|---:|"
    if before:
        head += " bytes/edge before | before / now |"
        rule += "---:|---:|"
    push = any(k.endswith(" | push") for k in now)
    if push:
        head += " held, push | bytes/edge, push |"
        rule += "---:|---:|"
    lines = [head, rule]
    for key, r in now.items():
        if key.endswith(" | push"):
            continue
        graph, model = key.split(" | ")
        row = f"| {graph} | {model} | {r['edges']:,} | {r['bytes'] / 2**20:.1f} MiB | {r['per_edge']:.1f} |"
        if before:
            b = before.get(key)
            row += f" {b['per_edge']:.1f} | {b['per_edge'] / r['per_edge']:.1f}x |" if b else " – | – |"
        if push:
            p = now[key + " | push"]
            row += f" {p['bytes'] / 2**20:.1f} MiB | {p['per_edge']:.1f} |"
        lines.append(row)
    return lines


def plans(gc, torch, ranks: int) -> list[str]:
    """Measured and predicted topology bytes per rank of each strategy's plan."""
    from gnncompile.cost_models.model import static_memory

    lines = ["| graph | model | strategy | rank edges (max) | measured/rank max | bytes/edge measured | "
             "predicted/rank max | bytes/edge predicted | predicted / measured |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, g in _graphs(gc).items():
        for kind in ("GCN", "GAT"):
            for (strategy, n), mode in itertools.product(
                    (("data", 1), ("data", ranks), ("tensor", ranks), ("mop", ranks), ("task", ranks)), _modes(gc)):
                torch.manual_seed(0)
                model = _model(gc, kind, g)
                try:
                    plan = gc.plan(copy.deepcopy(model), g, n, strategy=strategy, backward=mode)
                except gc.PlanningError as e:
                    lines.append(f"| {name} | {kind} | {strategy} x{n}, {mode} | not planned: {str(e).splitlines()[0][:80]} "
                                 "| | | | | |")
                    continue
                res = plan.run(epochs=1, timeout=600)
                measured = [r.topology_bytes for r in sorted(res.ranks, key=lambda r: r.rank)]
                predicted = [static_memory(plan, dp).topology for dp in plan.ranks]
                edges = [dp.sizes.edges for dp in plan.ranks]
                r = max(range(len(measured)), key=lambda i: measured[i])
                label = f"{strategy} x{n}" + (f" ({plan.options.get('chunks')} chunks)"
                                              if plan.options.get("chunks") else "") + f", {mode}"
                lines.append(
                    f"| {name} | {kind} | {label} | {max(edges):,} | {measured[r] / 2**20:.1f} MiB | "
                    f"{measured[r] / max(edges[r], 1):.1f} | {max(predicted) / 2**20:.1f} MiB | "
                    f"{predicted[r] / max(edges[r], 1):.1f} | {predicted[r] / max(measured[r], 1):.2f} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["all", "single", "plans"], default="all")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--json", help="write part 1's measurements to this file")
    ap.add_argument("--before", help="part 1's measurements of an older checkout (--json output)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    import torch

    import gnncompile as gc

    torch.set_num_threads(2)
    t0 = time.time()
    md = [f"{today()} · {machine_info(2)} · `{command_line()}`", ""]
    if args.part in ("all", "single"):
        now = single(gc, torch)
        if args.json:
            Path(args.json).write_text(json.dumps(now, indent=1))
        before = json.loads(Path(args.before).read_text()) if args.before else None
        table = single_table(now, before)
        print("\n".join(table))
        md += ["### One device: bytes per edge the training graph holds after one step", "",
               "Measured in-process: every tensor reachable from the training graph's structure, weights and "
               "caches (kernel handles included; features, labels and masks not), each storage once, after one "
               "forward and backward of the model (GCN 2x64, GAT 2 layers 4x16); \"push\": the same graph with "
               "backward products scattered from its forward CSR (`gc.ops.set_backward_product`)."
               + (f" Before: the same script at an older commit (`--json`, given here with `--before "
                  f"{args.before}`)." if before else ""), "", *table, ""]
    if args.part in ("all", "plans"):
        table = plans(gc, torch, args.ranks)
        md += [f"### Plans on {args.ranks} local ranks: measured against predicted", "",
               "Measured: `RankResult.topology_bytes` (the rank's graph inputs after its first training step, "
               ":meth:`Graph.structure_bytes`). Predicted: the cost model's `static_memory(plan, rank).topology`. "
               "Both for the rank holding the most; bytes per edge divide by that rank's edges.", "", *table, ""]
    md.append(f"({time.time() - t0:.0f} s)")
    if not args.no_write:
        update_section(HERE / "RESULTS.md", "Topology bytes per edge", "\n".join(md))


if __name__ == "__main__":
    main()
