#!/usr/bin/env python
"""Per-epoch training time (forward + backward + Adam) of gnncompile vs PyG, same machine, same run.

Models: 2-layer GCN (hidden 256), 2-layer GraphSAGE-mean (hidden 256), 2-layer GAT (4 heads x 64),
feature dropout 0.5 (PyG's cells leave it out on sparse features), and attention dropout 0.5 in
both systems' GAT.
Graphs: Cora, coauthor_physics (sparse bag-of-words features, fed to every system as the same
torch sparse CSR tensor), and an R-MAT graph with 100k vertices / ~2M edges (128 random features).
Systems: gnncompile (default kernel backend), PyG with ``edge_index``, PyG with a CSR ``adj_t``
(``torch.sparse_csr_tensor``; PyG's fastest path without torch_sparse); on CUDA also
``gnncompile-cupy``: gnncompile with the ``cupy`` backend (``GNNCOMPILE_BACKEND=cupy``: per-shape
choice of cuSPARSE or the own kernels, the fused CUDA attention); ``gnncompile-train``: the steps
of ``gc.train`` itself (its Philox dropout masks and fused Adam), timed by its history; the other
gnncompile cells time the module in the loop PyG's cells use (torch's dropout, ``torch.optim.Adam``).

Every (system, model, graph) cell runs in its own subprocess so allocator state does not leak
between cells; each cell is run twice: with the default allocator and with the glibc settings
that PERF_NOTES.md recommends for fresh large allocations (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``; ``THP_MEM_ALLOC_ENABLE=1``). The time of a cell is the median of
``--epochs`` timed epochs after ``--warmup`` untimed ones. The ratio column is
gnncompile / best PyG variant under the same allocator setting (< 1 means gnncompile is faster),
gnncompile being the first of ``gnncompile``, ``gnncompile-train``, ``gnncompile-cupy`` run.

With ``--device cuda`` (issue 17's measurement) every cell trains on the GPU: the graph and
features are moved there before timing (gnncompile: the compact training graph ``gc.train`` holds,
scales in float32), each epoch is timed between two ``torch.cuda.synchronize()`` calls, and the
cell reports its peak allocated GPU memory (``torch.cuda.max_memory_allocated``) and ``out of
memory`` where it does not fit; allocator settings do not apply (one setting, ``default``). The
section "Epoch time vs PyG on CUDA" names the GPU and the torch, CUDA, CuPy and PyG versions.
``rmat-2m``: R-MAT with 2M vertices and 40M edges (for a GPU).

Usage::

    python benchmarks/epoch_time.py                      # everything (~15-25 min on 2 cores)
    python benchmarks/epoch_time.py --graphs cora --models gcn --epochs 5
    python benchmarks/epoch_time.py --device cuda --graphs cora rmat rmat-2m --epochs 20 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _results import command_line, gpu_info, machine_info, today, update_section  # noqa: E402

GRAPHS = ("cora", "coauthor_physics", "rmat", "rmat-2m")
DEFAULT_GRAPHS = ("cora", "coauthor_physics", "rmat")
MODELS = ("gcn", "sage", "gat")
SYSTEMS = ("gnncompile", "gnncompile-train", "gnncompile-cupy", "pyg-edge_index", "pyg-csr")
CPU_SYSTEMS = ("gnncompile", "gnncompile-train", "pyg-edge_index", "pyg-csr")
ALLOC_ENV = {
    "default": {},
    "tuned": {"MALLOC_MMAP_THRESHOLD_": "17179869184", "MALLOC_TRIM_THRESHOLD_": "17179869184",
              "THP_MEM_ALLOC_ENABLE": "1"},
}


# --------------------------------------------------------------------------- one cell (subprocess)
def _load(name: str):
    import gnncompile as gc

    if name == "rmat":
        return gc.datasets.synthetic("rmat", num_nodes=100_000, num_edges=2_000_000, num_features=128,
                                     num_classes=16, seed=0)
    if name == "rmat-2m":
        return gc.datasets.synthetic("rmat", num_nodes=2_000_000, num_edges=40_000_000, num_features=128,
                                     num_classes=16, seed=0)
    return gc.datasets.load(name)


def _pyg_model(kind: str, fin: int, fout: int):
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "gcn":
                self.c1, self.c2 = GCNConv(fin, 256, cached=True), GCNConv(256, fout, cached=True)
            elif kind == "sage":
                self.c1, self.c2 = SAGEConv(fin, 256), SAGEConv(256, fout)
            else:
                # attention dropout as gc.nn.GAT's (its dropout is the features' and the attention's)
                self.c1 = GATConv(fin, 64, heads=4, dropout=0.5)
                self.c2 = GATConv(256, fout, heads=1, dropout=0.5)

        def forward(self, x, adj):
            x = F.dropout(x, 0.5, self.training) if x.layout == torch.strided else x
            x = self.c1(x, adj)
            x = F.elu(x) if kind == "gat" else F.relu(x)
            x = F.dropout(x, 0.5, self.training)
            return self.c2(x, adj)

    return Net()


def run_cell(system: str, model: str, graph: str, epochs: int, warmup: int, threads: int,
             device: str = "cpu") -> dict:
    import torch

    try:
        return _run_cell(system, model, graph, epochs, warmup, threads, torch.device(device))
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}


def _run_cell(system: str, model: str, graph: str, epochs: int, warmup: int, threads: int, device) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    g = _load(graph)
    cuda = device.type == "cuda"
    if cuda and system.startswith("gnncompile"):
        g = g.compact()
        g.cast_scales(torch.float32)  # what gc.train holds
    if cuda:
        g = g.to(device)
    x, y, mask = g.x, g.y, g.train_mask
    note = ""
    if system.startswith("gnncompile"):
        import gnncompile as gc

        if model == "gat":
            net = gc.nn.GAT(g.num_features, 64, g.num_classes, num_layers=2, heads=4, dropout=0.5)
        else:
            net = gc.nn.build_model(model, g.num_features, 256, g.num_classes, num_layers=2, dropout=0.5)
        net = net.to(device)
        fwd = lambda: net(g, x)  # noqa: E731
        if system == "gnncompile-train":
            return _train_cell(gc, net, g, epochs, warmup, device)
    else:
        net = _pyg_model(model, g.num_features, g.num_classes).to(device)
        ei = torch.stack([g.indices, g.dst])
        if system == "pyg-csr":
            # adj_t[dst, src]: exactly the in-edge CSR gnncompile keeps.
            adj = torch.sparse_csr_tensor(g.indptr, g.indices, torch.ones(g.num_edges, device=device),
                                          size=(g.num_nodes,) * 2)
        else:
            adj = ei
        fwd = lambda: net(x, adj)  # noqa: E731
        if x.layout == torch.sparse_csr:
            try:
                fwd().sum().backward()
            except (RuntimeError, NotImplementedError):
                # This PyG layer cannot take sparse features: give it the dense matrix.
                x = x.to_dense()
                note = "dense x"
            net.zero_grad()
    opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=5e-4)
    net.train()
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + epochs):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fwd()[mask], y[mask])
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    times.sort()
    out = {"median_s": times[len(times) // 2], "min_s": times[0], "epochs": epochs, "note": note}
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    if system == "gnncompile-cupy":
        from gnncompile.kernels import cuda as own_kernels

        out["choices"] = [str(c) for c in own_kernels.choices()]  # what the cupy backend chose per shape
    return out


def _train_cell(gc, net, g, epochs: int, warmup: int, device) -> dict:
    """``gnncompile-train``: the steps of :func:`gnncompile.train` itself (its dropout masks, its
    fused Adam, no host synchronization in the step), timed by its history (``epoch_time``: the
    step alone, ended by a CUDA synchronization on a GPU; evaluation is timed apart)."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    hist = gc.train(net, g, epochs=warmup + epochs, lr=0.01, weight_decay=5e-4, device=device,
                    eval_every=10**9, verbose=False)
    times = sorted(hist.epoch_time[warmup:])
    out = {"median_s": times[len(times) // 2], "min_s": times[0], "epochs": epochs,
           "note": "gc.train's step"}
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))  # (with its one final evaluation)
        from gnncompile.kernels import cuda as own_kernels

        out["choices"] = [str(c) for c in own_kernels.choices()]  # the torch backend's measured SDDMM, attention
    return out


