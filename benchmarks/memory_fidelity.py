#!/usr/bin/env python
"""Memory predictions: the cost model's predicted activation peak per rank against the runtime's measurement.

For every strategy that plans full-graph training (``data`` with METIS, ``tensor``, ``mop``, ``task``,
``task`` decoupled with recomputation (relaxed), ``layer``), models GCN-2 and GraphSAGE-2 (hidden 64)
and GAT-2 (4 heads x 16), on cora, coauthor_physics and an R-MAT graph (65k vertices, degree 16), the
peak of one training step per rank as the runtime measures it (live tensor bytes allocated during the
first step: :class:`gnncompile.runtime.memory.PeakMemory`, not process RSS) beside the predicted peak
above what is resident before the step (graph, features, labels, parameters; the first step also
allocates the gradients and, in its optimizer step, Adam's moments: the prediction is the first
step's, :meth:`~gnncompile.cost_models.model.Prediction.first_step_peak_memory`). The table shows
the maximum over the ranks of both and their ratio (predicted / measured); the issue's target is a
ratio within [0.8, 1.2] for every row.

Usage::

    python benchmarks/memory_fidelity.py                       # all graphs, models and strategies
    python benchmarks/memory_fidelity.py --graphs cora --models GAT --strategies data,task --no-write
    python benchmarks/memory_fidelity.py --graphs cora --models GCN --strategies data --setups "layer history"

Beside the grid, :data:`SETUPS` runs other setups on cora (sampled mini-batches, a layer hybrid,
historical embeddings with and without chunk shuffling, cached and regrouped task dependencies, SGC
with a task group per rank, chunked tensor, chunked recomputation) and reports the rank farthest from
its prediction.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, machine_info, today, update_section  # noqa: E402

SECTION = "Memory predictions"
GRAPHS = ("cora", "coauthor_physics", "rmat")
MODELS = ("GCN", "SAGE", "GAT")
#: strategy label -> gc.plan keyword arguments
STRATEGIES: dict[str, dict[str, Any]] = {
    "data": {"strategy": "data", "partitioner": "metis"},
    "tensor": {"strategy": "tensor"},
    "mop": {"strategy": "mop"},
    "task": {"strategy": "task"},
    "task dec+rc": {"strategy": "task", "decouple": True, "recompute": True, "semantics": "relaxed"},
    "layer": {"strategy": "layer"},
}
#: setups outside the grid above, each with its own model and rank count, on cora: what a step makes
#: itself (a sampled step's inputs, a regrouped epoch's, the first step's history tables), a layer
#: hybrid's chunks, an identity dropout (SGC's, p = 0), the logits' concatenation and chunked
#: ``tensor``'s posted all-to-alls.
#: label (no commas: ``--setups`` lists them) -> (model, ranks, gc.plan keyword arguments; fanouts 5 and 5)
SETUPS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "split b256 f5x5": ("SAGE", 2, {"strategy": "split", "batch_size": 256, "fanouts": [5, 5]}),
    "data mini-batch b256 f5x5": ("SAGE", 2, {"strategy": "data", "batch_size": 256, "fanouts": [5, 5]}),
    "layer stages=2": ("GCNII-4", 4, {"strategy": "layer", "stages": 2}),
    "layer history": ("GCN-3", 2, {"strategy": "layer", "semantics": "relaxed", "history": True}),
    "task cached 4 chunks": ("GCN", 2, {"strategy": "task", "chunks": 4, "semantics": "relaxed",
                                         "dependencies": "cached"}),
    "task regrouped 2 chunks": ("GCN", 2, {"strategy": "task", "chunks": 2, "semantics": "relaxed",
                                            "dependencies": "regrouped"}),
    "task group per task": ("SGC", 4, {"strategy": "task"}),
    # posted gradient all-to-alls in flight while the next chunk's backward runs
    "tensor chunks=2": ("GCN", 4, {"strategy": "tensor", "chunks": 2}),
    "tensor chunks=4": ("GCN", 4, {"strategy": "tensor", "chunks": 4}),
    # chunk shuffling builds every epoch's inputs in its step; checkpointed segments' outputs
    "layer history shuffled": ("GCN-3", 2, {"strategy": "layer", "semantics": "relaxed", "history": True,
                                            "shuffle": True}),
    "layer recompute 24 chunks": ("GCN", 3, {"strategy": "layer", "recompute": True, "chunks": 24}),
    "task recompute 8 chunks": ("GCN", 3, {"strategy": "task", "recompute": True, "chunks": 8}),
}
MIB = 2 ** 20


def _graph(gc: Any, name: str) -> Any:
    if name == "rmat":
        return gc.datasets.synthetic("rmat", num_nodes=65_536, avg_degree=16, num_features=64, num_classes=8,
                                     seed=0)
    return gc.datasets.load(name).normalize_features()


def _model(gc: Any, kind: str, g: Any) -> Any:
    if kind == "GCN":
        return gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2, dropout=0.5)
    if kind == "SAGE":
        return gc.nn.GraphSAGE(g.num_features, 64, g.num_classes, num_layers=2, dropout=0.5)
    return gc.nn.GAT(g.num_features, 16, g.num_classes, heads=4, num_layers=2, dropout=0.5)


def _setup_model(gc: Any, kind: str, g: Any) -> Any:
    """The models of :data:`SETUPS` (hidden 64, no dropout but GCNII's default), as the issue ran them."""
    if kind == "SAGE":
        return gc.nn.GraphSAGE(g.num_features, 64, g.num_classes)
    if kind == "GCNII-4":
        return gc.nn.GCNII(g.num_features, 64, g.num_classes, num_layers=4)
    if kind == "GCN-3":
        return gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=3)
    if kind == "GCN":
        return gc.nn.GCN(g.num_features, 64, g.num_classes)
    return gc.nn.SGC(g.num_features, g.num_classes, K=2)


