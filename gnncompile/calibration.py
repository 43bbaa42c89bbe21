"""Calibration: measure this host for the cost models and save a profile (``gnncompile calibrate``).

:func:`calibrate` measures the CPU (GEMM, STREAM, SpMM, the products of a linear layer by output
width and the training loss at one thread and all cores, a tiny op's overhead) in a launched rank,
the collectives of a backend between launched ranks, and the fixed costs of gnncompile's runtime
(:func:`runtime_overheads`: it plans and trains small models), and returns a calibrated
:class:`~gnncompile.cost_models.hardware.Cluster`, saved as JSON when given a path;
:meth:`Cluster.parse` reads the saved profile for ``<N>xcpu`` clusters.

With ``device="cuda"`` it measures a GPU instead (:func:`_calibrate_gpu`): the same rates once,
every timing synchronized (:func:`_best_time` takes the device's ``sync``; the CPU's is a no-op),
a tiny op's time with its launch, a synchronize's round trip, the runtime's fixed costs with the
plans on that GPU, and NCCL between GPUs where there are ``world_size`` of them. The profile
records the GPU's model (``calibration["model"]``), and :meth:`Cluster.parse` applies it to
clusters of that model (``4xH100``).

It launches the runtime and plans with :func:`gnncompile.plan`, so it sits above both (layers:
``cost_models`` < ``passes`` | ``runtime`` < ``api`` < ``calibration``); the cost models only read
the profile.

Runtime overheads
-----------------
Fixed costs of gnncompile's runtime, measured for the cost models.

On a small graph a training step is dominated by what every instruction costs regardless of its
data: calling a stage's fx module, autograd's bookkeeping per op, the executor's dispatch of a
communication instruction, the optimizer's loop over parameter tensors. The hardware calibration
(GEMM, STREAM, SpMM, collectives) does not see these; :func:`runtime_overheads` measures them by
training small GCNs (2 and 4 layers, so stages with different op counts) on one rank with one
thread, subtracting the compute time the cost model predicts for each instruction, and fitting

    Forward:  stage + op_forward  * ops        Backward: stage + op_backward * ops
    a stage with checkpointed segments (a 2-layer GCN with recomputation): + segment per segment
    comm instruction (a halo exchange with no peer): comm
    optimizer step: optimizer_tensor * parameter tensors
    a step beyond its instructions (zeroing gradients, bookkeeping): step

by least squares over the instructions' median durations. The result goes into
:attr:`~gnncompile.cost_models.specs.DeviceSpec.runtime`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import socket
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence, Union

import torch

from . import datasets, nn
from .api import plan as make_plan
from .cost_models.hardware import Cluster, _usable_cores, gpu_model_name, gpu_preset
from .cost_models.model import checkpointed_segments, loss_time, stage_ops_time
from .cost_models.specs import CPU_GAMMA, DEFAULT_INTRA, DEVICES, LINKS, DeviceSpec, LinkSpec
from .errors import PlanningError
from .paths import output_problem
from .frontend.ops import propagate
from .graph.core import Graph
from .ir.plan import Backward, Forward, HaloExchange, OptimizerStep
from .kernels import CSR, default_backend, spmm
from .kernels.dropout import dropout_mask
from .runtime.comm import complete, polls_by_default
from .runtime.executor import run_plan
from .runtime.launcher import launch

__all__ = ["calibrate", "runtime_overheads", "plausibility_warnings", "BACKENDS"]

#: Backends whose collectives :func:`calibrate` can measure.
BACKENDS = ("gloo", "nccl")


def _check_arguments(path: Any, quick: Any, backend: Any, world_size: Any) -> None:
    """Raise :class:`PlanningError` for arguments :func:`calibrate` cannot use."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise PlanningError(f"calibrate: path must be a file path or None, got {type(path).__name__}")
    problem = output_problem(path, parents_made=True) if path is not None else None
    if problem is not None:  # (found before the measuring, not after it)
        raise PlanningError(f"calibrate: path: {problem}")
    if not isinstance(quick, bool):
        raise PlanningError(f"calibrate: quick must be True or False, got {quick!r}")
    if backend is not None and backend not in BACKENDS:
        raise PlanningError(f"calibrate: unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise PlanningError("calibrate: backend='nccl' runs between GPUs and this machine has none "
                            "(torch.cuda.is_available() is False); use backend='gloo' (or None)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise PlanningError(f"calibrate: world_size must be an integer >= 2 to measure a link, got {world_size!r}")


def _cuda_index(device: Any, backend: Optional[str]) -> Optional[int]:
    """The GPU :func:`calibrate` measures for ``device`` (``None``: the CPU): ``"cuda"`` is GPU 0,
    ``"cuda:N"`` GPU ``N``. Raises :class:`PlanningError` for another device string, a GPU that is
    not there (checked before anything is measured), or ``backend="gloo"`` on a GPU (its
    collectives are NCCL's)."""
    match = re.fullmatch(r"(cpu)|cuda(?::(\d+))?", device) if isinstance(device, str) else None
    if match is None:
        raise PlanningError(f"calibrate: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if match.group(1):
        return None
    if not torch.cuda.is_available():
        raise PlanningError(f"calibrate: no CUDA device: torch.cuda.is_available() is False (device={device!r}); "
                            "calibrate the CPU with device='cpu', or run on a machine with a GPU")
    index, count = int(match.group(2) or 0), torch.cuda.device_count()
    if index >= count:
        raise PlanningError(f"calibrate: device={device!r} but this machine has {count} GPU(s) "
                            f"(cuda:0..cuda:{count - 1})")
    if backend == "gloo":
        raise PlanningError("calibrate: on a GPU the collectives measured are NCCL's between GPUs; "
                            "use backend='nccl' (or None) with device='cuda'")
    return index


def calibrate(path: Union[str, os.PathLike, None] = None, *, quick: bool = False, backend: Optional[str] = None,
              world_size: int = 2, device: str = "cpu") -> Cluster:
    """Measure this host's CPU (``device="cpu"``) or one of its GPUs (``"cuda"``, ``"cuda:N"``: see
    :func:`_calibrate_gpu`) and the collectives of ``backend`` (``None``: gloo on the CPU, NCCL
    between GPUs) between local ranks.

    Measures, at one thread and at all usable cores: float32/float64 GEMM FLOP/s
    (``torch.mm``, best over square sizes), STREAM-like bandwidth (copy and add of 64 MB
    arrays; the better of the two), SpMM effective bandwidth (``kernels.spmm`` on a random
    graph of uniform degree 10, width 64, in the Eq. 6 byte convention), and the three products
    of a linear layer (forward, weight and input gradient of ``x @ W^T``, ``x`` 4096 x 512) at
    output widths 4 to 256 (``gemm_curve``: narrow products run far below the square GEMM's
    rate), the same with a deep input (``x`` 2048 x 4096, ``gemm_deep_curve``: a first layer on
    dense features), and the training loss's forward and backward per logit (``loss_rate``,
    ``loss_grad_rate``). Also the time of a tiny torch op (``launch_overhead``) and, over
    ``world_size`` launched ranks,
    ``all_reduce`` and ``all_to_all_single`` at three message sizes, each call after a short
    computation as in a training step (mean: a step is a sum of its instructions, so their tails
    count; the back-to-back best is kept too), fitted as
    ``latency + bus_bytes / bandwidth`` (bus bytes as nccl-tests: ``2(p-1)/p·size`` for
    all-reduce, ``(p-1)/p·size`` for all-to-all; least squares on relative error). The
    ``shm`` link takes the all-to-all fit (a plain exchange of data); gloo's all-reduce has a
    higher latency floor on small messages, kept in ``calibration["collectives"]["fits"]``.
    The local rates are measured in a launched rank (a fresh process, as ranks run).

    Returns a one-node, one-rank :class:`~gnncompile.Cluster` whose device holds the all-core rates, with the
    raw measurements in :attr:`calibration`; saved as JSON to ``path`` when given.
    ``quick`` uses smaller problems and fewer repeats (a few seconds on 2 cores). Arguments of
    the wrong type or value (``world_size`` below 2, a ``backend`` other than ``"gloo"`` or
    ``"nccl"``, a ``device`` other than ``"cpu"``/``"cuda"``/``"cuda:N"``, a CUDA device where
    there is none) raise :class:`PlanningError` before anything is measured.
    """
    _check_arguments(path, quick, backend, world_size)
    index = _cuda_index(device, backend)
    if index is not None:
        return _calibrate_gpu(path, quick, world_size, index)
    backend = backend or "gloo"
    cores = _usable_cores()
    host = socket.gethostname()
    local = _measure_local(cores, quick)
    comm = _measure_collectives(backend, world_size, quick)
    rates = local["rates"]
    device = DeviceSpec(
        name=f"cpu ({host})",
        flops={dtype: pair[1] for dtype, pair in rates["flops"].items()},
        mem_bandwidth=rates["mem_bandwidth"][1],
        memory=_total_memory(),
        spmm_bandwidth=rates["spmm_bandwidth"][1],
        edge_rate=rates["edge_rate"][1],
        rng_rate=rates["rng_rate"][1],
        loss_rate=rates["loss_rate"][1],
        loss_grad_rate=rates["loss_grad_rate"][1],
        spmm_curve=tuple((p["working_set"], p["bandwidth"][1], p["edge_rate"][1]) for p in local["spmm_curve"]),
        gemm_curve=_all_cores_curve(local["gemm_curve"]),
        gemm_inner=float(local["linear"]["inner"]),
        gemm_deep_curve=_all_cores_curve(local["gemm_deep_curve"]),
        gemm_deep_inner=float(local["linear_deep"]["inner"]),
        gamma=CPU_GAMMA,
        push_factor=local["push"]["factor"],
        launch_overhead=local["op_overhead"]["seconds"],
        kind="cpu",
    )
    rank_rates = {k: local[k] for k in ("rates", "spmm_curve", "gemm_curve", "gemm_deep_curve")}
    link = LinkSpec("shm", comm["bandwidth"], comm["latency"])
    runtime = runtime_overheads(Cluster(1, 1, device, link, cores=cores, threads_per_rank=1, calibration=rank_rates),
                                quick=quick)
    # and at all cores: a multi-threaded op forks and joins its threads, which a small one does not
    # earn back (cora's GCN step: as fast at 2 threads as at 1)
    runtime_all = runtime_overheads(Cluster(1, 1, device, link, cores=cores, threads_per_rank=cores,
                                            calibration=rank_rates), quick=quick) if cores > 1 else runtime
    device = dataclasses.replace(device, runtime={**runtime, "switch": comm["switch"]["seconds"]})
    calibration = {
        "host": host,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "quick": quick,
        "cores": cores,
        "threads": [1, cores],
        **local,
        "collectives": comm,
        "runtime": {k: [runtime[k], runtime_all[k]] for k in runtime},
    }
    calibration["warnings"] = plausibility_warnings(calibration)
    cluster = Cluster(1, 1, device, LinkSpec("shm", comm["bandwidth"], comm["latency"]),
                  name=f"cpu (calibrated {host})", cores=cores, calibration=calibration)
    if path is not None:
        cluster.save(path)
    return cluster


def _calibrate_gpu(path: Union[str, os.PathLike, None], quick: bool, world_size: int, index: int) -> Cluster:
    """:func:`calibrate` on GPU ``index``: one launched rank on ``cuda:index`` measures (every timing
    synchronized; :func:`_gpu_rank`) float32 and float64 GEMM FLOP/s at torch's matmul settings
    (TF32 off by default: ``calibration["gpu"]["allow_tf32"]``), device-to-device copy and add
    bandwidth (bytes read + written), SpMM bandwidth and edge rate (default CUDA backend, the CPU
    path's byte convention and widths 64 and 4), the linear-layer product curves, the loss rates,
    a tiny op's time with its launch (``launch_overhead``) and a synchronize's round trip
    (``calibration["sync"]``); then :func:`runtime_overheads` with the plans on that GPU, and NCCL's
    collectives between ``world_size`` GPUs where there are that many (else skipped, recorded in
    ``calibration["collectives"]["skipped"]``, and the preset's intra-node link kept).

    The GPU's preset (:func:`~gnncompile.cost_models.hardware.gpu_preset`) gives the profile's
    ``calibration["model"]`` (what :meth:`Cluster.parse` matches) and the rates not measured
    (float16/bfloat16 FLOP/s, the host link); a GPU no preset matches calibrates under its own name
    (:func:`~gnncompile.cost_models.hardware.gpu_model_name`). The propagation rates are measured over
    whole kernels, so γ is 0 as on a CPU. Returns a one-rank GPU :class:`Cluster`; rates are plain
    numbers (no thread dimension)."""
    local = launch(_gpu_rank, 1, (quick,), device=f"cuda:{index}", backend="gloo", timeout=600)[0]
    gpu = local["gpu"]
    key = gpu_preset(gpu["name"], gpu["memory"])
    model = gpu_model_name(gpu["name"], gpu["memory"])
    preset = DEVICES[key] if key is not None else None
    rates = local["rates"]
    device = DeviceSpec(
        name=gpu["name"],
        flops={**(preset.flops if preset is not None else {}), **rates["flops"]},
        mem_bandwidth=rates["mem_bandwidth"],
        memory=gpu["memory"],
        spmm_bandwidth=rates["spmm_bandwidth"],
        edge_rate=rates["edge_rate"],
        rng_rate=rates["rng_rate"],
        loss_rate=rates["loss_rate"],
        loss_grad_rate=rates["loss_grad_rate"],
        spmm_curve=tuple((p["working_set"], p["bandwidth"], p["edge_rate"]) for p in local["spmm_curve"]),
        gemm_curve=tuple((p["width"], p["forward"], p["weight_grad"], p["input_grad"]) for p in local["gemm_curve"]),
        gemm_inner=float(local["linear"]["inner"]),
        gemm_deep_curve=tuple((p["width"], p["forward"], p["weight_grad"], p["input_grad"])
                              for p in local["gemm_deep_curve"]),
        gemm_deep_inner=float(local["linear_deep"]["inner"]),
        gamma=0.0,
        push_factor=local["push"]["factor"],
        host_bandwidth=preset.host_bandwidth if preset is not None else None,
        launch_overhead=local["op_overhead"]["seconds"],
        kind="gpu",
    )
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        comm: dict[str, Any] = _measure_collectives("nccl", world_size, quick)
        link = LinkSpec("nccl", comm["bandwidth"], comm["latency"])
    else:
        link = LINKS[DEFAULT_INTRA[key]] if key is not None else LINKS["pcie4"]
        comm = {"skipped": f"{gpus} CUDA device(s) visible, world_size={world_size} needs as many; "
                           f"the {'preset' if key is not None else 'placeholder'} link {link} is kept"}
    runtime = runtime_overheads(Cluster(1, 1, device, link, name=model), quick=quick, device=f"cuda:{index}")
    device = dataclasses.replace(device, runtime=runtime)
    host = socket.gethostname()
    calibration = {
        "model": model,
        "preset": key,
        "device": f"cuda:{index}",
        "host": host,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "quick": quick,
        **local,
        "flops_from_datasheet": sorted(set(device.flops) - set(rates["flops"])),
        "collectives": comm,
        "runtime": runtime,
    }
    cluster = Cluster(1, 1, device, link, name=f"{model} (calibrated {host})", calibration=calibration)
    if path is not None:
        cluster.save(path)
    return cluster


def _all_cores_curve(points: list[dict[str, Any]]) -> tuple[tuple[float, float, float, float], ...]:
    """A measured GEMM curve as the device's ``(width, forward, weight gradient, input gradient)``
    FLOP/s at all cores."""
    return tuple((p["width"], p["forward"][1], p["weight_grad"][1], p["input_grad"][1]) for p in points)


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


def runtime_overheads(cluster: Any, *, quick: bool = False, device: Optional[str] = None) -> dict[str, float]:
    """Fit the runtime's fixed costs on rank 0 of ``cluster`` (one rank with
    ``cluster.threads_per_rank`` threads, default all cores; see the module docstring): ``stage``,
    ``op_forward``, ``op_backward``, ``segment``, ``comm``, ``optimizer_tensor``, ``step``, seconds.
    The plans run on ``device`` (``run_plan``'s): default ``"cpu"`` for a CPU cluster and ``"cuda"``
    for a GPU one (one number per overhead; GPU ranks have no threads to interpolate in).

    :func:`calibrate` measures them at one thread and at all cores (``calibration["runtime"]``:
    ``[single, all_cores]`` per overhead): a rank of ``t`` threads pays them interpolated in ``t``
    (:meth:`~gnncompile.cost_models.hardware.Cluster.rank_device`), since each multi-threaded op
    forks and joins its threads."""
    bare = dataclasses.replace(cluster.rank_device(0), launch_overhead=0.0, runtime={})
    threads = cluster.threads_per_rank
    device = device or ("cpu" if bare.kind == "cpu" else "cuda")
    graph = datasets.synthetic("sbm", num_nodes=256, avg_degree=4, num_features=8, num_classes=4, seed=0)
    epochs = 12 if quick else 40
    samples: dict[str, list[tuple]] = defaultdict(list)  # kind -> (x, residual seconds); segment: 4-tuples
    for layers, recompute in ((2, False), (4, False), (2, True)):
        torch.manual_seed(0)
        model = nn.GCN(graph.num_features, 8, graph.num_classes, num_layers=layers, dropout=0.5)
        p = make_plan(model, graph, cluster, strategy="data", recompute=recompute, verify=False)
        res = run_plan(p, epochs=epochs, lr=0.01, seed=0, eval_every=epochs, update_model=False, timeout=120,
                       threads_per_rank=threads, device=device, progress=False)
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
                # what the cost model charges the stage beyond the fixed costs (PlanCost.stage_time)
                compute = stage_ops_time(st, dp.sizes, bare, back) + loss_time(st, dp.sizes, bare, back,
                                                                                p.info["output"])
                segments = checkpointed_segments(st)
                if segments:  # fitted after the stage and op costs, from what those leave
                    samples["segment"].append((segments, len(st.costs), back, measured - compute))
                else:
                    samples["B" if back else "F"].append((len(st.costs), measured - compute))
            elif isinstance(inst, HaloExchange):
                samples["comm"].append((0.0, measured))
            elif isinstance(inst, OptimizerStep):
                samples["opt"].append((tensors, measured))
    out: dict[str, float] = {}
    out["stage"], out["op_forward"] = _fit_line(*map(list, zip(*samples["F"])))
    stage_b, out["op_backward"] = _fit_line(*map(list, zip(*samples["B"])))
    out["stage"] = (out["stage"] + stage_b) / 2
    # a checkpointed segment's own cost: what its stages' instructions take beyond the stage and op
    # costs, per segment (least squares through the origin)
    rest = [(n, y - out["stage"] - ops * out["op_backward" if back else "op_forward"])
            for n, ops, back, y in samples["segment"]]
    out["segment"] = max(0.0, sum(n * y for n, y in rest) / sum(n * n for n, _ in rest)) if rest else 0.0
    out["comm"] = statistics.median(y for _, y in samples["comm"]) if samples["comm"] else 0.0
    out["optimizer_tensor"] = statistics.median(y / x for x, y in samples["opt"] if x) if samples["opt"] else 0.0
    out["step"] = max(0.0, statistics.median(y for _, y in samples["step"])) if samples["step"] else 0.0
    return out


def _no_sync() -> None:
    """The CPU's synchronization: none (a CPU op has finished when it returns)."""


def _best_time(fn: Callable[[], Any], repeats: int, budget: float, sync: Callable[[], None] = _no_sync) -> float:
    """The shortest of up to ``repeats`` timed calls of ``fn`` after one warm-up call; stops
    early once ``budget`` seconds have been spent timing. ``sync`` waits for the device's queued
    work (``torch.cuda.synchronize`` on a GPU): called after the warm-up and after each call, before
    the clock is read, so every timed call is its work, not its launch."""
    fn()
    sync()
    best, start = math.inf, time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return best


def _best_times(fns: Sequence[Callable[[], Any]], repeats: int, budget: float,
                sync: Callable[[], None] = _no_sync) -> list[float]:
    """:func:`_best_time` of each of ``fns``, their timed calls alternated (one of each per round;
    ``budget`` for them all), so a ratio of two is not skewed by load that came and went."""
    for fn in fns:
        fn()
    sync()
    best, start = [math.inf] * len(fns), time.perf_counter()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return best


def plausibility_warnings(calibration: dict[str, Any]) -> list[str]:
    """What in a CPU ``calibration`` contradicts how hosts behave, most likely load from other
    processes while it measured (the profile is kept; calibrating again on a quiet host fixes it):
    an all-core rate below the single thread's, scattering (push) measured faster than pulling
    through the transposed CSR, a fixed cost at all cores over 10x the single thread's."""
    out = []
    rates = calibration.get("rates", {})
    threads = calibration.get("threads", [1, 1])
    if threads[-1] > 1:
        pairs = {f"{dtype} GEMM": v for dtype, v in rates.get("flops", {}).items()}
        pairs.update({"memory bandwidth": rates.get("mem_bandwidth"), "SpMM bandwidth": rates.get("spmm_bandwidth")})
        for what, v in pairs.items():
            if v and v[1] < v[0]:
                out.append(f"{what} at {threads[-1]} threads ({v[1]:.3g}/s) measured below 1 thread's ({v[0]:.3g}/s)")
        for what, v in calibration.get("runtime", {}).items():
            if v[0] > 0 and v[1] > 10 * v[0]:
                out.append(f"runtime cost {what!r} at {threads[-1]} threads ({v[1] * 1e6:.3g} us) over 10x 1 thread's "
                           f"({v[0] * 1e6:.3g} us)")
    factor = calibration.get("push", {}).get("factor")
    if factor is not None and factor < 1:
        out.append(f"push_factor {factor:.2f} < 1: scattering measured faster than pulling through the transposed CSR")
    return out


def _total_memory() -> int:
    """Physical memory of this host, bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024


def _measure_local(cores: int, quick: bool) -> dict[str, Any]:
    """Local rates at all cores and at one thread, measured in one launched rank.

    A fresh process, as ranks are, that lowers its thread count instead of raising it: on some
    hosts raising ``torch.set_num_threads`` after parallel work leaves later kernels running
    several times slower.
    """
    threads = [cores, 1] if cores > 1 else [1]
    return launch(_local_rank, 1, (threads, quick), backend="gloo", timeout=120, threads_per_rank=cores)[0]


def _problems(quick: bool, device: torch.device) -> dict[str, Any]:
    """The inputs every local rate is measured on, on ``device``: square GEMMs, STREAM arrays, SpMM
    graphs (uniform in-degree 10, widths 64 and 4), a linear layer's products, the loss, a dropout
    mask. A GPU gets larger problems (a product of a CPU's size is mostly its launch there)."""
    gpu = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    degree, width, narrow = 10, 64, 4
    if gpu:
        sizes = [1024, 2048] if quick else [1024, 2048, 4096]
        stream_elems = (256 * 2**20) // 4
        # working sets from one in the L2 cache (50 MB on an H100) to several times it
        spmm_rows = [64_000, 400_000] if quick else [64_000, 400_000, 2_000_000]
        (linear_rows, linear_inner), (deep_rows, deep_inner) = (((16_384, 256), (4096, 2048)) if quick
                                                                else ((65_536, 512), (16_384, 4096)))
        loss_rows, mask_rows = (2**18, 2**20) if quick else (2**20, 2**20)
    else:
        sizes = [256, 512] if quick else [256, 512, 1024]
        stream_elems = (64 * 2**20) // 4
        # working sets from one that fits in the last-level cache to one that does not
        spmm_rows = [16_000, 50_000] if quick else [16_000, 64_000, 200_000]
        # a linear layer of a GNN: many rows, a few hundred inputs; and a deep input (a first layer
        # on dense features), as many input elements
        (linear_rows, linear_inner), (deep_rows, deep_inner) = (((2048, 256), (256, 2048)) if quick
                                                                else ((4096, 512), (2048, 4096)))
        loss_rows, mask_rows = (16_384, 65_536) if quick else (65_536, 65_536)
    linear_widths = (4, 8, 16, 32, 64, 128) if quick else (4, 8, 16, 32, 64, 128, 256)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*shape, dtype=dtype, generator=gen).to(device)

    spmm_cases = []
    for rows in spmm_rows:
        # the propagation the models run (GCN normalization, implicit self loops), uniform random edges
        graph = _uniform_graph(rows, degree, gen).to(device)
        nnz = graph.num_edges + rows
        spmm_cases.append({
            "graph": graph, "rows": rows, "nnz": nnz, "working_set": 4 * rows * width,
            "x": torch.randn(rows, width, generator=gen).to(device),
            "x_narrow": torch.randn(rows, narrow, generator=gen).to(device),
            "bytes": 4 * (nnz * (1 + 2 * width) + rows), "narrow_bytes": 4 * (nnz * (1 + 2 * narrow) + rows)})
    loss_classes = 8
    return {
        "device": device, "sizes": sizes, "degree": degree, "widths": [width, narrow], "spmm_cases": spmm_cases,
        "stream": [rand(stream_elems) for _ in range(3)],
        "gemm": {(dtype, n): (rand(n, n, dtype=getattr(torch, dtype)), rand(n, n, dtype=getattr(torch, dtype)))
                 for dtype in ("float32", "float64") for n in sizes},
        # "linear"/"linear_deep" -> (rows, inner, x, {width: (W, grad)})
        "products": {key: (rows, inner, rand(rows, inner), {w: (rand(w, inner), rand(rows, w)) for w in linear_widths})
                     for key, rows, inner in (("linear", linear_rows, linear_inner),
                                              ("linear_deep", deep_rows, deep_inner))},
        # the training loss as the runtime computes it: cross-entropy of the training rows of the logits
        "loss": (torch.randn(loss_rows, loss_classes, generator=gen).to(device).requires_grad_(True),
                 torch.randint(0, loss_classes, (loss_rows,), generator=gen).to(device),
                 (torch.rand(loss_rows, generator=gen) < 0.5).to(device)),
        # a dropout's mask as a rank computes it: the rows it holds (here every other row, a hidden
        # layer's 64 features each) of a whole tensor's mask, as bools (MaskDraw.times)
        "mask": (mask_rows, 64, torch.arange(0, mask_rows, 2, device=device)),
    }


def _time_once(pb: dict[str, Any], repeats: int, budget: float, sync: Callable[[], None]) -> dict[str, Any]:
    """Seconds of every measurement of :func:`_problems` ``pb`` once (at the threads set on a CPU), by
    :func:`_best_time` with ``sync``."""
    def best(fn: Callable[[], Any]) -> float:
        return _best_time(fn, repeats, budget, sync)

    logits, labels, train = pb["loss"]

    def loss_forward() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[train], labels[train], reduction="sum") / logits.shape[0]

    def loss_both() -> None:
        loss_forward().backward()
        logits.grad = None

    a, b, c = pb["stream"]
    mask_rows, mask_width, held_rows = pb["mask"]
    out: dict[str, Any] = {"gemm": {"float32": [], "float64": []}, "spmm": [], "linear": {}}
    for (dtype, _), (p, q) in pb["gemm"].items():
        mm_out = torch.empty_like(p)
        out["gemm"][dtype].append(best(lambda: torch.mm(p, q, out=mm_out)))
    out["stream"] = {"copy": best(lambda: c.copy_(a)), "add": best(lambda: torch.add(a, b, out=c))}
    for case in pb["spmm_cases"]:
        g = case["graph"]
        out["spmm"].append({key: best(lambda: propagate(g, case[x], norm="gcn", add_self_loops=True))
                            for key, x in (("seconds", "x"), ("narrow_seconds", "x_narrow"))})
    out["rng"] = best(lambda: dropout_mask(7, 0.5, mask_rows, (mask_width,), rows=held_rows, dtype=torch.bool,
                                           device=pb["device"]))
    forward_s = best(loss_forward)
    out["loss"] = {"forward": forward_s, "backward": max(best(loss_both) - forward_s, forward_s / 10)}
    for key, (_, _, lx, inputs) in pb["products"].items():
        for w, (weight, grad) in inputs.items():
            products = {"forward": lambda: torch.nn.functional.linear(lx, weight),  # what autograd runs
                        "weight_grad": lambda: grad.t().mm(lx), "input_grad": lambda: grad.mm(weight)}
            out["linear"].setdefault(key, {})[str(w)] = {name: best(fn) for name, fn in products.items()}
    return out


def _rates_once(pb: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The rates of one :func:`_time_once` pass ``s`` over ``pb``: FLOP/s, bytes/s, edges/s, draws/s,
    logits/s, and the GEMM and SpMM curves."""
    fits = [_spmm_fit(case["nnz"], (case["narrow_bytes"], t["narrow_seconds"]), (case["bytes"], t["seconds"]))
            for case, t in zip(pb["spmm_cases"], s["spmm"])]  # (edges/s, bytes/s) per case

    def gemm_curve(key: str) -> list[dict[str, Any]]:
        rows, inner = pb["products"][key][:2]
        return [{"width": int(w), **{name: 2 * rows * inner * int(w) / sec for name, sec in products.items()}}
                for w, products in s["linear"][key].items()]

    array_bytes = pb["stream"][0].numel() * 4
    logits = pb["loss"][0].numel()
    mask_rows, mask_width, held_rows = pb["mask"]
    return {
        "flops": {dtype: max(2 * n**3 / t for n, t in zip(pb["sizes"], sec)) for dtype, sec in s["gemm"].items()},
        "mem_bandwidth": max(2 * array_bytes / s["stream"]["copy"], 3 * array_bytes / s["stream"]["add"]),
        "spmm_bandwidth": fits[-1][1], "edge_rate": fits[-1][0],
        "rng_rate": held_rows.numel() * mask_width / s["rng"],
        "loss_rate": logits / s["loss"]["forward"], "loss_grad_rate": logits / s["loss"]["backward"],
        "gemm_curve": gemm_curve("linear"), "gemm_deep_curve": gemm_curve("linear_deep"),
        "spmm_curve": [{"working_set": case["working_set"], "bandwidth": bandwidth, "edge_rate": edge_rate}
                       for case, (edge_rate, bandwidth) in zip(pb["spmm_cases"], fits)],
    }


def _report(pb: dict[str, Any], seconds: Callable[[Callable[[dict], Any]], Any],
            rate: Callable[[Callable[[dict], Any]], Any]) -> dict[str, Any]:
    """The local measurements as :func:`calibrate` records them. ``seconds(get)``: a raw measurement
    ``get`` of the timed passes (``{threads: seconds}`` on a CPU, the seconds on a GPU);
    ``rate(get)``: a rate ``get`` of their :func:`_rates_once` (``[single thread, all cores]`` on a
    CPU, the rate on a GPU)."""
    mask_rows, mask_width, held_rows = pb["mask"]
    logits = pb["loss"][0]
    array_bytes = pb["stream"][0].numel() * 4
    kinds = ("forward", "weight_grad", "input_grad")

    def curve(key: str, products: str) -> list[dict[str, Any]]:
        """The curve ``key`` of :func:`_rates_once`: FLOP/s of the ``products`` by output width."""
        return [{"width": int(w), **{k: rate(lambda r, i=i, k=k: r[key][i][k]) for k in kinds}}
                for i, w in enumerate(pb["products"][products][3])]

    return {
        "rates": {
            "flops": {dtype: rate(lambda r, d=dtype: r["flops"][d]) for dtype in ("float32", "float64")},
            **{k: rate(lambda r, k=k: r[k]) for k in ("mem_bandwidth", "spmm_bandwidth", "edge_rate", "rng_rate",
                                                        "loss_rate", "loss_grad_rate")},
        },
        "rng": {"op": f"dropout_mask(p=0.5, bool): every other row of a {mask_rows} x {mask_width} mask "
                      "(Philox4x32-10)",
                "elements": held_rows.numel() * mask_width, "seconds": seconds(lambda s: s["rng"])},
        "loss": {"op": "cross_entropy(logits[train], labels[train]), half the rows training rows",
                 "rows": logits.shape[0], "classes": logits.shape[1], "seconds": seconds(lambda s: s["loss"])},
        "gemm": {"sizes": pb["sizes"],
                 "seconds": {d: seconds(lambda s, d=d: s["gemm"][d]) for d in ("float32", "float64")}},
        "stream": {"array_bytes": array_bytes, "bytes_moved": {"copy": 2 * array_bytes, "add": 3 * array_bytes},
                   "seconds": seconds(lambda s: s["stream"])},
        "spmm": {"op": "ops.propagate(norm='gcn', add_self_loops=True)", "backend": default_backend(pb["device"]),
                 "degree": pb["degree"], "widths": pb["widths"],
                 "bytes_convention": "4*(nnz*(1+2*width)+rows), NeutronTask Eq. 6; nnz with self loops",
                 "cases": [{**{k: v for k, v in case.items() if k not in ("graph", "x", "x_narrow")},
                            "seconds": seconds(lambda s, i=i: s["spmm"][i]["seconds"]),
                            "narrow_seconds": seconds(lambda s, i=i: s["spmm"][i]["narrow_seconds"])}
                           for i, case in enumerate(pb["spmm_cases"])]},
        "gemm_curve": curve("gemm_curve", "linear"),
        "gemm_deep_curve": curve("gemm_deep_curve", "linear_deep"),
        **{key: {"rows": rows, "inner": inner, "dtype": "float32",
                 "products": {"forward": "F.linear(x, W)", "weight_grad": "g.t() @ x", "input_grad": "g @ W"},
                 "seconds": {str(w): {k: seconds(lambda s, key=key, w=w, k=k: s["linear"][key][str(w)][k])
                                      for k in kinds} for w in inputs}}
           for key, (rows, inner, _, inputs) in pb["products"].items()},
        "spmm_curve": [{"working_set": case["working_set"],
                        "bandwidth": rate(lambda r, i=i: r["spmm_curve"][i]["bandwidth"]),
                        "edge_rate": rate(lambda r, i=i: r["spmm_curve"][i]["edge_rate"])}
                       for i, case in enumerate(pb["spmm_cases"])],
    }


def _op_overhead(device: torch.device, ops: int, repeats: int, budget: float, sync: Callable[[], None]) -> float:
    """Seconds of a tiny op (``add_`` on a 1-element tensor on ``device``) including its launch: the
    mean over ``ops`` back-to-back ones, one ``sync`` after them all (the best of ``repeats``)."""
    tiny = torch.zeros(1, device=device)
    return _best_time(lambda: [tiny.add_(1.0) for _ in range(ops)], repeats, budget, sync) / ops


def _local_rank(ctx: Any, threads: list[int], quick: bool) -> dict[str, Any]:
    """Run in a launched rank: GEMM, STREAM and SpMM rates at each of ``threads`` (in that order),
    and the per-op overhead at one thread."""
    repeats, budget = (3, 0.3) if quick else (7, 1.5)
    pb = _problems(quick, torch.device("cpu"))
    passes: dict[str, dict[str, Any]] = {}
    for t in threads:
        torch.set_num_threads(t)
        passes[str(t)] = _time_once(pb, repeats, budget, _no_sync)
    op_overhead = _op_overhead(torch.device("cpu"), 200, repeats, budget, _no_sync)
    torch.set_num_threads(max(threads))
    push = _push_seconds(pb["spmm_cases"][-1], repeats, budget, _no_sync)
    rates = {t: _rates_once(pb, s) for t, s in passes.items()}
    low, high = str(min(threads)), str(max(threads))
    return {**_report(pb, lambda get: {t: get(s) for t, s in passes.items()},
                      lambda get: [get(rates[low]), get(rates[high])]),
            "op_overhead": {"op": "add_ on a 1-element tensor, 1 thread", "seconds": op_overhead},
            "push": push}


def _gpu_rank(ctx: Any, quick: bool) -> dict[str, Any]:
    """Run in a launched rank on a GPU (``ctx.device``): the rates of :func:`_local_rank` once (no
    threads on a GPU), every timing synchronized; the per-op overhead (launch included), what a
    host synchronize costs, and the GPU's name, memory and matmul settings."""
    device = ctx.device
    torch.cuda.set_device(device)

    def sync() -> None:
        torch.cuda.synchronize(device)

    repeats, budget = (3, 0.3) if quick else (7, 1.5)
    pb = _problems(quick, device)
    s = _time_once(pb, repeats, budget, sync)
    rates = _rates_once(pb, s)
    ops = 1000
    op_overhead = _op_overhead(device, ops, repeats, budget, sync)
    sync()
    round_trips = []
    for _ in range(200):  # an idle device: what the host pays to learn that its queue is empty
        t0 = time.perf_counter()
        sync()
        round_trips.append(time.perf_counter() - t0)
    props = torch.cuda.get_device_properties(device)
    return {**_report(pb, lambda get: get(s), lambda get: get(rates)),
            "op_overhead": {"op": f"add_ on a 1-element tensor: the mean of {ops} back to back, one synchronize "
                                  "at the end (launch included)", "seconds": op_overhead},
            "sync": {"op": "torch.cuda.synchronize() on an idle device (median of 200)",
                     "seconds": statistics.median(round_trips)},
            "push": _push_seconds(pb["spmm_cases"][-1], repeats, budget, sync),
            "gpu": {"name": torch.cuda.get_device_name(device), "memory": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                    "cuda": torch.version.cuda, "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                    "float32_matmul_precision": torch.get_float32_matmul_precision()}}


def _push_seconds(case: dict[str, Any], repeats: int, budget: float, sync: Callable[[], None]) -> dict[str, Any]:
    """The backward product of the largest SpMM case both ways, at the threads set: pulled
    through the transposed CSR, and scattered from the graph's own CSR (``transpose=True``); their
    ratio is the device's ``push_factor``."""
    g = case["graph"]
    csr = CSR(g.indptr, g.indices, g.num_nodes, g.num_src)
    indptr_t, indices_t = g.transpose_structure()
    csr_t = CSR(indptr_t, indices_t, g.num_src, g.num_nodes)
    x = case["x"]
    # alternated, so that a burst of load on a shared host slows both alike, not one of them
    pulled, pushed = _best_times([lambda: spmm(csr_t, None, x), lambda: spmm(csr, None, x, transpose=True)],
                                 repeats, budget, sync)
    return {"op": "A^T x, width 64: over the transposed CSR / scattered from A's CSR",
            "backend": default_backend(x.device), "threads": torch.get_num_threads(),
            "seconds": {"transposed": pulled, "push": pushed}, "factor": pushed / pulled}


def _spmm_fit(edges: int, narrow: tuple[float, float], wide: tuple[float, float]) -> tuple[float, float]:
    """``(edges/s, bytes/s)`` of ``t = edges / edge_rate + bytes / bandwidth`` through two SpMMs of
    different widths (``(bytes, seconds)`` each). Without a per-edge term to find (the narrow one
    is not slower per byte), the edge rate is effectively unlimited and the bandwidth the wide one's."""
    (b1, t1), (b2, t2) = narrow, wide
    per_byte = (t2 - t1) / (b2 - b1) if b2 != b1 else 0.0
    per_edge = (t1 - b1 * per_byte) / edges if per_byte > 0 else 0.0
    if per_byte <= 0 or per_edge <= 0:
        return 1e18, b2 / t2
    return 1.0 / per_edge, 1.0 / per_byte


def _collective_rank(ctx: Any, sizes: list[int], batches: int, iters: list[int], calls: int) -> dict[str, Any]:
    """Run on each launched rank: seconds per ``all_reduce`` / ``all_to_all_single`` of each size,
    ``"back_to_back"``: the best over ``batches`` of ``iters[i]`` calls in a row; ``"in_step"``: the
    mean of ``calls`` calls each after the same short computation on every rank, as the runtime
    issues and waits for them (:func:`~gnncompile.runtime.comm.complete`; a collective follows a
    stage's compute: the ranks arrive at it apart, and a peer that computed meanwhile answers
    later than one spinning on the previous call); ``"switch"``: :func:`_switch_after_collective`
    (CPU ranks; ``None`` on CUDA)."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    # wait as the runtime's ranks do (:func:`~gnncompile.runtime.comm.complete`)
    poll = polls_by_default(ctx.backend, ctx.device)
    result: dict[str, Any] = {
        "back_to_back": {"all_reduce": [], "all_to_all": []}, "in_step": {"all_reduce": [], "all_to_all": []}}
    a = torch.rand(128, 128, device=ctx.device)
    b = torch.empty_like(a)

    def compute() -> None:  # about half a millisecond of a CPU core
        for _ in range(10):
            torch.mm(a, a, out=b)
        sync()

    for nbytes, k in zip(sizes, iters):
        src = torch.zeros(nbytes // 4, device=ctx.device)
        dst = torch.empty_like(src)
        for op, call in (("all_reduce", lambda: complete(dist.all_reduce(src, async_op=True), poll)),
                         ("all_to_all", lambda: complete(dist.all_to_all_single(dst, src, async_op=True), poll))):
            call()
            best = math.inf
            for _ in range(batches):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    call()
                sync()
                best = min(best, (time.perf_counter() - t0) / k)
            result["back_to_back"][op].append(best)
            seconds = []
            for _ in range(max(1, calls // max(1, nbytes // 2**20))):  # fewer of the large ones
                compute()
                t0 = time.perf_counter()
                call()
                sync()
                seconds.append(time.perf_counter() - t0)
            # the mean, not the median: a call that waits for a peer descheduled a few ms (a shared
            # host) is part of what a step costs, and a step sums its instructions
            result["in_step"][op].append(statistics.fmean(seconds))
    # what a wait costs the next computation (CPU ranks: on CUDA the host only launches kernels)
    result["switch"] = _switch_after_collective(poll, 100 if calls < 41 else 300) if ctx.device.type == "cpu" else None
    return result


def _uniform_graph(rows: int, degree: int, gen: torch.Generator) -> Graph:
    """``rows`` vertices of in-degree ``degree`` from uniformly drawn sources (the calibration's propagations)."""
    return Graph.from_edge_index(torch.stack([torch.randint(0, rows, (rows * degree,), generator=gen),
                                              torch.arange(rows).repeat_interleave(degree)]), rows)


def _switch_after_collective(poll: bool, rounds: int) -> dict[str, float]:
    """How much longer a small step-like computation (a propagation and a ReLU over 4096 rows of width
    16: cache-resident) takes right after a collective (a 4 KiB all-reduce, waited for as the runtime
    waits) than right after running it: what the thread switches of a wait cost the caches and
    predictors of the next instruction. Medians over ``rounds`` of each, interleaved."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1)
    rows, degree, width = 4096, 10, 16
    graph = _uniform_graph(rows, degree, gen)
    x = torch.randn(rows, width, generator=gen)
    small = torch.zeros(1024)

    def work() -> None:
        torch.relu(propagate(graph, x, "gcn", add_self_loops=True))

    after, in_a_row = [], []
    for _ in range(rounds):
        complete(dist.all_reduce(small, async_op=True), poll)
        t0 = time.perf_counter()
        work()
        after.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        work()
        in_a_row.append(time.perf_counter() - t0)
    return {"after_collective": statistics.median(after), "in_a_row": statistics.median(in_a_row)}


def _fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(latency, bandwidth)`` of ``seconds ≈ latency + nbytes / bandwidth``, least squares on
    relative error; latency clamped to >= 1e-7 s, and a bandwidth from the largest message if
    the fitted slope is not positive."""
    w = [1 / t**2 for t in seconds]
    s = sum(w)
    sx = sum(wi * x for wi, x in zip(w, nbytes))
    sxx = sum(wi * x * x for wi, x in zip(w, nbytes))
    st = sum(wi * t for wi, t in zip(w, seconds))
    sxt = sum(wi * x * t for wi, x, t in zip(w, nbytes, seconds))
    det = s * sxx - sx * sx
    alpha, beta = ((sxx * st - sx * sxt) / det, (s * sxt - sx * st) / det) if det > 0 else (0.0, 0.0)
    alpha = max(alpha, 1e-7)
    if beta <= 0:
        x_max, t_max = max(zip(nbytes, seconds))
        beta = max(t_max - alpha, t_max / 2) / x_max
    return alpha, 1 / beta


def _measure_collectives(backend: str, world_size: int, quick: bool) -> dict[str, Any]:
    """Launch ``world_size`` ranks and fit latency and bandwidth of their collectives."""
    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20] if quick else [4 * 2**10, 2**20, 16 * 2**20]
    sizes = [s - s % (4 * world_size) for s in sizes]
    iters, batches, calls = ([20, 5, 2], 3, 15) if quick else ([50, 10, 3], 5, 41)
    per_rank = launch(_collective_rank, world_size, (sizes, batches, iters, calls), backend=backend, timeout=120,
                      threads_per_rank=1)
    # the slowest rank's, per mode, collective and size
    seconds = {mode: {op: [max(r[mode][op][i] for r in per_rank) for i in range(len(sizes))]
                      for op in per_rank[0][mode]} for mode in per_rank[0] if mode != "switch"}
    if per_rank[0]["switch"] is None:
        switch: dict[str, Any] = {"op": "not measured (CUDA ranks)", "seconds": 0.0}
    else:
        after = statistics.fmean(r["switch"]["after_collective"] for r in per_rank)
        in_a_row = statistics.fmean(r["switch"]["in_a_row"] for r in per_rank)
        switch = {"op": "relu(propagate) over 4096 rows of width 16, right after a 4 KiB all-reduce vs in a row "
                        "(mean of the ranks' medians)", "seconds_after_collective": after,
                  "seconds_in_a_row": in_a_row, "seconds": max(0.0, after - in_a_row)}
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "all_to_all": (world_size - 1) / world_size}
    # the fits: what an instruction of a step sees (in_step), not the back-to-back best
    fits = {op: _fit_latency_bandwidth([factor[op] * s for s in sizes], t) for op, t in seconds["in_step"].items()}
    latency, bandwidth = fits["all_to_all"]
    return {"backend": backend, "world_size": world_size, "sizes": sizes, "seconds": seconds["in_step"],
            "seconds_back_to_back": seconds["back_to_back"], "fitted_on": "seconds (each call after a short "
            "computation, mean)", "bus_factor": factor,
            "fits": {op: {"latency": a, "bandwidth": b} for op, (a, b) in fits.items()},
            "link_from": "all_to_all", "latency": latency, "bandwidth": bandwidth, "switch": switch}
