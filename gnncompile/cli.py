"""The ``gnncompile`` command line.

``gnncompile train``     train a model on one device (the reference loop) and report accuracy/time
``gnncompile trace``     trace a model into the T/P operator graph and print its table and summary
``gnncompile plan``      plan parallel training on a cluster (``--gpus 4`` or ``--gpus 8x8xA100-ib200``),
                         print (or save) the plan; ``--explain`` prints why the planner chose it
``gnncompile run``       plan, then train across N local ranks (or under ``torchrun``) and report
                         accuracy, epoch time and per-rank communication, predicted beside measured
``gnncompile calibrate`` measure this machine (GEMM, memory, SpMM, collectives) for the cost models
``gnncompile datasets``  list the datasets found locally, with their sizes

Errors print one line (``gnncompile: error: ...``) and exit with status 1; usage errors (bad values,
flags that do not go together, output paths that cannot be written) exit 2 before anything is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import ArgumentError, DatasetError, GnnCompileError
from .paths import output_problem

SYNTHETIC_DEFAULTS = dict(num_nodes=20_000, avg_degree=20, num_features=128, num_classes=8)


# --------------------------------------------------------------------------- argument types
# Checked by argparse, so a bad value is a usage error before anything is loaded, planned or launched.
def _number(text: str, kind: type, what: str, *, low: float, strict: bool, high: float = math.inf,
            high_strict: bool = False) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if (kind is not int and not math.isfinite(value)) or value < low or (strict and value == low) or value > high \
            or (high_strict and value == high):
        raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
    return value


def fanout_list(text: str) -> tuple[int, ...]:
    """``10,5`` -> ``(10, 5)``: sampled in-edges per GNN layer, input layer first (``-1``: all)."""
    from .graph.sampling import parse_fanouts

    if any(not t.strip() for t in text.split(",")):
        raise argparse.ArgumentTypeError(f"an empty fanout in {text!r}: give one number per GNN layer, e.g. 10,5")
    try:
        return parse_fanouts(text)
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """An integer in ``[1, 2^63)`` (epochs, widths, counts)."""
    return _number(text, int, "a positive integer below 2^63", low=0, strict=True, high=2**63, high_strict=True)


def non_negative_int(text: str) -> int:
    """An integer in ``[0, 2^63)`` (seeds, as gc.plan and gc.train take them)."""
    return _number(text, int, "an integer in [0, 2^63)", low=0, strict=False, high=2**63, high_strict=True)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rate, timeout, degree)."""
    return _number(text, float, "a number > 0", low=0.0, strict=True)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (weight decay)."""
    return _number(text, float, "a number >= 0", low=0.0, strict=False)


def probability(text: str) -> float:
    """A dropout probability in [0, 1)."""
    return _number(text, float, "a probability in [0, 1)", low=0.0, strict=False, high=1.0, high_strict=True)


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu, cuda or cuda:N")
    return text


def ranks_or_cluster(text: str) -> Union[int, str]:
    """``--gpus``: a number of local ranks (>= 1), or a cluster description (``4xA5000``), parsed
    here so that a bad one is a usage error (listing the valid names) before anything runs."""
    if text.strip().lstrip("+-").isdigit():
        return positive_int(text)
    from .cost_models.hardware import DEVICES, LINKS, Cluster
    from .errors import PlanningError

    try:
        Cluster.parse(text)
    except PlanningError as e:  # (one usage line: its first clause and the models, links or the grammar)
        first = str(e).split("; ")[0]
        if "profile" in first:  # the spec parsed; a saved profile is unreadable: not a usage error
            return text
        hint = f"models: {', '.join(DEVICES)}" if "model" in first else f"links: {', '.join(LINKS)}" \
            if "link" in first else "expected [NODESx]DEVICESxMODEL[-LINK], e.g. 4xA5000 or 2x4xA100-ib200"
        raise argparse.ArgumentTypeError(f"{first}; {hint}") from None
    return text


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_device(device: Optional[str]) -> None:
    """Refuse a CUDA device this machine does not have, before a model is built or a rank started."""
    if device is None or device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise GnnCompileError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is "
                              f"False; torch {torch.__version__}); use --device cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise GnnCompileError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")


def _load_graph(args: argparse.Namespace):
    from . import datasets

    if args.dataset in datasets.SYNTHETIC_KINDS:
        kw = dict(SYNTHETIC_DEFAULTS)
        for key in ("num_nodes", "avg_degree", "num_features", "num_classes"):
            value = getattr(args, key, None)
            if value is not None:
                kw[key] = value
        return datasets.synthetic(args.dataset, seed=args.seed, **kw)
    try:
        return datasets.load(args.dataset)
    except DatasetError as exc:
        if datasets.locate(args.dataset) is None:  # not found: say what --dataset takes besides files
            raise DatasetError(f"{exc}\nsynthetic graphs (built in, any case): "
                                f"{', '.join(datasets.SYNTHETIC_KINDS)}") from None
        raise


def _require_trainable(graph, args: argparse.Namespace) -> None:
    """Refuse a graph without node features or labels, saying which it lacks and which file it is."""
    from . import datasets

    missing = [what for what, have in (("node features (x)", graph.x), ("labels (y)", graph.y)) if have is None]
    if not missing:
        return
    where = "" if args.dataset in datasets.SYNTHETIC_KINDS else f" ({datasets.locate(args.dataset) or args.dataset})"
    usable = [i.name for i in datasets.list() if i.trainable]
    raise GnnCompileError(f"dataset {graph.name!r}{where} has no {' and no '.join(missing)}, so a model cannot be "
                          f"trained on it; datasets with features and labels: {', '.join(usable) or '(none found)'}")


def _build_model(args: argparse.Namespace, graph):
    import torch

    from . import nn

    _require_trainable(graph, args)
    torch.manual_seed(args.seed)
    extra = {}
    if args.heads is not None:
        extra["heads"] = args.heads
    return nn.build_model(args.model, graph.num_features, args.hidden, graph.num_classes,
                          num_layers=args.layers, dropout=args.dropout, **extra)


def _make_plan(args: argparse.Namespace, runnable: bool = False):
    """The graph (or its statistics), the model and the plan the arguments describe; ``runnable``:
    refuse, before planning, a dataset known here by its statistics only."""
    from . import datasets, nn
    from .api import plan

    known = {k.lower(): k for k in datasets.KNOWN_STATS}
    graph = None
    if args.dataset.lower() in known:
        try:
            graph = datasets.load(args.dataset)
        except GnnCompileError as exc:  # not stored here: plan from its statistics
            if runnable:
                raise GnnCompileError(f"--dataset {args.dataset}: only its statistics are known here ({exc}); "
                                      f"`gnncompile plan` plans from them, training needs the graph") from None
            graph = datasets.KNOWN_STATS[known[args.dataset.lower()]]
    if graph is None:
        graph = _load_graph(args)
    if isinstance(graph, datasets.Graph):
        model = _build_model(args, graph)
    else:
        import torch

        torch.manual_seed(args.seed)
        extra = {"heads": args.heads} if args.heads is not None else {}
        model = nn.build_model(args.model, graph.num_features, args.hidden, graph.num_classes,
                               num_layers=args.layers, dropout=args.dropout, **extra)
    strategy = None if args.strategy == "auto" else args.strategy
    p = plan(model, graph, gpus=_gpus(args.gpus), strategy=strategy, semantics=args.semantics, seed=args.seed,
             features=args.features, **_strategy_options(args))
    return graph, model, p


def _console() -> Any:
    """A rich console for tables: the terminal's width (100 columns at least), or 200 columns when
    the output is not a terminal (a pipe or a file), where rich would shorten numbers to fit 80."""
    from rich.console import Console

    if sys.stdout.isatty():
        console = Console()
        console.width = max(console.width, 100)
        return console
    return Console(width=200)


def _epochs_run(hist: Any, args: argparse.Namespace) -> str:
    """``"N epochs"``, or how many of them ran before early stopping ended the run."""
    if hist.stopped_at is None:
        return f"{args.epochs} epochs"
    return f"{len(hist.loss)} of {args.epochs} epochs (early stop: no better validation accuracy for {args.patience} epoch(s))"


def _gpus(value: Union[int, str]) -> Union[int, str]:
    return int(value) if isinstance(value, int) or value.isdigit() else value


def _report_plan(p, args: argparse.Namespace) -> None:
    if getattr(args, "explain", False):
        print()
        p.explain()
    if getattr(args, "timeline", None):
        with _writing(args.timeline):
            print(f"timeline written to {p.timeline(args.timeline)}")
    if getattr(args, "memory_plot", None):
        with _writing(args.memory_plot):
            print(f"memory plot written to {p.memory_plot(args.memory_plot)}")


def _vertices_held(p: Any, r: Any) -> int:
    """The run table's "vertices" of rank ``r`` (a ``RankResult``): the whole graph's where the plan
    has the rank work on all vertices (``RankSizes.all_nodes``: feature columns, tasks, stages),
    else the rows it owns (the runtime's ``num_owned``: the vertices it scores, 0 on a rank that
    scores none although it holds the whole graph)."""
    sizes = p.ranks[r.rank].sizes
    return max(r.num_owned, sizes.all_nodes or 0)


def _cmd_trace(args: argparse.Namespace) -> int:
    from .frontend.tracer import trace

    graph = _load_graph(args)
    model = _build_model(args, graph)
    tp = trace(model, graph)
    print(tp)
    print()
    print(tp.summary())
    if args.dot:
        _write_text(args.dot, tp.to_dot())
        print(f"DOT written to {_shown(args.dot)}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    _, _, p = _make_plan(args)
    print(p)
    _report_plan(p, args)
    if args.save:
        if isinstance(args.save, str):
            with _writing(args.save):
                p.save(args.save)
        else:
            _write_text(args.save, p.to_json())
        print(f"plan written to {_shown(args.save)}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from rich.table import Table

    _check_device(args.device)
    if args.dist_backend == "nccl" and (args.device == "cpu" or not _cuda_visible()):
        raise GnnCompileError("--dist-backend nccl needs a CUDA device per rank (NCCL does not run on CPU tensors); "
                              "use --dist-backend gloo, or leave it out to let the launcher choose")
    # only what the user set: the runtime chooses devices and backend itself otherwise
    placement = {k: v for k, v in (("device", args.device), ("backend", args.dist_backend)) if v is not None}
    if args.torchrun:
        from .runtime.executor import run_plan_torchrun

        graph, model, p = _make_plan(args, runnable=True)
        if not args.quiet and os.environ.get("RANK", "0") == "0":
            print(p)
            print()
        if os.environ.get("RANK", "0") == "0":
            print(f"{p.num_ranks} ranks under torchrun (world {os.environ.get('WORLD_SIZE', '?')}, "
                  f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} on this machine); planned for "
                  f"{str(p.cluster).split(' (')[0]}")
        res = run_plan_torchrun(p, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                                timeout=args.timeout, **placement, **_checkpointing(args))
        if res is None:  # not rank 0
            return 0
    else:
        from .runtime.executor import describe_run, plan_placement

        graph, model, p = _make_plan(args, runnable=True)
        if not args.quiet:
            print(p)
            print()
        # where the ranks will run (and what the plan was made for), before they start; an
        # impossible forced choice is refused here
        print(describe_run(p, plan_placement(p, **placement)))
        res = p.run(epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                    timeout=args.timeout, **placement, **_checkpointing(args))
    console = _console()
    hist = res.history
    table = Table(title=f"{args.model} on {graph.name}: strategy {p.strategy}, {p.num_ranks} ranks, "
                        f"{_epochs_run(hist, args)}")
    for col in ("final loss", "best val acc", "test acc @ best val", "final test acc", "epoch time (median)"):
        table.add_column(col, justify="right")
    table.add_row(f"{hist.loss[-1]:.4f}" if hist.loss else "-", f"{hist.best_val_acc:.4f}",
                  f"{hist.test_acc_at_best_val:.4f}", f"{hist.final_test_acc:.4f}",
                  f"{hist.median_epoch_time() * 1e3:.1f} ms")
    console.print(table)
    if not any(r.timeline for r in res.ranks):  # a resumed run whose checkpoint had ended: nothing measured
        print(f"no epoch trained in this run: its checkpoint holds {len(hist.loss)} epochs"
              + (f" and stopped early at epoch {hist.stopped_at + 1}" if hist.stopped_at is not None else ""))
    else:
        comm = Table(title="per rank, one training step (measured)" if len(res.ranks) == p.num_ranks else
                     f"rank 0 of {p.num_ranks}, one training step (measured; under torchrun each process has its own)")
        # a sampled plan's epoch runs several steps (and its halo rows change with each sample)
        steps = int(p.info.get("steps_per_epoch") or 1)
        for col in ("rank", "vertices", "halo rows", "bytes sent", "bytes received", "predicted sent",
                    "peak tensor memory", "step time (median)" if steps == 1 else f"step time (epoch / {steps})"):
            comm.add_column(col, justify="right")
        halo = p.info.get("halo_rows", []) if "steps_per_epoch" not in p.info else []
        for r in res.ranks:
            ts = sorted(t / steps for t in (r.epoch_time[1:] or r.epoch_time))
            comm.add_row(str(r.rank), f"{_vertices_held(p, r):,}",
                         f"{halo[r.rank]:,}" if r.rank < len(halo) else "-", f"{r.bytes_sent:,}",
                         f"{r.bytes_received:,}", f"{p.predictions['bytes_sent'][r.rank]:,}",
                         f"{r.peak_memory / 2**20:.1f} MiB", f"{ts[len(ts) // 2] * 1e3:.1f} ms" if ts else "-")
        console.print(comm)
        if p.prediction is not None:
            measured = sorted(t / steps for t in (res.ranks[0].epoch_time[1:] or res.ranks[0].epoch_time))
            med = measured[len(measured) // 2] if measured else float("nan")
            pred = p.prediction
            above = max(pred.first_step_above_resident())
            print(f"step time: predicted {pred.step_time * 1e3:.1f} ms{pred.cluster.prediction_label} on "
                  f"{p.cluster}, measured {med * 1e3:.1f} ms "
                  f"(median); tensor memory of the first step above resident data, predicted peak {above / 2**20:.1f} "
                  f"MiB per rank (measured: the peak tensor memory column)")
    _report_plan(p, args)
    if args.json:
        _write_json(args.json, {"dataset": graph.name, "model": args.model, "strategy": p.strategy,
                                "ranks": p.num_ranks, **hist.to_dict(),
                                "test_acc_at_best_val": hist.test_acc_at_best_val,
                                "bytes_sent": [r.bytes_sent for r in res.ranks],
                                "bytes_received": [r.bytes_received for r in res.ranks],
                                "peak_memory": [r.peak_memory for r in res.ranks]})
    return 0


@contextlib.contextmanager
def _writing(path: Union[str, Path]) -> Any:
    """Writing the output file ``path``: an operating-system error (``/proc/version``: Input/output
    error, a full disk) becomes one line naming the file."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise GnnCompileError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _write_text(target: Any, text: str) -> None:
    """``--save``/``--dot``: ``text`` written to the file ``target``, or to ``target`` itself when it
    is a stream (``-``: :func:`main` passes the standard output)."""
    if isinstance(target, str):
        with _writing(target), open(target, "w") as f:
            f.write(text)
        return
    with _writing("standard output"):
        target.write(text if text.endswith("\n") else text + "\n")
        target.flush()


