"""`insert_recomputation`: recompute T segments in backward instead of saving their activations.

NeutronTask §5.1 ("Recomputation Technique", Fig. 8c): between two graph operations a GNN runs a
run of vertex-wise T ops (bias, activation, dropout, the next layer's linear map) that is an
ordinary DNN block, so the classic checkpointing trick applies to it: keep only the block's inputs
for backward and re-run the block when its gradients are needed. The recomputed values are
identical (dropout replays the same RNG state), so the pass is exact.

Decide, then rewrite
--------------------
:func:`t_segments` returns the decision as data: the maximal T segments of the graph, each with
what its ops save for backward now and what checkpointing would keep instead (its inputs).
:func:`insert_recomputation` rewrites the chosen segments (by default the profitable ones, those
that save more than they would keep).

A **T segment** is a connected set of T nodes with the same *boundary depth* (the number of P/E
ops on the longest path before a node) and the same layer. Any path that leaves a segment crosses a
P/E op (depth grows) or a later layer, so it can never come back: every segment is convex and can be
cut out of the graph as one call.

Random numbers: a segment runs all its ops at the position of its call, so its random ops
(dropout...) would draw before a random op outside that sat between them in the original order
(GAT: the attention dropout between a layer's feature dropout and the fused dropout mask of
``fuse_masked_propagate``). Such a segment is split: its random ops stay outside, un-recomputed,
and the rest is regrouped into convex connected pieces. The RNG stream, and so every dropout
mask, is the same as without the pass.
"""

from __future__ import annotations

import contextlib

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import PassError
from ..frontend import ops
from ..ir.symbolic import Lin
from ..ir.tpgraph import TPGraph, TPInfo, graph_module
from ..nn.functional import feature_dropout
from .infra import graph_pass

__all__ = ["Recompute", "TSegment", "t_segments", "insert_recomputation", "source_name", "draws_random_numbers"]


@contextlib.contextmanager
def _redirected_replay() -> Any:
    """A replay under :class:`~gnncompile.frontend.ops.plan_dropout_draws`, which it re-enters
    itself (its dropouts are not refused as a foreign checkpoint's)."""
    with ops.plan_dropout_draws.replays_handled(), ops.plan_dropout_draws():
        yield


