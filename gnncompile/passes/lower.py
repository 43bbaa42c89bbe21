"""Generic lowering: per-op layout decisions -> conversions -> stage modules -> instruction lists.

Every strategy is a preset of decisions over the traced operator graph (DESIGN.md, "One space,
not six systems"); this module applies them, so that a strategy module only decides (and the
driver, :mod:`gnncompile.passes.driver`, completes the plan):

1. **Decide** (the strategy, as data: :class:`Decisions`): the layout of every value (``rows``:
   sharded by a vertex partition; ``cols``: sharded by feature; ``replicated``), the layout each
   consumer needs each of its inputs in (a P op on ``rows`` reads source rows it does not own, so
   it needs ``halo``), and the device group of every op.
2. **Convert** (:func:`split_stages`): wherever a consumer needs a layout its producer does not
   give, a :class:`Conversion` is recorded (``rows -> halo``: halo exchange; ``rows <-> cols``:
   all-to-all; ``rows -> replicated``: all-gather, whose backward is a sum-reduce-scatter; a change
   of group: send/recv). One conversion per (value, kind) serves every consumer that needs it.
3. **Split**: a stage boundary is placed at every conversion: an op's stage is the largest, over
   its inputs, of the input's stage plus one if the edge is converted. The ops of one stage become
   one fx ``GraphModule`` whose inputs and outputs are named values (fx node names; converted values
   are ``value@halo`` etc.). Stage modules share the traced model's parameters.
4. **Order**: the stages' forwards and backwards (per chunk) are list-scheduled and the
   conversions' communication is inserted into that order (:mod:`gnncompile.passes.schedule`);
   the driver (:mod:`gnncompile.passes.driver`) appends the gradient all-reduce and the optimizer
   step and inserts FREE.

The split preserves the model: running the stages in order, feeding each converted value through
the identity, computes exactly the traced graph (tested for every model of the zoo).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.fx
import torch.nn.functional as F

from ..errors import PlanningError
from ..frontend.ops import SOURCE_ARGS, call_arguments, dropout_noise, dropout_rows, propagation_calls
from ..ir.plan import OpCost, StageSpec, converted_name
from ..ir.symbolic import Lin
from ..ir.tpgraph import TPGraph, TPInfo, graph_module
from .recompute import _value_bytes, draws_random_numbers

__all__ = [
    "LAYOUTS", "OUTPUT", "CONVERSIONS", "Decisions", "Conversion", "StagedModel", "split_stages",
    "source_input", "call_arguments", "requires_grad_values", "row_mixing_ops", "propagation_norms", "value_dims",
]

LAYOUTS = ("rows", "cols", "replicated")

#: The consumer name of the model output's conversion (the loss).
OUTPUT = "output"

#: (layout a value has, layout a consumer needs) -> the conversion that provides it.
CONVERSIONS: dict[tuple[str, str], str] = {
    ("rows", "halo"): "halo",
    ("rows", "cols"): "cols",
    ("cols", "rows"): "rows",
    # an all-gather (writes value@gathered, AllGather's output); its backward sums the replicas'
    # partial gradients and keeps each rank's rows (a reduce-scatter)
    ("rows", "replicated"): "gathered",
}


def source_input(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The input of a P/E op that is read on the source side of edges (``None`` if it has none)."""
    if node.op != "call_function" or node.target not in SOURCE_ARGS:
        return None
    arg = call_arguments(node)[SOURCE_ARGS[node.target]]
    return arg if isinstance(arg, torch.fx.Node) else None


@dataclass(frozen=True)
class Decisions:
    """A strategy's per-value decisions, applied by :func:`split_stages`.

    ``layout``: value (fx node name) -> ``"rows" | "cols" | "replicated"``; values not listed are
    ``default_layout``. ``needs``: ``(consumer, producer)`` -> the layout the consumer needs the
    producer's value in (only where it differs from the producer's layout). ``output_layout``: the
    layout the loss needs the output in; a conversion of the output (consumed by ``OUTPUT``) is
    added where it differs.
    """

    layout: Mapping[str, str] = field(default_factory=dict)
    needs: Mapping[tuple[str, str], str] = field(default_factory=dict)
    default_layout: str = "rows"
    #: the layout the loss needs the model's output in (``None``: wherever it is)
    output_layout: Optional[str] = None
    #: every stage holds ops of one layout only (stages then run on one device group each: the
    #: ``rows`` group or the ``cols`` group of a mixture-of-accelerators plan)
    pure_stages: bool = False
    #: move a dense op whose users all lie in later stages into the earliest of them (stages on
    #: different ranks then send the op's input, once, instead of its result per user stage)
    sink: bool = False

    def layout_of(self, value: str) -> str:
        return self.layout.get(value, self.default_layout)


