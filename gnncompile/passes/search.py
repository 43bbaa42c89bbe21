"""The planner's search: enumerate candidate plans, drop those that do not fit, rank by simulated time.

``gnncompile.plan(model, graph, gpus)`` without ``strategy=`` calls :func:`search`:

1. **Enumerate** (:func:`candidates`): for every registered strategy (:mod:`~gnncompile.passes.registry`), the
   product of its option space (``data``: partitioner x recomputation) and of the rank counts to
   try (default: every device; :func:`rank_counts` adds halvings, for ``gc.plan(...,
   devices="any")``: on small graphs communication can cost more than the parallelism gains).
   Options the caller fixed (``partitioner="metis"``) are not varied.
2. **Lower** every candidate to a plan (a strategy that cannot lower a model says why, and the
   candidate is recorded as rejected with that reason). Under ``semantics="exact"`` a plan that
   applied a relaxed transformation is rejected; relaxed plans are considered only when the caller
   asked for ``semantics="relaxed"``.
3. **Predict** each plan with the cost models (:func:`~gnncompile.cost_models.model.predict`:
   discrete-event simulation of all ranks' instruction lists): step time, peak memory per rank.
4. **Filter and rank**: plans whose predicted peak memory exceeds a device's capacity are
   rejected; the rest are ranked by step time (ties: fewer ranks, then fewer bytes). When nothing
   fits, :class:`~gnncompile.errors.PlanningError` says by how much the closest candidate
   overflows and what would make it fit.

**Pruning.** Candidates without chunks are evaluated first; every later one is bounded before it
is costed: a point-to-point pipeline (``mop``) from its
:class:`~gnncompile.passes.schedule.StepOutline`, before its messages are made
(:func:`step_bound`), a lowering whose ranks run alike (``tensor``) from its first rank's
:class:`~gnncompile.passes.schedule.RankOutline`, before the other ranks' steps are made, and any
plan from its instruction lists before the cost model's liveness walk and the simulation
(:func:`plan_bound`). A rank runs one instruction at a time but its posted all-to-alls, which run
in order on a queue of their own and which their readers wait for (with ``overlap``: one stream for
compute, one for communication), so replaying one rank alone, each instruction costed as the cost
model costs it or less (:func:`rank_bound`), ends no later than the simulated step. A candidate
whose bound exceeds the fastest fitting step found so far cannot win and is recorded as rejected
with both numbers (``pruned``); the others are simulated and ranked as above. Only large candidates
(:data:`PRUNE_FROM` instructions or more over all ranks) are pruned: a small one costs little to
simulate, and ``plan.explain()`` compares the plans it has (GNNPipe's rule, the sampled
mini-batch comparison). Point-to-point lowerings whose step would post more than
:data:`~gnncompile.passes.schedule.MAX_MESSAGES` messages are refused from the count, before they
are scheduled.

**Garbage collection.** The objects that exist when a search starts are frozen (``gc.freeze``)
until it returns, so the full collections the search's fx graphs trigger scan only what it made
(:func:`collecting_only_new_objects`; benchmarks/RESULTS.md "Planning time").

The result is a :class:`SearchResult`; ``plan.explain()`` prints it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from ..cost_models import formulas
from ..cost_models.hardware import Cluster
from ..cost_models.model import ELSIZE, Prediction, load_seconds, predict, stage_ops_time
from ..cost_models.specs import PUSH_FACTOR
from ..errors import ArgumentError, GnnCompileError, PlanningError
from ..graph.core import Graph, GraphStats
from ..ir.plan import AllGather, AllReduce, AllToAll, Backward, DevicePlan, Forward, HaloExchange, Plan, RankSizes, \
    ReduceScatter, Send, StageSpec, human_bytes
from ..ir.replay import dependencies
from ..ir.rules import rule
from ..ir.tpgraph import TPGraph
from ..kernels import torch_threads
from .features import choose_feature_layout, trace_both
from .driver import lower, with_backward
from .registry import STRATEGIES, get, neutral_values
from .schedule import Pruned, RankOutline, StepOutline, checking_outlines

__all__ = ["Candidate", "Evaluated", "SearchResult", "candidates", "search", "rank_counts", "sub_cluster", "evaluate",
           "explain_plan", "step_bound", "plan_bound", "rank_bound", "PRUNE_FROM"]


@dataclass(frozen=True)
class Candidate:
    """A point of the search space: a strategy, its options and a rank count."""

    strategy: str
    options: dict[str, Any]
    num_ranks: int

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items()
                         if k not in ("semantics", "strategy", "seed") and v is not None
                         and (k, v) != ("dropout", "replicated"))
        return f"{self.strategy}[{opts}] x{self.num_ranks}"


@dataclass
class Evaluated:
    """A candidate with its plan and prediction, or the reason it was rejected."""

    candidate: Candidate
    plan: Optional[Plan] = None
    prediction: Optional[Prediction] = None
    rejected: str = ""
    #: why the model is not exact under the candidate's strategy, in words that do not name it
    #: (``""`` when it was rejected for another reason)
    inexact: str = ""

    @property
    def ok(self) -> bool:
        return not self.rejected

    @property
    def step_time(self) -> float:
        return self.prediction.step_time if self.prediction else math.inf

    @property
    def peak_memory(self) -> int:
        return self.prediction.max_peak_memory if self.prediction else 0

    @property
    def max_bytes(self) -> float:
        return max(self.prediction.bytes_sent, default=0.0) if self.prediction else 0.0


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


@dataclass
class SearchResult:
    """Every candidate the search looked at, the winner first."""

    cluster: Cluster
    semantics: str
    ranked: list[Evaluated]
    rejected: list[Evaluated]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Evaluated:
        if not self.ranked:
            raise PlanningError("no candidate plan fits")
        return self.ranked[0]

    def table(self, top: int = 8) -> list[str]:
        head = ["#", "candidate", "step time", "peak mem/rank", "max bytes/rank", "compute", "comm", "bubble"]
        rows = []
        for i, e in enumerate(self.ranked[:top]):
            sim = e.prediction.simulation
            comp = max(r.compute for r in sim.ranks)
            comm = max(r.comm for r in sim.ranks)
            rows.append([str(i + 1), e.candidate.describe(), _fmt_time(e.step_time), human_bytes(e.peak_memory),
                         human_bytes(e.max_bytes), _fmt_time(comp), _fmt_time(comm), f"{sim.bubble_fraction:.0%}"])
        widths = [max(len(r[j]) for r in [head] + rows) for j in range(len(head))]
        fmt = lambda r: "  " + "  ".join(x.ljust(w) if j == 1 else x.rjust(w)  # noqa: E731
                                        for j, (x, w) in enumerate(zip(r, widths)))
        return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]

    def why(self) -> list[str]:
        """Why the winner won: its margin over the runner-up, split by what the time goes to."""
        if not self.ranked:
            return []
        best = self.ranked[0]
        if len(self.ranked) == 1:
            return [f"  {best.candidate.describe()} is the only candidate that fits."]
        second = self.ranked[1]
        a, b = best.prediction.simulation, second.prediction.simulation
        lines = [f"  {best.candidate.describe()} wins: {_fmt_time(best.step_time)} per step vs "
                 f"{_fmt_time(second.step_time)} for {second.candidate.describe()} "
                 f"({second.step_time / best.step_time:.2f}x)." if best.step_time > 0 else
                 f"  {best.candidate.describe()} wins."]
        ka, kb = a.time_by_kind(), b.time_by_kind()
        diffs = sorted(((kb.get(k, 0.0) / len(b.ranks) - ka.get(k, 0.0) / len(a.ranks), k) for k in set(ka) | set(kb)),
                       reverse=True)
        parts = [f"{k} {'-' if d > 0 else '+'}{_fmt_time(abs(d))}" for d, k in diffs if abs(d) > 1e-12][:4]
        if parts:
            lines.append(f"  per-rank time by instruction kind, winner vs runner-up: {', '.join(parts)}")
        if best.max_bytes != second.max_bytes:
            lines.append(f"  communication per rank: {human_bytes(best.max_bytes)} vs {human_bytes(second.max_bytes)}")
        if best.peak_memory != second.peak_memory:
            lines.append(f"  peak memory per rank: {human_bytes(best.peak_memory)} vs {human_bytes(second.peak_memory)}")
        other = next((e for e in self.ranked if e.candidate.strategy != best.candidate.strategy), None)
        if other is not None and other is not second:
            lines.append(f"  best other strategy: {other.candidate.describe()}, {_fmt_time(other.step_time)} per step "
                         f"({other.step_time / best.step_time:.2f}x), communication "
                         f"{human_bytes(other.max_bytes)} vs {human_bytes(best.max_bytes)} per rank, peak memory "
                         f"{human_bytes(other.peak_memory)} vs {human_bytes(best.peak_memory)}")
        lines += self._gnnpipe_rule()
        lines += self._sampled_comparison()
        return lines

    def _sampled_comparison(self) -> list[str]:
        """Sampled mini-batch plans: what a step loads, computes and sends under mini-batch ``data``
        and ``split`` (GSPLIT Table 1's redundancy of data parallelism, against split's shuffles),
        from the plans' presampled means; step times are per step, an epoch runs several."""
        evaluated = self.ranked + [e for e in self.rejected if e.prediction is not None]
        found = {}
        for e in evaluated:
            if e.plan is not None and "steps_per_epoch" in e.plan.info:
                found.setdefault(e.candidate.strategy, e)
        if not found:
            return []
        any_plan = next(iter(found.values())).plan
        lines = [f"  sampled mini-batches of {any_plan.info['batch_size']} seeds (fanouts "
                 f"{','.join(map(str, any_plan.info['fanouts']))}): step times are per step, "
                 f"{any_plan.info['steps_per_epoch']} steps per epoch"]
        totals = {}
        for name, e in found.items():
            info = e.plan.info
            totals[name] = (sum(info["input_rows"]), sum(info["sampled_rows"]), sum(info["sampled_edges"]))
            load = max(load_seconds(e.plan, dp, self.cluster.rank_device(dp.rank)) for dp in e.plan.ranks)
            lines.append(f"  {e.candidate.describe()}: per step, all ranks load {totals[name][0]:,} input rows "
                         f"({load * 1e3:.3g} ms on the slowest rank's host link), compute {totals[name][1]:,} rows "
                         f"and aggregate {totals[name][2]:,} edges; {human_bytes(sum(e.prediction.bytes_sent))} sent")
        if "data" in totals and "split" in totals:
            d, sp = totals["data"], totals["split"]
            lines.append(f"  data's micro-batches overlap: {d[0] / max(sp[0], 1):.2f}x the input rows and "
                         f"{d[2] / max(sp[2], 1):.2f}x the edges of split, which sends its shuffles instead "
                         "(GSPLIT Table 1)")
        return lines

    def _gnnpipe_rule(self) -> list[str]:
        """GNNPipe §3.5's rule for graph (``data``) against layer parallelism (``layer``), next to
        the bytes the two best such plans carry (the rule counts one H-wide value per stage boundary
        and no gradient all-reduce; a model carrying more, like GCNII's x0, pays more)."""
        evaluated = self.ranked + [e for e in self.rejected if e.prediction is not None]
        data = next((e for e in evaluated if e.candidate.strategy == "data" and e.plan is not None
                     and "partition" in e.plan.info), None)
        layer = next((e for e in evaluated if e.candidate.strategy == "layer" and e.plan is not None
                      and e.plan.info.get("group_size") == 1), None)
        if data is None or layer is None:
            return []
        alpha = data.plan.info["partition"]["replication_factor"] - 1  # remote copies per vertex
        props = sum(c.kind == "P" for s in data.plan.ranks[0].stages for c in s.costs)
        stages = layer.plan.info["stages"]
        rule = "data" if alpha * props < stages - 1 else "layer"
        sent = {e.candidate.strategy: sum(e.prediction.bytes_sent) for e in (data, layer)}
        planned = min(sent, key=sent.get)
        return [f"  GNNPipe's rule (§3.5): graph parallelism communicates less than layer pipelining when "
                f"alpha_g L < S_p - 1: alpha_g = {alpha:.2f} ({data.plan.info['partition']['method']}, "
                f"{data.candidate.num_ranks} parts), L = {props} propagations, S_p = {stages}: "
                f"{alpha * props:.3g} {'<' if rule == 'data' else '>='} {stages - 1}, so {rule}; the plans carry "
                f"{human_bytes(sent['data'])} ({data.candidate.describe()}: halo exchange and gradient all-reduce) "
                f"vs {human_bytes(sent['layer'])} ({layer.candidate.describe()}: every value crossing a stage) per "
                f"step, so {planned}" + ("" if planned == rule else " (the rule leaves out the all-reduce and "
                                                                    "values wider than one hidden state)")]

    def __str__(self) -> str:
        return self.report()

    def report(self, top: int = 8) -> str:
        """The search as ``plan.explain()`` prints it: how many candidates fit and were rejected, the
        fastest ``top`` in a table, the others named, why the winner won, each rejection's reason."""
        cap = self.cluster.rank_device(0).memory
        total = len(self.ranked) + len(self.rejected)
        shown = min(top, len(self.ranked))
        ranked = f"{len(self.ranked)} fit" + (f" (the fastest {shown} below)" if shown < len(self.ranked) else "")
        lines = [f"Search over {total} candidates on {self.cluster} (semantics={self.semantics}, "
                 f"{self.seconds:.2f} s); memory per rank {human_bytes(cap)}",
                 f"  {ranked}, {len(self.rejected)} rejected",
                 *self.table(top)]
        if shown < len(self.ranked):
            rest = self.ranked[shown:]
            lines.append(f"  ... {len(rest)} slower candidate{'s' if len(rest) > 1 else ''} not shown: "
                         + ", ".join(f"{e.candidate.describe()} {_fmt_time(e.step_time)}" for e in rest[:6])
                         + (f", ... ({len(rest) - 6} more)" if len(rest) > 6 else ""))
        lines += self.why()
        if self.rejected:
            lines.append(f"  rejected ({len(self.rejected)}):")
            lines += [f"    {e.candidate.describe()}: {e.rejected}" for e in self.rejected[:12]]
            if len(self.rejected) > 12:
                lines.append(f"    ... {len(self.rejected) - 12} more")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def rank_counts(cluster: Cluster, limit: Optional[int] = None) -> list[int]:
    """Rank counts to try: all devices, then halvings down to one device (largest first)."""
    n = cluster.num_devices if limit is None else min(limit, cluster.num_devices)
    out = [n]
    k = 1 << (n.bit_length() - 1)
    if k == n:
        k //= 2
    while k >= 1:
        out.append(k)
        k //= 2
    return out