class Recompute(torch.nn.Module):
    """Runs ``body`` under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant).

    Autograd keeps only the inputs; the body's ops run again in backward with the forward's RNG
    state (``preserve_rng_state``), so dropout draws the same masks (under
    :class:`~gnncompile.frontend.ops.plan_dropout_draws` when the forward ran in it). Without gradients (eval,
    ``no_grad``) the body runs plainly. When traced again by torch.fx the body is inlined.

    ``body`` is a ``GraphModule`` that refers to the *same* submodules and parameters as the graph
    it was cut from, so parameters keep their names in the enclosing module
    (``named_parameters()`` lists each once; ``state_dict()`` also lists them under
    ``<this module>.body.``).
    """

    def __init__(self, body: torch.fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled() or any(isinstance(a, torch.fx.Proxy) for a in inputs):
            return self.body(*inputs)
        # torch function modes are not active in checkpoint's replay: a forward whose F.dropout
        # plan_dropout_draws redirects replays under the same redirection
        draws = ops.plan_dropout_draws.active()

        def contexts() -> tuple[Any, Any]:
            if not draws:
                return contextlib.nullcontext(), contextlib.nullcontext()
            return ops.plan_dropout_draws.replays_handled(), _redirected_replay()

        cache = ops._MASKS
        if cache is None:
            return checkpoint(self.body, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
        # a chunked executor serves dropout masks from a per-step cache keyed by the call's position
        # in its stage: the replay in backward takes them from the same positions
        base = cache._count

        def run(*xs: Any) -> Any:
            if ops._MASKS is not None:
                ops._MASKS._count = base
            return self.body(*xs)

        return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


_RANDOM_FUNCTIONS = {
    F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.rrelu, F.rrelu_,
    F.gumbel_softmax, F.fractional_max_pool2d, F.fractional_max_pool3d, F.fractional_max_pool2d_with_indices,
    F.fractional_max_pool3d_with_indices, torch.rrelu, torch.rrelu_,
    torch.bernoulli, torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.normal, torch.multinomial, torch.poisson,
    feature_dropout, ops.dropout_noise, ops.dropout_rows,
    # ATen's (F.dropout & co. call them; a traced torch.dropout becomes F.dropout)
    torch.dropout, torch.dropout_, torch.feature_dropout, torch.feature_dropout_, torch.alpha_dropout,
    torch.alpha_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_,
}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_", "multinomial"}
_DETERMINISTIC_MODULES = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.LayerNorm, torch.nn.GroupNorm,
                          torch.nn.BatchNorm1d, torch.nn.Identity, torch.nn.ReLU, torch.nn.ELU, torch.nn.LeakyReLU,
                          torch.nn.GELU, torch.nn.SiLU, torch.nn.ReLU6, torch.nn.CELU, torch.nn.SELU,
                          torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softplus, torch.nn.PReLU)


def draws_random_numbers(node: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether running ``node`` consumes the global RNG (conservative for unknown modules)."""
    if node.op == "call_function":
        return node.target in _RANDOM_FUNCTIONS
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, Recompute):
            return any(draws_random_numbers(n, dict(m.body.named_modules())) for n in m.body.graph.nodes)
        return not isinstance(m, _DETERMINISTIC_MODULES)
    return False


@dataclass(frozen=True)
class TSegment:
    """A convex run of T ops between P/E ops: the unit that :func:`insert_recomputation` checkpoints.

    ``nodes`` in graph order; ``inputs``: the non-parameter nodes it reads from outside;
    ``outputs``: its nodes read outside. ``saved_bytes``: what its ops save for backward now;
    ``kept_bytes``: what checkpointing keeps instead (its inputs, except the graph's own inputs,
    which are resident anyway).
    """

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    layer: int
    saved_bytes: Lin
    kept_bytes: Lin

    def savings(self, tp: TPGraph) -> int:
        """Bytes saved for backward that checkpointing this segment frees, for ``tp.stats``."""
        return tp.value(self.saved_bytes) - tp.value(self.kept_bytes)


def _is_t_op(n: torch.fx.Node) -> bool:
    t = n.meta.get("tp")
    return (isinstance(t, TPInfo) and t.kind == "T"
            and n.op in ("call_function", "call_method", "call_module"))


def _value_bytes(t: Optional[TPInfo]) -> Lin:
    """Size of a node's output as a linear form (0 when unknown or not a tensor)."""
    if t is None or t.rows is None or t.dtype is None:
        return Lin()
    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        return Lin()
    return t.rows * (math.prod(t.dims) * dtype.itemsize)


def _segment(tp: TPGraph, names: Sequence[str]) -> TSegment:
    wanted = set(names)
    nodes = [n for n in tp.graph.nodes if n.name in wanted]
    members = set(nodes)
    inputs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    saved = sum((n.meta["tp"].saved_bytes for n in nodes), Lin())
    kept = sum((_value_bytes(a.meta.get("tp")) for a in inputs if a.op != "placeholder"), Lin())
    layer = max(n.meta["tp"].layer for n in nodes)
    return TSegment(tuple(n.name for n in nodes), tuple(a.name for a in inputs), tuple(n.name for n in outputs),
                    layer, saved, kept)


def _components(nodes: Iterable[torch.fx.Node], linked: Callable[[torch.fx.Node, torch.fx.Node], bool]
                ) -> list[list[torch.fx.Node]]:
    """Connected components of ``nodes`` under the data edges ``a -> n`` with ``linked(a, n)``."""
    members = list(nodes)
    parent = {n: n for n in members}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for a in n.all_input_nodes:
            if a in parent and linked(a, n):
                parent[find(a)] = find(n)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _leaves_and_reenters(members: set[torch.fx.Node]) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """A (outside node, segment node) pair on a path that leaves ``members`` and comes back, if any."""
    stack = [u for n in members for u in n.users if u not in members]
    seen: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in members:
                return n, u
            stack.append(u)
    return None


def _random_conflict(tp: TPGraph, members: set[torch.fx.Node], modules: dict[str, torch.nn.Module]
                     ) -> Optional[torch.fx.Node]:
    """A random op outside ``members`` that runs between two of its nodes, when ``members`` has random ops.

    Checkpointing runs the segment at one point, so its random draws would move past that op.
    """
    if not any(draws_random_numbers(n, modules) for n in members):
        return None
    nodes = list(tp.graph.nodes)
    idx = [i for i, n in enumerate(nodes) if n in members]
    for n in nodes[idx[0] + 1:idx[-1]]:
        if n not in members and draws_random_numbers(n, modules):
            return n
    return None


def t_segments(tp: TPGraph) -> list[TSegment]:
    """The T segments of ``tp`` in graph order: maximal, except where random ops split them (module docstring)."""
    modules = dict(tp.named_modules())
    depth: dict[torch.fx.Node, int] = {}
    for n in tp.graph.nodes:
        t = n.meta.get("tp")
        step = 1 if isinstance(t, TPInfo) and t.kind in ("P", "E") else 0
        depth[n] = max((depth[a] for a in n.all_input_nodes), default=0) + step

    def linked(a: torch.fx.Node, n: torch.fx.Node) -> bool:
        return depth[a] == depth[n] and a.meta["tp"].layer == n.meta["tp"].layer

    pieces: list[list[torch.fx.Node]] = []
    for group in _components((n for n in tp.graph.nodes if _is_t_op(n)), linked):
        if _random_conflict(tp, set(group), modules) is None:
            pieces.append(group)
            continue
        rest = [n for n in group if not draws_random_numbers(n, modules)]
        pieces += [p for p in _components(rest, linked) if _leaves_and_reenters(set(p)) is None]
    order = {n: i for i, n in enumerate(tp.graph.nodes)}
    return [_segment(tp, [n.name for n in p]) for p in sorted(pieces, key=lambda p: min(order[n] for n in p))]


def _check_segment(tp: TPGraph, names: Iterable[str]) -> list[torch.fx.Node]:
    """The nodes of a requested segment, after checking it can be checkpointed as one call."""
    by_name = {n.name: n for n in tp.graph.nodes}
    wanted = list(dict.fromkeys(names))
    if not wanted:
        raise PassError("pass insert_recomputation: an empty segment was requested")
    missing = [s for s in wanted if s not in by_name]
    if missing:
        raise PassError(f"pass insert_recomputation: no node named {', '.join(map(repr, missing))}")
    bad = [s for s in wanted if not _is_t_op(by_name[s])]
    if bad:
        raise PassError(f"pass insert_recomputation: only T ops can be recomputed; "
                        f"{', '.join(repr(s) + ' is ' + by_name[s].meta['tp'].kind for s in bad)}")
    members = {by_name[s] for s in wanted}
    path = _leaves_and_reenters(members)
    if path is not None:
        raise PassError(f"pass insert_recomputation: segment {wanted} is not convex: a path leaves it "
                        f"and re-enters at {path[1].name!r} (through {path[0].name!r})")
    layers = {n.meta["tp"].layer for n in members}
    if len(layers) > 1:
        raise PassError(f"pass insert_recomputation: segment {wanted} spans layers {sorted(layers)}")
    clash = _random_conflict(tp, members, dict(tp.named_modules()))
    if clash is not None:
        raise PassError(f"pass insert_recomputation: segment {wanted} draws random numbers and {clash.name!r} "
                        "draws between its nodes; checkpointing would reorder the draws")
    return [n for n in tp.graph.nodes if n in members]


def _stable_toposort(graph: torch.fx.Graph) -> None:
    """Reorder ``graph``'s nodes so that defs precede uses, keeping the order otherwise."""
    order: list[torch.fx.Node] = []
    placed: set[torch.fx.Node] = set()
    for root in list(graph.nodes):
        stack = [(root, False)]
        while stack:
            n, ready = stack.pop()
            if n in placed:
                continue
            if ready:
                placed.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a not in placed)
    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)