def _shown(target: Any) -> str:
    """How an output is named in messages: its path, or ``standard output``."""
    return target if isinstance(target, str) else "standard output"


def _json_data(value: Any) -> Any:
    """``value`` with every float that is not finite (a diverged run's NaN loss) as ``None``: JSON has
    no NaN or infinity (Python writes ``NaN``, which strict parsers, ``jq`` and JavaScript refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_data(v) for v in value]
    return value


def _write_json(target: Any, data: dict) -> None:
    """``--json``: ``data`` written to the file ``target``, or to ``target`` itself when it is a stream
    (``--json -``: :func:`main` passes the standard output, the other output going to standard error);
    values JSON has no type for are written as their ``str``, numbers that are not finite as ``null``."""
    data = _json_data(data)
    if isinstance(target, str):
        with _writing(target), open(target, "w") as f:
            json.dump(data, f, indent=1, default=str, allow_nan=False)
        return
    with _writing("standard output"):
        json.dump(data, target, indent=1, default=str, allow_nan=False)
        target.write("\n")
        target.flush()


def _cmd_train(args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from . import kernels
    from .runtime.trainer import train

    _check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.backend:
        kernels.set_default_backend(args.backend)
    console = _console()
    graph = _load_graph(args)
    model = _build_model(args, graph)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]{graph}[/bold]")
    console.print(f"model {args.model}: {n_params:,} parameters; device {args.device}; "
                  f"kernel backend {kernels.default_backend()}")
    if args.batch_size is not None or args.fanouts is not None or args.eval_fanouts is not None:
        sampled = dict(batch_size=args.batch_size, fanouts=args.fanouts, eval_fanouts=args.eval_fanouts)
        if args.batch_size is not None and args.fanouts is not None:
            console.print(f"sampled mini-batches: {args.batch_size} seeds per step, fanouts "
                          f"{','.join(map(str, args.fanouts))} (input layer first)")
    else:
        sampled = {}
    hist = train(model, graph, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
                 seed=args.seed, device=args.device, verbose=None if not args.quiet else False, **_checkpointing(args),
                 **sampled)
    table = Table(title=f"{args.model} on {graph.name}, {_epochs_run(hist, args)} on {args.device}")
    for col in ("final loss", "best val acc", "test acc @ best val", "final test acc",
                "epoch time (median)", "total train time"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{hist.loss[-1]:.4f}" if hist.loss else "-",
        f"{hist.best_val_acc:.4f}",
        f"{hist.test_acc_at_best_val:.4f}",
        f"{hist.final_test_acc:.4f}",
        f"{hist.median_epoch_time() * 1e3:.1f} ms",
        f"{sum(hist.epoch_time):.2f} s",
    )
    console.print(table)
    if args.json:
        _write_json(args.json, {"dataset": graph.name, "model": args.model, "params": n_params, **hist.to_dict(),
                                "test_acc_at_best_val": hist.test_acc_at_best_val})
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from rich.table import Table

    from . import datasets

    infos = datasets.list()
    if args.json:
        print(json.dumps([{**{k: (str(v) if k == "path" else v) for k, v in vars(i).items()},
                           "trainable": i.trainable, "missing": list(i.missing)} for i in infos], indent=1))
        return 0
    table = Table(title="datasets")
    for col in ("name", "nodes", "edges (stored)", "symmetric", "features", "classes", "trainable"):
        table.add_column(col, justify="left" if col in ("name", "trainable") else "right", no_wrap=True)
    for i in infos:
        feats = "-" if not i.num_features else f"{i.num_features:,}" + (" (sparse)" if i.sparse_features else "")
        table.add_row(i.name, f"{i.num_nodes:,}", f"{i.num_edges:,}", "yes" if i.symmetric else "no", feats,
                      str(i.num_classes or "-"), "yes" if i.trainable else f"no: no {' or '.join(i.missing)}")
    console = _console()
    console.print(table)
    for folder in sorted({str(i.path.parent.parent if i.path.parent.name == i.name else i.path.parent) for i in infos}):
        print(f"found in: {folder}")
    print(f"synthetic (built in, trainable): {', '.join(datasets.SYNTHETIC_KINDS)}")
    if any(not i.trainable for i in infos):
        print("not trainable: graphs without node features or labels can be loaded and partitioned, "
              "but train, run and plan need both")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibration import calibrate
    from .cost_models.hardware import default_gpu_profile_path, default_profile_path

    if args.device == "cpu":
        path = args.out or default_profile_path()
        cluster = calibrate(path, quick=args.quick)
    else:  # measured first: the default path is the GPU model's
        cluster = calibrate(args.out, quick=args.quick, device=args.device)
        path = args.out or cluster.save(default_gpu_profile_path(cluster.calibration["model"]))
    print(cluster)
    cal = getattr(cluster, "calibration", None) or {}
    if args.json:
        _write_json(args.json, cal)
    if args.device == "cpu":
        print("\n".join(_cpu_calibration_summary(cal)))
        if Path(path).expanduser().resolve() == default_profile_path().expanduser().resolve():
            print(f"profile written to {path}; plans for '<N>xcpu' clusters use it")
        else:
            print(f"profile written to {path}; plans use it with GNNCOMPILE_PROFILE={path} (they read "
                  f"{default_profile_path()} otherwise)")
        return 0
    d, model = cluster.device, cal["model"]
    print(f"{d.name} ({'preset ' + cal['preset'] if cal.get('preset') else 'no preset matches'}): "
          f"float32 {d.flops['float32'] / 1e12:.3g} TFLOP/s (allow_tf32={cal['gpu']['allow_tf32']}), "
          f"float64 {d.flops['float64'] / 1e12:.3g} TFLOP/s, memory {d.mem_bandwidth / 1e9:.4g} GB/s, "
          f"SpMM {d.spmm_bandwidth / 1e9:.4g} GB/s and {d.edge_rate / 1e9:.3g} G edges/s, "
          f"per op {d.launch_overhead * 1e6:.3g} us, synchronize {cal['sync']['seconds'] * 1e6:.3g} us")
    comm = cal["collectives"]
    print(f"collectives: {comm['skipped']}" if "skipped" in comm else
          f"collectives (nccl, {comm['world_size']} GPUs): {cluster.intra}, "
          f"latency {cluster.intra.latency * 1e6:.3g} us")
    print(f"profile written to {path}; plans for '<N>x{model}' clusters use it"
          + ("" if cal.get("preset") else f" when passed as their profile (no preset is a {model})"))
    return 0


def _cpu_calibration_summary(cal: dict[str, Any]) -> list[str]:
    """What ``calibrate`` measured on the CPU, in a few lines: the key rates at one thread and at
    all cores, the per-op overhead and the collectives' fit (the whole record: ``--json``, or the
    profile file)."""
    rates, threads = cal["rates"], cal["threads"]

    def pair(key: str, scale: float) -> str:  # (one thread / all cores)
        return " / ".join(f"{v / scale:.3g}" for v in rates[key])

    flops = ", ".join(f"{dtype} {' / '.join(f'{v / 1e9:.3g}' for v in values)} GFLOP/s"
                      for dtype, values in rates["flops"].items())
    comm = cal["collectives"]
    return [f"measured{' (quick)' if cal.get('quick') else ''} on {cal['host']}, torch {cal['torch']}; rates at "
            f"{' / '.join(str(t) for t in threads)} thread(s):",
            f"  GEMM {flops}",
            f"  memory {pair('mem_bandwidth', 1e9)} GB/s; SpMM {pair('spmm_bandwidth', 1e9)} GB/s, "
            f"{pair('edge_rate', 1e9)} G edges/s",
            f"  per op {cal['op_overhead']['seconds'] * 1e6:.3g} us; collectives ({comm['backend']}, "
            f"{comm['world_size']} ranks): latency {comm['latency'] * 1e6:.3g} us, bandwidth "
            f"{comm['bandwidth'] / 1e9:.3g} GB/s",
            "  (every measurement: the profile file, or --json PATH)",
            *(f"warning: {w}" for w in cal.get("warnings", [])),
            *(["  (the host was likely busy while measuring: calibrate again when it is quiet)"]
              if cal.get("warnings") else [])]


def build_parser() -> argparse.ArgumentParser:
    from .kernels import BACKENDS
    from .nn import MODELS

    parser = argparse.ArgumentParser(prog="gnncompile", description="Plan and run parallel GNN training.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("train", help="train a model on one device (the reference loop)",
                       description="Full-graph (or, with --batch-size and --fanouts, sampled mini-batch) training on "
                                   "one device with Adam; prints accuracy and epoch time.")
    _add_model_args(t, MODELS)
    t.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                   help="sampled mini-batch training: B seeds per step (needs --fanouts)")
    t.add_argument("--fanouts", type=fanout_list, default=None, metavar="F1,F2,...",
                   help="sampled in-edges per GNN layer, input layer first (-1: all), e.g. 10,5 (needs --batch-size)")
    t.add_argument("--eval-fanouts", type=fanout_list, default=None, metavar="F1,F2,...",
                   help="evaluate on blocks sampled with these fanouts (default: the whole graph; needs --batch-size)")
    t.add_argument("--device", type=device_name, default="cpu", metavar="DEVICE",
                   help="where to train: cpu (default), cuda or cuda:N")
    t.add_argument("--backend", default=None, choices=tuple(BACKENDS),
                   help=f"sparse kernel backend ({', '.join(BACKENDS)}; default: $GNNCOMPILE_BACKEND, else chosen by "
                        "device)")
    t.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    t.add_argument("--json", default=None, metavar="PATH",
                   help="also write the history as JSON to PATH (-: to standard output, the rest of the output "
                        "then going to standard error)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_checkpoint_args(t)
    t.set_defaults(func=_cmd_train)

    tr = sub.add_parser("trace", help="trace a model and print its T/P operator graph",
                        description="Trace the model with torch.fx into the annotated T/P/E operator graph; "
                                    "print the per-op table and the per-layer summary.")
    _add_model_args(tr, MODELS, training=False)
    tr.add_argument("--dot", default=None, metavar="PATH",
                    help="also write Graphviz DOT to PATH (-: to standard output, the rest of the output then going "
                         "to standard error)")
    tr.set_defaults(func=_cmd_trace)

    pl = sub.add_parser("plan", help="plan parallel training and print the plan",
                        description="Trace the model, lower it with a strategy over N ranks, print the per-rank plan.")
    _add_model_args(pl, MODELS, training=False)
    _add_plan_args(pl)
    pl.add_argument("--save", default=None, metavar="PATH",
                    help="also write the plan as JSON to PATH (-: to standard output, the rest of the output then "
                         "going to standard error)")
    pl.set_defaults(func=_cmd_plan)

    r = sub.add_parser("run", help="plan, then train across ranks",
                       description="Plan, then train across N local processes (gloo on CPU, NCCL with one GPU per "
                                   "rank), or under torchrun with --torchrun; prints accuracy and per-rank traffic.")
    _add_model_args(r, MODELS)
    _add_plan_args(r)
    r.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds a collective or receive may wait before the run fails (default: 300)")
    r.add_argument("--device", type=device_name, default=None, metavar="DEVICE",
                   help="where the ranks compute: cpu, or cuda / cuda:N (ranks share the GPUs when they outnumber "
                        "them); default: the GPUs when there are any, else cpu")
    r.add_argument("--dist-backend", default=None, choices=("gloo", "nccl"),
                   help="torch.distributed backend (default: nccl with a GPU per rank, else gloo, which ranks "
                        "sharing a GPU use with host-staged send/recv)")
    r.add_argument("--torchrun", action="store_true",
                   help="this process is one rank launched by torchrun (reads RANK, WORLD_SIZE, MASTER_ADDR...)")
    r.add_argument("--json", default=None, metavar="PATH",
                   help="also write the history and traffic as JSON to PATH (-: to standard output, the rest of the "
                        "output then going to standard error)")
    r.add_argument("--quiet", action="store_true", help="do not print the plan")
    _add_checkpoint_args(r)
    r.set_defaults(func=_cmd_run)

    c = sub.add_parser("calibrate", help="measure this machine for the cost models",
                       description="Measure GEMM FLOP/s, memory and SpMM bandwidth, per-op overhead and the gloo "
                                   "collectives' latency and bandwidth; save the CPU profile the cost models use. "
                                   "With --device cuda: the GPU's rates, launch and runtime costs and NCCL between "
                                   "GPUs; save the profile of that GPU model.")
    c.add_argument("--quick", action="store_true", help="smaller problems, fewer repeats: about 10-20 s on 2 cores, noisier")
    c.add_argument("--device", type=device_name, default="cpu", metavar="DEVICE",
                   help="what to measure: cpu (default), cuda (GPU 0) or cuda:N")
    c.add_argument("--out", default=None, metavar="PATH",
                   help="where to save the profile (default: ~/.cache/gnncompile/cpu_profile.json, or "
                        "$GNNCOMPILE_PROFILE; a GPU's: gpu_profile-<model>.json in that file's directory)")
    c.add_argument("--json", default=None, metavar="PATH",
                   help="also write every measurement as JSON to PATH (-: to standard output, the rest of the "
                        "output then going to standard error)")
    c.set_defaults(func=_cmd_calibrate)

    d = sub.add_parser("datasets", help="list available datasets", description="List the datasets found locally.")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.set_defaults(func=_cmd_datasets)
    return parser


#: strategy options with a command-line flag of their own name ("--seed" is shared with the model's
#: initialization; "--semantics" is a common flag; the model's "--dropout" is its probability)
_SHARED_OPTIONS = {"seed", "semantics"}
_FLAGS = {"dropout": "--dropout-masks"}


def _first_sentence(text: str) -> str:
    return text.split(". ")[0].rstrip(".")


#: metavars of the strategies' integer options (others: N)
_METAVARS = {"batch_size": "B", "chunks": "K", "subgraph_chunks": "K", "stages": "S"}
#: a trailing note in a strategy's help that states its default: "(default 4 per rank)",
#: "(default: one stage per rank)", "(...; half when not given)"
_DEFAULT_NOTE = re.compile(r"^(?:default:?\s+(?P<lead>.+)|(?P<trail>.+?)\s+when not given)$")


def _split_default(text: str) -> tuple[str, Optional[str]]:
    """A strategy option's help ``text`` without the default its trailing parenthesis states, and
    that default (``None``: it states none): ``"chunks (default 4 per rank)"`` ->
    ``("chunks", "4 per rank")``; ``"ranks (the rest ...; half when not given)"`` -> ``("ranks (the rest ...)", "half")``."""
    m = re.search(r"\s*\(([^()]*)\)$", text)
    if m is None:
        return text, None
    kept, note = [], None
    for part in m.group(1).split("; "):
        d = _DEFAULT_NOTE.match(part)
        if d is None:
            kept.append(part)
        else:
            note = d.group("lead") or d.group("trail")
    if note is None:
        return text, None
    return text[:m.start()] + (f" ({'; '.join(kept)})" if kept else ""), note


def _strategy_flag(name: str) -> str:
    """The command-line flag of the strategy option ``name`` (``partitioner`` -> ``--partitioner``)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _add_strategy_options(p: argparse.ArgumentParser) -> None:
    """One flag per strategy option the registered strategies declare (their declarations' kinds,
    choices and documentation); an option not given is searched (or, with a named strategy and a
    pinned option, takes its default). Each flag's help states its default once."""
    from .passes.registry import STRATEGIES, option_specs

    tried: dict[str, set] = {}  # what the strategies' search spaces vary
    for strat in STRATEGIES.values():
        for opts in strat.options.space("relaxed", {}):
            for k, v in opts.items():
                tried.setdefault(k, set()).add(repr(v))
    for name, owners in option_specs().items():
        if name in _SHARED_OPTIONS:
            continue
        spec = owners[0][1]
        docs: dict[str, tuple[list[str], Optional[str]]] = {}  # text -> (strategies, the default it states)
        for who, s in owners:
            text, note = _split_default(s.cli or _first_sentence(s.doc))
            docs.setdefault(text, ([], note))[0].append(who)
        text = "; ".join(f"{', '.join(who)}: {doc}" for doc, (who, _) in docs.items())
        notes = "; ".join(note if len(docs) == 1 else f"{', '.join(who)}: {note}"
                          for who, note in docs.values() if note)
        if len(tried.get(name, ())) > 1:
            default = "searched" + (f", or {spec.default!r} with a named strategy" if spec.pinned else "")
            default += f"; {notes}" if notes else ""
        else:
            values = {repr(s.default) for _, s in owners}
            default = notes or (values.pop() if len(values) == 1 and spec.default is not None else "set by the strategy")
        kwargs: dict[str, Any] = {"default": None, "dest": f"strategy_{name}", "help": f"{text} (default: {default})"}
        if spec.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.kind == "choice":
            kwargs["choices"] = spec.choices
        elif spec.kind == "fanouts":
            kwargs["type"] = fanout_list
            kwargs["metavar"] = "F1,F2,..."
        else:
            kwargs["type"] = non_negative_int if spec.kind == "int" else positive_int
            kwargs["metavar"] = _METAVARS.get(name, "N")
        p.add_argument(_strategy_flag(name), **kwargs)


