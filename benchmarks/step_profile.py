#!/usr/bin/env python
"""Where one training step's time goes: torch.profiler over steady-state steps, per kernel.

For each (model, graph) cell of ``benchmarks/epoch_time.py`` (same graphs and models), profiles
``--steps`` steps after ``--warmup`` untimed ones of

* ``gnncompile-train``: :func:`gnncompile.train` itself (its Philox dropout masks, fused Adam), the
  profiler started and stopped by a probe (:mod:`gnncompile.runtime.probe`) around its steps;
* ``pyg-edge_index``: PyG's layers on ``edge_index`` in a plain loop (torch's dropout, Adam),

and prints, per cell, the wall time per step, the device (CUDA kernel) time per step, the number
of kernel launches per step, and the ``--top`` operators by device time (on the CPU: by CPU time).
Device time well under wall time means the step waits on the host (launches, synchronizations).

Usage::

    python benchmarks/step_profile.py --device cuda --graphs cora rmat --models gcn gat
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from epoch_time import MODELS, _load, _pyg_model  # noqa: E402

SYSTEMS = ("gnncompile-train", "pyg-edge_index")


def _gnncompile_steps(model: str, g: Any, device: Any, warmup: int, steps: int, prof: Any) -> float:
    """Profiles steps [warmup, warmup + steps) of gc.train; returns their wall time per step."""
    import torch

    import gnncompile as gc
    from gnncompile.runtime.probe import probing

    if model == "gat":
        net = gc.nn.GAT(g.num_features, 64, g.num_classes, num_layers=2, heads=4, dropout=0.5)
    else:
        net = gc.nn.build_model(model, g.num_features, 256, g.num_classes, num_layers=2, dropout=0.5)
    wall: list[float] = []

    @contextlib.contextmanager
    def step_probe(phase: str, epoch: int) -> Iterator[None]:
        active = phase == "step" and warmup <= epoch < warmup + steps
        if active:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if epoch == warmup:
                prof.start()
            t0 = time.perf_counter()
        yield
        if active:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall.append(time.perf_counter() - t0)
            if epoch == warmup + steps - 1:
                prof.stop()

    with probing(step_probe):
        gc.train(net, g, epochs=warmup + steps, lr=0.01, weight_decay=5e-4, device=device, eval_every=10**9,
                 verbose=False)
    return sum(wall) / len(wall)


def _pyg_steps(model: str, g: Any, device: Any, warmup: int, steps: int, prof: Any) -> float:
    import torch
    import torch.nn.functional as F

    g = g.to(device)
    net = _pyg_model(model, g.num_features, g.num_classes).to(device)
    x = g.x
    edge_index = torch.stack([g.indices, g.dst])  # as benchmarks/epoch_time.py feeds PyG
    if x.layout != torch.strided:  # sparse features as epoch_time feeds them, dense where a layer refuses them
        try:
            net(x, edge_index).sum().backward()
        except (RuntimeError, NotImplementedError):
            x = x.to_dense()
        net.zero_grad()
    y, mask = g.y, g.train_mask
    opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=5e-4)
    net.train()
    wall = []
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.start()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x, edge_index)[mask], y[mask]).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
    prof.stop()
    return sum(wall) / len(wall)


def profile_cell(system: str, model: str, graph: str, device_name: str, warmup: int, steps: int, top: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device_name)
    torch.manual_seed(0)
    g = _load(graph)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    run = _gnncompile_steps if system == "gnncompile-train" else _pyg_steps
    wall = run(model, g, device, warmup, steps, prof)
    events = prof.key_averages()
    cuda = device.type == "cuda"
    key = "device_time_total" if cuda else "cpu_time_total"
    kernels = [e for e in prof.events() if cuda and e.device_type.name == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset"))]
    device_ms = sum(e.device_time for e in kernels) / 1e3 / steps if cuda else float("nan")
    lines = [f"== {system} {model} on {graph} ({device}): wall {wall * 1e3:.2f} ms/step, "
             f"device {device_ms:.2f} ms/step, {len(kernels) / steps:.0f} kernel launches/step"]
    lines.append(events.table(sort_by=key, row_limit=top, max_name_column_width=60))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--graphs", nargs="+", default=["cora"], help="graphs of benchmarks/epoch_time.py")
    p.add_argument("--models", nargs="+", default=["gcn"], choices=MODELS)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default: 5)")
    p.add_argument("--top", type=int, default=15, help="operators listed per cell (default: 15)")
    p.add_argument("--out", type=Path, help="also write the tables to this file")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    out = []
    for graph in args.graphs:
        for model in args.models:
            for system in args.systems:
                try:
                    text = profile_cell(system, model, graph, args.device, args.warmup, args.steps, args.top)
                except Exception as exc:  # one cell's failure (PyG missing, out of memory) ends only that cell
                    text = f"== {system} {model} on {graph}: failed: {type(exc).__name__}: {exc}"
                print(text, flush=True)
                out.append(text)
    if args.out is not None:
        args.out.write_text("\n\n".join(out) + "\n")


if __name__ == "__main__":
    main()
