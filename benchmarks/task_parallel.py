#!/usr/bin/env python
"""Task parallelism (`task`, NeutronTask) vs graph parallelism (`data`): memory, bytes, accuracy, pipeline.

Part 1, memory: measured peak tensor memory per rank of one training step (the runtime's live
tensor accounting) for `data` (METIS), `task`, and `task` with task-decoupled training and
recomputation (NeutronTask's memory configuration, relaxed) on 4 local ranks, with the cost model's
predicted peak beside it; GCN and GAT with 2 and 4 layers on coauthor_physics and an RMAT graph.
NeutronTask (§6, 4xA5000) reports 49-67% less total memory than data parallelism.

Part 2, traffic: total bytes per step of both plans (measured = predicted, checked here).

Part 2b, chunks: task-decoupled + recomputation on GCN-4 for 4 to 32 chunks against `data`: the
peak per rank falls with the chunk size (a T rank recomputes one chunk's activations at a time).

Part 3, accuracy: GCN trained 200 epochs with `gc.train` and with a 4-rank `task` plan (4 chunks)
from the same weights, seed and replicated dropout masks, on cora and coauthor_physics; and the
relaxed plans of NeutronTask's vertex dependency management: `dependencies="regrouped"`
(Algorithm 1: 8 chunks shuffled into 4 subgraphs every epoch, in-edges from later subgraphs
skipped), `"skip-later"` (the same skipping in one fixed chunk order) and `"cached"` (later chunks
read from the previous step's copy), with their gaps.

Part 4, pipeline: the predicted step and bubble fraction of a 4-rank `task` plan of coauthor_physics
on 4xA5000 for 1, 4 and 8 chunks (the chunk pipeline of NeutronTask Fig. 5c), exact and regrouped.

Usage::

    python benchmarks/task_parallel.py                 # all parts
    python benchmarks/task_parallel.py --seeds 1 --no-write
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


def _graphs(gc):
    return {"coauthor_physics": gc.datasets.load("coauthor_physics").normalize_features(),
            "rmat (65k, deg 16)": gc.datasets.synthetic("rmat", num_nodes=65_536, avg_degree=16, num_features=64,
                                                        num_classes=8, seed=0)}


def _model(gc, kind: str, layers: int, g):
    if kind == "GCN":
        return gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=layers, dropout=0.5)
    return gc.nn.GAT(g.num_features, 16, g.num_classes, heads=4, num_layers=layers, dropout=0.5)


def memory(gc, torch, ranks: int) -> list[str]:
    lines = ["| graph | model | data peak/rank max (pred) | data total (pred) | task peak/rank max (pred) | "
             "task total (pred) | task total / data total | task dec+rc peak/rank max (pred) | "
             "task dec+rc total (pred) | dec+rc total / data total | data bytes/step | task bytes/step | task regime |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    mib = 2 ** 20
    for name, g in _graphs(gc).items():
        for kind in ("GCN", "GAT"):
            for layers in (2, 4):
                torch.manual_seed(0)
                model = _model(gc, kind, layers, g)
                out = {}
                for strategy in ("data", "task"):
                    kw = {"partitioner": "metis"} if strategy == "data" else {}
                    plan = gc.plan(copy.deepcopy(model), g, ranks, strategy=strategy, **kw)
                    res = plan.run(epochs=1, timeout=600)
                    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"], strategy
                    act = plan.prediction.first_step_above_resident()
                    out[strategy] = (plan, [r.peak_memory for r in res.ranks], act)
                (dp, dm, da), (tp, tm, ta) = out["data"], out["task"]
                try:  # NeutronTask's memory configuration: task-decoupled training with recomputation
                    dec = gc.plan(copy.deepcopy(model), g, ranks, strategy="task", decouple=True, recompute=True,
                                  semantics="relaxed", chunks=DEC_CHUNKS)
                    dres = dec.run(epochs=1, timeout=600)
                    dmeas, dpred = [r.peak_memory for r in dres.ranks], dec.prediction.first_step_above_resident()
                    dec_cells = (f"{max(dmeas) / mib:.0f} MiB ({max(dpred) / mib:.0f}) | {sum(dmeas) / mib:.0f} MiB "
                                 f"({sum(dpred) / mib:.0f}) | {sum(dmeas) / sum(dm):.2f}")
                except gc.PlanningError as e:  # e.g. a decoupled GAT's attention would cross tasks
                    why = "edge values cross tasks" if "edge values" in str(e) else str(e).splitlines()[0][-60:]
                    dec_cells = f"n/a ({why}) | – | –"
                lines.append(
                    f"| {name} | {kind}-{layers} | {max(dm) / mib:.0f} MiB ({max(da) / mib:.0f}) "
                    f"| {sum(dm) / mib:.0f} MiB ({sum(da) / mib:.0f}) "
                    f"| {max(tm) / mib:.0f} MiB ({max(ta) / mib:.0f}) | "
                    f"{sum(tm) / mib:.0f} MiB ({sum(ta) / mib:.0f}) | {sum(tm) / sum(dm):.2f} | {dec_cells} | "
                    f"{sum(dp.predictions['bytes_sent']) / mib:.1f} MiB | {sum(tp.predictions['bytes_sent']) / mib:.1f} MiB"
                    f" | {tp.info['regime']}: {', '.join(f'{k}→{v}' for k, v in tp.info['groups'].items())} |")
                print(lines[-1], flush=True)
    return lines


def chunks(gc, torch, ranks: int) -> list[str]:
    """Task-decoupled + recomputation (GCN-4) by chunk count against `data`: peak per rank and in
    total, measured (predicted), and the measured step time."""
    lines = ["| graph | plan | chunks | peak/rank max (pred) | total (pred) | max / data max | total / data total | "
             "step ms (measured) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    mib = 2 ** 20
    for name, g in _graphs(gc).items():
        torch.manual_seed(0)
        model = _model(gc, "GCN", 4, g)
        base = None
        for k in (None, 4, 8, 16, 32):
            if k is None:
                plan = gc.plan(copy.deepcopy(model), g, ranks, strategy="data", partitioner="metis")
            else:
                plan = gc.plan(copy.deepcopy(model), g, ranks, strategy="task", decouple=True, recompute=True,
                               semantics="relaxed", chunks=k)
            res = plan.run(epochs=3, timeout=600)
            meas, pred = [r.peak_memory for r in res.ranks], plan.prediction.first_step_above_resident()
            if base is None:
                base = (max(meas), sum(meas))
            step = res.history.median_epoch_time() * 1e3
            lines.append(f"| {name} | {'data (metis)' if k is None else 'task dec+rc'} | {k or '–'} | "
                         f"{max(meas) / mib:.1f} MiB ({max(pred) / mib:.1f}) | {sum(meas) / mib:.1f} MiB "
                         f"({sum(pred) / mib:.1f}) | {max(meas) / base[0]:.2f} | {sum(meas) / base[1]:.2f} | "
                         f"{step:.0f} |")
            print(lines[-1], flush=True)
    return lines


def accuracy(gc, torch, seeds: int, epochs: int) -> list[str]:
    relaxed = ("regrouped", "skip-later", "cached")
    lines = ["| dataset | single-device acc | task x4 acc | Δ (points) | "
             + " | ".join(f"task x4 {d} acc (relaxed) | Δ (points)" for d in relaxed)
             + " | single ms/epoch | task x4 ms/epoch | task x4 regrouped ms/epoch |",
             "|---|" + "---:|" * (3 + 2 * len(relaxed) + 3)]
    fit = dict(lr=0.01, weight_decay=5e-4)
    for name in ("cora", "coauthor_physics"):
        graph = gc.datasets.load(name).normalize_features()
        ref, ref_t = [], []
        acc: dict[str, list[float]] = {d: [] for d in ("exact", *relaxed)}
        times: dict[str, list[float]] = {d: [] for d in ("exact", *relaxed)}
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = gc.nn.GCN(graph.num_features, HIDDEN[name], graph.num_classes, num_layers=2, dropout=0.5)
            h = gc.train(copy.deepcopy(model), graph, epochs=epochs, seed=seed, verbose=False, **fit)
            ref.append(h.test_acc_at_best_val)
            ref_t.append(h.median_epoch_time())
            for dep in acc:
                plan = gc.plan(copy.deepcopy(model), graph, 4, strategy="task", chunks=4, dependencies=dep,
                               semantics="exact" if dep == "exact" else "relaxed")
                res = plan.run(epochs=epochs, seed=seed, timeout=900, **fit)
                acc[dep].append(res.history.test_acc_at_best_val)
                times[dep].append(res.history.median_epoch_time())
            print(f"{name} seed {seed}: single {ref[-1]:.4f}, "
                  + ", ".join(f"{d} {v[-1]:.4f}" for d, v in acc.items()), flush=True)

        def cells(dep: str) -> str:
            return f"{statistics.mean(acc[dep]):.4f} | {100 * statistics.mean(p - r for p, r in zip(acc[dep], ref)):+.2f}"
        lines.append(f"| {name} | {statistics.mean(ref):.4f} | {cells('exact')} | "
                     + " | ".join(cells(d) for d in relaxed)
                     + f" | {statistics.median(ref_t) * 1e3:.1f} | {statistics.median(times['exact']) * 1e3:.1f} | "
                     f"{statistics.median(times['regrouped']) * 1e3:.1f} |")
    return lines


def pipeline(gc, torch) -> list[str]:
    g = gc.datasets.load("coauthor_physics").normalize_features()
    torch.manual_seed(0)
    model = gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2, dropout=0.5)
    lines = ["| chunks | predicted step | bubble | regrouped (relaxed): predicted step | bubble | groups |",
             "|---:|---:|---:|---:|---:|---|"]
    for k in (1, 4, 8):
        plan = gc.plan(copy.deepcopy(model), g, "4xA5000", strategy="task", chunks=k)
        sim = plan.prediction.simulation
        rg = gc.plan(copy.deepcopy(model), g, "4xA5000", strategy="task", chunks=k, dependencies="regrouped",
                     semantics="relaxed").prediction.simulation
        lines.append(f"| {k} | {sim.step_time * 1e3:.2f} ms | {100 * sim.bubble_fraction:.0f}% | "
                     f"{rg.step_time * 1e3:.2f} ms | {100 * rg.bubble_fraction:.0f}% | "
                     f"{', '.join(f'{a}→{b}' for a, b in plan.info['groups'].items())} |")
        print(lines[-1], flush=True)
        if k == 4:
            plan.timeline(HERE / TIMELINE)
            drawn = f"{100 * sim.bubble_fraction:.0f}%"
    lines += ["", f"![predicted 4-chunk task pipeline]({TIMELINE}) `{TIMELINE}`: the predicted step of the "
                  f"exact 4-chunk plan (bubble {drawn}: the first propagation reads every chunk, so it starts after "
                  "the last one arrived; regrouped, subgraph j reads subgraphs 0..j only)."]
    return lines


PARTS = ("memory", "chunks", "accuracy", "pipeline")
#: chunks of the task-decoupled + recomputation plans of the memory table (the chunks part varies them)
DEC_CHUNKS = 16
TIMELINE = "task_pipeline_timeline.png"
SECTION = "Task strategy (NeutronTask) vs data: memory, bytes, accuracy"


def _section_text(path: Path) -> str:
    """This script's current section of ``path`` ('' when absent)."""
    if not path.exists():
        return ""
    text = path.read_text()
    start = text.find(f"## {SECTION}\n")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _old_block(section: str, prefix: str) -> list[str] | None:
    """The paragraph of ``section`` starting with ``prefix``, the table after it and a figure line
    right below the table, as lines."""
    lines = section.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(prefix)), None)
    if start is None:
        return None
    out, i = [lines[start], ""], start + 1
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    while i < len(lines) and lines[i].startswith("|"):
        out.append(lines[i])
        i += 1
    if i + 1 < len(lines) and lines[i + 1].startswith("!["):  # a figure under the table
        out += ["", lines[i + 1]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run ({', '.join(PARTS)}); the others keep their tables from "
                         "RESULTS.md")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")

    import torch

    import gnncompile as gc

    old = _section_text(HERE / "RESULTS.md")
    intro = {
        "memory": f"Peak tensor memory of one training step on {args.ranks} local ranks, measured by the runtime (the "
                  "cost model's predicted peak above the resident graph, features and parameters in parentheses: the "
                  "first step also allocates the gradients and Adam's moments), and total bytes per step (measured = "
                  f"predicted). GCN hidden 64, GAT 4 heads x 16, dropout 0.5; task dec+rc with {DEC_CHUNKS} chunks "
                  "(the plain task plans with the default, 4):",
        "chunks": f"Task-decoupled + recomputation by chunk count, GCN-4 hidden 64 on {args.ranks} local ranks: peak "
                  "tensor memory of the first training step per rank (largest) and summed over the ranks, measured "
                  "(predicted), against `data`; step time: median of epochs 2-3 (the ranks share 2 cores):",
        "accuracy": f"GCN (2 layers, dropout 0.5, Adam lr 0.01, wd 5e-4), {args.epochs} epochs, mean over {args.seeds} "
                    "seed(s) of test accuracy at best validation; same initial weights, seed and dropout masks:",
        "pipeline": "Predicted step of a 4-rank task plan on 4xA5000 (coauthor_physics, GCN 2x64) by chunk count:",
    }
    run = {"memory": lambda: memory(gc, torch, args.ranks), "chunks": lambda: chunks(gc, torch, args.ranks),
           "accuracy": lambda: accuracy(gc, torch, args.seeds, args.epochs),
           "pipeline": lambda: pipeline(gc, torch)}
    blocks = []
    for part in PARTS:
        if part in parts:
            blocks += [intro[part], "", *run[part](), ""]
        else:
            kept = _old_block(old, intro[part][:20])
            if kept is None:
                raise SystemExit(f"RESULTS.md has no {part} table to keep; run --parts {part}")
            blocks += [*kept, ""]
    text = "\n".join([
        f"{today()} · {machine_info(torch.get_num_threads())} · `{command_line()}`"
        + ("" if parts == set(PARTS) else " (the other parts' tables are kept from the previous run)"), "",
        *blocks,
        "The ranks are processes sharing this machine's 2 cores (gloo over loopback): epoch times measure the "
        "runtime's overheads, not a speed-up.",
    ])
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