def _strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The strategy options of the parsed ``args`` (``None``: not given, searched)."""
    from .passes.registry import option_specs

    return {name: getattr(args, f"strategy_{name}") for name in option_specs() if name not in _SHARED_OPTIONS}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from .api import STRATEGIES
    from .passes.registry import PLANNED

    p.add_argument("--gpus", default="4", type=ranks_or_cluster,
                   help="number of local ranks, or a cluster such as 4xA5000 or 8x8xA100-ib200 (default: 4)")
    p.add_argument("--strategy", default="auto", choices=("auto",) + STRATEGIES + PLANNED,
                   help="parallelization strategy; auto (default) lets the cost models choose")
    p.add_argument("--semantics", default="exact", choices=("exact", "relaxed"),
                   help="refuse (exact, default) or allow relaxed transformations")
    p.add_argument("--features", default="auto", choices=("auto", "dense", "csr"),
                   help="how ranks hold the input features: auto (default) stores mostly-zero dense features as "
                        "CSR when only linear layers read them and the cost models predict it faster")
    _add_strategy_options(p)
    p.add_argument("--explain", action="store_true", help="print the planner's candidates and why it chose the plan")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="draw the predicted (and measured) timeline; the file type follows the suffix (.png, .svg, "
                        ".pdf, ...; none: .png is added)")
    p.add_argument("--memory-plot", default=None, metavar="PATH",
                   help="draw the predicted memory per rank (file type as for --timeline)")


def _add_model_args(t: argparse.ArgumentParser, MODELS: dict, *, training: bool = True) -> None:
    """The dataset and model flags; with ``training``, also the optimizer's (``--epochs``, ``--lr``,
    ``--weight-decay``: not for ``trace`` and ``plan``, which train nothing)."""
    t.add_argument("--dataset", default="sbm",
                   help="dataset name or path, or a synthetic kind (sbm, rmat, er); default: sbm")
    t.add_argument("--model", default="gcn", choices=sorted(MODELS), help="model (default: gcn)")
    if training:
        t.add_argument("--epochs", type=positive_int, default=200, help="training epochs (default: 200)")
    t.add_argument("--hidden", type=positive_int, default=64, help="hidden width (per head for gat; default: 64)")
    t.add_argument("--layers", type=positive_int, default=2, help="number of layers (default: 2)")
    with_heads = _models_taking("heads", MODELS)
    t.add_argument("--heads", type=positive_int, default=None,
                   help=f"attention heads ({', '.join(with_heads)} only; default: "
                        + ", ".join(f"{inspect.signature(MODELS[m]).parameters['heads'].default} for {m}"
                                    for m in with_heads) + ")")
    t.add_argument("--dropout", type=probability, default=0.5, help="dropout probability (default: 0.5)")
    if training:
        t.add_argument("--lr", type=positive_float, default=0.01, help="Adam learning rate (default: 0.01)")
        t.add_argument("--weight-decay", type=non_negative_float, default=5e-4,
                       help="Adam weight decay (default: 5e-4)")
    t.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed for weights, dropout, partitioning and synthetic graphs (default: 0)")
    t.add_argument("--num-nodes", type=positive_int, default=None,
                   help="synthetic graphs (sbm, rmat, er) only: number of vertices")
    t.add_argument("--avg-degree", type=positive_float, default=None,
                   help="synthetic graphs (sbm, rmat, er) only: average degree")
    t.add_argument("--num-features", type=positive_int, default=None,
                   help="synthetic graphs (sbm, rmat, er) only: feature dimension")
    t.add_argument("--num-classes", type=positive_int, default=None,
                   help="synthetic graphs (sbm, rmat, er) only: number of classes")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints (torch.distributed.checkpoint) and the best model (best.pt) to DIR "
                        "(with --torchrun on several machines: a filesystem they all share)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="checkpoint every N epochs and after the last one (default: 10)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir up to --epochs in total")
    p.add_argument("--patience", type=positive_int, default=None, metavar="N",
                   help="stop after N epochs without a higher validation accuracy")


def _checkpointing(args: argparse.Namespace) -> dict:
    """The checkpoint and early-stopping keyword arguments of ``train`` / ``plan.run`` the user set."""
    out: dict = {"patience": args.patience}
    if args.checkpoint_dir is not None:
        out.update(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 10,
                   resume=args.resume)
    return out


def _error_text(exc: BaseException) -> str:
    """What an error says: an operating-system error names its file first (``/tmp: Is a directory``,
    ``/proc/version: Input/output error``), the project's errors say what they say."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        names = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{names}: {exc.strerror}"
    return str(exc)


