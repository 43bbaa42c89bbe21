#!/usr/bin/env python
"""The CUDA path end to end: accuracy on CUDA vs CPU, one step CUDA == CPU, every strategy on ranks sharing a GPU.

Part 1, accuracy: ``gc.train(..., device=d)`` (what ``gnncompile train --device d`` runs) for GCN,
GraphSAGE and GAT on cora and coauthor_physics, ``--seeds`` seeds, on the CPU and on CUDA; the
mean test accuracies (at the epoch of best validation accuracy) should agree within 0.5 points
(dropout masks come from each device's own generator, so runs differ, not their distribution).

Part 2, one step: the same model and weights, one training step (forward, backward, Adam) on the
CPU and on CUDA with the same dropout masks (drawn on the CPU from one seed and applied on both
devices); largest relative difference of loss, logits, gradients and updated parameters (float64).

Part 3, strategies: per strategy, one step of a plan on ``--ranks`` ranks sharing the GPU (gloo,
send/recv staged through host memory) against single-device CUDA training of the same model
(:func:`gnncompile.testing.check_plan`), and the measured bytes of every rank against the plan's
prediction.

Needs a CUDA device; without one it says so and writes nothing. Usage::

    python benchmarks/gpu.py                      # all parts, 3 seeds, 4 ranks
    python benchmarks/gpu.py --parts 2 3 --no-write
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, today, update_section  # noqa: E402

MODELS = {"GCN": ("gcn", dict(hidden=16, dropout=0.5), dict(lr=0.01)),
          "SAGE": ("sage", dict(hidden=64, dropout=0.5), dict(lr=0.01)),
          "GAT": ("gat", dict(hidden=8, heads=8, dropout=0.6), dict(lr=0.005))}
DATASETS = ("cora", "coauthor_physics")
STRATEGIES = {  # name: plan options (the exact ones: a step must equal single-device training)
    "data": dict(strategy="data", partitioner="metis"),
    "tensor": dict(strategy="tensor"),
    "tensor, 4 chunks": dict(strategy="tensor", chunks=4),
    "mop": dict(strategy="mop"),
    "task": dict(strategy="task", chunks=4),
}


def _model(gc, name: str, g, dropout=None):
    kind, mkw, _ = MODELS[name]
    mkw = dict(mkw)
    hidden = mkw.pop("hidden")
    if dropout is not None:
        mkw["dropout"] = dropout
    return gc.nn.build_model(kind, g.num_features, hidden, g.num_classes, num_layers=2, **mkw)


def part_accuracy(gc, torch, seeds: int, epochs: int) -> list[str]:
    lines = ["| model / dataset | CPU test acc (mean) | CUDA test acc (mean) | difference (points) | within 0.5 | "
             "CUDA s / epoch (median) |", "|---|---|---|---|---|---|"]
    for ds in DATASETS:
        g = gc.datasets.load(ds).normalize_features()
        for name, (_, _, tkw) in MODELS.items():
            accs: dict[str, list[float]] = {"cpu": [], "cuda": []}
            times: list[float] = []
            for seed in range(seeds):
                for dev in ("cpu", "cuda"):
                    torch.manual_seed(seed)
                    net = _model(gc, name, g)
                    hist = gc.train(net, g, epochs=epochs, seed=seed, device=dev, verbose=False, **tkw)
                    accs[dev].append(hist.test_acc_at_best_val)
                    if dev == "cuda":
                        times.append(hist.median_epoch_time())
            cpu, cuda = statistics.fmean(accs["cpu"]), statistics.fmean(accs["cuda"])
            diff = 100 * (cuda - cpu)
            row = (f"| {name} / {ds} | {cpu:.4f} | {cuda:.4f} | {diff:+.2f} | {'yes' if abs(diff) <= 0.5 else 'NO'} | "
                   f"{statistics.median(times) * 1e3:.2f} ms |")
            print(row, flush=True)
            lines.append(row)
    return lines


class _CpuMasks:
    """Dropout masks drawn on the CPU from one seed and applied on any device (a TorchFunctionMode)."""

    def __new__(cls, torch, seed: int):
        import torch.nn.functional as F

        from gnncompile.frontend.ops import dropout_noise

        class Mode(torch.overrides.TorchFunctionMode):
            def __init__(self) -> None:
                super().__init__()
                self.gen = torch.Generator().manual_seed(seed)

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is F.dropout:
                    bound = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
                    x, p = bound["input"], bound.get("p", 0.5)
                    if bound.get("training", True) and 0 < p < 1:
                        with torch.random.fork_rng(devices=[]):
                            torch.manual_seed(int(torch.randint(2**31, (), generator=self.gen)))
                            noise = dropout_noise(torch.empty(x.shape, dtype=x.dtype), p)
                        return x * noise.to(x.device)
                return func(*args, **kwargs)

        return Mode()


def part_step(gc, torch) -> list[str]:
    import torch.nn.functional as F

    lines = ["| model / dataset | loss | logits | gradients | parameters after Adam |", "|---|---|---|---|---|"]

    def rel(a, b) -> float:
        a, b = a.detach().cpu(), b.detach().cpu()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    for ds in DATASETS:
        g = gc.datasets.load(ds).normalize_features()
        for name in MODELS:
            torch.manual_seed(0)
            base = _model(gc, name, g).double()
            out = {}
            for dev in ("cpu", "cuda"):
                net = copy.deepcopy(base).to(dev)
                gd = g.to(dev)
                x = gd.x.double() if gd.x.layout == torch.strided else gd.x.to(torch.float64)
                opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=5e-4)
                net.train()
                with _CpuMasks(torch, seed=0):
                    logits = net(gd, x)
                loss = F.cross_entropy(logits[gd.train_mask], gd.y[gd.train_mask])
                loss.backward()
                grads = [p.grad.detach().clone() for p in net.parameters()]
                opt.step()
                out[dev] = (loss, logits, grads, [p.detach().clone() for p in net.parameters()])
            c, d = out["cpu"], out["cuda"]
            row = (f"| {name} / {ds} | {rel(d[0], c[0]):.1e} | {rel(d[1], c[1]):.1e} | "
                   f"{max(rel(a, b) for a, b in zip(d[2], c[2])):.1e} | {max(rel(a, b) for a, b in zip(d[3], c[3])):.1e} |")
            print(row, flush=True)
            lines.append(row)
    return lines


def part_strategies(gc, torch, ranks: int) -> list[str]:
    from gnncompile.testing import check_plan

    g = gc.datasets.load("cora").normalize_features()  # features cast to the float64 parameters
    lines = ["| strategy | ranks on 1 GPU | step == single-device CUDA (rtol 1e-9) | bytes measured == predicted | "
             "placement |", "|---|---|---|---|---|"]
    for label, opts in STRATEGIES.items():
        torch.manual_seed(0)
        model = gc.nn.GCN(g.num_features, 16, g.num_classes, num_layers=2, dropout=0.0).double()
        t0 = time.perf_counter()
        try:
            res = check_plan(model, g, ranks, device="cuda", **opts)
            ok, placement = "yes", res.describe_placement()
            pred = list(res.plan.predictions["bytes_sent"])
            sent = [r.bytes_sent for r in res.ranks]
            same = "yes" if pred == sent else f"NO: {sent} vs {pred}"
        except AssertionError as exc:
            ok, same, placement = f"NO: {str(exc).splitlines()[0][:80]}", "-", "-"
        row = f"| {label} | {ranks} | {ok} | {same} | {placement} ({time.perf_counter() - t0:.1f} s) |"
        print(row, flush=True)
        lines.append(row)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "RESULTS.md"))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()

    import torch

    import gnncompile as gc

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device on this machine; nothing measured, nothing written", file=sys.stderr)
        sys.exit(2)
    sections = []
    if 1 in args.parts:
        sections += [f"### Accuracy on CUDA vs CPU ({args.epochs} epochs, {args.seeds} seeds)", "",
                     *part_accuracy(gc, torch, args.seeds, args.epochs), ""]
    if 2 in args.parts:
        sections += ["### One training step, CUDA vs CPU, same dropout masks (float64, largest relative difference)",
                     "", *part_step(gc, torch), ""]
    if 3 in args.parts:
        sections += [f"### Strategies on {args.ranks} ranks sharing one GPU (cora, GCN, float64)", "",
                     *part_strategies(gc, torch, args.ranks), ""]
    dev = torch.cuda.get_device_name(0)
    body = (f"Machine: {dev}, torch {torch.__version__}. Date: {today()}.\nCommand: `{command_line()}`\n\n"
            + "\n".join(sections))
    if not args.no_write:
        update_section(Path(args.out), "GPU", body)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
