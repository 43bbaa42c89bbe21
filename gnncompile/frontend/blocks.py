"""Block binding: a traced model run layer by layer on the blocks of a sampled mini-batch.

A model written for the whole graph (``forward(self, g, x)``, every primitive on ``g``) runs on a
sampled mini-batch (:func:`gnncompile.graph.sample_blocks`) once each graph op reads its layer's
block and every vertex value lives on the right rows. :func:`bind_blocks` rewrites a traced
:class:`~gnncompile.ir.tpgraph.TPGraph` that way:

- **one graph input per layer.** The graph input is replaced by ``L`` inputs, one block each
  (input layer first); a primitive of layer ``k`` (1-based, the tracer's layer: see
  :mod:`gnncompile.frontend.tracer`) reads block ``k - 1``.
- **rows.** A vertex value's *depth* is the number of layer-ending ops (P ops, ``aggregate``) on
  the longest path up to it: the input features are at depth 0, a layer-``k`` propagation's output
  at depth ``k``, a T op's output at the largest depth of its vertex inputs. A value at depth ``d``
  holds the rows of ``V_d``, block ``d``'s sources (``V_L``: the seeds); since every block's
  destinations are the first rows of its sources, ``V_t`` is a prefix of ``V_d`` for ``t > d``.
  Where a value is read at a larger depth than its own (the source side of a layer-``k`` op reads
  depth ``k - 1``, the destination side and a T op's inputs the op's own depth, the output depth
  ``L``), :func:`~gnncompile.frontend.ops.dst_rows` of the deeper layer's block restricts it to
  those first rows: GraphSAGE's root term, residuals, GCNII's and APPNP's ``x0``, GAT's
  destination scores. A read at a *smaller* depth than the value's cannot be expressed on blocks
  and is a :class:`~gnncompile.errors.TraceError`, as are edge values that cross layers.

On the whole graph every block is the graph itself and every restriction the identity, so the
bound model computes what the model computes; on blocks it computes the mini-batch's outputs, the
seeds' logits (the DGL/PyG block semantics).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx

from ..errors import TraceError
from ..graph.core import Graph
from ..ir.tpgraph import TPGraph, TPInfo, ends_layer
from .ops import SOURCE_ARGS, call_arguments, dst_rows, is_primitive, propagation_calls
from .tracer import trace

__all__ = ["BlockModel", "bind_blocks", "value_depths", "block_input_names", "block_norms"]

#: ``node.meta`` key of a bound graph's per-layer graph input: the block index it takes.
BLOCK_META = "block"


def _graph_inputs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph inputs: inputs without rows or dtype (a tensor input without rows, such as a
    sampled plan's dropout index, has a dtype)."""
    return [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("tp") is not None
            and n.meta["tp"].rows is None and n.meta["tp"].kind == "input" and n.meta["tp"].dtype is None]


def _vertex(node: torch.fx.Node) -> bool:
    info = node.meta.get("tp")
    return info is not None and info.space == "V"


def _edge(node: torch.fx.Node) -> bool:
    info = node.meta.get("tp")
    return info is not None and info.space in ("E", "E+V")


def _reads(node: torch.fx.Node, depth_of: Mapping[torch.fx.Node, int], own: Optional[int]
           ) -> list[tuple[torch.fx.Node, int]]:
    """The vertex inputs ``node`` reads and the depth it reads each at: a graph op's source side at
    the layer before its own, its other vertex inputs at its layer; a T op's at ``own``, the depth
    of its output."""
    out = []
    if node.op == "call_function" and is_primitive(node.target):
        layer = node.meta["tp"].layer
        src = SOURCE_ARGS.get(node.target)
        args = call_arguments(node)
        for name, a in args.items():
            if isinstance(a, torch.fx.Node) and a in depth_of:
                out.append((a, layer - 1 if name == src else layer))
        return out
    for a in node.all_input_nodes:
        if a in depth_of:
            out.append((a, own))
    return out


