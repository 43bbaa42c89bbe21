"""The cost model of a plan: time and memory of every instruction of every rank.

Everything here is a pure function of the plan's data (its instruction lists, the
:class:`~gnncompile.ir.plan.OpCost` annotations of its stages, each rank's sizes) and a
:class:`~gnncompile.cost_models.hardware.Cluster`; no model, graph or device is touched, so a plan
for a billion-edge graph on a cluster we do not have is costed on a laptop.

Compute (per op of a stage, on the rank's device):

- ``T`` ops (dense, vertex-wise): roofline ``max(flops / FLOP/s, bytes / memory bandwidth)``;
  backward costs ``OpCost.backward`` forwards: one for the weights' gradient if the op has
  trainable weights, one for the input's gradient if the input needs one (the first layer's
  ``x @ W`` on raw features costs one, a hidden ``h @ W`` two, ``relu(h)`` one). A linear layer
  on dense rows (:func:`_dense_product`) runs at the calibrated rates of its output width
  (:meth:`~gnncompile.cost_models.specs.DeviceSpec.gemm_rates`: forward, weight gradient, input
  gradient) where the device has them: narrow products run far below the square-GEMM FLOP/s.
  A linear layer on sparse CSR rows (:func:`_sparse_product_inputs`) is costed as two
  propagations where the device's propagation rates were measured: the forward gathers rows of
  the weight, the weight's gradient ``x^T @ g`` scatters into rows of the weight's size.
- ``P`` ops (propagation): NeutronTask Eq. 6 for one layer of width ``d`` on the rank's ``|V|``
  vertices and ``|E| = |V| d̄`` edges (:func:`~gnncompile.cost_models.formulas.p_task_time`),
  plus ``|E| / edge_rate`` where the device was calibrated (random row gathers are latency bound
  at small widths), both rates for the size of the gathered source rows
  (:meth:`~gnncompile.cost_models.hardware.DeviceSpec.spmm_rates`: in cache or in DRAM);
  backward is the same propagation over the transposed graph; where its edge values need a
  gradient (:attr:`OpCost.values`, GAT's attention) one more (the SDDMM, ``OpCost.backward == 2``)
  and, pulled through the transposed graph, a gather of the values in transposed order.
- random numbers (dropout masks): ``draws / rng_rate`` where calibrated.
- the training loss, in the Forward and Backward of the stage that makes the model's output:
  ``rows * classes / loss_rate`` (``loss_grad_rate``) where calibrated.
- ``E`` ops (edge-wise): memory bound, ``bytes / memory bandwidth``; backward twice.
- fixed costs: the runtime's measured overheads (``DeviceSpec.runtime``: per stage instruction,
  per op forward and backward, per communication instruction, per parameter tensor of the
  optimizer, per compute instruction that follows a wait for peers), or ``launch_overhead`` per
  op where none were measured; a checkpointed
  (``recompute``) segment runs its forward again in the backward.
- ``OPT``: Adam reads and writes parameters, gradients and two moments: ``16 * 4 * params`` bytes.

Communication (per instruction, over the slowest link of its group): halo exchange and all-to-all
as pairwise exchanges, all-reduce / all-gather / reduce-scatter as rings, send/recv point to point
(:mod:`~gnncompile.cost_models.formulas`).

Memory (per rank, over the instruction list; the liveness walk of :class:`PlanCost`): a resident part
(the rank's topology in the runtime's layout, features, labels, parameters and Adam state) plus a
liveness walk: the parameters' gradients live from the first ``Backward`` of the stage whose ops hold
the weights (a stage's share of the rank's gradients: its ops' size-independent bytes) to the end of
the optimizer step, which sets them to ``None``; gradients no backward made are made by the gradient
all-reduce (zeros), which flattens all of them into one temporary bucket. A stage's ``saved``
activations live from its ``Forward`` to its ``Backward``; a value passed between stages (a stage
output, a halo-extended tensor, a received value) lives from its producer to its ``Free`` (after its
last forward read, the ``reads`` of :mod:`gnncompile.ir.dataflow`, and its sends' completion, see
:mod:`gnncompile.passes.free`), else to the end of the step (the runtime holds what the plan has not
freed), and at least to the ``Backward`` of each stage that saves it (an input its ops save, an
output saved by an op of its own stage: else the stage's input leaf keeps only its shape); a stage reading several chunks of a
value reads their concatenation, held from the first such forward to the last such backward where
an op saves it (:func:`_saves_inputs`), else to the last such forward (its gradient, of the same
size, is made anew in each of those backwards); the gradient of a value (made by a backward, or
received) until the backward (or gradient communication) that consumes it; transient buffers only
during their instruction. Inside a stage the ops run one after the other, reading what
:attr:`~gnncompile.ir.plan.OpCost.reads` names (unknown: the previous op's output): forward, op
``k`` holds what ops ``0..k-1`` saved, the stage outputs made so far, the outputs of earlier ops that
it or a later op reads (unless saved as their result: ``relu``...), its output and its temporaries;
backward visits the ops last to first, op ``k`` holding the saved tensors of ops ``0..k``, the
gradient of its output, those of the values it and later ops read (a value read again further up
gets this op's part added to its gradient), the gradients of the stage inputs read by it or a later
op (ops autograd does not visit, ``backward == 0``, none); a checkpointed segment keeps only its
inputs in forward and first replays its forward in backward, its ops saving what they save with
gradients. What an op saves of a held stage input it reads is that input (no new memory), as is
what an op saves of a stage output; an op saving a stage input holds it to the stage's backward. An op that keeps sparse CSR input features sparse (their dropout) outputs new
values on their structure, not dense rows; a linear layer on them copies its weight and the rows'
indices on a CPU. A replicated dropout computes only the bool mask of the rows it reads
(:class:`_RankMasks`); an op of its stage that saves its output (a linear layer) holds its input
instead, computing the output again in backward (``OpCost.replayed``: a temporary of that backward,
and one more pass over it). A send of a slice of columns copies
it, held until the send is known complete (the value's ``Free``, else the optimizer step). A
posted all-to-all allocates its result and a send buffer as it posts and drops what it copied
(per-peer column slices) and the gradient it sends right then (``Cost.release``), not when its
transfer ends: the next chunk's compute runs meanwhile (:func:`_all_to_all_cost`). Adam's
update holds three temporaries of the largest parameter tensor. After the last instruction the
step concatenates the logits of its chunks, and a sampled epoch of several steps samples the next
step's inputs while this step's are held. A chunk's sizes are the rank's over the chunks it runs
(:func:`_chunk_sizes`); a stale read concatenates every chunk it reads, fresh or from the history;
a dropout drawing nothing is its input. That is a steady step's; the first step (``first_step``:
what the runtime measures) has no Adam state before its optimizer step, which allocates the two
moments, and makes the history tables at its first stale reads. What a step makes for itself when
it starts (a sampled step's blocks, feature rows and labels; a regrouped epoch's inputs) is held
through it and counted above what is live before the first step
(:attr:`StaticMemory.before_first_step`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..errors import PlanningError
from ..graph.core import topology_bytes
from ..ir.dataflow import effects
from ..ir.plan import (AllGather, AllReduce, AllToAll, Backward, DevicePlan, Forward, Free, HaloExchange,
                       Instruction, OpCost, OptimizerStep, Plan, RankSizes, Recompute, Recv, ReduceScatter, Send,
                       StageSpec)
from ..ir.rules import register_cost, rule
from ..ir.symbolic import Lin
from . import formulas
from .hardware import Cluster, DeviceSpec
from .specs import PUSH_FACTOR
from .simulate import Cost, Simulation, simulate

__all__ = ["ELSIZE", "StaticMemory", "static_memory", "PlanCost", "predict", "Prediction", "op_time", "op_value",
           "load_seconds"]

#: the input features' value name in plans (the model's ``x``)
FEATURES = "x"

ELSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4}

#: bytes Adam moves per float32 parameter: torch's fused Adam (:func:`gnncompile.runtime.trainer.adam`)
#: reads the parameter, its gradient and both moments and writes the parameter and the moments
_ADAM_BYTES_PER_PARAM = 7 * 4


def _elsize(dtype: str) -> int:
    try:
        return ELSIZE[dtype]
    except KeyError:
        raise PlanningError(f"no element size for dtype {dtype!r}; known: {', '.join(ELSIZE)}") from None


def _eval(lin: Any, sizes: RankSizes) -> float:
    return float(max(0, lin(sizes.nodes, sizes.edges)))


def _op_sizes(op: OpCost, sizes: RankSizes) -> tuple[RankSizes, float]:
    """The sizes an op's forms are evaluated at, and the share of that work the rank does: a ``cols``
    op runs on every vertex for the rank's share of the columns; a ``replicated`` op (the ``tensor``
    strategy's edge-wise attention ops) all of it on every vertex and edge. Where the rank's sizes
    differ per layer (:attr:`RankSizes.layers`) the op's layer's are used."""
    sizes = sizes.at_layer(op.layer, op.kind in ("P", "E"))
    if op.layout == "cols" and sizes.all_nodes is not None:
        share = sizes.col_share_ppm if sizes.col_share_ppm is not None else 1_000_000
        return dataclasses.replace(sizes, nodes=sizes.all_nodes), share / 1e6
    if op.layout == "replicated" and sizes.all_nodes is not None:
        return dataclasses.replace(sizes, nodes=sizes.all_nodes), 1.0
    return sizes, 1.0


def op_value(op: OpCost, lin: Any, sizes: RankSizes) -> float:
    """A size-dependent field of ``op`` (``op.flops``, ``op.out``...) for the rank of ``sizes``."""
    at, share = _op_sizes(op, sizes)
    return _eval(lin, at) * share


def op_time(op: OpCost, sizes: RankSizes, device: DeviceSpec, *, backward: bool = False,
            dtype: str = "float32", push: bool = False) -> float:
    """Seconds of one op's forward (or backward) on a rank of ``sizes`` (see the module docstring);
    ``push``: a propagation's backward scatters from the forward CSR (``device.push_factor`` times
    the pull through a transpose)."""
    at, share = _op_sizes(op, sizes)
    nodes, edges = at.nodes, at.edges
    mult = float(op.backward) if backward else 1.0
    if mult == 0:  # autograd does not visit an op none of whose inputs needs a gradient
        return 0.0
    per_op = device.runtime.get("op_backward" if backward else "op_forward", device.launch_overhead)
    overhead = op.count * per_op
    if not backward and device.rng_rate:
        overhead += _eval(op.random, at) * share / device.rng_rate
    if backward:  # a replayed dropout output is computed again: its input and mask read, it written
        overhead += _eval(op.replayed, at) * share * (2 + 1 / _elsize(dtype)) / device.mem_bandwidth
    if op.kind == "P":
        # the edges the op visits, implicit self loops included: its FLOPs are 2 |E'| d
        visited = _eval(op.flops, at) / (2 * op.width) if op.width else edges
        width = op.width * share
        t = _spmm_seconds(nodes, visited, width, at.source_rows * width, device, dtype)
        if backward and push:
            t *= device.push_factor if device.push_factor is not None else PUSH_FACTOR
        elif backward and op.values.e:
            # a pull through the transposed structure first permutes the edge values: a gather of
            # E rows of the values' width, at a propagation's rates for that width
            heads = float(op.values.e) / _elsize(dtype)
            t_perm = _spmm_seconds(edges, edges, heads, edges * heads, device, dtype)
            return mult * t + t_perm + overhead
        return mult * t + overhead
    flops, nbytes = _eval(op.flops, at) * share, _eval(op.bytes, at) * share
    if op.kind == "E":
        return mult * nbytes / device.mem_bandwidth + overhead
    es = _elsize(dtype)
    # sparse rows times a dense weight, on a device whose propagation rates were measured (presets
    # keep the roofline): a propagation over the rows' stored entries
    inputs = _sparse_product_inputs(op, es) if device.spmm_curve else None
    if inputs is not None:
        entries = flops / (2 * op.width)
        # forward: gathers rows of the weight; the weight's gradient x^T @ g is scattered from x's
        # structure into rows of the weight's size (nn.functional._sparse_t_matmul): the same accesses
        return _spmm_seconds(nodes, entries, op.width, inputs * op.width, device, dtype) + overhead
    rates = device.gemm_rates(op.width, op.flops.v / (2 * op.width)) \
        if dtype == "float32" and _dense_product(op, es) else None
    if rates is not None:  # a linear layer: its products' measured rates at its output and input widths
        forward, weight_grad, input_grad = rates
        if not backward:
            return max(flops / forward, nbytes / device.mem_bandwidth) + overhead
        # one product for the weights' gradient, one more for the input's (OpCost.backward == 2)
        seconds = flops / weight_grad + (op.backward - 1) * flops / input_grad
        return max(seconds, mult * nbytes / device.mem_bandwidth) + overhead
    return mult * max(flops / device.flops_for(dtype), nbytes / device.mem_bandwidth) + overhead


def _spmm_seconds(rows: float, entries: float, width: float, gathered: float, device: DeviceSpec,
                  dtype: str) -> float:
    """A sparse-dense product over ``rows`` rows with ``entries`` stored entries, ``width`` wide,
    gathering from ``gathered`` elements of dense rows: NeutronTask Eq. 6 plus ``entries /
    edge_rate``, at the device's rates for that working set (:meth:`DeviceSpec.spmm_rates`)."""
    es = _elsize(dtype)
    bandwidth, edge_rate = device.spmm_rates(gathered * es)
    t = formulas.p_task_time(rows, entries / rows if rows else 0.0, [width], device.flops_for(dtype), bandwidth,
                             device.gamma, elsize=es)
    return t + entries / edge_rate if edge_rate else t


