"""Fixed costs of gnncompile's runtime, measured for the cost models.

On a small graph a training step is dominated by what every instruction costs regardless of its
data: calling a stage's fx module, autograd's bookkeeping per op, the executor's dispatch of a
communication instruction, the optimizer's loop over parameter tensors. The hardware calibration
(GEMM, STREAM, SpMM, collectives) does not see these; :func:`runtime_overheads` measures them by
training small GCNs (2 and 4 layers, so stages with different op counts) on one rank, subtracting
the compute time the cost model predicts for each instruction, and fitting

    Forward:  stage + op_forward  * ops        Backward: stage + op_backward * ops
    comm instruction (a halo exchange with no peer): comm
    optimizer step: optimizer_tensor * parameter tensors
    a step beyond its instructions (loss, zeroing gradients): step

by least squares over the instructions' median durations. The result goes into
:attr:`~gnncompile.cost_models.hardware.DeviceSpec.runtime`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import torch

__all__ = ["runtime_overheads"]


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with both clamped at >= 0 (``a`` alone if the xs do not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return max(0.0, my), 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    b = max(0.0, b)
    a = max(0.0, my - b * mx)
    return a, b


def runtime_overheads(cluster: Any, *, quick: bool = False) -> dict[str, float]:
    """Fit the runtime's fixed costs on ``cluster``'s device (one rank; see the module docstring)."""
    import dataclasses

    from .. import datasets, nn
    from ..api import plan as make_plan
    from ..cost_models.model import op_time
    from ..ir.plan import Backward, Forward, HaloExchange, OptimizerStep

    bare = dataclasses.replace(cluster.device, launch_overhead=0.0, runtime={})
    graph = datasets.synthetic("sbm", num_nodes=256, avg_degree=4, num_features=8, num_classes=4, seed=0)
    epochs = 12 if quick else 40
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)  # kind -> (x, residual seconds)
    for layers in (2, 4):
        torch.manual_seed(0)
        model = nn.GCN(graph.num_features, 8, graph.num_classes, num_layers=layers, dropout=0.5)
        p = make_plan(model, graph, cluster, strategy="data", verify=False)
        res = p.run(epochs=epochs, lr=0.01, seed=0, eval_every=epochs, update_model=False, timeout=120)
        durations: dict[str, list[float]] = defaultdict(list)
        per_step: dict[int, float] = defaultdict(float)
        for e in res.ranks[0].timeline:
            if e.step >= 2:
                durations[e.instruction].append(e.duration)
                per_step[e.step] += e.duration
        # what a step costs beyond its instructions (loss, zeroing gradients, bookkeeping)
        samples["step"] += [(0.0, res.ranks[0].epoch_time[k] - t) for k, t in per_step.items()]
        dp = p.ranks[0]
        stages = {s.index: s for s in dp.stages}
        tensors = sum(1 for q in model.parameters() if q.requires_grad)
        for inst in dp.instructions:
            if str(inst) not in durations:
                continue
            measured = statistics.median(durations[str(inst)])
            if isinstance(inst, (Forward, Backward)):
                st = stages[inst.stage]
                back = isinstance(inst, Backward)
                compute = sum(op_time(op, dp.sizes, bare, backward=back) for op in st.costs)
                samples["B" if back else "F"].append((len(st.costs), measured - compute))
            elif isinstance(inst, HaloExchange):
                samples["comm"].append((0.0, measured))
            elif isinstance(inst, OptimizerStep):
                samples["opt"].append((tensors, measured))
    out: dict[str, float] = {}
    out["stage"], out["op_forward"] = _fit_line(*map(list, zip(*samples["F"])))
    stage_b, out["op_backward"] = _fit_line(*map(list, zip(*samples["B"])))
    out["stage"] = (out["stage"] + stage_b) / 2
    out["comm"] = statistics.median(y for _, y in samples["comm"]) if samples["comm"] else 0.0
    out["optimizer_tensor"] = statistics.median(y / x for x, y in samples["opt"] if x) if samples["opt"] else 0.0
    out["step"] = max(0.0, statistics.median(y for _, y in samples["step"])) if samples["step"] else 0.0
    return out