@dataclass(frozen=True)
class Conversion:
    """A layout conversion of ``value`` for the ops ``consumers``; writes ``output``."""

    kind: str
    value: str
    output: str
    consumers: tuple[str, ...]
    #: whether the value depends on parameters, i.e. its gradient must travel back
    needs_grad: bool


@dataclass
class StagedModel:
    """A traced model split into stages: what a strategy turns into per-rank programs."""

    tp: TPGraph
    stages: list[StageSpec]
    modules: dict[int, torch.fx.GraphModule]
    conversions: list[Conversion]
    #: stage index of every compute op
    stage_of: dict[str, int]
    #: the name of the model's output value (the logits)
    output: str

    def first_consumer_stage(self, conv: Conversion) -> int:
        """The stage that first needs ``conv`` (``len(stages)`` for the output's conversion: after the last)."""
        return min(self.stage_of.get(c, len(self.stages)) for c in conv.consumers)

    def producer_stage(self, conv: Conversion) -> int:
        return self.stage_of.get(conv.value, -1)


def requires_grad_values(tp: Union[TPGraph, torch.fx.GraphModule], needing: Iterable[str] = ()) -> set[str]:
    """Names of the values that depend on a trainable parameter or on an input named in
    ``needing`` (a checkpointed segment's inputs that need a gradient): their gradients are needed."""
    req: set[str] = set(needing)
    for n in tp.graph.nodes:
        if n.op == "get_attr":
            obj = _get_attr(tp, n.target)
            if isinstance(obj, torch.Tensor) and obj.requires_grad:
                req.add(n.name)
        elif n.op == "call_module":
            mod = tp.get_submodule(n.target)
            if any(p.requires_grad for p in mod.parameters()) or any(a.name in req for a in n.all_input_nodes):
                req.add(n.name)
        elif n.op in ("call_function", "call_method"):
            if any(a.name in req for a in n.all_input_nodes):
                req.add(n.name)
    return req


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def _elsize(dtype: Optional[str]) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype or "float32")).element_size()