def _free_name(tp: TPGraph, stem: str) -> str:
    taken = {name for name, _ in tp.named_children()}
    k = 0
    while f"{stem}_{k}" in taken:
        k += 1
    return f"{stem}_{k}"


def _extract(tp: TPGraph, nodes: list[torch.fx.Node]) -> None:
    """Replace ``nodes`` (a checked segment) by one call to a :class:`Recompute` module."""
    graph = tp.graph
    members = set(nodes)
    inputs: list[torch.fx.Node] = []
    params: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in members:
                continue
            target = params if a.op == "get_attr" else inputs
            if a not in target:
                target.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]

    body_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = body_graph.placeholder(a.name)
    for p in params:
        env[p] = body_graph.get_attr(p.target)
    for n in nodes:
        env[n] = body_graph.node_copy(n, lambda a: env[a])
    body_graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    body = graph_module(tp, body_graph, class_name="TSegment")

    name = _free_name(tp, "recompute")
    tp.add_submodule(name, Recompute(body))
    infos = [n.meta["tp"] for n in nodes]
    layer = max(t.layer for t in infos)
    moved_params = [p for p in params if all(u in members for u in p.users)]
    kept = sum((_value_bytes(a.meta.get("tp")) for a in inputs if a.op != "placeholder"), Lin())
    first = outputs[0].meta["tp"]
    single = len(outputs) == 1
    info = TPInfo(
        kind="T", layer=layer,
        rows=first.rows if single else None, dims=first.dims if single else (), dtype=first.dtype,
        flops=sum((t.flops for t in infos), Lin()),
        bytes_read=sum((t.bytes_read for t in infos), Lin()),
        bytes_written=sum((t.bytes_written for t in infos), Lin()),
        saved_bytes=kept,
        params=sum(t.params for t in infos) + sum(p.meta["tp"].params for p in moved_params),
        recompute=True,
        op=f"Recompute[{len(nodes)} ops]",
    )
    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(name, tuple(inputs))
    call.meta["tp"] = info
    replacements = [call]
    if not single:
        replacements = []
        anchor = call
        for i, o in enumerate(outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, i))
            t = o.meta["tp"]
            item.meta["tp"] = TPInfo(kind="T", layer=layer, rows=t.rows, dims=t.dims, dtype=t.dtype, op="getitem")
            replacements.append(item)
            anchor = item
    for o, r in zip(outputs, replacements):
        o.replace_all_uses_with(r, delete_user_cb=lambda u: u not in members)
    for n in reversed(nodes):
        graph.erase_node(n)
    for p in moved_params:
        graph.erase_node(p)
    _stable_toposort(graph)