# --------------------------------------------------------------------------- driver
def _spawn(system: str, model: str, graph: str, alloc: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, **ALLOC_ENV[alloc])
    if system == "gnncompile-cupy":
        env["GNNCOMPILE_BACKEND"] = "cupy"
    cmd = [sys.executable, __file__, "--cell", system, model, graph, "--epochs", str(args.epochs),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--device", args.device]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.timeout}s"}
    if out.returncode < 0:  # killed by a signal: no message of its own (SIGKILL: the kernel's OOM killer)
        name = signal.Signals(-out.returncode).name
        why = " (most likely the out-of-memory killer)" if name == "SIGKILL" else ""
        return {"error": f"killed by {name}{why}"}
    if out.returncode != 0:
        err = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"error": err[:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", nargs="+", default=list(DEFAULT_GRAPHS), choices=GRAPHS)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every cell trains")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS,
                   help="default: all on CUDA; all but gnncompile-cupy on the CPU")
    p.add_argument("--alloc", nargs="+", default=list(ALLOC_ENV), choices=list(ALLOC_ENV))
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed epochs per cell")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"))
    p.add_argument("--cell", nargs=3, metavar=("SYSTEM", "MODEL", "GRAPH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        print(json.dumps(run_cell(*args.cell, args.epochs, args.warmup, args.threads, args.device)))
        return
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: nothing measured, nothing written")
        args.alloc = ["default"]  # glibc's allocator settings do not touch GPU memory
    if args.systems is None:
        args.systems = list(SYSTEMS if cuda else CPU_SYSTEMS)

    # the ratio's own system: the module in PyG's loop where it runs, else gc.train's steps
    ours_system = next((s for s in ("gnncompile", "gnncompile-train", "gnncompile-cupy") if s in args.systems), None)
    rows = []
    load0 = f"{os.getloadavg()[0]:.2f}"
    for graph in args.graphs:
        for model in args.models:
            for alloc in args.alloc:
                res = {s: _spawn(s, model, graph, alloc, args) for s in args.systems}
                ours = res.get(ours_system, {}).get("median_s")
                pyg = [r["median_s"] for s, r in res.items() if s.startswith("pyg") and "median_s" in r]
                ratio = ours / min(pyg) if ours and pyg else float("nan")
                row = (graph, model, alloc, res, ratio)
                rows.append(row)
                cells = "  ".join(
                    f"{s}={r['median_s'] * 1e3:8.1f}ms" if "median_s" in r else f"{s}=ERR({r['error']})"
                    for s, r in res.items()
                )
                print(f"{graph:17s} {model:5s} {alloc:8s} {cells}  ratio={ratio:.2f}", flush=True)

    def cell(r: dict) -> str:
        if "median_s" not in r:
            return r["error"] if r["error"] == "out of memory" else f"error: {r['error']}"
        text = f"{r['median_s'] * 1e3:.1f}"
        if "peak_bytes" in r:
            text += f" ({r['peak_bytes'] / 2**20:,.0f} MiB)"
        return text + (f" ({r['note']})" if r.get("note") else "")

    unit = "ms (peak GPU memory)" if cuda else "ms"
    header = "| graph | model | allocator | " + " | ".join(f"{s} {unit}" for s in args.systems) + \
        f" | ratio {ours_system or 'gnncompile (not run)'}/best PyG |"
    lines = [header, "|" + "---|" * (4 + len(args.systems))]
    for graph, model, alloc, res, ratio in rows:
        cells = " | ".join(cell(res[s]) for s in args.systems)
        lines.append(f"| {graph} | {model} | {alloc} | {cells} | {ratio:.2f} |")
    where = f"GPU: {gpu_info()}; host: " if cuda else "Machine: "
    body = (
        f"{where}{machine_info(args.threads)}. Date: {today()}. "
        f"Load average at start / end: {load0} / {os.getloadavg()[0]:.2f} (the machine is shared: timings move with it).\n"
        f"Command: `{command_line()}`\n\n"
        f"Median of {args.epochs} epochs after {args.warmup} warm-up epochs; each cell in a fresh process. "
        "Models: GCN and GraphSAGE-mean with hidden 256, GAT with 4 heads x 64, all 2 layers, dropout 0.5.\n"
        "`tuned` = glibc MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ raised and THP_MEM_ALLOC_ENABLE=1.\n\n"
        + "\n".join(lines) + "\n"
    )
    if cuda:
        body += ("\nOn CUDA each epoch is timed between two `torch.cuda.synchronize()` calls; peak GPU memory is "
                 "`torch.cuda.max_memory_allocated` over the timed and warm-up epochs.\n")
        for system, what in (("gnncompile-train", "the default (`torch`) backend measured in the gnncompile-train "
                              "cells (SDDMM, GAT's attention)"),
                             ("gnncompile-cupy", "the `cupy` backend chose in the gnncompile-cupy cells")):
            chosen = [f"- {graph} {model}: {c}" for graph, model, _, res, _ in rows
                      for c in res.get(system, {}).get("choices", ())]
            if chosen:
                body += (f"\nChoices {what} (`kernels.cuda.choices()`, times in ms):\n\n" + "\n".join(chosen) + "\n")
    update_section(Path(args.out), "Epoch time vs PyG on CUDA" if cuda else "Epoch time vs PyG", body)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