def sub_cluster(cluster: Cluster, num_ranks: int) -> Cluster:
    """The part of ``cluster`` a plan over ``num_ranks`` ranks uses: whole nodes first, filled in
    order. On a CPU host the ranks of a smaller plan get more threads each (the launcher divides the
    cores among the ranks it starts), which :meth:`Cluster.rank_device` models."""
    if num_ranks == cluster.num_devices:
        return cluster
    if not 1 <= num_ranks <= cluster.num_devices:
        raise PlanningError(f"{num_ranks} ranks do not fit the cluster {cluster.name!r} of {cluster.num_devices} devices")
    per_node = min(num_ranks, cluster.devices_per_node)
    nodes = math.ceil(num_ranks / per_node)
    threads = None if cluster.device.kind == "cpu" else cluster.threads_per_rank
    return dataclasses.replace(cluster, nodes=nodes, devices_per_node=per_node,
                               inter=cluster.inter if nodes > 1 else None, threads_per_rank=threads,
                               name=f"{cluster.name}[{num_ranks} of {cluster.num_devices}]")


def candidates(cluster: Cluster, *, semantics: str = "exact", strategies: Optional[Iterable[str]] = None,
               fixed: Optional[dict[str, Any]] = None, ranks: Optional[Sequence[int]] = None) -> list[Candidate]:
    """The search space: every registered strategy's options x rank counts (see the module docstring)."""
    names = list(strategies) if strategies is not None else list(STRATEGIES)
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise PlanningError(f"no lowering registered for strategy {', '.join(map(repr, unknown))}; "
                            f"registered: {', '.join(STRATEGIES)}")
    counts = list(ranks) if ranks is not None else [cluster.num_devices]
    neutral = neutral_values()
    out = []
    for name in names:
        for n in counts:
            out.extend(Candidate(name, opts, n) for opts in STRATEGIES[name].candidates(semantics, dict(fixed or {}),
                                                                                       neutral, n))
    return out