def measure_setups(gc: Any, torch: Any, labels: list[str]) -> list[str]:
    """One table row per setup of :data:`SETUPS` on cora (as loaded, not normalized): measured and
    predicted peak per rank, and the worst rank's ratio."""
    lines = ["| setup | model | ranks | measured peak/rank max | predicted peak/rank max | predicted / measured, "
             "worst rank | per rank measured (predicted), MiB |",
             "|---|---|---:|---:|---:|---:|---|"]
    g = gc.datasets.load("cora")
    for label in labels:
        kind, ranks, options = SETUPS[label]
        t0 = time.perf_counter()
        torch.manual_seed(0)
        plan = gc.plan(_setup_model(gc, kind, g), g, ranks, **options)
        res = plan.run(epochs=1, seed=0, timeout=900, progress=False)
        meas = [r.peak_memory for r in res.ranks]
        pred = plan.prediction.first_step_above_resident()
        worst = max((p / max(m, 1) for m, p in zip(meas, pred)), key=lambda x: abs(math.log(max(x, 1e-9))))
        per_rank = ", ".join(f"{m / MIB:.2f} ({p / MIB:.2f})" for m, p in zip(meas, pred))
        lines.append(f"| {label} | {kind} | {ranks} | {max(meas) / MIB:.2f} MiB | {max(pred) / MIB:.2f} MiB "
                     f"| {worst:.2f} | {per_rank} |")
        print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return lines