def op_costs(tp: TPGraph, nodes: list[torch.fx.Node], decisions: Optional[Decisions] = None, *,
             req: Optional[set[str]] = None, modules: Optional[dict[str, torch.nn.Module]] = None) -> list[OpCost]:
    """The :class:`OpCost` of every T/P/E op among ``nodes`` (what a stage's cost model reads).

    A checkpointed segment (``insert_recomputation``) contributes one entry per op it runs (marked
    ``recompute``; the segment's saved bytes, its inputs, on the first). ``req`` and ``modules``:
    ``tp``'s :func:`requires_grad_values` and named modules when the caller has them (a split
    costs every stage of one graph).
    """
    if req is None:
        req = requires_grad_values(tp)
    if modules is None:
        modules = dict(tp.named_modules())
    out = []
    here = {n.name for n in nodes}
    for n in nodes:
        t = n.meta.get("tp")
        if t is None or t.kind not in ("T", "P", "E"):
            continue
        body = getattr(tp.get_submodule(n.target), "body", None) if n.op == "call_module" else None
        if t.recompute and isinstance(body, torch.fx.GraphModule):
            # a checkpointed segment: cost its ops one by one (a roofline of their sum would hide
            # memory-bound ops behind compute-bound ones); it keeps only its inputs for backward
            inner = [m for m in body.graph.nodes if m.meta.get("tp") is not None
                     and m.meta["tp"].kind in ("T", "P", "E")]
            body_modules = dict(body.named_modules())
            body_here = {m.name for m in body.graph.nodes if m.op not in ("placeholder", "get_attr", "output")}
            placeholders = [m.name for m in body.graph.nodes if m.op == "placeholder"]
            outer = {ph: a for ph, a in zip(placeholders, n.args) if isinstance(a, torch.fx.Node)}
            body_req = requires_grad_values(body, [ph for ph, a in outer.items() if a.name in req])
            returned = {m.name for m in body.graph.output_node().all_input_nodes}
            for k, m in enumerate(inner):
                # its backward: its weights' gradient, and its input's where that needs one (a
                # dropout of the features has none: autograd does not visit it)
                weights = m.meta["tp"].params > 0 or any(a.op == "get_attr" and a.name in body_req
                                                         for a in m.all_input_nodes)
                inputs = any(a.op != "get_attr" and a.name in body_req for a in m.all_input_nodes)
                c = _op_cost(m, m.meta["tp"], body_modules, recompute=True, backward=int(weights) + int(inputs))
                c = dataclasses.replace(c, input_grad=inputs, reads=_reads(m, body_here, req, f"{n.name}.", outer))
                # the first op's saved: what the segment keeps; the others': what they save in the
                # replay (a replicated dropout's output they save: its input and mask, as outside)
                mt = m.meta["tp"]
                saved, replayed = t.saved_bytes if k == 0 else mt.saved_bytes, Lin()
                if k and mt.replays and all(r in body_here for r in mt.replays):
                    saved, replayed = mt.saved_bytes - mt.replay_saving, mt.replayed_bytes
                out.append(dataclasses.replace(c, name=f"{n.name}.{m.name}", saved=saved, replayed=replayed,
                                               returned=m.name in returned))
            if inner:
                continue
        weights = t.params > 0 or any(a.op == "get_attr" and a.name in req for a in n.all_input_nodes)
        inputs = any(a.op != "get_attr" and a.name in req for a in n.all_input_nodes)
        values = _trained_edge_values(n, req) if t.kind == "P" else Lin()
        # a propagation whose edge values need a gradient computes it too (an SDDMM: one more unit)
        trained = values != Lin()
        c = _op_cost(n, t, modules, recompute=t.recompute, backward=int(weights) + int(inputs) + int(trained))
        c = dataclasses.replace(c, values=values, input_grad=inputs, reads=_reads(n, here, req))
        if t.replays and all(r in here for r in t.replays):
            # the dropouts it saves run in its stage: their outputs are computed again in backward
            c = dataclasses.replace(c, saved=t.saved_bytes - t.replay_saving, replayed=t.replayed_bytes)
        elif t.saved_bytes == Lin():
            # what it saves was counted for another op of the trace; a value made in another stage
            # reaches this one as a stage input of its own, which it keeps
            c = dataclasses.replace(c, saved=_saved_stage_inputs(n, t, here))
        out.append(dataclasses.replace(c, layout=decisions.layout_of(n.name)) if decisions is not None else c)
    return out


def _reads(n: torch.fx.Node, here: set[str], req: set[str], prefix: str = "",
           outer: Optional[dict[str, torch.fx.Node]] = None) -> tuple[str, ...]:
    """The values op ``n`` reads: outputs of ops of its stage (``here``) and, among the producers of
    the stage's inputs, those needing a gradient (``req``); through the stage's nodes that are no
    T/P/E op (views, getitem).
    Inside a checkpointed segment: its ops are named ``prefix`` + name, and its placeholders stand
    for the nodes ``outer`` maps them to."""
    found: set[str] = set()
    seen: set[str] = set()
    stack = list(n.all_input_nodes)
    while stack:
        a = stack.pop()
        if a.name in seen or a.op == "get_attr":
            continue
        seen.add(a.name)
        if outer is not None and a.op == "placeholder":
            if a.name in outer and outer[a.name].name in req:
                found.add(outer[a.name].name)
            continue
        if a.name not in here and (outer is not None or a.name not in req):
            continue  # a stage input that needs no gradient (the features, the graph)
        info = a.meta.get("tp")
        if a.name in here and (info is None or info.kind not in ("T", "P", "E")):
            stack.extend(a.all_input_nodes)
        else:
            found.add(prefix + a.name if a.name in here and outer is not None else a.name)
    return tuple(sorted(found))