def _sparse_product_inputs(op: OpCost, elsize: int) -> Optional[int]:
    """The input width ``K`` of a linear layer on sparse CSR rows (the first layer on sparse
    features), or ``None`` for other ops: a ``T`` op whose size-independent bytes are a ``K x
    width`` weight while its FLOPs per row, ``2 * entries * width``, are fewer than ``2 K width``."""
    if op.kind != "T" or not op.width or op.flops.e or op.backward != 1:
        return None
    inputs = int(op.bytes.c // (op.width * elsize))
    entries = op.flops.v / (2 * op.width)
    if inputs < 2 or entries < 1 or entries * 2 > inputs or op.bytes.c != inputs * op.width * elsize:
        return None
    return inputs


def _dense_product(op: OpCost, elsize: int) -> bool:
    """Whether ``op`` is a linear layer on dense rows: a ``T`` op with weights whose FLOPs per row are
    ``2 K width`` for the ``K x width`` weight (and bias) its size-independent bytes read (a product
    with sparse input rows does fewer FLOPs than its weight implies; elementwise ops do ``< 4 width``)."""
    if op.kind != "T" or not op.width or op.flops.e or op.backward < 1:
        return False
    inner = op.flops.v / (2 * op.width)
    weight = inner * op.width * elsize
    return inner >= 2 and weight <= op.bytes.c <= weight + op.width * elsize  # (a fused bias: one row more)


def stage_ops_time(stage: StageSpec, sizes: RankSizes, device: DeviceSpec, backward: bool, push: bool = False) -> float:
    """Seconds of one Forward/Backward of ``stage``'s ops on a rank of ``sizes`` (one chunk's
    share): the runtime's cost per stage instruction and per checkpointed segment plus each op's
    :func:`op_time`; a backward also replays its checkpointed segments' forwards. The training loss
    is not included (:meth:`PlanCost.stage_time` adds it)."""
    t = device.runtime.get("stage", 0.0) + sum(op_time(op, sizes, device, backward=backward, push=push)
                                               for op in stage.costs)
    if backward:  # checkpointed segments run their forward again
        t += sum(op_time(op, sizes, device) for op in stage.costs if op.recompute)
    return t + device.runtime.get("segment", 0.0) * checkpointed_segments(stage)


def _segment_of(op: OpCost) -> Optional[str]:
    """The checkpointed segment ``op`` runs in (its ops are ``recompute`` and named ``<segment>.<op>``),
    else ``None``."""
    return op.name.rsplit(".", 1)[0] if op.recompute and "." in op.name else None


def checkpointed_segments(stage: StageSpec) -> int:
    """How many checkpointed segments ``stage`` runs (:func:`_segment_of` its ops): each costs the
    runtime's ``segment`` in its forward and in its backward (saving and restoring the random
    state, the saved-tensor hooks that replay it)."""
    return len({_segment_of(op) for op in stage.costs} - {None})


def loss_time(stage: StageSpec, sizes: RankSizes, device: DeviceSpec, backward: bool, output: Optional[str]) -> float:
    """Seconds of the training loss in a Forward (or Backward) of ``stage`` on a rank of ``sizes``: the
    logits of the model's ``output`` (its rows and width, where the stage makes it) over the device's
    loss rates; 0 where the stage does not make it or the rates were not calibrated."""
    rate = device.loss_grad_rate if backward else device.loss_rate
    op = next((op for op in stage.costs if op.name == output), None) if rate else None
    if op is None:
        return 0.0
    return _op_sizes(op, sizes)[0].nodes * op.width / rate


@dataclass(frozen=True)
class StaticMemory:
    """Bytes a rank holds for the whole step, by kind; ``gradients`` are the exception: they live from
    the backward that makes them to the end of the optimizer step (:attr:`resident`: the rest)."""

    topology: int
    features: int
    labels: int
    parameters: int
    gradients: int
    optimizer: int
    #: historical embeddings of relaxed stale reads (GNNPipe, NeutronTask's cache), and their gradients
    history: int = 0
    #: of ``topology``, ``features`` and ``labels``: the bytes each step makes for itself when it
    #: starts and holds to its end (a sampled mini-batch's blocks, feature rows and labels: sampled and
    #: gathered in the step), not before it
    loaded: int = 0
    #: inputs each step makes when it starts, beside the resident ones, and holds to its end (a
    #: regrouped epoch's graph slices, feature rows, labels and vertex ids: the program's own inputs
    #: stay for evaluation)
    step_inputs: int = 0

    @property
    def total(self) -> int:
        return self.topology + self.features + self.labels + self.parameters + self.gradients + self.optimizer \
            + self.history + self.step_inputs

    @property
    def resident(self) -> int:
        """Bytes live before a steady step starts, or made as it starts and held: :attr:`total`
        without the gradients."""
        return self.total - self.gradients

    @property
    def before_first_step(self) -> int:
        """Bytes live before the first step starts (what the runtime's ``PeakMemory`` does not count
        of it): :attr:`total` without what that step makes, the gradients, Adam's moments, the
        history tables (:func:`_history_tables`) and the step's own inputs (:attr:`loaded`,
        :attr:`step_inputs`)."""
        return self.total - self.gradients - self.optimizer - self.history - self.loaded - self.step_inputs

    def as_dict(self) -> dict[str, int]:
        out = {"topology": self.topology, "features": self.features, "labels": self.labels,
               "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer}
        if self.history:
            out["history"] = self.history
        if self.step_inputs:
            out["step inputs"] = self.step_inputs
        return out


def _history_bytes(plan: Plan, dp: DevicePlan) -> int:
    """Bytes of the rank's historical-embedding tables: one row per vertex of the chunk order for
    every value its stages read stale (twice with historical gradients)."""
    copies = 2 if plan.options.get("historical_gradients") else 1
    return int(copies * sum(_history_tables(plan, dp).values()))


def _history_tables(plan: Plan, dp: DevicePlan) -> dict[str, float]:
    """Bytes of one historical-embedding table per value the rank's stages read stale (by the
    stage input's name): one row per vertex of the chunk order (the runtime's
    ``_Rank.stale_store``)."""
    names = {name for st in dp.stages for name, per_chunk in st.stale if any(per_chunk)}
    if not names:
        return {}
    # a stale-read value is computed by one of the rank's stages or received by it
    width: dict[str, int] = {}
    for st in dp.stages:
        for op in st.costs:
            if op.name in names:
                width.setdefault(op.name, op.width)
    for ins in dp.instructions:
        name = getattr(ins, "local", "") or getattr(ins, "value", None)
        if name in names and getattr(ins, "shape", None):
            width.setdefault(name, math.prod(ins.shape[1:]))
    elsize = _elsize(plan.info.get("param_dtype", "float32"))
    return {n: float(dp.sizes.all_nodes * width.get(n, 0) * elsize) for n in sorted(names)}


def _graph_bytes(plan: Plan, nodes: int, edges: int, src: int, symmetric: bool, cpu: bool) -> int:
    """One graph's topology in the runtime's layout with the model's normalization scales (in the
    model's dtype: destinations, self loops and, for ``gcn``, sources), on a ``cpu`` rank or not
    (``plan.info["topology"]["edge_dst"]``: whether each edge's destination is held there)."""
    topo = plan.info.get("topology", {})
    per_value = _elsize(plan.info.get("param_dtype", "float32"))
    scales = sum(per_value * ((2 if loops else 1) * nodes + (src if norm == "gcn" else 0))
                 for norm, loops in topo.get("norms", ()))
    push = topo.get("backward") == "push"
    # off the CPU the products are cuSPARSE's through torch: a normalization's scales folded into
    # edge values (kernels._edge_factors) and the offsets as int32 beside the int64 ones
    # (torch's CSR takes one index dtype), of the in-edge CSR and of a transpose where one is held;
    # propagations over A + L with fixed terms (``looped_norms``) join the loops to the matrix instead:
    # A + L with int32 offsets and indices per direction (the forward one scattered backward when
    # pushing, a symmetric graph's own), its entries per normalization and direction (kernels._looped_csr)
    torch_csr = 0
    if not cpu and edges:
        folded = set(topo.get("looped_norms", ()))
        # one edge tensor per normalization and direction (a pull through a transpose reads the scales
        # swapped; a push reads the forward's), cached per scale tensors
        directions = 1 if push and not symmetric else 2
        torch_csr = sum(per_value * edges * directions for norm, loops in topo.get("norms", ())
                        if norm in ("gcn", "mean") and not (loops and norm in folded))
        if topo.get("plain_products", True):
            torch_csr += 4 * (nodes + 1) + (0 if symmetric or push else 4 * (src + 1))
        if folded:
            entries = edges + nodes
            torch_csr += 4 * entries + 4 * (nodes + 1) + (0 if symmetric or push else 4 * entries + 4 * (src + 1))
            torch_csr += len(folded) * per_value * entries * directions
        for heads in topo.get("edge_heads", ()):
            # a multi-head product's head-interleaved structure: offsets, columns and the entries'
            # positions among the edge values, per structure it runs over (kernels._interleaved)
            isz = 4 if max(edges, nodes, src) * heads <= 2**31 - 1 else 8
            torch_csr += isz * (nodes * heads + 1 + 2 * edges * heads)
            if not (symmetric or push):
                torch_csr += isz * (src * heads + 1 + 2 * edges * heads)
    dst = topo.get("edge_dst")
    return scales + torch_csr + topology_bytes(nodes, edges, src, symmetric=symmetric, weighted=bool(topo.get("weighted")),
                                   edge_values=bool(topo.get("edge_values")), edge_loops=bool(topo.get("edge_loops")),
                                   push=push,
                                   edge_dst=None if dst is None else dst == "always" or (dst == "off_cpu" and not cpu))


def static_memory(plan: Plan, dp: DevicePlan, device: Optional[DeviceSpec] = None) -> StaticMemory:
    """The rank's resident data, in the runtime's layout.

    Topology: :func:`~gnncompile.graph.core.topology_bytes`, the compact layout the runtime holds
    (int32 indices, int64 offsets, the transpose unless the rank's graph is the whole symmetric
    graph or its backward products scatter, edge weights and an edge permutation only when edge
    values exist and a transpose is held), plus the
    normalizations' per-vertex scales (in the model's dtype, destinations and sources) from
    ``plan.info["topology"]``, and off the CPU what torch's CSR products add: those scales folded
    into edge values (an edge tensor per normalization, :func:`gnncompile.kernels._edge_factors`)
    and int32 copies of the offsets. Features: rows of the input features in the model's dtype
    (sparse CSR features: their stored bytes per row, :func:`_feature_bytes_per_row`);
    labels int64 plus three bool masks.
    Parameters are replicated on every rank that runs a stage (data parallelism) with their
    gradients and Adam's two moments; a rank whose sizes name its ``params`` (the ``task``
    strategy: a rank holds its own tasks' parameters) holds that many. Relaxed stale reads keep
    historical embeddings (:func:`_history_bytes`). ``device``: the rank's (default: a CPU), which
    decides what the edge ops' kernels index by (:func:`_graph_bytes`).
    """
    cpu = device is None or device.kind == "cpu"
    s = dp.sizes
    nodes, edges, src = s.nodes, s.edges, s.source_rows
    params = s.params if s.params is not None else int(plan.info.get("params", 0)) if s.trains != 0 else 0
    pbytes = params * _elsize(plan.info.get("param_dtype", "float32"))
    rows = nodes if s.feature_rows is None else s.feature_rows  # a rank that runs no T op holds no features or labels
    per_row = _feature_bytes_per_row(plan)
    topo = plan.info.get("topology", {})
    held = topo.get("graphs")
    if held is not None and dp.rank < len(held):  # a concrete graph: the graphs the rank holds
        topology = sum(_graph_bytes(plan, n, e, s, bool(sym), cpu) for n, s, e, sym in held[dp.rank])
    else:
        whole = nodes == src == topo.get("nodes", -1)
        topology = _graph_bytes(plan, nodes, edges, src, bool(topo.get("symmetric")) and whole, cpu) if edges else 0
    return StaticMemory(topology=topology,
                        features=int(rows * per_row), labels=11 * rows, parameters=pbytes, gradients=pbytes,
                        optimizer=2 * pbytes, history=_history_bytes(plan, dp))


def _with_native_features(plan: Plan, dp: DevicePlan, static: StaticMemory, device: DeviceSpec) -> StaticMemory:
    """``static`` with, on a CPU, the int32 column indices the native kernels keep beside sparse
    CSR input features (``nn.functional.prepare_sparse_features``: 4 bytes per stored entry)."""
    per_row = plan.info.get("feature_bytes_per_row")
    if device.kind != "cpu" or _sparse_row_value_bytes(plan) is None or per_row is None:
        return static
    rows = dp.sizes.nodes if dp.sizes.feature_rows is None else dp.sizes.feature_rows
    es = _elsize(plan.info.get("param_dtype", "float32"))
    entries = rows * max(0.0, float(per_row) - 8.0) / (es + 8)
    return dataclasses.replace(static, features=static.features + int(4 * entries))


def _with_step_inputs(plan: Plan, dp: DevicePlan, static: StaticMemory) -> StaticMemory:
    """``static`` with the inputs each step makes for itself when it starts (inside the step the
    runtime measures, held to its end). A sampled plan (``plan.info["steps_per_epoch"]``) samples
    its blocks and gathers its feature rows and labels every step: its ``topology``, ``features``
    and ``labels`` are all :attr:`StaticMemory.loaded`. A regrouped ``task`` plan
    (``dependencies="regrouped"``) builds every epoch's graph slices, feature rows (with the native
    kernels' int32 column indices of sparse ones, made at their first product) and scored rows'
    labels and mask beside the program's own inputs, which evaluation keeps, and the vertex order
    (int64 ids: every subgraph's, and the scored rows'): as much again as the resident ones, in
    :attr:`StaticMemory.step_inputs`."""
    if "steps_per_epoch" in plan.info:
        return dataclasses.replace(static, loaded=static.topology + static.features + static.labels)
    if plan.info.get("regrouped") or plan.options.get("dependencies") == "regrouped":  # (plans saved before the key)
        s = dp.sizes
        vertices = int(plan.info.get("topology", {}).get("nodes") or s.all_nodes or s.nodes)
        ids = 8 * vertices + (8 * s.nodes if s.trains else 0)
        return dataclasses.replace(static, step_inputs=static.topology + static.features + static.labels + ids)
    return static


def _chunk_sizes(dp: DevicePlan) -> RankSizes:
    """The sizes of one chunk a rank works on: :meth:`RankSizes.per_chunk`, except where the rank's
    stages run only some of the plan's chunks (:attr:`StageSpec.runs`: a ``layer`` hybrid's group
    member runs its partition's) while its sizes count all of them (``chunks``): its rows and edges
    are then those of the chunks it runs, each one of them (``all_nodes``, the whole graph's rows,
    stays divided by every chunk)."""
    s = dp.sizes
    at = s.per_chunk()
    runs = max((len(st.runs) for st in dp.stages if st.runs), default=0)
    if runs and runs < max(int(s.chunks or 1), 1):
        at = dataclasses.replace(at, nodes=-(-s.nodes // runs), edges=-(-s.edges // runs))
    return at


def _feature_bytes_per_row(plan: Plan) -> float:
    """Bytes of one row of the input features: sparse CSR ones' stored bytes
    (``plan.info["feature_bytes_per_row"]``), else ``features`` values of the model's dtype."""
    per_row = plan.info.get("feature_bytes_per_row")
    if per_row is not None:
        return float(per_row)
    return _elsize(plan.info.get("param_dtype", "float32")) * int(plan.info.get("features", 0))


def _sparse_row_value_bytes(plan: Plan) -> Optional[float]:
    """Bytes per row of the stored values of the plan's sparse CSR input features, or ``None`` when
    the features are dense. ``plan.info["feature_bytes_per_row"]`` counts a stored entry as its value
    and its int64 column index, and a row as its int64 pointer."""
    per_row = plan.info.get("feature_bytes_per_row")
    features = int(plan.info.get("features", 0))
    es = _elsize(plan.info.get("param_dtype", "float32"))
    if per_row is None or not features or per_row >= es * features:
        return None
    return max(0.0, (float(per_row) - 8.0) * es / (es + 8))


def _sparse_op(plan: Plan, op: OpCost) -> bool:
    """Whether ``op`` computes on the sparse input features and keeps them sparse (a dropout of
    ``x``): a first-layer T op as wide as the features of a plan whose features are sparse."""
    return op.kind == "T" and op.layer <= 1 and op.width == int(plan.info.get("features", -1)) \
        and _sparse_row_value_bytes(plan) is not None


#: functions of the dropouts :func:`gnncompile.passes.dropout.replicate_dropout_masks` rewrites into
#: ``dropout_rows`` when they draw a mask
_DROPOUTS = frozenset({"dropout", "feature_dropout"})


def _identity_dropout(plan: Plan, op: OpCost) -> bool:
    """Whether ``op`` is a dropout that draws nothing and returns its input itself (``p == 0``, as
    SGC's default input dropout): a plan that replicates masks (``dropout="replicated"``) rewrote
    every dropout that draws into ``dropout_rows``, so one still named ``dropout`` or
    ``feature_dropout`` draws nothing; elsewhere one that the lowering annotates with no draws
    (:attr:`OpCost.random`)."""
    if op.kind != "T" or _function_of(op) not in _DROPOUTS:
        return False
    return plan.options.get("dropout", "replicated") == "replicated" or op.random == Lin()


def _out_bytes(plan: Plan, op: OpCost, sizes: RankSizes) -> float:
    """Bytes of ``op``'s output on a rank of ``sizes``: ``op.out`` (dense rows), except for an op that
    keeps the sparse input features sparse, whose output is new values on the input's structure,
    and a dropout that draws nothing (:func:`_identity_dropout`), whose output is its input."""
    if _identity_dropout(plan, op):
        return 0.0
    dense = op_value(op, op.out, sizes)
    if not _sparse_op(plan, op):
        return dense
    es = _elsize(plan.info.get("param_dtype", "float32"))
    return dense * (_sparse_row_value_bytes(plan) or 0.0) / (op.width * es)


def _mask_bytes(plan: Plan, op: OpCost, sizes: RankSizes) -> float:
    """Bytes of the dropout mask ``op`` draws in the model's dtype: ``op.random`` numbers (the rows
    the op reads; a sparse input's replicated mask: one number per stored value of the whole matrix)."""
    return _eval(op.random, sizes) * _elsize(plan.info.get("param_dtype", "float32"))


def _plan_masks(plan: Plan) -> dict[str, float]:
    """Mask bytes of every dropout of the plan, by op name, at the size of the rank that runs it."""
    every: dict[str, float] = {}
    for r in plan.ranks:
        at = _chunk_sizes(r)
        for st in r.stages:
            for op in st.costs:
                if _eval(op.random, at) > 0 and not _identity_dropout(plan, op):
                    every.setdefault(op.name, _mask_bytes(plan, op, at))
    return every


class _RankMasks:
    """What a rank's dropout masks hold (the runtime's :class:`~gnncompile.frontend.ops.MaskDraw`).

    A replicated mask (``plan.options["dropout"] == "replicated"``) is a seed: a dropout computes
    only the rows it reads, as a bool tensor (one byte per entry: what its product saves for
    backward, in the op's measured saved bytes), and multiplies into the output's own buffer
    (``keep`` cast, scaled, times ``x`` in place): no temporary beside the output. A mask that is not replicated (``F.dropout`` on
    the rank's rows) is drawn whole in the model's dtype, a temporary of the op. Nothing is kept
    between instructions. (``GNNCOMPILE_DROPOUT_MASKS=torch`` draws and keeps whole masks instead;
    the model does not follow it.)
    """

    def __init__(self, plan: Plan, dp: DevicePlan, sizes: RankSizes, every: dict[str, float]) -> None:
        """``every``: the plan's dropouts (:func:`_plan_masks`); ``sizes``: the rank's per-chunk sizes."""
        self.replicated = plan.options.get("dropout", "replicated") == "replicated"
        self.bytes = {op.name: _mask_bytes(plan, op, sizes) for st in dp.stages for op in st.costs
                      if op.name in every}

    def step_start(self) -> tuple[float, float]:
        """Bytes kept and bytes of temporaries the rank allocates before its first instruction: none."""
        return 0.0, 0.0

    def drawn_at(self, stage: StageSpec) -> tuple[float, set[str]]:
        """Bytes of masks a forward of ``stage`` keeps, and their ops: none (masks are seeds)."""
        return 0.0, set()

    def forward_extra(self, op: OpCost, drawn: set[str]) -> float:
        """Temporaries of ``op``'s forward beside its output: none for a replicated dropout, a local
        one's mask."""
        if op.name not in self.bytes or self.replicated:
            return 0.0
        return self.bytes[op.name]

    def viewed(self, op: OpCost) -> bool:
        """Whether what ``op`` saves for backward is a view of memory counted elsewhere: never."""
        return False

    def kept(self) -> dict[int, float]:
        """Bytes of masks kept until a stage's last backward, by stage: none."""
        return {}


class PlanCost:
    """Cost of every instruction of ``plan`` on ``cluster``: the cost function the simulator calls.

    Building it walks each rank's instruction list once (the memory liveness); calling it is a
    dictionary lookup. ``plan_cost(rank, instruction)`` returns a :class:`~.simulate.Cost`.
    ``first_step``: cost the first step, whose optimizer step allocates Adam's moments (else they
    are resident: :meth:`base_memory`).
    """

    def __init__(self, plan: Plan, cluster: Cluster, *, first_step: bool = False) -> None:
        if cluster.num_devices < plan.num_ranks:
            raise PlanningError(f"the plan has {plan.num_ranks} ranks but the cluster {cluster.name!r} has "
                                f"{cluster.num_devices} devices")
        self.plan = plan
        self.cluster = cluster
        self.first_step = first_step
        self.devices = [cluster.rank_device(r) for r in range(plan.num_ranks)]
        self.static = [_with_step_inputs(plan, dp, _with_native_features(plan, dp, static_memory(plan, dp, dev), dev))
                       for dp, dev in zip(plan.ranks, self.devices)]
        self.masks = _plan_masks(plan)  # the dropout masks of every rank, for the ranks' liveness walks
        self._p2p_times: dict[tuple[bool, tuple[int, ...], str], float] = {}  # (same node, shape, dtype)
        self._a2a_totals: dict[tuple[int, int], _ShapeTotals] = {}  # by the ids of the shape tuples
        self._group_index: dict[tuple[int, ...], dict[int, int]] = {}  # group -> rank -> position
        self._links: dict[tuple[tuple[int, ...], str], Any] = {}  # (group, collective) -> _group_link
        self._stage_times: dict[tuple, float] = {}  # (device id, sizes, stage id, backward) -> seconds
        self._costs: list[dict[Instruction, Cost]] = [self._rank_costs(dp) for dp in plan.ranks]

    def __call__(self, rank: int, inst: Instruction) -> Cost:
        return self._costs[rank][inst]

    def base_memory(self) -> list[int]:
        """Bytes each rank holds before the step: its resident data (:attr:`StaticMemory.resident`),
        without Adam's moments and the history tables in the first step (which makes them)."""
        return [s.resident - (s.optimizer + s.history if self.first_step else 0) for s in self.static]

    # ------------------------------------------------------------------ compute
    def stage_time(self, rank: int, stage: StageSpec, backward: bool) -> float:
        """Seconds of one Forward/Backward of ``stage`` (one chunk's share on a chunked rank);
        computed once per (device, sizes, stage, direction): ranks alike share it."""
        dev = self.devices[rank]
        at = _chunk_sizes(self.plan.ranks[rank])
        key = (id(dev), at, id(stage), backward)
        t = self._stage_times.get(key)
        if t is None:
            push = backward and self.plan.info.get("topology", {}).get("backward") == "push"
            t = stage_ops_time(stage, at, dev, backward, push) + \
                loss_time(stage, at, dev, backward, self.plan.info.get("output"))
            self._stage_times[key] = t
        return t

    # ------------------------------------------------------------------ communication
    def comm_time(self, rank: int, inst: Instruction) -> float:
        """Transfer time of a communication instruction plus the runtime's fixed cost per instruction."""
        return self.devices[rank].runtime.get("comm", 0.0) + self._transfer_time(rank, inst)

    def _transfer_time(self, rank: int, inst: Instruction) -> float:
        r = rule(inst)
        if r.kind == "collective" and len(inst.group) <= 1:
            return 0.0
        transfer = r.cost_rule().transfer
        if transfer is None:
            raise PlanningError(f"no communication model for {type(inst).__name__}")
        return transfer(self, rank, inst)

    def _group_link(self, group: tuple[int, ...], collective: str = "") -> Any:
        """The link a collective over ``group`` runs at: the group's slowest, or on one node the measured
        link of ``collective`` where it names one; time-shared where the host is oversubscribed
        (:meth:`~gnncompile.cost_models.hardware.Cluster.time_shared`)."""
        c = self.cluster
        measured = bool(collective) and c.nodes == 1
        key = (group, collective if measured else "")
        link = self._links.get(key)
        if link is None:
            base = c.collective_link(collective) if measured else c.slowest_link(group)
            link = self._links[key] = c.time_shared(base)
        return link

    # ------------------------------------------------------------------ one rank
    def _rank_costs(self, dp: DevicePlan) -> dict[Instruction, Cost]:
        """Time and memory events of each instruction of ``dp`` (the liveness walk of the module
        docstring; each instruction's share is its class's :class:`CostRule`)."""
        walk = _RankWalk(self, dp)
        costs: dict[Instruction, Cost] = {}
        for i, inst in enumerate(dp.instructions):
            seconds, stream, alloc, transient = rule(inst).cost_rule().cost(walk, i, inst)
            if i == 0:  # masks every rank draws before the step's first instruction
                kept, temporary = walk.masks.step_start()
                alloc, transient = alloc + kept, transient + temporary
            costs[inst] = Cost(seconds=seconds, stream=stream, alloc=int(alloc + transient), free=int(transient))
        for stage, nbytes in walk.masks.kept().items():  # after the stage's last backward
            last = max((i for (s, _), i in walk.backward_at.items() if s == stage), default=len(dp.instructions) - 1)
            walk.release_at(last, nbytes)
        for i, nbytes in walk.frees.items():
            inst = dp.instructions[i]
            costs[inst] = dataclasses.replace(costs[inst], free=costs[inst].free + int(nbytes))
        for i, nbytes in walk.early.items():
            inst = dp.instructions[i]
            costs[inst] = dataclasses.replace(costs[inst], release=costs[inst].release + int(nbytes))
        if dp.instructions:
            # after the last instruction (the optimizer step, which released the gradients) the step
            # concatenates the logits of its chunks (:meth:`_Rank.step`) while every value it held is
            # still alive; then a sampled epoch's next step samples and gathers its inputs while this
            # step's are still held (``_sampled_epoch``), everything else of the step released
            last = dp.instructions[-1]
            c = costs[last]
            logits = _step_logits(walk) - (walk.param_grads if isinstance(last, OptimizerStep) else 0.0)
            steps = int(self.plan.info.get("steps_per_epoch") or 1)
            nxt = self.static[walk.index].loaded - c.free if steps > 1 else 0.0
            extra = max(0.0, logits, nxt)
            if extra:
                costs[last] = dataclasses.replace(c, alloc=c.alloc + int(extra), free=c.free + int(extra))
        return costs


#: bytes of the CPU generator's state (``torch.get_rng_state()``), which ``torch.utils.checkpoint``
#: keeps per call (``preserve_rng_state``; a CUDA generator's is as small and in host memory)
CPU_RNG_STATE_BYTES = int(torch.get_rng_state().numel())


def _segment_outputs(st: StageSpec, value_bytes: dict[str, float]) -> dict[str, float]:
    """Bytes of the values of ``st``'s checkpointed segments (``recompute_<k>``, whose ops are named
    ``recompute_<k>.<op>``): the outputs of the ops it returns (:attr:`OpCost.returned`; a plan
    saved without them: its last op's)."""
    ops: dict[str, list[OpCost]] = defaultdict(list)
    for op in st.costs:
        if _segment_of(op) is not None:
            ops[_segment_of(op)].append(op)
    return {segment: sum(value_bytes[op.name] for op in ([op for op in members if op.returned] or members[-1:]))
            for segment, members in ops.items()}


def _step_logits(w: "_RankWalk") -> float:
    """Bytes of the concatenation of the model output's chunks a rank computes in a training step
    (every chunk a Forward of the output's stage makes, or a communication delivers as the output),
    which the runtime makes when the step ends; 0 on ranks that compute no output rows."""
    output = w.cost.plan.info.get("output")
    if not output:
        return 0.0
    total = 0.0
    for inst in w.dp.instructions:
        r = rule(inst)
        if r.runs == "forward" and isinstance(inst, Forward):
            st = w.stages[inst.stage]
            if output in st.outputs and any(op.name == output for op in st.costs):
                total += w.value_bytes.get(output, 0.0)
        elif r.communicates and getattr(inst, "output", None) == output and not getattr(inst, "grad", False):
            total += w.value_bytes.get(output, 0.0)
    return total


class _RankWalk:
    """The state of the liveness walk over one rank's instructions that the cost rules share: the
    bytes of every value, where each value is last used, and what is released after which instruction."""

    def __init__(self, cost: PlanCost, dp: DevicePlan) -> None:
        self.cost, self.dp = cost, dp
        self.stages = stages = {s.index: s for s in dp.stages}
        self.sizes = sizes = _chunk_sizes(dp)
        plan = cost.plan
        self.value_bytes: dict[str, float] = {}
        for s in dp.stages:
            for op in s.costs:
                self.value_bytes[op.name] = _out_bytes(plan, op, sizes)
            self.value_bytes.update(_segment_outputs(s, self.value_bytes))
        self.masks = _RankMasks(plan, dp, sizes, cost.masks)
        #: bytes of one chunk's rows of the input features, the rank's share of their columns where it
        #: has one (a stage reading several chunks concatenates them)
        share = sizes.col_share_ppm / 1e6 if sizes.col_share_ppm else 1.0
        self.feature_chunk = sizes.nodes * share * _feature_bytes_per_row(plan)
        src_rows = sizes.source_rows
        for inst in dp.instructions:
            output_bytes = rule(inst).cost_rule().output_bytes
            nbytes = output_bytes(inst, src_rows) if output_bytes is not None else None
            if nbytes is not None:
                self.value_bytes[inst.output] = nbytes
        # where each value is freed (per chunk) and each stage's backward runs
        self.backward_at: dict[tuple[int, int], int] = {}
        self.free_at: dict[tuple[str, int], int] = {}
        #: the first Forward or Backward from each instruction on (``len(instructions)`` if none)
        self.next_compute = [len(dp.instructions)] * (len(dp.instructions) + 1)
        for i in reversed(range(len(dp.instructions))):
            self.next_compute[i] = i if rule(dp.instructions[i]).runs in ("forward", "backward") \
                else self.next_compute[i + 1]
        for i, inst in enumerate(dp.instructions):
            self.free_at.update(dict.fromkeys(effects(inst, stages).frees, i))
            if rule(inst).runs == "backward":
                self.backward_at[inst.stage, inst.chunk] = i
        # a stage's input leaves stay until its backward where an op of the stage saves them, else
        # the executor keeps only their shape: a single chunk read is the value itself (then held
        # until that backward at least), several chunks read are one concatenation per (value,
        # chunks), kept to the last such backward, else dropped after the last forward that reads it
        self.held: dict[tuple[str, int], int] = {}
        #: (value, chunks read, chunks read stale) -> (first, last use) of its concatenation
        self.concat_span: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}
        for i, inst in enumerate(dp.instructions):
            if rule(inst).runs == "forward" and (inst.stage, inst.chunk) in self.backward_at:
                st = stages[inst.stage]
                back = self.backward_at[inst.stage, inst.chunk]
                saves_input = _saves_inputs(st, sizes)
                for v in dict.fromkeys(st.inputs):
                    read, stale = _read_chunks(st, v, inst.chunk)
                    if len(read) == 1:
                        if saves_input:
                            self.held[v, read[0]] = max(self.held.get((v, read[0]), back), back)
                    else:
                        end = back if saves_input else i
                        first, last = self.concat_span.get((v, read, stale), (i, end))
                        self.concat_span[v, read, stale] = (min(first, i), max(last, end))
        # historical embeddings (relaxed stale reads): the first step makes each value's table at the
        # first forward reading it stale, where that step keeps copies (``history_refresh`` 1: every
        # step; a longer refresh makes none in it); with historical gradients every step makes a
        # gradient table in its first backward reaching a stale chunk (the previous step's is
        # dropped at the step's end)
        refreshed = int(plan.options.get("history_refresh") or 1) == 1
        tables = _history_tables(plan, dp)
        self.history_tables = dict(tables) if cost.first_step and refreshed else {}
        self.history_grad_tables = dict(tables) if plan.options.get("historical_gradients") else {}
        #: compute instructions that follow a wait for peers (nothing but FREEs between): each pays the
        #: device's ``runtime["switch"]`` (its thread blocked while others ran)
        self.after_wait: set[int] = set()
        if len(plan.ranks) > 1:
            waited = False
            for i, inst in enumerate(dp.instructions):
                r = rule(inst)
                if r.kind == "memory":
                    continue
                if waited and r.kind in ("compute", "optimizer"):
                    self.after_wait.add(i)
                waited = r.communicates
        #: where posted sends are last waited for: the optimizer step (else the last instruction)
        self.optimizer_at = next((i for i, inst in enumerate(dp.instructions) if isinstance(inst, OptimizerStep)),
                                 len(dp.instructions) - 1)
        #: bytes of send buffers the optimizer step releases before it changes the parameters
        self.sends_at_optimizer = 0.0
        #: :func:`_saved_per_op` by (stage, replay), and the temporaries of each op's backward by
        #: stage: the same for each of a stage's chunks
        self.saved_cache: dict[tuple[int, bool], list[float]] = {}
        self.backward_temps: dict[int, list[float]] = {}
        self.frees: dict[int, float] = {}  # instruction index -> bytes released at its end
        self.early: dict[int, float] = {}  # instruction index -> bytes released right after it starts
        #: bytes of the parameters' gradients each stage's first backward makes, and those not made yet
        self.index = dp.rank if dp.rank < len(plan.ranks) and plan.ranks[dp.rank] is dp else plan.ranks.index(dp)
        self.device = cost.devices[self.index]  # the rank's device (DeviceSpec)
        self.param_grads = cost.static[self.index].gradients
        self.stage_grads = _stage_gradients(dp, self.param_grads)
        self.grads_unmade = float(self.param_grads)
        self.grad_made: dict[tuple[str, int], float] = {}
        self.received: dict[tuple[str, int], float] = {}
        #: (value, chunk) -> (output, chunk) of a halo exchange that hands the value on as its output
        self.aliases: dict[tuple[str, int], tuple[str, int]] = {
            (inst.value, inst.chunk): (inst.output, inst.chunk) for inst in dp.instructions
            if isinstance(inst, HaloExchange) and not inst.grad and _halo_aliases(inst)}

    def gone(self, key: tuple[str, int], i: int) -> int:
        """Where the value ``key`` stored at instruction ``i`` is released: at its ``Free``, else at
        the end of the step (the runtime keeps every value it stored and the plan does not free);
        a value a halo exchange hands on as its output (:func:`_halo_aliases`) lives as long as that too."""
        end = self.free_at[key] if key in self.free_at else len(self.dp.instructions) - 1
        end = max(end, i, self.held.get(key, end))
        alias = self.aliases.get(key)
        return max(end, self.gone(alias, i)) if alias is not None else end

    def release_at(self, i: int, nbytes: float) -> None:
        self.frees[i] = self.frees.get(i, 0.0) + nbytes

    def release_on_start(self, i: int, nbytes: float) -> None:
        """Release ``nbytes`` right after instruction ``i`` starts and allocates (:attr:`Cost.release`)."""
        self.early[i] = self.early.get(i, 0.0) + nbytes

    def switch(self, i: int) -> float:
        """What instruction ``i`` pays for following a wait for peers (0 if it does not)."""
        return self.device.runtime.get("switch", 0.0) if i in self.after_wait else 0.0


#: What a cost rule returns for one instruction: seconds, stream, bytes allocated when it starts
#: (besides its transient buffers), transient bytes (allocated at its start, released at its end).
StepCost = tuple[float, str, float, float]


@dataclass(frozen=True)
class CostRule:
    """The cost model's rule of one instruction class (the ``cost`` field of its
    :class:`~gnncompile.ir.rules.InstructionRule`).

    ``cost(walk, i, inst) -> (seconds, stream, alloc, transient)``: its share of the rank's liveness
    walk; ``transfer(plan_cost, rank, inst) -> seconds``: a communication's transfer time (``None``
    for local instructions); ``output_bytes(inst, src_rows)``: bytes of the value it writes under
    ``inst.output``, or ``None``.
    """

    cost: Callable[[_RankWalk, int, Any], StepCost]
    transfer: Optional[Callable[[PlanCost, int, Any], float]] = None
    output_bytes: Optional[Callable[[Any, float], Optional[float]]] = None


# --------------------------------------------------------------------------- compute rules
def load_seconds(plan: Plan, dp: DevicePlan, device: DeviceSpec) -> float:
    """Seconds a rank of a sampled mini-batch plan spends loading a step's input feature rows onto
    its device (``feature_rows`` rows at their stored bytes, over ``device.host_bandwidth``); 0 for
    plans whose features stay on the device."""
    if "steps_per_epoch" not in plan.info:
        return 0.0
    rows = dp.sizes.feature_rows if dp.sizes.feature_rows is not None else dp.sizes.nodes
    return rows * _feature_bytes_per_row(plan) / device.host_bandwidth


def _stage_gradients(dp: DevicePlan, total: float) -> dict[int, float]:
    """Bytes of the parameter gradients the first backward of each of the rank's stages makes: the
    rank's ``total`` shared in proportion to the size-independent bytes of the stages' ops (their
    weights: a GEMM reads its weight whatever the rows); all of it to the first stage where no op
    has any."""
    weights = {st.index: sum(float(op.bytes.c) for op in st.costs if op.bytes.c > 0) for st in dp.stages}
    whole = sum(weights.values())
    if not total or not weights:
        return {}
    if not whole:
        return {dp.stages[0].index: float(total)}
    return {k: total * v / whole for k, v in weights.items() if v}


def _make_gradients(w: _RankWalk, nbytes: float) -> float:
    """Gradients of ``nbytes`` made now (at most those not made yet), kept to the optimizer step's end."""
    nbytes = min(nbytes, w.grads_unmade)
    w.grads_unmade -= nbytes
    w.release_at(w.optimizer_at, nbytes)
    return nbytes


def _forward_cost(w: _RankWalk, i: int, inst: Union[Forward, Recompute]) -> StepCost:
    st = w.stages[inst.stage]
    seconds = w.cost.stage_time(w.dp.rank, st, backward=False) + w.switch(i)
    if isinstance(inst, Forward) and "x" in st.inputs:  # a sampled step's features arrive first
        seconds += load_seconds(w.cost.plan, w.dp, w.device)
    kept = _saved_per_op(w, st)
    saved = sum(kept)
    outs = sum(w.value_bytes.get(o, 0.0) for o in st.outputs)
    # the stage's ops run one after the other: op k holds what the ops before it saved, the stage
    # outputs made so far, the outputs of earlier ops that it or a later op reads (the previous op's
    # at least: :attr:`OpCost.reads`), its output and its temporaries (a dropout's mask); what exceeds
    # the stage's saved tensors and outputs is released at its end
    drawn, new = w.masks.drawn_at(st)
    last_read = _last_reads(st)
    peak = held = made = 0.0
    pending: dict[int, float] = {}  # op -> bytes of its output held for later readers, not counted otherwise
    for j, (op, k) in enumerate(zip(st.costs, kept)):
        out = w.value_bytes.get(op.name, 0.0)
        extra = w.masks.forward_extra(op, new) + _sparse_product_temporaries(w, op) + _op_temporaries(op, out, w.device, False)
        peak = max(peak, held + made + sum(pending.values()) + out + extra)
        held += k
        made += out if op.name in st.outputs else 0.0
        pending = {i: b for i, b in pending.items() if last_read[i] > j}
        # this op's output for its readers: already counted where it is a stage output or what it saved
        unsaved = 0.0 if op.name in st.outputs else out - min(out, k) if _saves_result(op) else out
        if unsaved and last_read[j] > j:
            pending[j] = unsaved
    transient = max(0.0, peak - saved - outs - drawn)
    alloc = saved + outs + drawn
    back = w.backward_at.get((inst.stage, inst.chunk), len(w.dp.instructions) - 1)
    w.release_at(back, saved)
    kept_outputs = set(_outputs_saved(st).values())
    for o in st.outputs:  # an output an op saved stays until the backward too
        end = w.gone((o, inst.chunk), i)
        w.release_at(max(end, back) if o in kept_outputs else end, w.value_bytes.get(o, 0.0))
    for v in dict.fromkeys(st.inputs):
        read, stale = _read_chunks(st, v, inst.chunk)
        if stale and v in w.history_tables:  # the first step's table of v, made by its first stale read
            alloc += w.history_tables.pop(v)
        chunk = w.value_bytes.get(v, w.feature_chunk if v.split("@", 1)[0] == FEATURES else None)
        if chunk is not None and len(read) > 1 and w.concat_span.get((v, read, stale), (-1,))[0] == i:
            whole = chunk * len(read)
            alloc += whole
            w.release_at(w.concat_span[v, read, stale][1], whole)
    return seconds, "compute", alloc, transient


def _read_chunks(st: StageSpec, v: str, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunks of input ``v`` that ``Forward(st, chunk)`` reads, fresh or from the previous step
    (relaxed stale reads: their copies in the history), and those read stale. Several chunks are
    read as one concatenation of all of them (the runtime's ``_concat_key``)."""
    fresh = tuple(st.chunks_read(v, chunk))
    stale = tuple(sorted(st.chunks_stale(v, chunk))) if st.stale else ()
    return (tuple(sorted(set(fresh) | set(stale))), stale) if stale else (fresh, ())


def _last_reads(st: StageSpec) -> list[int]:
    """For each op of ``st``, the last op (its index; its own where none) reading its output, by
    :attr:`OpCost.reads` (where an op's are unknown: it reads the previous op's output)."""
    index = {op.name: j for j, op in enumerate(st.costs)}
    last = list(range(len(st.costs)))
    for j, op in enumerate(st.costs):
        for name in op.reads if op.reads is not None else (st.costs[j - 1].name,) if j else ():
            i = index.get(name)
            if i is not None and i < j:
                last[i] = max(last[i], j)
    return last


def _replayed(st: StageSpec) -> list[bool]:
    """Which ops of ``st`` save only while a checkpointed segment replays its forward in backward:
    every op of a segment (ops named ``<segment>.<op>``, ``recompute``) but its first, whose
    ``saved`` are the segment's kept inputs; the others' ``saved`` are what the op saves when it runs
    with gradients."""
    seen: set[str] = set()
    out = []
    for op in st.costs:
        segment = _segment_of(op)
        out.append(segment is not None and segment in seen)
        if segment is not None:
            seen.add(segment)
    return out


#: functions whose autograd node saves their result, not their input (PyTorch's derivative
#: formulas): an op so named (fx names a call after its function: ``relu``, ``relu_1``) holds its output
_RESULT_SAVERS = frozenset({"relu", "sigmoid", "tanh", "exp", "softmax", "log_softmax", "edge_softmax",
                            "edge_attention"})

#: functions whose forward or backward holds temporaries of their output's size beside their inputs,
#: output and gradients: ``(forward, backward)`` counts on a CPU (native edge ops) and elsewhere (the
#: torch formulations). ``edge_softmax``'s torch formulation spreads a per-destination term over the
#: edges (:class:`~gnncompile.frontend.ops._EdgeSoftmax`); ``edge_attention``'s backward makes the
#: scores' gradient before summing it into the vertices (:class:`~gnncompile.frontend.ops._EdgeAttention`;
#: its torch formulation also gathers the scores or spreads a term over the edges)
_OUTPUT_SIZED_TEMPORARIES = {"edge_softmax": {"cpu": (0, 0), "other": (1, 1)},
                             "edge_attention": {"cpu": (0, 1), "other": (1, 2)}}


def _function_of(op: OpCost) -> str:
    """The function an op calls, from its fx name (``relu_1`` -> ``relu``; ``seg.relu`` -> ``relu``)."""
    base = op.name.rsplit(".", 1)[-1]
    stem, _, suffix = base.rpartition("_")
    return stem if suffix.isdigit() and stem else base


def _saves_result(op: OpCost) -> bool:
    """Whether ``op`` is a call of a function whose backward saves its output (:data:`_RESULT_SAVERS`);
    other ops' ``saved`` count as their inputs (a linear layer's, ``elu``'s, ``leaky_relu``'s)."""
    return _function_of(op) in _RESULT_SAVERS


def _op_temporaries(op: OpCost, out: float, device: DeviceSpec, backward: bool) -> float:
    """Bytes of ``op``'s own temporaries in its forward or ``backward`` on ``device``
    (:data:`_OUTPUT_SIZED_TEMPORARIES`)."""
    counts = _OUTPUT_SIZED_TEMPORARIES.get(_function_of(op))
    if counts is None:
        return 0.0
    return counts["cpu" if device.kind == "cpu" else "other"][int(backward)] * out


def _saved_per_op(w: _RankWalk, st: StageSpec, replay: bool = False) -> list[float]:
    """Bytes each op of ``st`` saves for backward that are new memory: not the rows of a kept
    dropout mask (views), not a held stage input that the stage's first op saves (the input
    itself; a first dropout saves its mask), not a stage output that the op after it saves as its input (a linear layer's: an op
    with weights) or that the op itself saves as its result (:func:`_saves_result`). An op of a
    checkpointed segment (:func:`_replayed`) saves only in its replay (``replay``); on a CPU the
    segment's first op also holds the generator's state, which checkpointing keeps per call to
    replay the segment's random draws (:data:`CPU_RNG_STATE_BYTES`)."""
    key = (st.index, replay)
    if key in w.saved_cache:
        return w.saved_cache[key]
    replayed = _replayed(st)
    kept = w.saved_cache[key] = [0.0 if w.masks.viewed(op) or again != replay and (again or replay) else
                                 _saved_bytes(op, w.sizes) for op, again in zip(st.costs, replayed)]
    if not replay and w.device.kind == "cpu":  # each checkpointed call keeps the CPU generator's state
        for j, (op, again) in enumerate(zip(st.costs, replayed)):
            if _segment_of(op) is not None and not again:  # (a segment's first op)
                kept[j] += CPU_RNG_STATE_BYTES
    if kept and not replay and st.costs[0].name not in w.masks.bytes:  # (a dropout saves its mask)
        for j, op in enumerate(st.costs):
            read = _stage_inputs_read(w, st, j)
            if read and op.name not in w.masks.bytes and not _saves_result(op):
                kept[j] -= min(kept[j], read)
        for j, name in _outputs_saved(st).items():
            kept[j] -= min(kept[j], w.value_bytes.get(name, 0.0))
    return kept


def _stage_inputs_read(w: _RankWalk, st: StageSpec, j: int) -> float:
    """Bytes of the (largest) stage input that op ``j`` of ``st`` reads: by :attr:`OpCost.reads`
    (which names the inputs needing a gradient), else, for the first op, any of them."""
    op = st.costs[j]
    named = [w.value_bytes[v] for v in st.inputs if v in w.value_bytes and v.split("@", 1)[0] in (op.reads or ())]
    if named or j:
        return max(named, default=0.0)
    return max((w.value_bytes[v] for v in st.inputs if v in w.value_bytes), default=0.0)


def _saves_inputs(st: StageSpec, sizes: RankSizes) -> bool:
    """Whether an op of ``st`` saves a stage input for backward: its first op saving anything but
    its result (a linear layer its input; ``relu`` saves its output), an op reading one
    (:attr:`OpCost.reads`) that saves what it reads (no dropout, which saves its mask, nor an op
    saving its result), or a propagation whose edge values need a gradient (which reads the
    gathered input rows: GAT's; its ``saved`` may be none of its own, the values replayed and the
    input counted as saved by the op that made it)."""
    inputs = {v.split("@", 1)[0] for v in st.inputs}
    first = st.costs[0] if st.costs else None
    return first is not None and op_value(first, first.saved, sizes) > 0 and not _saves_result(first) or \
        any(op.kind == "P" and op_value(op, op.values, sizes) > 0 for op in st.costs) or \
        any(op.reads and inputs & set(op.reads) and op_value(op, op.saved, sizes) > 0 and not _saves_result(op)
            and op.random == Lin() for op in st.costs)


def _sparse_product_temporaries(w: _RankWalk, op: OpCost) -> float:
    """Temporaries of a linear layer on sparse CSR rows (:func:`_sparse_product_inputs`) on a CPU
    (the native kernels): its forward copies the weight transposed, its backward the weight's
    gradient once more (made contiguous, as its parameter). The same bytes each way; 0 for other
    ops and devices. (The rows' int32 column indices are made before the first step and kept:
    :attr:`StaticMemory.features` on a CPU.)"""
    es = _elsize(w.cost.plan.info.get("param_dtype", "float32"))
    if w.device.kind != "cpu":
        return 0.0
    inputs = _sparse_product_inputs(op, es)
    if inputs is None:
        return 0.0
    return inputs * op.width * es


def _saved_bytes(op: OpCost, sizes: RankSizes) -> float:
    """Bytes ``op`` saves for backward on a rank of ``sizes``: ``op.saved``, except that a propagation
    on a share of the columns (``cols``) saves its edge values whole: its share of them is a view of
    the replicated edge tensor (one head of GAT's), which keeps all of it."""
    return _edge_values_bytes(op, op.saved, sizes)


def _edge_values_bytes(op: OpCost, form: Lin, sizes: RankSizes) -> float:
    """``form`` (what ``op`` saves or replays of its edge values) on a rank of ``sizes``: whole for a
    propagation on a share of the columns (a view of the replicated edge tensor keeps all of it; a
    replayed dropout output is computed whole), else the op's share."""
    if op.kind == "P" and op.layout == "cols":
        return _eval(form, _op_sizes(op, sizes)[0])
    return op_value(op, form, sizes)


def _outputs_saved(st: StageSpec) -> dict[int, str]:
    """The stage outputs that an op of ``st`` saves for backward, by the op's position: its own
    output (:func:`_saves_result`), or the previous op's, which an op with weights (a linear
    layer: a ``T`` op with size-independent bytes) reading it saves as its input. They live until
    the stage's backward at least (:func:`_forward_cost`)."""
    out: dict[int, str] = {}
    for j, op in enumerate(st.costs):
        if _saves_result(op) and op.name in st.outputs:
            out[j] = op.name
        elif j and op.kind == "T" and op.bytes.c > 0 and st.costs[j - 1].name in st.outputs \
                and (op.reads is None or st.costs[j - 1].name in op.reads):
            out[j] = st.costs[j - 1].name
    return out


def _backward_cost(w: _RankWalk, i: int, inst: Backward) -> StepCost:
    st = w.stages[inst.stage]
    seconds = w.cost.stage_time(w.dp.rank, st, backward=True) + w.switch(i)
    # gradients of the stage's inputs that something upstream consumes, made by the backward of the
    # ops reading them. A concatenation's gradient is then split into a gradient of every chunk it
    # holds, made by the first backward that reads them (later ones add into them); a gradient made
    # before is summed with the new one (no growth).
    made = split = wholes = 0.0
    inputs: dict[str, float] = {}  # stage input -> bytes of its gradient here (a concatenation's whole)
    tables = 0.0
    for v in dict.fromkeys(st.inputs):
        if v in w.value_bytes:
            read, stale = _read_chunks(st, v, inst.chunk)
            if stale and v in w.history_grad_tables:  # this step's table of historical gradients
                tables += w.history_grad_tables.pop(v)
            # a stale chunk's part of the concatenation's gradient goes to no chunk's
            fresh = [k for k in read if k not in stale]
            for key in [(v, k) for k in fresh] if len(read) > 1 else [(v, inst.chunk)]:
                if key not in w.grad_made:
                    w.grad_made[key] = w.value_bytes[v]
                    made += w.value_bytes[v]
                    split += w.value_bytes[v] if len(read) > 1 else 0.0
            inputs[v] = w.value_bytes[v] * len(read)
            wholes += inputs[v] if len(read) > 1 else 0.0
    received = {op.name for op in st.costs if op.name in st.outputs and (op.name, inst.chunk) in w.grad_made}
    peak = _backward_peak(w, st, inputs, received)
    if wholes:  # the new chunk gradients are copied out of the concatenation's
        peak = max(peak, sum(inputs.values()) + split)
    transient = max(0.0, peak - sum(_saved_per_op(w, st)) - made)
    # the weights' gradients of the stage, at its first backward (later chunks accumulate into them)
    alloc = _make_gradients(w, w.stage_grads.pop(inst.stage, 0.0)) + made + tables
    w.release_at(len(w.dp.instructions) - 1, tables)
    # the gradients of the outputs were consumed here
    for o in st.outputs:
        w.release_at(i, w.grad_made.pop((o, inst.chunk), 0.0))
    return seconds, "compute", alloc, transient


def _backward_peak(w: _RankWalk, st: StageSpec, inputs: dict[str, float], received: set[str]) -> float:
    """Peak bytes of a stage's backward above what was live before it, gradients received for its
    outputs (``received``) excepted. Autograd visits its ops last to first; op ``k``'s backward holds
    the saved tensors of ops ``0..k`` (later ones are released; a checkpointed segment first replays
    its forward, its ops saving what they save with gradients), the gradients of the values that
    ops ``k..`` read (:attr:`OpCost.reads`) and that ops ``..k`` made (its output's, the ones its
    inputs get now, the accumulating ones of values read again further up), the gradients of the
    stage's inputs (``inputs``, bytes) that it or a later op read, and its temporaries."""
    costs = st.costs
    index = {op.name: j for j, op in enumerate(costs)}
    by_base: dict[str, list[str]] = {}
    for v in inputs:
        by_base.setdefault(v.split("@", 1)[0], []).append(v)
    grads_in = [op.backward > 0 and op.input_grad for op in costs]
    needs_grad = {op.name for op in costs if op.backward > 0} | set(inputs)  # (an op autograd skips makes none)
    for j in range(1, len(costs)):  # nothing flows back through an op autograd does not visit
        grads_in[j] = grads_in[j] and (costs[j - 1].backward > 0 or costs[j].reads is not None)
    last_use: dict[str, int] = {}     # value read -> the last op (forward order) whose backward grads it
    reads: list[list[str]] = []
    for j, op in enumerate(costs):
        read = op.reads if op.reads is not None else (costs[j - 1].name,) if j else tuple(inputs)
        reads.append([u for name in read for u in by_base.get(name, [name] if name in index else [])
                      if u in needs_grad] if grads_in[j] else [])
        for u in reads[-1]:
            last_use[u] = j
    kept = _saved_per_op(w, st)
    again = _saved_per_op(w, st, replay=True)
    temps = w.backward_temps.get(st.index)
    if temps is None:
        temps = w.backward_temps[st.index] = [
            # (a pulled propagation's edge values in transposed order are freed before their gradient,
            # counted with the gradients, is made: frontend.ops._SpMM)
            _sparse_product_temporaries(w, op) + _op_temporaries(op, w.value_bytes.get(op.name, 0.0), w.device, True)
            + _edge_values_bytes(op, op.replayed, w.sizes) for op in costs]
    peak = below = 0.0
    for k, op in enumerate(costs):
        below += kept[k] + again[k]
        if not op.backward:
            continue
        out = w.value_bytes.get(op.name, 0.0)
        grads = sum(b for v, b in inputs.items() if last_use.get(v, -1) >= k)
        grads += sum(w.value_bytes.get(u, 0.0) for u, j in index.items()
                     if j <= k and u not in received and last_use.get(u, -1) >= k)
        if op.name not in received and op.name not in last_use:  # read by nobody here: a stage output
            grads += out
        # a value read again further up already has a gradient: this op's part is added to it
        adding = sum(inputs.get(u, w.value_bytes.get(u, 0.0)) for u in reads[k] if last_use[u] > k)
        peak = max(peak, below + grads + adding + temps[k])
    return peak


def _optimizer_cost(w: _RankWalk, i: int, inst: OptimizerStep) -> StepCost:
    info, dev = w.cost.plan.info, w.device
    # this rank's parameters (a rank of mop's sparse group or a task rank holds some or none): Adam
    # steps those, with the model's tensors in proportion
    params = w.cost.static[w.index].parameters // _elsize(info.get("param_dtype", "float32"))
    share = params / max(int(info.get("params", 0)), 1)
    tensors = math.ceil(int(info.get("param_tensors", 1)) * min(share, 1.0))
    # the step's bookkeeping outside instructions (loss, zeroing gradients) is charged here
    seconds = params * _ADAM_BYTES_PER_PARAM / dev.mem_bandwidth + \
        tensors * dev.runtime.get("optimizer_tensor", dev.launch_overhead) + dev.runtime.get("step", 0.0) + w.switch(i)
    # the first step creates Adam's two moments (kept); a steady step holds them from the start; the
    # fused update makes no temporaries. Send buffers still held are released before it starts.
    moments = w.cost.static[w.index].optimizer if w.cost.first_step else 0.0
    early = min(moments, w.sends_at_optimizer)
    w.release_at(i, w.sends_at_optimizer - early)
    return seconds, "compute", moments - early, 0.0


def _free_cost(w: _RankWalk, i: int, inst: Free) -> StepCost:
    return 0.0, "compute", 0.0, 0.0  # the liveness walk already releases values after their last use


# --------------------------------------------------------------------------- communication rules
def _all_reduce_cost(w: _RankWalk, i: int, inst: AllReduce) -> StepCost:
    """The gradients' all-reduce: gradients no backward made are made (zeros), and over a group of
    several ranks they are flattened into one bucket (a temporary of the ``numel`` reduced)."""
    alloc = _make_gradients(w, w.grads_unmade)
    bucket = inst.numel * _elsize(inst.dtype) if len(inst.group) > 1 else 0.0
    return w.cost.comm_time(w.dp.rank, inst), "comm", alloc, bucket


def _send_cost(w: _RankWalk, i: int, inst: Send) -> StepCost:
    """A Send: a slice of columns (``part`` on the last dimension) is copied into a contiguous buffer
    that lives until the send is known complete: the value's ``Free``, else the optimizer step (a
    gradient's, or a value the plan never frees, e.g. the input features); whole rows are sent in place."""
    seconds = w.cost.comm_time(w.dp.rank, inst)
    if not inst.part or inst.part[0] == 0:
        return seconds, "comm", 0.0, 0.0
    nbytes = math.prod(inst.shape) * _elsize(inst.dtype)
    end = w.free_at.get((inst.name, inst.chunk)) if not inst.grad else None
    if end is None and isinstance(w.dp.instructions[w.optimizer_at], OptimizerStep) and w.optimizer_at > i:
        w.sends_at_optimizer += nbytes  # waited for (and dropped) as the optimizer step starts
    else:
        w.release_at(max(end if end is not None else w.optimizer_at, i), nbytes)
    return seconds, "comm", nbytes, 0.0


def _recv_cost(w: _RankWalk, i: int, inst: Recv) -> StepCost:
    """A Recv: a value (or a block of one) kept like a stage output; a gradient kept until the
    backward (or gradient communication) that consumes it: a block is added into a gradient of the
    value's size, a whole one is stored, or summed with the gradient made so far (a new tensor)."""
    seconds = w.cost.comm_time(w.dp.rank, inst)
    nbytes = math.prod(inst.shape) * _elsize(inst.dtype)
    if inst.grad:
        key = (inst.name, inst.chunk)
        if key in w.grad_made:
            return seconds, "comm", 0.0, nbytes if inst.part else 2 * nbytes
        whole = w.value_bytes.get(inst.name, nbytes) if inst.part else nbytes
        w.grad_made[key] = whole
        return seconds, "comm", whole, nbytes if inst.part else 0.0
    alloc = nbytes
    if inst.part:  # a block of (name, chunk): the value is the sum of its blocks
        key = (inst.name, inst.chunk)
        got = w.received[key] = w.received.get(key, 0.0) + alloc
        w.value_bytes[inst.name] = max(w.value_bytes.get(inst.name, 0.0), got)
    else:
        w.value_bytes[inst.name] = alloc
    w.release_at(w.gone((inst.name, inst.chunk), i), alloc)
    return seconds, "comm", alloc, 0.0


def _conversion_cost(w: _RankWalk, i: int, inst: Union[HaloExchange, AllToAll, AllGather, ReduceScatter],
                     posted: bool = False) -> StepCost:
    """A layout conversion's time and memory; ``posted`` (an all-to-all): the gradient it consumes
    is dropped as it posts (:attr:`Cost.release`), not when its transfer ends."""
    seconds = w.cost.comm_time(w.dp.rank, inst)
    if _halo_aliases(inst):  # the output is the value itself (its storage lives until both are gone:
        if inst.grad:        # _RankWalk.gone); the output's gradient becomes the value's
            w.grad_made[inst.value, inst.chunk] = w.grad_made.pop((inst.output, inst.chunk), 0.0)
        return seconds, "comm", 0.0, 0.0
    # a halo exchange's buffer of the rows it sends (forward; backward: of the gradients it receives
    # back, the same rows), beside its result (forward: the halo rows are received into the output)
    rows = sum(inst.send_rows) if isinstance(inst, HaloExchange) else 0
    transient = rows * inst.width * _elsize(inst.dtype) if rows else 0.0
    if inst.grad:  # consumes the gradient of the output, makes the value's
        (w.release_on_start if posted else w.release_at)(i, w.grad_made.pop((inst.output, inst.chunk), 0.0))
        w.grad_made[inst.value, inst.chunk] = w.value_bytes.get(inst.value, 0.0)
        alloc = w.value_bytes.get(inst.value, 0.0)
    else:
        alloc = w.value_bytes.get(inst.output, 0.0)
        w.release_at(w.gone((inst.output, inst.chunk), i), alloc)
    return seconds, "comm", alloc, transient


def _halo_aliases(inst: Any) -> bool:
    """Whether a halo exchange hands back its input itself (:meth:`Communicator.halo_forward`): the
    rank receives no rows (forward), and for the gradient sends none either (one rank alone).
    Sampled exchanges (``inst.halo``) change every step and are not assumed to."""
    if not isinstance(inst, HaloExchange) or inst.halo or any(inst.recv_rows):
        return False
    return not inst.grad or not any(inst.send_rows)


def _all_to_all_cost(w: _RankWalk, i: int, inst: AllToAll) -> StepCost:
    """An all-to-all, which the runtime posts: as it posts, it allocates its result and copies what it
    sends (the value, or the output's gradient) into one contiguous buffer, through a copy per peer
    where the peers' blocks are column slices (a ``rows -> cols`` transfer); then it drops those
    copies and the gradient it sent. The buffer stays until the exchange is waited for, by the next
    ``Forward`` or ``Backward``. Everything else as :func:`_conversion_cost`."""
    seconds, stream, result, transient = _conversion_cost(w, i, inst, posted=True)
    sent = w.value_bytes.get(inst.output if inst.grad else inst.value, 0.0)
    # (the gradient goes back; one member's one block is its value as it is)
    copies = sent if (inst.src_layout == "rows") != inst.grad and len(inst.group) > 1 else 0.0
    w.release_on_start(i, copies)
    w.release_at(max(i, w.next_compute[i + 1] - 1), sent)
    return seconds, stream, result + sent + copies, transient


def _p2p_transfer(pc: PlanCost, rank: int, inst: Union[Send, Recv]) -> float:
    c = pc.cluster
    key = (rank // c.devices_per_node == inst.peer // c.devices_per_node, inst.shape, inst.dtype)
    t = pc._p2p_times.get(key)
    if t is None:
        link = c.time_shared(c.link(rank, inst.peer))
        t = pc._p2p_times[key] = formulas.p2p_time(math.prod(inst.shape) * _elsize(inst.dtype),
                                                     link.bandwidth, link.latency)
    return t


def _halo_transfer(pc: PlanCost, rank: int, inst: HaloExchange) -> float:
    """A halo exchange: :func:`~.formulas.all_to_all_time` of ``rows * width`` elements per peer
    (the row totals computed once per pair of row tuples: a rank's exchanges repeat them layer after layer)."""
    key = (id(inst.send_rows), id(inst.recv_rows))
    totals = pc._a2a_totals.get(key)
    if totals is None or totals.shapes[0] is not inst.send_rows or totals.shapes[1] is not inst.recv_rows:
        totals = pc._a2a_totals[key] = _ShapeTotals(inst.send_rows, inst.recv_rows)
    per_row = inst.width * _elsize(inst.dtype)
    out, into = totals.send_total * per_row, totals.recv_total * per_row
    if inst.grad:
        out, into = into, out
    link = pc._group_link(inst.group)
    return formulas.all_to_all_totals_time(totals.peers if per_row else 0, out, into, link.bandwidth, link.latency)


class _ShapeTotals:
    """Elements per peer of an all-to-all's send and receive shapes (or a halo exchange's rows),
    their totals and the number of peers with a non-empty send or receive: computed once per pair
    of tuples (the lowerings share one tuple between the instructions of a conversion), so each
    member's time is O(1)."""

    def __init__(self, send_shapes: tuple, recv_shapes: tuple) -> None:
        self.shapes = (send_shapes, recv_shapes)
        self.send = [math.prod(s) if isinstance(s, tuple) else int(s) for s in send_shapes]
        self.recv = [math.prod(s) if isinstance(s, tuple) else int(s) for s in recv_shapes]
        if len(self.send) != len(self.recv):
            raise PlanningError(f"all-to-all: {len(self.send)} send shapes but {len(self.recv)} receive shapes")
        if min(self.send, default=0) < 0 or min(self.recv, default=0) < 0:
            raise PlanningError(f"all-to-all: negative sizes in {send_shapes!r} / {recv_shapes!r}")
        self.send_total, self.recv_total = sum(self.send), sum(self.recv)
        self.peers = sum(1 for s, r in zip(self.send, self.recv) if s or r)


def _all_to_all_transfer(pc: PlanCost, rank: int, inst: AllToAll) -> float:
    """One member's part of an all-to-all (:func:`~.formulas.all_to_all_time`, its own entry excluded)."""
    group = inst.group
    index = pc._group_index.get(group)
    if index is None:
        index = pc._group_index[group] = {r: j for j, r in enumerate(group)}
    key = (id(inst.send_shapes), id(inst.recv_shapes))
    totals = pc._a2a_totals.get(key)
    if totals is None or totals.shapes[0] is not inst.send_shapes or totals.shapes[1] is not inst.recv_shapes:
        totals = pc._a2a_totals[key] = _ShapeTotals(inst.send_shapes, inst.recv_shapes)
    me = index[rank]
    es = _elsize(inst.dtype)
    own_s, own_r = totals.send[me], totals.recv[me]
    out, into = (totals.send_total - own_s) * es, (totals.recv_total - own_r) * es
    if inst.grad:
        out, into = into, out
    link = pc._group_link(group)
    return formulas.all_to_all_totals_time(totals.peers - (1 if own_s or own_r else 0), out, into, link.bandwidth,
                                           link.latency)


def _all_reduce_transfer(pc: PlanCost, rank: int, inst: AllReduce) -> float:
    link = pc._group_link(inst.group, "all_reduce")
    return formulas.ring_allreduce_time(inst.numel * _elsize(inst.dtype), len(inst.group), link.bandwidth,
                                        link.latency)


def _ring_transfer(gather: bool) -> Callable[[PlanCost, int, Any], float]:
    """An all-gather (``gather``) or reduce-scatter of the ``shape`` tensor; its gradient is the other one."""
    def transfer(pc: PlanCost, rank: int, inst: Union[AllGather, ReduceScatter]) -> float:
        link = pc._group_link(inst.group)
        fn = formulas.ring_allgather_time if gather != inst.grad else formulas.ring_reduce_scatter_time
        return fn(math.prod(inst.shape) * _elsize(inst.dtype), len(inst.group), link.bandwidth, link.latency)
    return transfer


# --------------------------------------------------------------------------- output sizes
def _halo_bytes(inst: HaloExchange, src_rows: float) -> Optional[float]:
    return src_rows * inst.width * _elsize(inst.dtype)


def _all_to_all_bytes(inst: AllToAll, src_rows: float) -> Optional[float]:
    return None if inst.grad else sum(math.prod(s) for s in inst.recv_shapes) * _elsize(inst.dtype)


def _gathered_bytes(inst: AllGather, src_rows: float) -> Optional[float]:
    return None if inst.grad else math.prod(inst.shape) * _elsize(inst.dtype)  # the whole tensor on every member


def _scattered_bytes(inst: ReduceScatter, src_rows: float) -> Optional[float]:
    # one member's share of the tensor
    return None if inst.grad else math.prod(inst.shape) * _elsize(inst.dtype) / max(len(inst.group), 1)


for _cls, _rule in {
    Forward: CostRule(_forward_cost), Recompute: CostRule(_forward_cost), Backward: CostRule(_backward_cost),
    OptimizerStep: CostRule(_optimizer_cost), Free: CostRule(_free_cost),
    Send: CostRule(_send_cost, _p2p_transfer), Recv: CostRule(_recv_cost, _p2p_transfer),
    HaloExchange: CostRule(_conversion_cost, _halo_transfer, _halo_bytes),
    AllToAll: CostRule(_all_to_all_cost, _all_to_all_transfer, _all_to_all_bytes),
    AllGather: CostRule(_conversion_cost, _ring_transfer(gather=True), _gathered_bytes),
    ReduceScatter: CostRule(_conversion_cost, _ring_transfer(gather=False), _scattered_bytes),
    AllReduce: CostRule(_all_reduce_cost, _all_reduce_transfer),
}.items():
    register_cost(_cls, _rule)
del _cls, _rule


@dataclass
class Prediction:
    """What the cost models predict for one plan on one cluster."""

    plan: Plan
    cluster: Cluster
    simulation: Simulation
    static: list[StaticMemory]
    overlap: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return self.simulation.step_time

    @property
    def peak_memory(self) -> list[int]:
        """Peak bytes per rank of a steady training step, resident data (graph, features,
        parameters, optimizer state) included; a run measures the first step above what is
        resident before it (:meth:`first_step_above_resident`)."""
        return [r.peak_memory for r in self.simulation.ranks]

    @property
    def max_peak_memory(self) -> int:
        return max(self.peak_memory, default=0)

    @property
    def capacity(self) -> int:
        return self.cluster.rank_device(0).memory

    @property
    def fits(self) -> bool:
        cap = [self.cluster.rank_device(r).memory for r in range(len(self.peak_memory))]
        return all(m <= c for m, c in zip(self.peak_memory, cap))

    @property
    def bytes_sent(self) -> list[float]:
        return list(self.plan.predictions.get("bytes_sent", []))

    def time_by_kind(self) -> dict[str, float]:
        return self.simulation.time_by_kind()

    def first_step_peak_memory(self) -> list[int]:
        """Peak bytes per rank of the first training step (what the runtime measures): Adam's moments
        are allocated by its optimizer step, not resident before it (:attr:`peak_memory`: a steady
        step's). Simulates the plan again."""
        return predict(self.plan, self.cluster, overlap=self.overlap, first_step=True).peak_memory

    def first_step_above_resident(self) -> list[int]:
        """Peak bytes per rank of the first step above what is resident before it (graph, features,
        labels, parameters): what the runtime's ``PeakMemory`` measures of that step, what the step
        makes included: gradients, Adam's moments, history tables, a sampled step's blocks, feature
        rows and labels, a regrouped epoch's inputs (:attr:`StaticMemory.before_first_step`)."""
        return [p - s.before_first_step for p, s in zip(self.first_step_peak_memory(), self.static)]


def predict(plan: Plan, cluster: Cluster, *, overlap: bool = False, first_step: bool = False) -> Prediction:
    """Simulate ``plan`` on ``cluster``: step time, per-rank busy/idle/wait time and peak memory (of
    a steady step; ``first_step``: of the first, whose optimizer step allocates Adam's moments)."""
    cost = PlanCost(plan, cluster, first_step=first_step)
    sim = simulate(plan, cost, overlap=overlap, base_memory=cost.base_memory())
    return Prediction(plan=plan, cluster=cluster, simulation=sim, static=cost.static, overlap=overlap)