def measure(gc: Any, torch: Any, graphs: list[str], models: list[str], strategies: list[str],
            ranks: int) -> list[str]:
    """One table row per (graph, model, strategy): measured and predicted peak per rank, max over ranks."""
    lines = ["| graph | model | strategy | measured peak/rank max | predicted peak/rank max | predicted / measured "
             "| per rank measured (predicted), MiB |",
             "|---|---|---|---:|---:|---:|---|"]
    for gname in graphs:
        g = _graph(gc, gname)
        for kind in models:
            torch.manual_seed(0)
            model = _model(gc, kind, g)
            for label in strategies:
                t0 = time.perf_counter()
                try:
                    plan = gc.plan(copy.deepcopy(model), g, ranks, **STRATEGIES[label])
                except gc.PlanningError as e:  # the first candidate's reason, e.g. "cannot lower: ..."
                    why = str(e).splitlines()[0].split("cannot lower: ")[-1].split(";")[0]
                    lines.append(f"| {gname} | {kind}-2 | {label} | n/a | n/a | – | not planned: {why[:120]} |")
                    print(lines[-1], flush=True)
                    continue
                res = plan.run(epochs=1, timeout=900, progress=False)
                meas = [r.peak_memory for r in res.ranks]
                pred = plan.prediction.first_step_above_resident()
                per_rank = ", ".join(f"{m / MIB:.1f} ({p / MIB:.1f})" for m, p in zip(meas, pred))
                lines.append(f"| {gname} | {kind}-2 | {label} | {max(meas) / MIB:.1f} MiB | {max(pred) / MIB:.1f} MiB "
                             f"| {max(pred) / max(max(meas), 1):.2f} | {per_rank} |")
                print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default=",".join(GRAPHS), help=f"comma-separated, of {', '.join(GRAPHS)}")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES)}")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma-separated, of {', '.join(SETUPS)} (empty: none)")
    ap.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = ap.parse_args()
    picked = {"graphs": args.graphs.split(","), "models": args.models.split(","),
              "strategies": args.strategies.split(","), "setups": [s for s in args.setups.split(",") if s]}
    for what, known in (("graphs", GRAPHS), ("models", MODELS), ("strategies", tuple(STRATEGIES)),
                        ("setups", tuple(SETUPS))):
        bad = sorted(set(picked[what]) - set(known))
        if bad:
            ap.error(f"unknown {what} {bad}; known: {', '.join(known)}")

    import torch

    import gnncompile as gc

    t0 = time.perf_counter()
    rows = measure(gc, torch, picked["graphs"], picked["models"], picked["strategies"], args.ranks)
    setups = measure_setups(gc, torch, picked["setups"]) if picked["setups"] else []
    text = "\n".join([
        f"{today()} · {machine_info(torch.get_num_threads())} · `{command_line()}` · "
        f"{time.perf_counter() - t0:.0f} s", "",
        f"Peak tensor memory of one training step per rank on {args.ranks} local ranks (gloo), measured by the "
        "runtime (live tensor bytes allocated during the first step, not RSS), and the cost model's predicted peak "
        "above the resident graph, features, labels and parameters (both count the gradients and Adam's moments "
        "the first step allocates). GCN-2 and GraphSAGE-2 hidden 64, GAT-2 4 heads x 16, dropout 0.5; the R-MAT "
        "graph has 65,536 vertices, average degree 16, 64 features. Target: predicted / measured in [0.8, 1.2].",
        "", *rows, "",
        "The runtime builds the graphs' derived structures (kernel handles, the transposed structure, edge "
        "destinations, normalization scales: resident topology, `RankResult.topology_bytes`, equal to the cost "
        "model's) before the first step (`frontend.ops.prepare_graph`), so they are not in these peaks. The weight "
        "gradient of a linear layer on sparse input features is scattered from the features' own structure on "
        "the CPU (no transposition is built or kept). A linear layer (or propagation) that saves the output of a "
        "replicated dropout whose input is held anyway (relu's output, the features, a softmax's) keeps that input "
        "and the dropout's bool mask instead and computes the output again in backward "
        "(`frontend.ops.replay_dropout_outputs`); every strategy frees a value after its last use. Adam is torch's "
        "fused implementation (`runtime.trainer.adam`: no parameter-sized temporaries). Inside a stage the model "
        "follows what each op reads (`OpCost.reads`): which outputs a forward still holds, which gradients a "
        "backward accumulates. GAT's attention is one fused op (`ops.edge_attention`: it saves the coefficients and "
        "the per-vertex scores, not the pre-activations); its multi-head propagation returns a tensor of its own "
        "(no view), so `Free` releases it as a stage output, and a pulled backward frees the permuted edge values "
        "before it makes their gradient.", "",
        *([f"Other setups on cora (as loaded), each with its own model (hidden 64) and rank count, measured and "
           "predicted alike; the ratio is the rank farthest from 1. What a step makes for itself is above the "
           "resident data and counted: a sampled step's blocks, feature rows and labels (sampled and gathered in "
           "it; an epoch of several steps samples the next step's while it holds this one's), a regrouped epoch's "
           "graph slices, feature rows, labels and vertex order (beside the program's own, which evaluation keeps), "
           "the first step's history tables (made by its first stale read, where it keeps copies), and a stale "
           "read's concatenation of every chunk it reads, fresh or from the history. A `layer` hybrid's group "
           "member runs its partition's chunks only (half of them with `stages=2` on 4 ranks), so a chunk's rows "
           "are its rows over those. SGC's input dropout (p = 0) returns `x` itself, and a rank that scores the "
           "output concatenates its chunks' logits when the step ends. Chunked `tensor` posts its all-to-alls: "
           "the next chunk's backward runs while a gradient exchange is in flight, holding its send buffer and "
           "result but not the gradient it sent nor the per-peer copies, which the rank drops as it posts (it was "
           "predicted at 1.13x with 2 chunks when the model held them to the transfer's end). With chunk shuffling a "
           "`layer` step builds its epoch's graph slices, feature rows and labels, as regrouped `task` dependencies "
           "do (predicted at half the measured peak before). A checkpointed segment's value is what its body "
           "returns, and each checkpointed call keeps the CPU generator's state (5 KB, per segment and chunk: 24 "
           "chunks of recomputation measured 5.5x their prediction before).", "", *setups, ""] if setups else [])])
    print(text)
    if not args.no_write:
        update_section(HERE / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