#: keyword arguments of the library whose flag (by command) is not ``--`` + the name with dashes
#: (``plan.run(backend=)`` is ``run --dist-backend``; ``train --backend`` is the kernels')
_KEYWORD_FLAGS = {"backend": {"run": "--dist-backend"}}


def _keyword_flags(parser: argparse.ArgumentParser, command: str) -> dict[str, tuple[str, Optional[str]]]:
    """Keyword argument (``checkpoint_dir``, ``recompute``) -> ``(flag, how a switch is turned off)``
    for the flags of ``command``'s ``parser`` (``("--recompute", "--no-recompute")``, ``("--resume",
    "without --resume")``; ``None`` for a flag taking a value): what :func:`_flag_spelling` translates."""
    out: dict[str, tuple[str, Optional[str]]] = {}
    for action in parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or action.dest == "help":
            continue
        off = next((f for f in flags if f.startswith("--no-")), f"without {flags[0]}") if action.nargs == 0 else None
        out[action.dest.removeprefix("strategy_")] = (flags[0], off)
    for name, by_command in _KEYWORD_FLAGS.items():
        if command in by_command:
            out[name] = (by_command[command], None)
    return out


#: option names without an underscore that messages use only as names (spelled as their flags)
_BARE_NAMES = frozenset({"fanouts"})