@graph_pass(exact=True)
def insert_recomputation(tp: TPGraph, segments: Optional[Iterable[Iterable[str]]] = None) -> TPGraph:
    """Recompute T segments in backward instead of saving their activations (exact).

    NeutronTask §5.1, Fig. 8c. Each chosen T segment (see :func:`t_segments`) is cut out into a
    ``GraphModule`` and replaced by one ``call_module`` to a :class:`Recompute` wrapper that runs it
    under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; a segment with several
    outputs returns a tuple read by ``getitem`` nodes.

    Parameters
    ----------
    segments:
        Node-name collections, each a convex set of T ops of one layer (for example
        ``t_segments(tp)[i].nodes``). ``None`` (default): every maximal T segment whose ops save
        more bytes for backward than its inputs take (:meth:`TSegment.savings` > 0).

    Requires:
        A verified TPGraph. Requested segments exist, are T ops of one layer, are convex (no path
        leaves a segment and comes back) and do not draw random numbers around another random op
        (see the module docstring), else :class:`~gnncompile.errors.PassError`.
    Ensures:
        Each segment is one ``recompute_<k>`` node (kind T, the segment's layer, ``recompute=True``,
        FLOPs/bytes the sum of its ops, ``saved_bytes`` = the bytes of its non-input tensor
        inputs, which checkpointing keeps alive), plus ``getitem`` nodes for extra outputs. Fewer
        bytes are saved for backward: the segment's intermediates are recomputed.
    Preserves:
        The function and every gradient: the same ops run in the same order on the same random
        numbers (dropout inside a segment replays the forward's RNG state when recomputed), so
        outputs are bit-identical; a gradient summed from several consumers may be added up in
        another order. Parameter names (the wrappers share the graph's submodules). Exact.

    Example (2-layer GCN; ``*`` = recomputed)::

        before                                   after
        propagate     P  1                       propagate     P  1
        add           T  2  (bias)               recompute_0*  T  2  = checkpoint(add, relu,
        relu          T  2                                             dropout, convs_1_lin)
        dropout       T  2                       propagate_1   P  2
        convs_1_lin   T  2                       add_1         T  3
        propagate_1   P  2
        add_1         T  3
    """
    if segments is None:
        chosen = [list(s.nodes) for s in t_segments(tp) if s.savings(tp) > 0]
    else:
        chosen = [list(s) for s in segments]
    checked = [_check_segment(tp, names) for names in chosen]
    taken: set[torch.fx.Node] = set()
    for nodes in checked:
        overlap = taken.intersection(nodes)
        if overlap:
            raise PassError(f"pass insert_recomputation: segments overlap at {sorted(n.name for n in overlap)}")
        taken.update(nodes)
    for nodes in checked:
        _extract(tp, nodes)
    tp.recompile()
    return tp


def source_name(qualified_name: str) -> str:
    """The name a parameter or buffer has in the graph a :class:`Recompute` body was cut from.

    ``recompute_0.body.convs.1.lin.weight`` -> ``convs.1.lin.weight`` (``state_dict`` lists
    parameters used inside a recomputed segment under both names).
    """
    return re.sub(r"^(?:recompute_\d+\.body\.)+", "", qualified_name)