@contextlib.contextmanager
def collecting_only_new_objects() -> Iterator[None]:
    """Within the block, full garbage collections skip the objects that existed when it was entered
    (frozen, and unfrozen on exit: they are collectable again afterwards). Does nothing when the
    caller has frozen objects itself (unfreezing would release theirs) or disabled collection."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: edges of index work per torch thread while planning (partitions, shards, chunks: many ops of
#: O(|E|) each): with less, an op's parallel region costs more than it saves, and far more on a busy
#: host, where it waits for a descheduled thread (RESULTS.md "Planning time")
EDGES_PER_THREAD = 1 << 20


def planning_threads(graph: Union[Graph, GraphStats]) -> contextlib.AbstractContextManager[None]:
    """Within the block, torch uses one thread per :data:`EDGES_PER_THREAD` edges of ``graph``, at
    least one and at most the caller's count (a :class:`GraphStats` plan does no index work on a
    graph: the caller's count)."""
    if not isinstance(graph, Graph):
        return contextlib.nullcontext()
    return torch_threads(max(1, min(torch.get_num_threads(), graph.num_edges // EDGES_PER_THREAD)))


def search(model: torch.nn.Module, graph: Union[Graph, GraphStats], cluster: Cluster, *,
           tp: Optional[TPGraph] = None, tp_eval: Optional[TPGraph] = None, semantics: str = "exact",
           strategies: Optional[Iterable[str]] = None, fixed: Optional[dict[str, Any]] = None,
           ranks: Optional[Sequence[int]] = None, overlap: bool = False, features: str = "auto") -> SearchResult:
    """Lower, predict, filter and rank every candidate (see the module docstring); ``features``: how
    ranks hold the input features (:func:`~gnncompile.passes.features.choose_feature_layout`)."""
    with collecting_only_new_objects(), planning_threads(graph):
        return _search(model, graph, cluster, tp=tp, tp_eval=tp_eval, semantics=semantics, strategies=strategies,
                       fixed=fixed, ranks=ranks, overlap=overlap, features=features)


def _search(model: torch.nn.Module, graph: Union[Graph, GraphStats], cluster: Cluster, *,
            tp: Optional[TPGraph], tp_eval: Optional[TPGraph], semantics: str, strategies: Optional[Iterable[str]],
            fixed: Optional[dict[str, Any]], ranks: Optional[Sequence[int]], overlap: bool,
            features: str) -> SearchResult:
    t0 = time.perf_counter()
    if tp is None or tp_eval is None:
        tp, tp_eval = trace_both(model, graph)
    _check_output_width(type(model).__name__, tp, graph)
    layout = choose_feature_layout(model, graph, cluster, tp, tp_eval, features)
    graph, tp, tp_eval = layout.graph, layout.tp, layout.tp_eval
    ok: list[Evaluated] = []
    rejected: list[Evaluated] = []
    found = candidates(cluster, semantics=semantics, strategies=strategies, fixed=fixed, ranks=ranks)
    # unchunked candidates first: they are cheap to simulate and give the bound to beat (module docstring)
    for cand in sorted(found, key=lambda c: (c.options.get("chunks") or 1) > 1):
        best = min((e.step_time for e in ok), default=math.inf)
        ev = _evaluate(cand, model, graph, cluster, tp, tp_eval, semantics, overlap, beat=best)
        (ok if ev.ok else rejected).append(ev)
    ok.sort(key=lambda e: (e.step_time, e.candidate.num_ranks, e.max_bytes))
    for e in ok + rejected:
        if e.plan is not None:
            e.plan.options["features"] = layout.layout
    result = SearchResult(cluster=cluster, semantics=semantics, ranked=ok, rejected=rejected,
                          seconds=time.perf_counter() - t0)
    if layout.note:
        result.notes.append(layout.note)
    if not cluster.calibrated and cluster.device.kind == "cpu":
        result.notes.append("the CPU numbers are uncalibrated placeholders; run `gnncompile calibrate` once on "
                            "this machine for predictions that track measurements")
    elif not cluster.calibrated:
        result.notes.append("the GPU numbers are datasheet peak rates: kernel launches and the framework's own "
                            "costs are not measured, so steps of small graphs are predicted far too fast (the "
                            "ranking of plans on large graphs holds better)")
    if isinstance(graph, GraphStats):
        if (fixed or {}).get("batch_size") is not None:
            result.notes.append("planned from graph statistics: a mini-batch's per-layer sizes are expectations "
                                "from the mean degree with uniformly drawn sources (formulas.sampled_sizes: hubs "
                                "make real batches smaller and data's micro-batches overlap more), an epoch runs over "
                                "every vertex, and split's shuffles assume the cut shown in the plan's partition line")
        else:
            result.notes.append("planned from graph statistics: per-rank sizes come from the replication factor "
                                "estimate shown in the plan's partition line")
    if not ok:
        raise PlanningError(_nothing_fits(result))
    return result


def _check_output_width(model: str, tp: TPGraph, graph: Union[Graph, GraphStats]) -> None:
    """Raise :class:`ArgumentError` where the output of ``tp`` (the trace of ``model``: one row of
    logits per vertex) has fewer columns than ``graph`` has classes: the loss would read past it."""
    classes = graph.num_classes
    out = tp.graph.output_node().args[0]
    info = out.meta.get("tp") if isinstance(out, torch.fx.Node) else None
    if not classes or info is None or info.space != "V" or len(info.dims) != 1 or info.dims[0] >= classes:
        return
    raise ArgumentError(f"model: {model}'s output has {info.dims[0]} column(s), one "
                        f"logit per class, but {graph.name!r} has {classes} classes (labels 0..{classes - 1}); "
                        f"make its last layer's output width {classes}")


#: The fewest instructions (over all ranks) a candidate's step must have for the search to prune it
#: by its bound instead of simulating it (module docstring).
PRUNE_FROM = 10_000


class _Bounds:
    """Lower bounds of instruction costs on ``cluster``: each is the cost model's own
    (:class:`~gnncompile.cost_models.model.PlanCost`) or less (a sampled step's input loading and an
    oversubscribed host's latency factor are left out, an all-to-all's peers counted from its send
    and receive sides apart), memoized (ranks repeat them)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.per_node = cluster.devices_per_node
        self._stages: dict[tuple, float] = {}
        self._p2p: dict[tuple, float] = {}
        self._links: dict[tuple[int, ...], Any] = {}
        self._totals: dict[int, tuple[tuple, int, int]] = {}  # id(shapes) -> (shapes, elements, non-empty)
        self._devices: dict[int, Any] = {}  # rank -> its device (held: the memos key devices by id)

    def device(self, rank: int) -> Any:
        dev = self._devices.get(rank)
        if dev is None:
            dev = self._devices[rank] = self.cluster.rank_device(rank)
        return dev

    def stage(self, rank: int, sizes: RankSizes, stage: StageSpec, backward: bool) -> float:
        """One Forward/Backward of ``stage`` on a rank of ``sizes`` (one chunk's share)."""
        dev = self.device(rank)
        key = (id(dev), sizes, id(stage), backward)
        t = self._stages.get(key)
        if t is None:
            # the cost model's own stage time without the loss and with the cheaper of pulled and pushed
            # backward products (a profile may measure pushing faster): not more
            push = backward and (dev.push_factor if dev.push_factor is not None else PUSH_FACTOR) < 1
            t = self._stages[key] = stage_ops_time(stage, sizes.per_chunk(), dev, backward, push)
        return t

    def send(self, rank: int, peer: int, shape: tuple[int, ...], dtype: str) -> float:
        """A point-to-point Send of ``shape`` from ``rank`` to ``peer``."""
        dev = self.device(rank)
        key = (id(dev), rank // self.per_node == peer // self.per_node, shape, dtype)
        t = self._p2p.get(key)
        if t is None:
            link = self.cluster.link(rank, peer)
            t = self._p2p[key] = dev.runtime.get("comm", 0.0) + formulas.p2p_time(
                math.prod(shape) * ELSIZE.get(dtype, 0), link.bandwidth, link.latency)
        return t

    def _total(self, shapes: tuple) -> tuple[int, int]:
        hit = self._totals.get(id(shapes))
        if hit is None or hit[0] is not shapes:
            numel = [math.prod(x) for x in shapes]
            hit = self._totals[id(shapes)] = (shapes, sum(numel), sum(1 for x in numel if x))
        return hit[1], hit[2]

    def all_to_all(self, rank: int, inst: AllToAll) -> float:
        """The rank's own part of an all-to-all (pairwise exchange over the group's slowest link):
        its peers counted as the larger of those it sends to and receives from."""
        if len(inst.group) <= 1 or not inst.send_shapes or not inst.recv_shapes:
            return 0.0
        link = self._link(inst.group)
        me = inst.group.index(rank)
        moved, peers = [], 0
        for shapes in (inst.send_shapes, inst.recv_shapes):
            total, nonempty = self._total(shapes)
            own = math.prod(shapes[me])
            moved.append(total - own)
            peers = max(peers, nonempty - (1 if own else 0))
        es = ELSIZE.get(inst.dtype, 0)
        return self.device(rank).runtime.get("comm", 0.0) + peers * link.latency + \
            max(moved) * es / link.bandwidth

    def _link(self, group: tuple[int, ...]) -> Any:
        link = self._links.get(group)
        if link is None:
            link = self._links[group] = self.cluster.slowest_link(group)
        return link

    def _rows(self, rows: tuple) -> tuple[int, int]:
        hit = self._totals.get(id(rows))
        if hit is None or hit[0] is not rows:
            hit = self._totals[id(rows)] = (rows, sum(rows), sum(1 for x in rows if x))
        return hit[1], hit[2]

    def halo(self, rank: int, inst: HaloExchange) -> float:
        """A halo exchange (an all-to-all of rows; its peers counted as for :meth:`all_to_all`)."""
        if len(inst.group) <= 1:
            return 0.0
        per_row = inst.width * ELSIZE.get(inst.dtype, 0)
        (out, peers_out), (into, peers_in) = self._rows(inst.send_rows), self._rows(inst.recv_rows)
        link = self._link(inst.group)
        return self.device(rank).runtime.get("comm", 0.0) + (max(peers_out, peers_in) if per_row else 0) * \
            link.latency + max(out, into) * per_row / link.bandwidth

    def collective(self, rank: int, inst: Union[AllReduce, AllGather, ReduceScatter]) -> float:
        """A ring all-reduce, all-gather or reduce-scatter over the group's slowest link (an
        all-reduce inside one node: the link the cluster measured for it)."""
        n = len(inst.group)
        if n <= 1:
            return 0.0
        c = self.cluster
        if type(inst) is AllReduce:
            link = c.collective_link("all_reduce") if c.nodes == 1 else self._link(inst.group)
            t = formulas.ring_allreduce_time(inst.numel * ELSIZE.get(inst.dtype, 0), n, link.bandwidth, link.latency)
        else:
            link = self._link(inst.group)
            t = formulas.ring_allgather_time(math.prod(inst.shape) * ELSIZE.get(inst.dtype, 0), n, link.bandwidth,
                                             link.latency)
        return self.device(rank).runtime.get("comm", 0.0) + t


def step_bound(outline: StepOutline, cluster: Cluster, overlap: bool = False) -> tuple[float, int]:
    """A lower bound of the simulated step time of the plan ``outline`` describes on ``cluster``, and
    the rank giving it: the rank's compute (its tasks' stage times) plus its sends' transfer times
    (one instruction at a time), or the larger of the two with ``overlap`` (two streams); every
    term the cost model's or less (:class:`_Bounds`)."""
    bounds = _Bounds(cluster)
    best, worst = 0.0, -1
    for r, tasks in outline.tasks.items():
        sizes = outline.sizes[r]
        compute = sum(bounds.stage(r, sizes, outline.stages[t.stage], isinstance(t, Backward)) for t in tasks)
        sends = sum(bounds.send(r, peer, shape, dtype) for peer, shape, dtype in outline.sends[r])
        t = max(compute, sends) if overlap else compute + sends
        if t > best:
            best, worst = t, r
    return best, worst


def plan_bound(plan: Plan, cluster: Cluster, overlap: bool = False, beat: float = math.inf) -> tuple[float, int]:
    """A lower bound of ``plan``'s simulated step time on ``cluster`` (and the rank giving it) from
    its instruction lists, without the cost model's liveness walk or the simulation.

    Every rank's instructions are replayed alone (:func:`rank_bound`) with each instruction's
    bounded duration: the simulation runs the same queues and dependencies, a collective starts no
    earlier than this rank is ready and lasts at least this rank's own part, and a Recv ends no
    earlier than it is ready, so no instruction ends earlier in the simulation than here. With
    ``overlap`` (two streams per rank) the rank's compute, and its communication, each run one at a
    time. Stops at the first rank whose bound exceeds ``beat`` (that rank's bound: the candidate
    cannot win)."""
    bounds = _Bounds(cluster)
    names = plan.info.get("inputs", ("g", "x"))
    inputs = frozenset((names,) if isinstance(names, str) else names)
    best, worst = 0.0, -1
    for dp in plan.ranks:
        t = rank_bound(dp, bounds, inputs, overlap, beat)
        if t > best:
            best, worst = t, dp.rank
            if best > beat:
                break
    return best, worst


def _holds_transposes(plan: Plan) -> bool:
    """Whether some rank of ``plan`` holds a transposed graph for its backward products (a graph
    that is not the whole symmetric graph, with ``backward="transposed"``)."""
    if plan.options.get("backward", "transposed") != "transposed":
        return False
    topo = plan.info.get("topology", {})
    held = topo.get("graphs")
    if held is not None:
        return any(not sym for graphs in held for *_, sym in graphs)
    whole = all(dp.sizes.nodes == dp.sizes.source_rows == topo.get("nodes") for dp in plan.ranks)
    return not (topo.get("symmetric") and whole)


def rank_bound(dp: DevicePlan, bounds: "_Bounds", inputs: frozenset[str], overlap: bool = False,
               beat: float = math.inf) -> float:
    """A lower bound of when rank ``dp``'s last instruction ends in the simulation (:func:`plan_bound`).

    Without ``overlap``: the replay of the rank alone (:func:`~gnncompile.ir.replay.replay`'s queues
    and data dependencies: one instruction at a time, posted all-to-alls in order on a queue of
    their own, a reader waiting for them), each Forward/Backward, Send and collective taking its
    :class:`_Bounds` time, anything else none. That replay lies between the larger of its two
    queues' totals and the sum of both (it never idles); when either already decides against a
    finite ``beat`` (the former exceeds it, or the latter does not), the former is returned without
    the rank's dependencies. With ``overlap``: the larger of the compute and the communication (each
    stream runs one instruction at a time)."""
    r = dp.rank
    stages = {s.index: s for s in dp.stages}
    insts = dp.instructions
    rules = [rule(inst) for inst in insts]
    posted = [rl.posted for rl in rules]  # all-to-alls: on a queue of their own
    seconds = [0.0] * len(insts)
    compute = comm = 0.0
    for i, inst in enumerate(insts):
        kind = type(inst)
        if kind is Forward or kind is Backward:
            seconds[i] = t = bounds.stage(r, dp.sizes, stages[inst.stage], kind is Backward)
            compute += t
        elif kind is Send:
            seconds[i] = t = bounds.send(r, inst.peer, inst.shape, inst.dtype)
            comm += t
        elif kind is AllToAll:
            seconds[i] = t = bounds.all_to_all(r, inst)
            comm += t
        elif kind is HaloExchange:
            seconds[i] = t = bounds.halo(r, inst)
            comm += t
        elif kind is AllReduce or kind is AllGather or kind is ReduceScatter:
            seconds[i] = t = bounds.collective(r, inst)
            comm += t
    if overlap:
        return max(compute, comm)
    if not any(posted):  # one queue, in program order
        return sum(seconds)
    total = sum(seconds)
    on_posted = sum(t for t, p in zip(seconds, posted) if p)
    cheap = max(total - on_posted, on_posted)
    if math.isfinite(beat) and (cheap > beat or total <= beat):
        return cheap
    queues = ["posted" if p else "rank" for p in posted]
    deps = dependencies(dp, inputs, queues, rules)
    end = [0.0] * len(insts)
    last = {"rank": 0.0, "posted": 0.0}
    for i, q in enumerate(queues):
        t = last[q]
        for d in deps[i]:
            if end[d] > t:
                t = end[d]
        end[i] = last[q] = t + seconds[i]
    return max(last.values())


def _evaluate(cand: Candidate, model: torch.nn.Module, graph: Union[Graph, GraphStats], cluster: Cluster,
              tp: TPGraph, tp_eval: TPGraph, semantics: str, overlap: bool, beat: float = math.inf) -> Evaluated:
    """Lower and predict one candidate; ``rejected`` says why it cannot be returned (if so). A large
    candidate (:data:`PRUNE_FROM`) whose :func:`step_bound` or :func:`plan_bound` exceeds ``beat``
    (the fastest step found so far) is pruned."""
    ev = Evaluated(cand)
    if cand.num_ranks > max(graph.num_nodes, 1):
        ev.rejected = f"{cand.num_ranks} ranks exceed the graph's {graph.num_nodes} vertices"
        return ev
    used = sub_cluster(cluster, cand.num_ranks)
    strategy = get(cand.strategy)
    # NeutronTask Eq. 7 splits the ranks by the cost model's task times on the cluster's device
    device = used.rank_device(0) if strategy.needs_device else None

    def check(outline: Union[StepOutline, RankOutline]) -> None:
        if isinstance(outline, RankOutline):  # one of ranks that run alike
            if len(outline.instructions) * cand.num_ranks < PRUNE_FROM or not math.isfinite(beat):
                return
            dp = DevicePlan(outline.rank, outline.stages, outline.instructions, outline.sizes)
            bound = rank_bound(dp, _Bounds(used), outline.inputs, overlap, beat)
            if bound > beat:
                raise Pruned(f"pruned: its step takes at least {_fmt_time(bound)} (rank {outline.rank}'s compute, "
                             f"sends and all-to-alls in program order), slower than {_fmt_time(beat)} found before")
            return
        size = sum(map(len, outline.tasks.values())) + 2 * sum(map(len, outline.sends.values()))  # Send + Recv
        if size < PRUNE_FROM or not math.isfinite(beat):
            return
        bound, rank = step_bound(outline, used, overlap)
        if bound > beat:
            raise Pruned(f"pruned: its step takes at least {_fmt_time(bound)} (rank {rank}'s compute "
                         f"{'or' if overlap else 'plus'} its sends), slower than {_fmt_time(beat)} found before")

    try:
        with checking_outlines(check):
            ev.plan = lower(strategy, tp, tp_eval, model, graph, cand.num_ranks,
                            strategy.make_options(dict(cand.options)), device=device)
    except Pruned as e:
        ev.rejected = str(e)
        return ev
    except GnnCompileError as e:
        ev.rejected = f"cannot lower: {e}"
        ev.inexact = getattr(e, "inexact", None) or ""
        return ev
    if semantics == "exact" and ev.plan.relaxations:
        ev.rejected = f"relaxed ({'; '.join(ev.plan.relaxations)}) but semantics='exact'"
        return ev
    if math.isfinite(beat) and sum(len(dp.instructions) for dp in ev.plan.ranks) >= PRUNE_FROM:
        bound, rank = plan_bound(ev.plan, used, overlap, beat)
        if bound > beat:
            ev.rejected = (f"pruned: its step takes at least {_fmt_time(bound)} (rank {rank}'s compute, sends and "
                           f"all-to-alls in program order), slower than {_fmt_time(beat)} found before")
            return ev
    ev.plan.cluster = str(used)
    # the devices planned for, as data (the run header compares them with where the ranks run)
    ev.plan.info["devices"] = {"nodes": used.nodes, "per_node": used.devices_per_node, "kind": used.device.kind,
                               "name": used.device.name}
    # what gnncompile.load_plan plans again for, as JSON holds it (a saved plan reads back equal)
    ev.plan.info["cluster"] = json.loads(json.dumps(used.to_dict()))
    ev.prediction = predict(ev.plan, used, overlap=overlap)
    if not ev.prediction.fits and "backward" not in cand.options and _holds_transposes(ev.plan):
        # exact either way: without the transposed graphs a candidate may fit, for slower backward products
        # (kept when it fits, or as the closer miss when neither does)
        pushed = with_backward(ev.plan, "push")
        prediction = predict(pushed, used, overlap=overlap)
        if prediction.fits or prediction.max_peak_memory < ev.prediction.max_peak_memory:
            ev.plan, ev.prediction = pushed, prediction
    ev.plan.prediction = ev.prediction
    if not ev.prediction.fits:
        cap = used.rank_device(0).memory
        pushed_note = " with backward products pushed (no transposed graphs)" \
            if ev.plan.options.get("backward") == "push" and "backward" not in cand.options else ""
        ev.rejected = (f"does not fit: predicted peak {human_bytes(ev.prediction.max_peak_memory)} per rank"
                       f"{pushed_note} exceeds {human_bytes(cap)} by "
                       f"{human_bytes(ev.prediction.max_peak_memory - cap)}")
    return ev


def evaluate(model: torch.nn.Module, graph: Union[Graph, GraphStats], cluster: Cluster, strategy: str = "data", *,
             num_ranks: Optional[int] = None, semantics: str = "exact", overlap: bool = False,
             features: str = "auto", **options: Any) -> Evaluated:
    """Lower and predict one candidate without filtering it (e.g. to see how far a plan overflows).

    ``options`` are the strategy's options (``partitioner="metis"``, ``recompute=False``...);
    ``num_ranks`` defaults to every device of ``cluster``; ``features`` as for :func:`search`.
    """
    if strategy not in STRATEGIES:
        raise PlanningError(f"no lowering registered for strategy {strategy!r}; registered: {', '.join(STRATEGIES)}")
    tp, tp_eval = trace_both(model, graph)
    layout = choose_feature_layout(model, graph, cluster, tp, tp_eval, features)
    graph, tp, tp_eval = layout.graph, layout.tp, layout.tp_eval
    opts = STRATEGIES[strategy].candidates(semantics, options, neutral_values(), num_ranks or cluster.num_devices)
    if len(opts) != 1:
        raise PlanningError(f"evaluate: fix every option of strategy {strategy!r} (got {sorted(options)}); "
                            f"it would try {len(opts)} variants")
    cand = Candidate(strategy, opts[0], num_ranks or cluster.num_devices)
    ev = _evaluate(cand, model, graph, cluster, tp, tp_eval, semantics, overlap)
    if ev.plan is not None:
        ev.plan.options["features"] = layout.layout
    return ev


def _reasons(rejected: list[Evaluated], shown: int = 6) -> str:
    """Why the candidates ``rejected`` were: each distinct reason once, after the candidates it
    rejected (the first ``shown`` reasons, then how many more)."""
    by_reason: dict[tuple[bool, str], list[Evaluated]] = {}   # (not exact?, why) -> the candidates
    for e in rejected:
        by_reason.setdefault((bool(e.inexact), e.inexact or e.rejected), []).append(e)
    parts = []
    for (inexact, why), evs in list(by_reason.items())[:shown]:
        cands = [e.candidate.describe() for e in evs]
        who = cands[0] if len(cands) == 1 else f"{cands[0]} and {len(cands) - 1} more candidates"
        names = list(dict.fromkeys(e.candidate.strategy for e in evs))
        if inexact and len(names) > 1:   # (one strategy: its own words)
            why = f"strategies {', '.join(map(repr, names))} are not exact for this model: {why}"
        elif inexact:
            why = evs[0].rejected
        parts.append(f"{who}: {why}")
    if len(by_reason) > shown:
        parts.append(f"{len(by_reason) - shown} more reasons")
    return "; ".join(parts)


def _nothing_fits(result: SearchResult) -> str:
    """The error when no candidate fits: the closest one, by how much it overflows, and what would help."""
    measured = [e for e in result.rejected if e.prediction is not None]
    if not measured:
        return f"no candidate plan could be built: {_reasons(result.rejected)}"
    cap = result.cluster.rank_device(0).memory
    closest = min(measured, key=lambda e: e.peak_memory)
    over = closest.peak_memory - cap
    hints = []
    static = max(s.total for s in closest.prediction.static)
    if static > cap:
        hints.append(f"its resident data alone ({human_bytes(static)} per rank: topology, features, parameters) "
                     "exceeds a device, so only more devices (or a strategy that shards the graph further) help")
    else:
        need = math.ceil(closest.candidate.num_ranks * closest.peak_memory / cap)
        hints.append(f"about {need} devices of this kind would spread it to fit")
        if not closest.candidate.options.get("recompute", True):
            hints.append("recomputation would shrink the saved activations")
    return (f"no plan fits in {human_bytes(cap)} per device on {result.cluster}: the closest, "
            f"{closest.candidate.describe()}, needs {human_bytes(closest.peak_memory)} per rank, "
            f"{human_bytes(over)} too much; " + "; ".join(hints))


def explain_plan(plan: Plan) -> str:
    """What ``plan.explain()`` prints: the search that chose the plan, or the plan's own prediction."""
    result: Optional[SearchResult] = getattr(plan, "search", None)
    lines = []
    if result is not None:
        lines.append(str(result))
    pred: Optional[Prediction] = getattr(plan, "prediction", None)
    if pred is not None:
        sim = pred.simulation
        lines.append(f"Chosen plan: {plan.strategy} over {plan.num_ranks} ranks on {pred.cluster}: predicted step "
                     f"{_fmt_time(sim.step_time)}{pred.cluster.prediction_label}, bubble {sim.bubble_fraction:.0%}")
        lines += [ln for ln in plan.header()[1:]]
        lines.append(sim.summary())
        st = pred.static[0]
        lines.append("  resident data on rank 0: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in st.as_dict().items()))
    if not lines:
        lines.append("this plan carries no prediction (it was loaded from a file); plan it again to explain it")
    return "\n".join(lines)