def _flag_spelling(message: str, flags: dict[str, tuple[str, Optional[str]]]) -> str:
    """``message`` (a library error) with the keyword arguments it names spelled as the flags the
    user gave: ``resume=True needs checkpoint_dir`` -> ``--resume needs --checkpoint-dir``;
    ``pass resume=True (CLI: --resume)`` -> ``pass --resume``; ``plan.run(..., resume=True) (CLI:
    add --checkpoint-dir D --resume)`` -> ``add --checkpoint-dir D --resume``."""
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    if not names:
        return message
    # a Python spelling followed by its command-line one: keep the latter
    message = re.sub(r"[\w.]+\(\.\.\.[^()]*\) \(CLI: ([^()]*)\)", r"\1", message)
    message = re.sub(rf"\b(?:{names})=\S+ \(CLI: ([^()]*)\)", r"\1", message)

    quotes = "'\""

    def assignment(m: re.Match) -> str:
        flag, off = flags[m.group(1)]
        value = m.group(2)
        if value == "True":
            return flag
        if value == "False" and off is not None:
            return off
        return f"{flag} {value.strip(quotes)}"

    # (not inside a candidate's brackets, data[partitioner=metis, recompute=False]: plan vocabulary)
    message = "".join(part if part.startswith("[") else
                      re.sub(rf"(?<![\w.-])({names})=('[^']*'|\"[^\"]*\"|[^\s,;)]+)", assignment, part)
                      for part in re.split(r"(\[[^\[\]]*\])", message))
    # bare names: those no English word spells (checkpoint_dir, fanouts), and switches after "without"
    spelled = "|".join(sorted((re.escape(n) for n in flags if "_" in n or n in _BARE_NAMES), key=len, reverse=True))
    if spelled:
        message = re.sub(rf"(?<![\w./-])({spelled})(?![\w/=-])", lambda m: flags[m.group(1)][0], message)
    switches = "|".join(sorted((re.escape(n) for n, (_, off) in flags.items() if off), key=len, reverse=True))
    if not switches:
        return message
    return re.sub(rf"\bwithout ({switches})\b(?![=-])", lambda m: f"without {flags[m.group(1)][0]}", message)