def _saved_stage_inputs(n: torch.fx.Node, t: TPInfo, here: set[str]) -> Lin:
    """Bytes of the values made outside ``n``'s stage (``here``) that it saves for backward (its
    ``saves``), the input features and parameters excepted (resident)."""
    total = Lin()
    for a in n.all_input_nodes:
        info = a.meta.get("tp")
        if a.name in t.saves and a.name not in here and a.op not in ("placeholder", "get_attr") and info is not None \
                and info.kind in ("T", "P", "E"):
            total = total + _value_bytes(info)
    return total


def _trained_edge_values(n: torch.fx.Node, req: set[str]) -> Lin:
    """Bytes of the edge values (``edge_weight``) propagation ``n`` multiplies by where they need a
    gradient, else ``Lin()``."""
    arg = call_arguments(n).get("edge_weight")
    return _value_bytes(arg.meta.get("tp") if isinstance(arg, torch.fx.Node) and arg.name in req else None)


def dropout_p(n: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> Optional[float]:
    """The drop probability of a dropout node (``None`` for any other op, or when not a constant):
    a dropout with ``p == 0`` or ``p == 1`` draws no random numbers (``F.dropout``, ``dropout_rows``)."""
    if n.op == "call_module":
        m = modules.get(n.target)
        return float(m.p) if isinstance(m, torch.nn.modules.dropout._DropoutNd) else None
    if n.op != "call_function" or n.target not in (F.dropout, dropout_rows, dropout_noise):
        return None
    try:
        p = inspect.signature(n.target).bind(*n.args, **n.kwargs).arguments.get("p", 0.5)
    except TypeError:
        return None
    return float(p) if isinstance(p, (int, float)) else None


def _op_cost(n: torch.fx.Node, t: TPInfo, modules: dict[str, torch.nn.Module], *, recompute: bool,
             backward: int) -> OpCost:
    width = math.prod(t.dims) if t.dims else 1
    rows = t.rows if t.rows is not None else Lin()
    random = Lin()
    if draws_random_numbers(n, modules) and dropout_p(n, modules) not in (0.0, 1.0):
        # a dropout computes the mask of the rows it reads (a replicated one: only those rows of the
        # whole tensor's mask); a sparse input's replicated mask is one draw per stored value, counted
        # whole (``num_rows`` of them: a rank's share of them is not among its sizes), not per element
        # of its dense width; a sampled plan's (``dropout_index_nnz0``: its rows' values, at most its
        # rows times the width) is counted per element
        args = call_arguments(n) if n.target is dropout_rows else {}
        sparse = getattr(args.get("index"), "name", "") == "dropout_index_nnz"  # passes.dropout.INDEX_INPUTS
        random = Lin.const(args["num_rows"]) if sparse else rows * width
    return OpCost(name=n.name, kind=t.kind, flops=t.flops, bytes=t.bytes_read + t.bytes_written, saved=t.saved_bytes,
                  out=rows * (width * _elsize(t.dtype)), width=width, recompute=recompute, backward=backward,
                  random=random, layer=t.layer)


def _sink(graph: torch.fx.Graph, stage_of: dict[str, int], stage_layout: dict[int, str], decisions: Decisions,
          converted_edges: dict[tuple[str, str], str]) -> None:
    """Move each dense op whose users all lie in later stages into the earliest of them (when that
    stage has the op's layout), last op first: e.g. GCNII's ``alpha * x0`` of every layer then runs
    beside its layer, and only ``x0`` crosses to a later stage instead of one product per layer."""
    for n in reversed(list(graph.nodes)):
        if n.name not in stage_of or n.meta.get("tp") is None or n.meta["tp"].kind != "T":
            continue
        users = list(n.users)
        if not users or any(u.name not in stage_of or (u.name, n.name) in converted_edges for u in users):
            continue
        target = min(stage_of[u.name] for u in users)
        if target > stage_of[n.name] and stage_layout.get(target, decisions.layout_of(n.name)) == \
                decisions.layout_of(n.name):
            stage_of[n.name] = target


def split_stages(tp: TPGraph, decisions: Decisions) -> StagedModel:
    """Insert the conversions ``decisions`` call for and split ``tp`` into stage modules.

    Requires: a verified :class:`TPGraph`. Ensures: every compute op is in exactly one stage; each
    stage's inputs are model inputs, outputs of earlier stages, or conversion outputs; the stages
    run in index order compute the traced graph. Raises :class:`PlanningError` when a needed
    layout has no conversion.
    """
    graph = tp.graph
    compute_ops = ("call_function", "call_module", "call_method")
    req = requires_grad_values(tp)
    conv_by_key: dict[tuple[str, str], dict[str, Any]] = {}
    converted_edges: dict[tuple[str, str], str] = {}  # (consumer, producer) -> converted value name
    for n in graph.nodes:
        if n.op not in compute_ops:
            continue
        for p in n.all_input_nodes:
            need = decisions.needs.get((n.name, p.name))
            have = "replicated" if p.op == "get_attr" else decisions.layout_of(p.name)
            if need is None or need == have:
                continue
            # a strategy may tell stages of one layout apart by a suffix ("cols/1"): same conversions
            kind = CONVERSIONS.get((have.split("/")[0], need))
            if kind is None:
                raise PlanningError(f"op {n.name!r} needs {p.name!r} in layout {need!r} but it is {have!r}, and no "
                                    f"conversion {have}->{need} exists (known: "
                                    f"{', '.join(f'{a}->{b}' for a, b in CONVERSIONS)})")
            entry = conv_by_key.setdefault((p.name, kind), {"consumers": []})
            entry["consumers"].append(n.name)
            converted_edges[(n.name, p.name)] = converted_name(p.name, kind)

    stage_of: dict[str, int] = {}
    stage_layout: dict[int, str] = {}
    for n in graph.nodes:
        if n.op not in compute_ops:
            continue
        s = 0
        for p in n.all_input_nodes:
            if p.name in stage_of:
                s = max(s, stage_of[p.name] + (1 if (n.name, p.name) in converted_edges else 0))
            elif (n.name, p.name) in converted_edges:  # a converted model input: ready before stage 0
                s = max(s, 0)
        if decisions.pure_stages:
            lay = decisions.layout_of(n.name)
            while stage_layout.setdefault(s, lay) != lay:
                s += 1
        stage_of[n.name] = s
    if decisions.sink:
        _sink(graph, stage_of, stage_layout, decisions, converted_edges)
    num_stages = max(stage_of.values(), default=-1) + 1
    out_node = next(n for n in graph.nodes if n.op == "output")
    out_arg = out_node.args[0]
    if not isinstance(out_arg, torch.fx.Node):
        raise PlanningError("the model must return one tensor (the logits) to be planned")

    nodes_by_stage: dict[int, list[torch.fx.Node]] = {k: [] for k in range(num_stages)}
    for n in graph.nodes:
        if n.name in stage_of:
            nodes_by_stage[stage_of[n.name]].append(n)

    stages: list[StageSpec] = []
    modules: dict[int, torch.fx.GraphModule] = {}
    named = dict(tp.named_modules())
    for k in range(num_stages):
        members = nodes_by_stage[k]
        member_names = {n.name for n in members}
        sg = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        inputs: list[str] = []

        def value_for(consumer: torch.fx.Node, p: torch.fx.Node) -> torch.fx.Node:
            if p.op == "get_attr":
                if p.name not in env:
                    env[p.name] = sg.get_attr(p.target)
                    env[p.name].meta = dict(p.meta)
                return env[p.name]
            name = converted_edges.get((consumer.name, p.name), p.name)
            if name == p.name and p.name in member_names:
                return env[name]
            if name not in env:
                ph = sg.placeholder(name.replace("@", "_at_"))
                ph.meta = dict(p.meta)
                env[name] = ph
                inputs.append(name)
            return env[name]

        for n in members:
            new = sg.node_copy(n, lambda p, n=n: value_for(n, p))
            env[n.name] = new
        outputs = []
        for n in members:
            used_outside = any(
                u.op == "output" or u.name not in member_names or (u.name, n.name) in converted_edges for u in n.users)
            if used_outside:
                outputs.append(n.name)
        sg.output(tuple(env[o] for o in outputs))
        gm = graph_module(tp, sg, class_name=f"Stage{k}")
        kinds = Counter(n.meta["tp"].kind for n in members if "tp" in n.meta)
        layers = sorted({n.meta["tp"].layer for n in members if "tp" in n.meta and n.meta["tp"].layer > 0})
        stages.append(StageSpec(index=k, inputs=tuple(inputs), outputs=tuple(outputs),
                                ops=tuple(n.name for n in members),
                                kinds=" ".join(f"{kk}{kinds[kk]}" for kk in ("T", "P", "E") if kinds.get(kk)),
                                layers=tuple(layers), costs=tuple(op_costs(tp, members, decisions, req=req,
                                                                          modules=named))))
        modules[k] = gm

    conversions = [
        Conversion(kind=kind, value=value, output=converted_name(value, kind), consumers=tuple(e["consumers"]),
                   needs_grad=value in req)
        for (value, kind), e in conv_by_key.items()
    ]
    output = out_arg.name
    have = decisions.layout_of(output)
    if decisions.output_layout is not None and decisions.output_layout != have:
        kind = CONVERSIONS.get((have.split("/")[0], decisions.output_layout))
        if kind is None:
            raise PlanningError(f"the loss needs the output {output!r} in layout {decisions.output_layout!r} but it is "
                                f"{have!r}, and no conversion {have}->{decisions.output_layout} exists")
        conversions.append(Conversion(kind=kind, value=output, output=converted_name(output, kind),
                                      consumers=(OUTPUT,), needs_grad=output in req))
        output = converted_name(output, kind)
    return StagedModel(tp=tp, stages=stages, modules=modules, conversions=conversions, stage_of=stage_of,
                       output=output)


_ROW_MIXING_MODULES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.InstanceNorm1d)