def _depths(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    depth: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "output" or not _vertex(node):
            continue
        if node.op == "placeholder":
            depth[node] = 0
        elif node.op == "call_function" and is_primitive(node.target):
            depth[node] = node.meta["tp"].layer  # a vertex output of a layer-k op: V_k (its destinations)
        else:
            depth[node] = max((depth[a] for a in node.all_input_nodes if a in depth), default=0)
    return depth


def value_depths(tp: TPGraph) -> dict[str, int]:
    """Depth of every vertex value of ``tp`` (see the module docstring), by node name."""
    return {n.name: d for n, d in _depths(tp.graph).items()}


def block_input_names(tp: TPGraph) -> tuple[str, ...]:
    """The per-layer graph inputs of a graph made by :func:`bind_blocks`, input layer first."""
    found = sorted((n.meta[BLOCK_META], n.name) for n in tp.graph.nodes
                   if n.op == "placeholder" and BLOCK_META in n.meta)
    if not found:
        raise TraceError("this graph takes no blocks: bind it with gnncompile.frontend.blocks.bind_blocks first")
    return tuple(name for _, name in found)


def bind_blocks(tp: TPGraph) -> TPGraph:
    """``tp`` rewritten to run on per-layer blocks (module docstring); ``tp`` is left unchanged.

    The result takes the blocks first (inputs ``g_0 ... g_{L-1}``, :func:`block_input_names`) and
    then ``tp``'s other inputs; it shares ``tp``'s submodules and parameters. ``tp`` must be
    specialized to one mode (``trace(..., training=...)``). Raises :class:`TraceError` for a model
    without propagation, or one whose values cannot live on blocks' rows.
    """
    if tp.specialized is None and tp.eval_graph is not None:
        raise TraceError("bind_blocks: this graph differs between training and eval mode; bind each mode's graph "
                         "(gnncompile.trace(..., training=True / False))")
    num_layers = tp.num_layers
    if num_layers == 0:
        raise TraceError(f"bind_blocks: {type(tp).__name__} has no propagation (no P op or aggregate): there is "
                         "nothing to sample")
    graph = copy.deepcopy(tp.graph)
    g_inputs = _graph_inputs(graph)
    if len(g_inputs) != 1:
        raise TraceError(f"bind_blocks: expected one graph input, found {len(g_inputs)}")
    g_old = g_inputs[0]
    depth = _depths(graph)

    # one placeholder per layer, right after the graph input (placeholders keep their order)
    blocks: list[torch.fx.Node] = []
    with graph.inserting_after(g_old):
        for k in reversed(range(num_layers)):
            p = graph.placeholder(f"g_{k}")
            p.meta["tp"] = g_old.meta["tp"]
            p.meta[BLOCK_META] = k
            blocks.append(p)
    blocks.reverse()
    # placeholders inserted after g_old in reverse order end up g_0, g_1, ... in order
    edge_layer: dict[torch.fx.Node, int] = {}
    restricted: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}

    def restrict(value: torch.fx.Node, to: int) -> torch.fx.Node:
        key = (value, to)
        if key not in restricted:
            if value.op == "placeholder":
                first = next(n for n in graph.nodes if n.op != "placeholder")
                where = graph.inserting_before(first)
            else:
                where = graph.inserting_after(value)
            with where:
                r = graph.call_function(dst_rows, (blocks[to - 1], value))
            r.meta["tp"] = TPInfo(kind="E", layer=to, rows=value.meta["tp"].rows, dims=value.meta["tp"].dims,
                                  dtype=value.meta["tp"].dtype, op="dst_rows")
            depth[r] = to
            restricted[key] = r
        return restricted[key]

    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        if node.op == "output":
            out = node.args[0]
            if isinstance(out, torch.fx.Node) and out in depth and depth[out] < num_layers:
                node.args = (restrict(out, num_layers),)
            continue
        primitive = node.op == "call_function" and is_primitive(node.target)
        if primitive:
            layer = node.meta["tp"].layer
            if not 1 <= layer <= num_layers:
                raise TraceError(f"bind_blocks: {node.name} is a graph op of layer {layer}, outside 1..{num_layers}")
            node.args = (blocks[layer - 1],) + tuple(node.args[1:])
        # a T op whose output is not a vertex value (a scalar, an edge value) reads its inputs as they are
        reads = _reads(node, depth, depth.get(node)) if primitive or node in depth else []
        for value, want in reads:
            have = depth[value]
            if have > want:
                raise TraceError(f"bind_blocks: {node.name} reads {value.name} (rows of layer {have}'s outputs) as "
                                 f"rows of layer {want}: a value cannot go back to a wider vertex set on blocks")
            if have < want:
                node.replace_input_with(value, restrict(value, want))
        # edge values belong to one layer's block
        if _edge(node):
            layer = node.meta["tp"].layer
            for a in node.all_input_nodes:
                if a in edge_layer and edge_layer[a] != layer and not ends_layer(node):
                    raise TraceError(f"bind_blocks: {node.name} (layer {layer}) reads the edge values {a.name} "
                                     f"of layer {edge_layer[a]}; edge values cannot cross layers on blocks")
            edge_layer[node] = layer
    if g_old.users:
        raise TraceError(f"bind_blocks: {', '.join(u.name for u in g_old.users)} use the graph input outside a "
                         "primitive")
    graph.erase_node(g_old)
    graph.lint()
    bound = TPGraph(tp, graph, tp.stats, class_name=type(tp).__name__)
    bound.training = tp.training
    bound.copy_modes_from(tp)
    return bound


def block_norms(*tps: TPGraph) -> list[tuple[str, bool]]:
    """The ``(norm, add_self_loops)`` pairs of the propagations of ``tps`` that read the graph's
    own coefficients (no computed edge weights): what each sampled block must hold."""
    calls = propagation_calls(*(tp.graph for tp in tps))
    return sorted({(a["norm"], bool(a["add_self_loops"])) for _, a in calls if a["edge_weight"] is None})


@dataclass
class BlockModel:
    """A model traced and bound to blocks for one mode: ``model(blocks, x)`` gives the seeds' outputs.

    ``train``/``eval`` are the bound training- and eval-mode graphs (sharing the model's parameters);
    calling picks the one of the model's current mode. ``blocks`` are one graph per layer, input
    layer first (a :class:`~gnncompile.graph.sampling.SampledBatch`'s ``blocks``), ``x`` the rows of
    the first block's sources.
    """

    train_graph: TPGraph
    eval_graph: TPGraph
    module: torch.nn.Module

    @classmethod
    def trace(cls, model: torch.nn.Module, graph: Graph, dtype: Optional[torch.dtype] = None) -> "BlockModel":
        return cls(bind_blocks(trace(model, graph, training=True, dtype=dtype)),
                   bind_blocks(trace(model, graph, training=False, dtype=dtype)), model)

    @property
    def num_layers(self) -> int:
        return len(block_input_names(self.train_graph))

    @property
    def norms(self) -> list[tuple[str, bool]]:
        """The coefficients each block must hold (:func:`block_norms`)."""
        return block_norms(self.train_graph, self.eval_graph)

    def __call__(self, blocks: Sequence[Graph], x: torch.Tensor) -> torch.Tensor:
        g = self.train_graph if self.module.training else self.eval_graph
        if len(blocks) != self.num_layers:
            raise TraceError(f"{type(self.module).__name__} has {self.num_layers} layers but the mini-batch has "
                             f"{len(blocks)} blocks; sample with one fanout per layer")
        return g(*blocks, x)