def _version() -> str:
    """The installed package's version (the source tree's ``__version__`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gnncompile")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        from . import __version__

        return __version__


def _models_taking(option: str, MODELS: dict) -> list[str]:
    """The models whose constructor takes ``option`` (``heads``: gat)."""
    return [name for name, cls in sorted(MODELS.items()) if option in inspect.signature(cls).parameters]


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-command's parser, whose usage line its errors print."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser  # pragma: no cover


#: output-file flags (argparse dest -> flag) checked before anything is loaded
_OUTPUTS = {"json": "--json", "save": "--save", "dot": "--dot", "timeline": "--timeline",
            "memory_plot": "--memory-plot", "out": "--out"}
#: outputs that ``-`` sends to standard output
_TO_STDOUT = ("json", "save", "dot")
#: pictures: the file type follows the suffix
_PICTURES = ("timeline", "memory_plot")
#: outputs whose missing parent directories are created (``calibrate --out``)
_PARENTS_MADE = ("out",)


def _check_outputs(error: Any, args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written, or a picture of an unknown file type, before
    anything is loaded (a run was wasted to fail on ``--json /tmp`` at the end)."""
    from .viz.timeline import image_path

    for dest, flag in _OUTPUTS.items():
        path = getattr(args, dest, None)
        if not isinstance(path, str) or (dest in _TO_STDOUT and path == "-"):  # (`datasets --json` is a switch)
            continue
        problem = output_problem(path, parents_made=dest in _PARENTS_MADE)
        if problem is None and dest in _PICTURES:
            try:
                problem = output_problem(str(image_path(path)))
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            error(f"argument {flag}: {problem}")