def row_mixing_ops(tp: TPGraph, training: bool = True) -> list[tuple[str, str]]:
    """Ops other than the graph primitives whose output rows depend on other rows of a vertex- or
    edge-space input: ``(op, why)`` pairs. A BatchNorm-like module that normalizes with the batch's
    statistics, and the ops the tracer found (:attr:`~gnncompile.ir.tpgraph.TPInfo.mixes_rows`:
    reductions, slices and indexes over the vertices, reads of their number, and ops such as a
    normalization, sort, roll or cumulative sum over dim 0). ``training=False``: ``tp`` is an
    evaluation trace, whose BatchNorm modules use their running statistics where they track them."""
    found = []
    for n in tp.graph.nodes:
        info = n.meta.get("tp")
        if info is None or info.kind not in ("T", "E"):
            continue
        if n.op == "call_module" and isinstance(tp.get_submodule(n.target), _ROW_MIXING_MODULES):
            mod = tp.get_submodule(n.target)
            if (training and mod.training) or not getattr(mod, "track_running_stats", False):
                found.append((n.name, f"{type(mod).__name__} normalizes with statistics over all vertices"))
        elif info.mixes_rows:
            found.append((n.name, info.mixes_rows))
    return found


def propagation_norms(*tps: TPGraph) -> set[tuple[str, bool]]:
    """The ``(norm, add_self_loops)`` pairs of the propagations without computed edge weights in
    ``tps`` (the normalization coefficients a rank's graph must hold).

    Raises :class:`PlanningError` for ``norm="gcn"`` of computed edge weights, which needs every
    source's global out-degree.
    """
    norms = set()
    for n, a in propagation_calls(*(tp.graph for tp in tps)):
        if a["edge_weight"] is None:
            norms.add((a["norm"], bool(a["add_self_loops"])))
        elif a["norm"] == "gcn":
            raise PlanningError(
                f"op {n.name!r}: norm='gcn' of computed edge weights needs every source's global "
                "out-degree, which per-rank graphs do not hold; use norm='mean' or normalize first")
    return norms


def value_dims(tp: TPGraph) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per-vertex shape and dtype of every annotated value of ``tp`` (parameters excluded)."""
    out = {}
    for n in tp.graph.nodes:
        t = n.meta.get("tp")
        if t is not None and n.op != "get_attr":
            out[n.name] = (tuple(t.dims), t.dtype or "float32")
    return out