def _check_combinations(error: Any, args: argparse.Namespace) -> None:
    """Refuse flags that do not go together, before anything is loaded (they used to fail, exit 1,
    after the dataset was loaded, or be ignored)."""
    from . import datasets
    from .nn import MODELS

    if isinstance(getattr(args, "dataset", None), str) and args.dataset.lower() in datasets.SYNTHETIC_KINDS:
        args.dataset = args.dataset.lower()  # the kinds, like dataset names, in any case ("SBM")
    if getattr(args, "checkpoint_every", None) is not None and args.checkpoint_dir is None:
        error("--checkpoint-every needs --checkpoint-dir DIR (where the checkpoints go)")
    if getattr(args, "checkpoint_dir", None) is not None and Path(args.checkpoint_dir).expanduser().exists() \
            and not Path(args.checkpoint_dir).expanduser().is_dir():
        error(f"argument --checkpoint-dir: {args.checkpoint_dir} exists and is not a directory")
    if hasattr(args, "dataset") and args.dataset not in datasets.SYNTHETIC_KINDS:
        given = [f"--{k.replace('_', '-')}" for k in SYNTHETIC_DEFAULTS if getattr(args, k, None) is not None]
        if given:
            error(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to synthetic graphs only (--dataset "
                  f"{', '.join(datasets.SYNTHETIC_KINDS)}), not to --dataset {args.dataset}")
    if getattr(args, "heads", None) is not None and args.model not in _models_taking("heads", MODELS):
        error(f"--heads: --model {args.model} has no attention heads (models with heads: "
              f"{', '.join(_models_taking('heads', MODELS))})")
    if args.command == "train":
        batch, fanouts = args.batch_size, args.fanouts
        eval_fanouts = args.eval_fanouts
    elif args.command in ("plan", "run"):
        _check_strategy_options(error, args)
        batch, fanouts = args.strategy_batch_size, args.strategy_fanouts
        eval_fanouts = None
        if args.strategy == "split" and batch is None and fanouts is None:
            error("--strategy split needs --batch-size B and --fanouts F1,F2,... (sampled mini-batch training), "
                  "e.g. --batch-size 1024 --fanouts 10,5")
    else:
        return
    if batch is None and (fanouts is not None or eval_fanouts is not None):
        flag = "--fanouts" if fanouts is not None else "--eval-fanouts"
        error(f"{flag} needs --batch-size B (sampled mini-batch training: B seeds per step)")
    if batch is not None and fanouts is None:
        error("--batch-size needs --fanouts F1,F2,... (sampled in-edges per GNN layer, input layer first, e.g. 10,5)")


def _check_strategy_options(error: Any, args: argparse.Namespace) -> None:
    """Refuse a strategy option the named ``--strategy`` does not have (``--strategy tensor
    --partitioner metis``), as :func:`gnncompile.plan` would after loading the dataset: a value other
    than the option's neutral one (``--chunks 1`` means no chunking, which every strategy does)."""
    from .passes.registry import STRATEGIES, neutral_values
    from .passes.strategy import ANY

    strategy = STRATEGIES.get(args.strategy)
    if strategy is None:  # auto: the search takes the strategies the options allow
        return
    own = set(strategy.options.names())
    neutral = neutral_values()
    for name, value in _strategy_options(args).items():
        if value is None or name in own or (neutral[name] is not ANY and value == neutral[name]):
            continue
        flags = ", ".join(_strategy_flag(n) for n in strategy.options.names() if n not in _SHARED_OPTIONS)
        error(f"{_strategy_flag(name)}: --strategy {strategy.name} has no such option (its options: {flags})")


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check flag by flag: combinations and output paths (usage errors, exit 2)."""
    _check_combinations(parser.error, args)
    _check_outputs(parser.error, args)


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Warnings printed as ``gnncompile: warning: <message>`` on standard error, one line each (not
    Python's ``file:line: Category:`` and the source line that warned, which mean nothing to a user
    of the command)."""
    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = " ".join(str(message).split())
        print(f"gnncompile: warning: {text}", file=sys.stderr if file is None else file)

    saved = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = saved


#: flags whose value is a list of numbers that may start with ``-1`` (argparse takes ``-1,5`` for an option)
_NUMBER_LIST_FLAGS = ("--fanouts", "--eval-fanouts")
_NUMBER_LIST = re.compile(r"^-\d+(?:,\s*-?\d+)*$")


def _attach_number_lists(argv: Sequence[str]) -> list[str]:
    """``--fanouts -1,5`` (or ``--fan -1,5``) as ``--fanouts=-1,5``: what argparse reads as meant."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + list(argv[i:])
        flag = argv[i].startswith("--") and len(argv[i]) > 2 and \
            any(f.startswith(argv[i]) for f in _NUMBER_LIST_FLAGS)
        if flag and i + 1 < len(argv) and _NUMBER_LIST.match(argv[i + 1]):  # (an abbreviation too)
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_attach_number_lists(sys.argv[1:] if argv is None else list(argv)))
    command = _command_parser(parser, args.command)  # (its usage line on its errors)
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "resume", False) and args.checkpoint_dir is None:
        command.error("--resume needs --checkpoint-dir DIR (the directory of the run's checkpoints)")

    _check_arguments(command, args)
    # `--json -` (`--save -`, `--dot -`; a command has one of them): that output alone on standard
    # output, the rest on standard error
    dashes = [dest for dest in _TO_STDOUT if getattr(args, dest, None) == "-"]
    to_stdout = bool(dashes)
    if dashes and sys.stdout is None:  # (`>&-`: the output would be skipped as if not asked for)
        command.error(f"argument {_OUTPUTS[dashes[0]]}: -: standard output is closed; give a file name")
    for dest in dashes:
        setattr(args, dest, sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext(), _one_line_warnings():
            return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of stdout went away (`gnncompile datasets | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (nothing more to flush at exit)
        return 141
    except (GnnCompileError, ValueError, OSError) as exc:
        lines = [ln.strip() for ln in _error_text(exc).strip().splitlines() if ln.strip()]
        msg = lines[0] if lines else type(exc).__name__
        for ln in lines[1:]:
            msg += (" " if msg.endswith(":") else "; ") + ln
        msg = _flag_spelling(msg, _keyword_flags(_command_parser(parser, args.command), args.command))
        print(f"gnncompile: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        from .runtime.checkpoint import latest

        d = getattr(args, "checkpoint_dir", None)
        found = latest(d, warn=False) if d is not None and Path(d).is_dir() else None
        print("gnncompile: interrupted" + (f"; continue from {found.name} with --checkpoint-dir {shlex.quote(str(d))} "
                                           "--resume" if found is not None else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
