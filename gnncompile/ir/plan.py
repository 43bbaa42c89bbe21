"""Plans: one instruction list per rank, as plain printable data.

A :class:`Plan` is what the planner returns and the runtime executes. It holds, per rank, a
:class:`DevicePlan`: the rank's *stages* (pieces of the traced operator graph, described by
:class:`StageSpec`; the runnable fx modules are attached by the lowering and are not part of the
data) and its *instruction list* for one training step. Instructions print in a short form, in the
style of ``torch.distributed.pipelining``'s action lists::

    F0c0                 forward of stage 0 on chunk 0
    B2c0                 backward of stage 2 on chunk 0
    R1c3                 recompute stage 1's forward on chunk 3 (activations were freed)
    SEND h1 c0 ->2       send value h1 (chunk 0) to rank 2; RECV h1 c0 <-0 receives it
    HALO h1 c0           halo exchange of h1's rows inside the group (writes h1@halo)
    A2A h2 c0 rows->cols all-to-all changing h2's layout (writes h2@cols)
    AG h / RS h          all-gather / reduce-scatter
    AR grads             all-reduce of replicated parameters' gradients
    FREE h1 c0           drop a stored value
    OPT                  optimizer step

A communication instruction with ``grad=True`` moves the *gradient* of its value in the opposite
direction (``HALO^T grad h1 c0`` sends the halo rows' gradients back to their owners and
accumulates them), so a backward pass is written with the same instructions as the forward.

Values are named after the fx nodes of the traced model (``linear_1``, ``propagate``); the model's
inputs are ``g`` (the rank's graph) and ``x``; a communication instruction writes its result under
``value@halo``, ``value@cols`` etc. (:func:`converted_name`).

Plans round-trip through JSON (:meth:`Plan.to_dict`, :meth:`Plan.save`, :func:`read_plan`);
:func:`gnncompile.load_plan` with the model and graph re-runs the recorded decisions and checks that
the same instruction lists come out, which rebuilds the stage modules. This module is data only: it
imports nothing above ``ir`` (running, explaining and plotting live in :mod:`gnncompile.api`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Optional, Union

from ..errors import ArgumentError, PlanningError, VerificationError
from ..paths import output_problem, write_text
from .symbolic import Lin

__all__ = [
    "Instruction", "Forward", "Backward", "Recompute", "Send", "Recv", "HaloExchange", "AllToAll",
    "AllGather", "ReduceScatter", "AllReduce", "Free", "OptimizerStep", "INSTRUCTIONS",
    "OpCost", "StageSpec", "DevicePlan", "Plan", "RankProgram", "RankSizes", "Schedule", "StepInputs", "ParamPlacement",
    "StepSize", "resolve_shape", "converted_name", "member_rows", "human_bytes",
    "PLAN_FORMAT_VERSION", "plan_differences", "rank_label", "read_plan",
]

PLAN_FORMAT_VERSION = 1


def converted_name(value: str, suffix: str) -> str:
    """Name of the value a conversion writes: ``converted_name("h1", "halo") == "h1@halo"``."""
    return f"{value}@{suffix}"


# --------------------------------------------------------------------------- per-step sizes
class StepSize(int):
    """A size that changes from step to step (a sampled mini-batch's rows), bounded by ``bound``.

    It *is* its bound as an ``int``: what the cost models, the verifier's byte accounting and
    memory plans compute with (the worst case). It also carries ``name``, which the runtime resolves
    every step from the step's sizes (:attr:`StepInputs.step_sizes`, or the step-input provider's
    view of a step) with :func:`resolve_shape`. Two step sizes are equal when name and bound are: a
    Send and its Recv, or a collective's members, must agree on the same per-step size; a step size
    never equals a fixed ``int``. In JSON: ``{"step": name, "max": bound}``.
    """

    name: str

    def __new__(cls, name: str, bound: int) -> "StepSize":
        if not isinstance(name, str) or not name:
            raise VerificationError(f"a per-step size needs a name, got {name!r}")
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise VerificationError(f"per-step size {name!r}: bound must be an int >= 0, got {bound!r}")
        self = super().__new__(cls, bound)
        self.name = name
        return self

    @property
    def bound(self) -> int:
        return int(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepSize):
            return self.name == other.name and int(self) == int(other)
        return False if isinstance(other, int) else NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((self.name, int(self)))

    def __repr__(self) -> str:
        return f"{self.name}<={int(self)}"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        return StepSize, (self.name, int(self))

    def to_json(self) -> dict[str, Any]:
        return {"step": self.name, "max": int(self)}


def resolve_shape(shape: Iterable[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """``shape`` with each :class:`StepSize` replaced by this step's value from ``sizes``.

    Raises :class:`~gnncompile.errors.VerificationError` when a step size has no value or exceeds
    its bound (the plan's byte and memory accounting would not hold).
    """
    out = []
    for d in shape:
        if isinstance(d, StepSize):
            if d.name not in sizes:
                raise VerificationError(f"per-step size {d.name!r} has no value in this step (sizes: "
                                        f"{', '.join(sorted(sizes)) or 'none'})")
            v = int(sizes[d.name])
            if not 0 <= v <= d.bound:
                raise VerificationError(f"per-step size {d.name!r} is {v} this step, outside its bound 0..{d.bound}")
            out.append(v)
        else:
            out.append(int(d))
    return tuple(out)


# --------------------------------------------------------------------------- instructions
@dataclass(frozen=True)
class Instruction:
    """Base class of plan instructions; subclasses are frozen dataclasses with a short ``str``."""

    kind: ClassVar[str] = ""
    #: Whether the instruction communicates (Send/Recv and collectives).
    communicates: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        d = {"op": type(self).__name__}
        for f in fields(self):
            d[f.name] = _as_list(getattr(self, f.name))
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Instruction":
        if not isinstance(d, dict):
            raise VerificationError(f"malformed instruction {d!r}: expected an object with an 'op' field")
        d = dict(d)
        op = d.pop("op", None)
        cls = INSTRUCTIONS.get(op) if isinstance(op, str) else None
        if cls is None:
            raise VerificationError(f"unknown instruction {op!r}; valid: {', '.join(INSTRUCTIONS)}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise VerificationError(f"malformed {op} instruction {d}: unknown field(s) {', '.join(unknown)}")
        try:
            return cls(**{k: _as_tuple(v) for k, v in d.items()})
        except TypeError as e:
            raise VerificationError(f"malformed {op} instruction {d}: {e}") from None


def _as_tuple(v: Any) -> Any:
    """JSON lists (nested too) back to the tuples instructions hold; ``{"step", "max"}`` objects
    back to :class:`StepSize`."""
    if isinstance(v, dict) and set(v) == {"step", "max"}:
        return StepSize(v["step"], v["max"])
    return tuple(_as_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v


def _as_list(v: Any) -> Any:
    """Tuples (nested too, e.g. ``AllToAll.send_shapes``) to the lists JSON holds."""
    if isinstance(v, StepSize):
        return v.to_json()
    return [_as_list(x) for x in v] if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class Forward(Instruction):
    """Run stage ``stage``'s forward on chunk ``chunk``, keeping what its backward needs."""

    stage: int
    chunk: int = 0
    kind: ClassVar[str] = "F"

    def __str__(self) -> str:
        return f"F{self.stage}c{self.chunk}"


@dataclass(frozen=True)
class Backward(Instruction):
    """Run stage ``stage``'s backward on chunk ``chunk`` (gradients of its outputs must be there)."""

    stage: int
    chunk: int = 0
    kind: ClassVar[str] = "B"

    def __str__(self) -> str:
        return f"B{self.stage}c{self.chunk}"


@dataclass(frozen=True)
class Recompute(Instruction):
    """Re-run stage ``stage``'s forward on chunk ``chunk`` before its backward (activations freed)."""

    stage: int
    chunk: int = 0
    kind: ClassVar[str] = "R"

    def __str__(self) -> str:
        return f"R{self.stage}c{self.chunk}"


def _grad(grad: bool) -> str:
    return "grad " if grad else ""


def _part(part: tuple[int, ...]) -> str:
    if not part:
        return ""
    dim, lo, hi = part
    return f"[{lo}:{hi}]" if dim == 0 else f"[:,{lo}:{hi}]"


@dataclass(frozen=True)
class Send(Instruction):
    """Send ``value`` of ``chunk`` (or its gradient) to rank ``peer``; ``shape``/``dtype`` describe it.

    Sends are *eager*: a Send completes when it is posted (the runtime uses ``isend`` and waits for
    completion at the end of the step); the matching Recv waits for it. ``local``: the name the rank
    reads (default ``value``; e.g. the gradient of ``h@cols`` travels back as ``h``). ``part``:
    ``(dim, start, stop)``: only that slice of the local value (or gradient) is sent (``dim`` 0:
    rows, 1: the last dimension).
    """

    value: str
    chunk: int
    peer: int
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    grad: bool = False
    local: str = ""
    part: tuple[int, ...] = ()
    kind: ClassVar[str] = "SEND"
    communicates: ClassVar[bool] = True

    @property
    def name(self) -> str:
        """The local value this Send reads (its gradient when ``grad``)."""
        return self.local or self.value

    def __str__(self) -> str:
        where = f" ({self.local}{_part(self.part)})" if self.local else _part(self.part)
        return f"SEND {_grad(self.grad)}{self.value} c{self.chunk}{where} ->{self.peer}"


@dataclass(frozen=True)
class Recv(Instruction):
    """Receive ``value`` of ``chunk`` (or its gradient) from rank ``peer``.

    ``local``: the name the received data is stored under (default ``value``; e.g. ``h`` received
    into ``h@cols``). ``part``: ``(dim, start, stop)``: the received block is that slice of the local
    value: blocks of one ``(local, chunk)`` are concatenated in ``start`` order when the value is
    read; a gradient block is added into that slice of the local gradient.
    """

    value: str
    chunk: int
    peer: int
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    grad: bool = False
    local: str = ""
    part: tuple[int, ...] = ()
    kind: ClassVar[str] = "RECV"
    communicates: ClassVar[bool] = True

    @property
    def name(self) -> str:
        """The local value this Recv writes (or whose gradient it contributes to)."""
        return self.local or self.value

    def __str__(self) -> str:
        where = f" ({self.local}{_part(self.part)})" if self.local else _part(self.part)
        return f"RECV {_grad(self.grad)}{self.value} c{self.chunk}{where} <-{self.peer}"


@dataclass(frozen=True)
class HaloExchange(Instruction):
    """Halo exchange of ``value`` (rows layout) inside ``group``; writes ``value@halo``.

    ``send_rows[i]`` / ``recv_rows[i]`` are the numbers of rows this rank sends to / receives from
    ``group[i]``; ``width`` is the number of elements per row. With ``grad=True`` the gradients of
    the halo rows travel back to their owners and are added to the gradient of ``value``.
    ``halo``: which exchange lists the runtime uses: ``""`` the rank's own (fixed) ones, else the
    per-layer lists of the step's graph input of that name (a sampled mini-batch's shuffle index,
    which changes every step: then the row counts are the expected ones, what the cost models
    plan with).
    """

    value: str
    chunk: int
    group: tuple[int, ...]
    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    width: int
    dtype: str = "float32"
    grad: bool = False
    halo: str = ""
    kind: ClassVar[str] = "HALO"
    communicates: ClassVar[bool] = True

    def __hash__(self) -> int:
        # without the per-member tuples (one entry per rank: the cost model keys its costs by
        # instruction); equal instructions still hash equal
        return hash((self.value, self.chunk, self.grad, len(self.group), self.width, self.halo))

    @property
    def output(self) -> str:
        return converted_name(self.value, "halo")

    def __str__(self) -> str:
        via = f" [{self.halo}]" if self.halo else ""
        return f"HALO{'^T' if self.grad else ''} {_grad(self.grad)}{self.value} c{self.chunk}{via}"


@dataclass(frozen=True)
class AllToAll(Instruction):
    """All-to-all inside ``group`` changing ``value``'s layout ``src_layout -> dst_layout``."""

    value: str
    chunk: int
    group: tuple[int, ...]
    src_layout: str
    dst_layout: str
    send_shapes: tuple[tuple[int, ...], ...] = ()
    recv_shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    grad: bool = False
    kind: ClassVar[str] = "A2A"
    communicates: ClassVar[bool] = True

    def __hash__(self) -> int:
        # without the per-member tuples (see HaloExchange.__hash__)
        return hash((self.value, self.chunk, self.grad, len(self.group), self.src_layout, self.dst_layout))

    @property
    def output(self) -> str:
        return converted_name(self.value, self.dst_layout)

    def __str__(self) -> str:
        return f"A2A {_grad(self.grad)}{self.value} c{self.chunk} {self.src_layout}->{self.dst_layout}"


@dataclass(frozen=True)
class _WholeTensorCollective(Instruction):
    """A collective over ``value``'s whole tensor (``shape``: the full tensor on every rank)."""

    value: str
    chunk: int
    group: tuple[int, ...]
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    grad: bool = False
    communicates: ClassVar[bool] = True
    suffix: ClassVar[str] = ""

    def __hash__(self) -> int:
        # without the group (see HaloExchange.__hash__)
        return hash((self.kind, self.value, self.chunk, self.grad, len(self.group), self.shape))

    @property
    def output(self) -> str:
        return converted_name(self.value, self.suffix)

    def __str__(self) -> str:
        return f"{self.kind} {_grad(self.grad)}{self.value} c{self.chunk}"


def member_rows(num_rows: int, members: int) -> list[int]:
    """Rows of each member of an :class:`AllGather` / :class:`ReduceScatter` of a ``num_rows``-row tensor:
    balanced contiguous blocks in group order, the first ``num_rows mod members`` one row longer (the
    ``rows`` layout of the ``tensor`` strategy)."""
    return [num_rows // members + (1 if q < num_rows % members else 0) for q in range(members)]


@dataclass(frozen=True)
class AllGather(_WholeTensorCollective):
    """All-gather of ``value`` inside ``group`` (writes ``value@gathered``): each member holds its
    :func:`member_rows` block of the ``shape`` tensor (``rows`` layout) and every member gets all of it
    (``replicated``). With ``grad=True`` the gradient of ``value@gathered``, a partial sum on every
    member, is sum-reduce-scattered: each member gets its rows of the total."""

    kind: ClassVar[str] = "AG"
    suffix: ClassVar[str] = "gathered"
    __hash__ = _WholeTensorCollective.__hash__


@dataclass(frozen=True)
class ReduceScatter(_WholeTensorCollective):
    """Sum-reduce-scatter of ``value`` (the full ``shape`` on every member) inside ``group``: each member
    gets its :func:`member_rows` block of the sum (writes ``value@scattered``); with ``grad=True`` the
    gradient is all-gathered."""

    kind: ClassVar[str] = "RS"
    suffix: ClassVar[str] = "scattered"
    __hash__ = _WholeTensorCollective.__hash__


@dataclass(frozen=True)
class AllReduce(Instruction):
    """Sum-all-reduce inside ``group``; ``value="grads"`` reduces the gradients of the parameters
    replicated on the group (``numel`` elements in all, bucketed by the runtime)."""

    value: str
    group: tuple[int, ...]
    numel: int = 0
    dtype: str = "float32"
    kind: ClassVar[str] = "AR"
    communicates: ClassVar[bool] = True

    def __hash__(self) -> int:
        # without the group (see HaloExchange.__hash__)
        return hash((self.value, len(self.group), self.numel))

    def __str__(self) -> str:
        return f"AR {self.value}"


@dataclass(frozen=True)
class Free(Instruction):
    """Drop the stored ``value`` of ``chunk`` (its memory can be reused)."""

    value: str
    chunk: int = 0
    kind: ClassVar[str] = "FREE"

    def __str__(self) -> str:
        return f"FREE {self.value} c{self.chunk}"


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Apply the optimizer to this rank's parameters (after their gradients are complete)."""

    kind: ClassVar[str] = "OPT"

    def __str__(self) -> str:
        return "OPT"


INSTRUCTIONS: dict[str, type[Instruction]] = {
    c.__name__: c for c in (Forward, Backward, Recompute, Send, Recv, HaloExchange, AllToAll, AllGather,
                            ReduceScatter, AllReduce, Free, OptimizerStep)
}

#: Collective instruction types (every rank of ``group`` issues them in the same order).
COLLECTIVES = (HaloExchange, AllToAll, AllGather, ReduceScatter, AllReduce)


# --------------------------------------------------------------------------- stages and ranks
def _lin_to_json(lin: Lin) -> list[str]:
    return [str(lin.v), str(lin.e), str(lin.c)]


def _lin_from_json(v: Any) -> Lin:
    if isinstance(v, Lin):
        return v
    if not isinstance(v, (list, tuple)) or len(v) != 3:
        raise VerificationError(f"malformed linear form {v!r}: expected [v, e, c]")
    try:
        return Lin.of(*(Fraction(str(x)) for x in v))
    except (ValueError, ZeroDivisionError) as e:
        raise VerificationError(f"malformed linear form {v!r}: {e}") from None


@dataclass(frozen=True)
class OpCost:
    """Forward cost annotations of one op of a stage, copied from its :class:`~gnncompile.ir.tpgraph.TPInfo`.

    Size-dependent fields are :class:`~gnncompile.ir.symbolic.Lin` forms in the ``|V|`` and ``|E|``
    *of the rank that runs the stage* (its owned rows and local edges), so a cost model evaluates a
    plan without the model or the graph. ``width`` is the number of elements per row of the op's
    output (the ``d`` of NeutronTask Eq. 6 for a propagation); ``recompute`` marks a checkpointed
    segment whose forward runs again in backward.
    """

    name: str
    kind: str
    flops: Lin = field(default_factory=Lin)
    bytes: Lin = field(default_factory=Lin)
    saved: Lin = field(default_factory=Lin)
    out: Lin = field(default_factory=Lin)
    width: int = 0
    recompute: bool = False
    #: primitive kernels the op runs (a checkpointed segment runs several)
    count: int = 1
    #: backward work in units of the forward's: one for the gradient of its weights (if it has
    #: trainable ones), one for the gradient of its input (if the input needs one)
    backward: int = 2
    #: whether its backward computes the gradient of its input (the input needs one)
    input_grad: bool = True
    #: the values it reads: ops of its stage and the producers of the stage's inputs that need a
    #: gradient (a stage input ``v@halo`` is read as ``v``); ``None`` where unknown (then the
    #: previous op's output, the first op: the stage's inputs)
    reads: Optional[tuple[str, ...]] = None
    #: random numbers the forward draws (dropout masks)
    random: Lin = field(default_factory=Lin)
    #: the layout the op runs in: ``rows`` (a block of vertices) or ``cols`` (every vertex, a slice of
    #: the feature columns: its sizes are the whole graph's, its work a share of it)
    layout: str = "rows"
    #: the op's GNN layer (the tracer's, 1-based; 0: unknown): where a rank's sizes differ per layer
    #: (:attr:`RankSizes.layers`, a sampled mini-batch) its forms are evaluated at its layer's
    layer: int = 0
    #: bytes of the per-edge values a propagation multiplies by where they need a gradient (GAT's
    #: attention coefficients): its backward computes their gradient (an SDDMM) beside its input's
    values: Lin = field(default_factory=Lin)
    #: bytes of the dropout outputs the op saves that its backward computes again from their inputs
    #: and masks (:func:`~gnncompile.frontend.ops.replay_dropout_outputs`; not in ``saved``): a
    #: temporary of its backward
    replayed: Lin = field(default_factory=Lin)
    #: an op of a checkpointed segment (named ``<segment>.<op>``) whose output the segment returns:
    #: the value ``<segment>`` is what they make
    returned: bool = False

    _LINS: ClassVar[tuple[str, ...]] = ("flops", "bytes", "saved", "out", "random", "values", "replayed")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "width": self.width, "recompute": self.recompute,
                             "count": self.count, "backward": self.backward, "input_grad": self.input_grad,
                             "reads": None if self.reads is None else list(self.reads), "layout": self.layout,
                             "layer": self.layer, "returned": self.returned}
        d.update({k: _lin_to_json(getattr(self, k)) for k in self._LINS})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpCost":
        if not isinstance(d, dict):
            raise VerificationError(f"malformed op cost {d!r}: expected an object")
        try:
            return cls(**{k: _lin_from_json(v) if k in cls._LINS else tuple(v) if k == "reads" and v is not None
                          else v for k, v in d.items()})
        except TypeError as e:
            raise VerificationError(f"malformed op cost {d}: {e}") from None


@dataclass(frozen=True)
class StageSpec:
    """A stage: a connected piece of the operator graph run by one Forward/Backward instruction.

    ``inputs``/``outputs`` are value names (see the module docstring); ``ops`` the fx node names
    the stage computes; ``kinds`` a count such as ``"T3 P1"``; ``layers`` the GNN layers it covers;
    ``costs`` the cost annotations of its ops (what the cost models read).
    """

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[str, ...]
    kinds: str = ""
    layers: tuple[int, ...] = ()
    costs: tuple[OpCost, ...] = ()
    #: cross-chunk reads of a chunked stage: ``((input, ((chunks read by chunk 0), (by chunk 1), ...)), ...)``.
    #: Such an input of ``Forward(s, c)`` is the concatenation of ``(input, k)`` for the listed ``k``
    #: (a propagation's source rows: the chunk itself first, then the other chunks its edges read);
    #: its gradient goes back to each of them. Inputs not listed are read at ``(input, c)``.
    reads: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    #: the device group of the stage's ops when not every rank runs it (informational)
    group: str = ""
    #: the chunks this rank runs the stage on, when its group deals chunks out to its ranks
    #: (``()``: every chunk)
    runs: tuple[int, ...] = ()
    #: relaxed cross-chunk reads served from the previous step's copy (NeutronTask's cached
    #: neighbours): ``((input, ((stale chunks of chunk 0), ...)), ...)``. ``Forward(s, c)`` reads
    #: the fresh chunks (:meth:`chunks_read`) and these, in ascending chunk order; no gradient
    #: flows to a stale copy
    stale: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    def chunks_read(self, value: str, chunk: int) -> tuple[int, ...]:
        """The chunks of ``value`` that ``Forward(self, chunk)`` reads."""
        for name, per_chunk in self.reads:
            if name == value:
                return per_chunk[chunk]
        return (chunk,)

    def chunks_stale(self, value: str, chunk: int) -> tuple[int, ...]:
        """The chunks of ``value`` that ``Forward(self, chunk)`` reads from the previous step."""
        for name, per_chunk in self.stale:
            if name == value:
                return per_chunk[chunk]
        return ()

    def to_dict(self) -> dict[str, Any]:
        d = {k: _as_list(getattr(self, k)) for k in ("index", "inputs", "outputs", "ops", "kinds", "layers", "reads",
                                                      "group", "runs", "stale")}
        d["costs"] = [c.to_dict() for c in self.costs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StageSpec":
        if not isinstance(d, dict):
            raise VerificationError(f"malformed stage {d!r}: expected an object")
        d = dict(d)
        costs = d.pop("costs", [])
        if not isinstance(costs, list):
            raise VerificationError(f"malformed stage {d}: costs must be a list")
        try:
            return cls(**{k: _as_tuple(v) for k, v in d.items()}, costs=tuple(OpCost.from_dict(c) for c in costs))
        except TypeError as e:
            raise VerificationError(f"malformed stage {d}: {e}") from None

    def __str__(self) -> str:
        layers = f" L{self.layers[0]}" + (f"-{self.layers[-1]}" if len(self.layers) > 1 else "") if self.layers else ""
        group = f" on {self.group}" if self.group else ""
        if self.runs:
            group += f" (chunks {','.join(map(str, self.runs))})"
        return (f"stage {self.index}{layers} [{self.kinds}]{group}: ({', '.join(self.inputs)}) -> "
                f"({', '.join(self.outputs)})")



@dataclass(frozen=True)
class RankSizes:
    """What one rank works on in a step, the cost models' inputs (an unset field: not applicable).

    ``layers``: where the sizes differ per GNN layer (a sampled mini-batch, whose vertex sets
    shrink layer by layer), per layer ``k = 1 .. L + 1`` the tuple ``(rows, dst, src, edges)``: the
    rows layer ``k``'s T ops compute (its input's), the destinations and source rows of its graph
    ops and the edges they visit (layer ``L + 1``: the trailing T ops); an op of layer ``k`` is
    evaluated at these, and ``nodes``/``edges`` are then the largest rows and all edges held.
    ``nodes``: rows its row-wise ops compute; ``edges``: in-edges its propagations visit; ``halo``:
    remote rows it receives per halo exchange; ``src``: source rows a propagation reads (default
    ``nodes``); ``all_nodes``: rows of its ``cols``/``replicated`` ops (the whole graph), of which it
    computes ``col_share_ppm`` parts per million of the columns; ``chunks``: vertex chunks it runs
    (the per-chunk sizes divide ``nodes``/``edges``/``all_nodes`` by it); ``feature_rows``: input
    feature rows it holds (default ``nodes``); ``trains``: rows it scores (0: none, so it holds no
    parameters unless ``params`` says); ``params``: parameter elements it holds (default: all).
    Where a step's sizes change (:class:`StepSize`), each field is its bound: the cost models and
    memory plans plan for the largest step.
    """

    nodes: int = 0
    edges: int = 0
    halo: int = 0
    src: Optional[int] = None
    all_nodes: Optional[int] = None
    col_share_ppm: Optional[int] = None
    chunks: Optional[int] = None
    feature_rows: Optional[int] = None
    trains: Optional[int] = None
    params: Optional[int] = None
    layers: Optional[tuple[tuple[int, int, int, int], ...]] = None

    def __post_init__(self) -> None:
        if self.layers is not None:  # JSON lists back to tuples (the plan stays hashable, comparable)
            object.__setattr__(self, "layers", tuple(tuple(int(v) for v in t) for t in self.layers))

    def at_layer(self, layer: int, graph_op: bool) -> "RankSizes":
        """The sizes an op of ``layer`` (1-based) is evaluated at (``self`` without per-layer sizes):
        a graph op's destinations, source rows and edges, or a T op's rows."""
        if not self.layers or layer <= 0:
            return self
        rows, dst, src, edges = self.layers[min(layer, len(self.layers)) - 1]
        return replace(self, nodes=dst if graph_op else rows, edges=edges, src=src, layers=None)

    @property
    def source_rows(self) -> int:
        return self.nodes if self.src is None else self.src

    def per_chunk(self) -> "RankSizes":
        """The sizes one of ``chunks`` equal chunks works on: vertex and edge counts divided (rounded
        up), the source rows a propagation reads (its working set) kept."""
        k = max(int(self.chunks or 1), 1)
        if k == 1:
            return self
        return replace(self, nodes=-(-self.nodes // k), edges=-(-self.edges // k),
                       all_nodes=None if self.all_nodes is None else -(-self.all_nodes // k))

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: Any) -> "RankSizes":
        if isinstance(d, RankSizes):
            return d
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise VerificationError(f"rank sizes: unknown field(s) {', '.join(unknown)}; known: "
                                    f"{', '.join(sorted(known))}")
        return cls(**d)


@dataclass
class DevicePlan:
    """One rank's program: its stages and its instruction list for one training step.

    ``sizes``: what the rank works on, for the cost models (:class:`RankSizes`; a dict of its
    fields is accepted). ``modules`` maps a stage index to the runnable fx module; it is attached by
    the lowering and is not part of the plan's data (equality, JSON).
    """

    rank: int
    stages: tuple[StageSpec, ...]
    instructions: tuple[Instruction, ...]
    sizes: RankSizes = field(default_factory=RankSizes)
    modules: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, RankSizes):
            self.sizes = RankSizes.from_dict(self.sizes)

    def stage(self, index: int) -> StageSpec:
        for s in self.stages:
            if s.index == index:
                return s
        raise KeyError(f"rank {self.rank} has no stage {index}")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "stages": [s.to_dict() for s in self.stages],
                "instructions": [i.to_dict() for i in self.instructions], "sizes": self.sizes.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DevicePlan":
        if not isinstance(d, dict):
            raise VerificationError(f"malformed rank {d!r}: expected an object")
        if not isinstance(d.get("sizes", {}), dict):
            raise VerificationError(f"malformed rank data: sizes must be an object, got {d['sizes']!r}")
        try:
            return cls(rank=int(d["rank"]), stages=tuple(StageSpec.from_dict(s) for s in d["stages"]),
                       instructions=tuple(Instruction.from_dict(i) for i in d["instructions"]),
                       sizes=RankSizes.from_dict({str(k): v if isinstance(v, (list, tuple)) else int(v)
                                                  for k, v in d.get("sizes", {}).items()}))
        except KeyError as e:
            raise VerificationError(f"rank data lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise VerificationError(f"malformed rank data: {e}") from None

    def __str__(self) -> str:
        return f"rank {self.rank}: " + " ".join(str(i) for i in self.instructions)


#: the width ``print(plan)`` keeps its instruction table to (wider plans continue below)
TABLE_WIDTH = 120


def rank_label(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"ranks 0-3,8"``; one rank -> ``"rank 5"``."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    runs: list[str] = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(runs)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units; ``"-"`` for NaN)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for scale, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"



@dataclass(frozen=True)
class Schedule:
    """How a plan orders one training step (structured; ``str`` gives the one-line summary).

    ``kind``: ``"sequential"`` (every stage's forward, then the backwards in reverse),
    ``"chunk pipeline"`` (stages per vertex chunk, list-scheduled) or ``"task pipeline"`` (tasks
    on rank groups per chunk); ``chunks``: vertex chunks per step (1: none); ``communication``:
    how conversions travel (``"chunk-level all-to-alls"``, ``"point to point"``...); ``regime``:
    the task placement regime, if any.
    """

    kind: str = "sequential"
    chunks: int = 1
    communication: str = ""
    regime: str = ""

    def __str__(self) -> str:
        if self.kind == "sequential" and self.chunks == 1:
            return "sequential"
        chunks = f"{self.chunks} chunk{'' if self.chunks == 1 else 's'}"
        parts = [p for p in (self.regime, chunks, self.communication) if p]
        return f"{self.kind} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "chunks": self.chunks, "communication": self.communication,
                "regime": self.regime}

    @classmethod
    def from_dict(cls, d: Any) -> "Schedule":
        if isinstance(d, str):  # plans saved before schedules were structured
            return cls(kind=d)
        if not isinstance(d, dict):
            raise VerificationError(f"malformed plan data: schedule must be an object (or a schedule kind's "
                                    f"name), got {d!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(eq=False)
class Plan:
    """A parallel training plan as data: instruction lists per rank, stages, predictions.

    :func:`gnncompile.plan` returns it as a :class:`gnncompile.Plan` (this data plus ``run``,
    ``explain``, ``timeline``, ``memory_plot``); the IR itself knows nothing of its callers.

    Fields
    ------
    strategy:
        ``"data"``, ``"task"``, ``"layer"``, ``"tensor"``, ``"mop"``, ``"split"`` or a hybrid name.
    semantics:
        ``"exact"`` or ``"relaxed"``; ``relaxations`` lists the relaxed transformations applied
        (empty for an exact plan).
    options:
        The recorded decisions (strategy options, partitioner, seed, ...) as JSON data, sequences
        as tuples (``fanouts=(10, 5)``; :meth:`from_dict` reads JSON's lists back as tuples): lowering
        the same model and graph with them gives this plan again.
    cluster:
        Description of the devices the plan is for.
    ranks:
        One :class:`DevicePlan` per rank.
    schedule:
        How the instruction lists order a step (:class:`Schedule`).
    predictions:
        Per-rank predictions, lists indexed by rank (e.g. ``bytes_sent``: the closed-form
        communication volume of one training step), and scalars.
    info:
        Descriptive data: graph statistics, partition statistics, model name.
    """

    strategy: str
    semantics: str
    options: dict[str, Any]
    cluster: str
    ranks: list[DevicePlan]
    schedule: Schedule = field(default_factory=Schedule)
    relaxations: tuple[str, ...] = ()
    predictions: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    #: Runtime artifacts attached by the lowering (the traced model, per-rank graphs); not data.
    program: Any = field(default=None, repr=False, compare=False)
    #: The planner's search that chose this plan (``gnncompile.passes.search.SearchResult``); not data.
    search: Any = field(default=None, repr=False, compare=False)
    #: The cost models' prediction for this plan (``gnncompile.cost_models.model.Prediction``); not data.
    prediction: Any = field(default=None, repr=False, compare=False)
    #: The result of the last ``gnncompile.Plan.run()`` (``gnncompile.runtime.executor.RunResult``); not data.
    last_run: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str):  # a schedule kind given by name
            self.schedule = Schedule(kind=self.schedule)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    # ------------------------------------------------------------------ printing
    def header(self) -> list[str]:
        rel = ", ".join(self.relaxations) if self.relaxations else "none"
        lines = [f"Plan: strategy={self.strategy} semantics={self.semantics} ranks={self.num_ranks} "
                 f"schedule={self.schedule}",
                 f"  cluster: {self.cluster}",
                 f"  relaxed transformations applied: {rel}"]
        if self.info.get("graph"):
            lines.append(f"  graph: {self.info['graph']}"
                         + ("; input features held as CSR" if self.options.get("features") == "csr" else ""))
        if self.info.get("model"):
            lines.append(f"  model: {self.info['model']}")
        if self.options.get("backward") == "push":
            lines.append("  backward products: push (scattered from the forward CSR; no transposed graph is held)")
        part = self.info.get("partition")
        if part and part.get("estimated") and "cut_fraction" in part:   # a split plan's sampled edges
            lines.append(f"  partition (estimated from statistics): {part.get('method')} into {part.get('num_parts')} "
                         f"parts, {part['cut_fraction']:.3f} of the sampled edges cross splits ({part.get('source', '')})")
        elif part and part.get("estimated"):
            lines.append(f"  partition (estimated from statistics): {part.get('method')} into {part.get('num_parts')} "
                         f"parts, replication factor alpha={part.get('replication_factor', float('nan')):.3f} "
                         f"({part.get('source', '')})")
        elif part:
            lines.append(f"  partition: {part.get('method')} into {part.get('num_parts')} parts, "
                         f"replication factor alpha={part.get('replication_factor', float('nan')):.3f}, "
                         f"edge cut {part.get('total_edge_cut', 0):,}")
        return lines

    def stage_table(self) -> list[str]:
        seen: dict[tuple, list[int]] = {}
        for dp in self.ranks:
            seen.setdefault(tuple(str(s) for s in dp.stages), []).append(dp.rank)
        lines = []
        for stages, ranks in seen.items():
            who = "all ranks" if len(ranks) == self.num_ranks and self.num_ranks > 1 else rank_label(ranks)
            lines.append(f"  stages on {who}:")
            lines.extend(f"    {s}" for s in stages)
        return lines

    def instruction_table(self, width: int = TABLE_WIDTH) -> list[str]:
        """Steps as rows, ranks as columns (like pipeline-schedule action tables).

        Ranks whose instruction lists print the same share one column (``ranks 0-7``); when the
        columns do not fit in ``width`` characters, they continue in further tables below, each
        with the step column and as many steps as its longest column, so no line is much wider
        than ``width``.
        """
        groups: dict[tuple[str, ...], list[int]] = {}
        for dp in self.ranks:
            groups.setdefault(tuple(str(i) for i in dp.instructions), []).append(dp.rank)
        cols = list(groups)
        heads = [rank_label(ranks) for ranks in groups.values()]
        depth = max((len(c) for c in cols), default=0)
        step_w = max(len("step"), len(str(depth - 1)))
        col_w = [max([len(h)] + [len(x) for x in c]) for h, c in zip(heads, cols)]
        blocks: list[list[int]] = [[]]
        used = 2 + step_w
        for j, w in enumerate(col_w):
            if blocks[-1] and used + 2 + w > width:
                blocks.append([])
                used = 2 + step_w
            blocks[-1].append(j)
            used += 2 + w
        lines: list[str] = []
        for block in blocks:
            widths = [step_w] + [col_w[j] for j in block]
            fmt = lambda r: "  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731,B023
            if lines:
                lines.append("")
            lines += [fmt(["step"] + [heads[j] for j in block]), fmt(["-" * w for w in widths])]
            rows = max(len(cols[j]) for j in block)
            lines += [fmt([str(k)] + [cols[j][k] if k < len(cols[j]) else "" for j in block]) for k in range(rows)]
        return lines

    def prediction_table(self) -> list[str]:
        """Per-rank predictions, one row per run of consecutive ranks with the same printed values."""
        per_rank = {k: v for k, v in self.predictions.items() if isinstance(v, (list, tuple)) and len(v) == self.num_ranks}
        if not per_rank:
            return []
        keys = sorted(per_rank)
        head = ["rank"] + keys
        values = [[human_bytes(per_rank[k][r]) if "bytes" in k or "memory" in k else f"{per_rank[k][r]:.4g}"
                   for k in keys] for r in range(self.num_ranks)]
        rows: list[list[str]] = []
        start = 0
        for r in range(1, self.num_ranks + 1):
            if r == self.num_ranks or values[r] != values[start]:
                rows.append([f"{start}" if r - 1 == start else f"{start}-{r - 1}"] + values[start])
                start = r
        widths = [max(len(x[j]) for x in [head] + rows) for j in range(len(head))]
        fmt = lambda r: "  " + "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
        return ["  predicted per training step:", fmt(head)] + [fmt(r) for r in rows]

    def __str__(self) -> str:
        return "\n".join(self.header() + self.stage_table() + self.prediction_table() + self.instruction_table())

    def __repr__(self) -> str:
        """One line: strategy, ranks, semantics, schedule, the recorded options, the predicted step time
        and peak memory when predicted (``str(plan)`` prints the whole plan)."""
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items())
                            if v is not None and k not in ("strategy", "semantics"))
        text = (f"<{type(self).__name__} {self.strategy} on {self.num_ranks} rank{'' if self.num_ranks == 1 else 's'}, "
                f"{self.semantics}, schedule {self.schedule}; options: {options or 'none'}")
        step = getattr(self.prediction, "step_time", None)
        if step is not None:
            text += f"; predicted step {step * 1e3:.3g} ms"
        peak = getattr(self.prediction, "max_peak_memory", None)
        if peak is not None:
            text += f", peak memory {human_bytes(peak)} (largest rank)"
        return text + ">"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython shows ``str(plan)``, the per-rank table."""
        printer.text(repr(self) if cycle else str(self))

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT_VERSION,
            "strategy": self.strategy, "semantics": self.semantics, "relaxations": list(self.relaxations),
            "options": self.options, "cluster": self.cluster, "schedule": self.schedule.to_dict(),
            "predictions": self.predictions, "info": self.info,
            "ranks": [dp.to_dict() for dp in self.ranks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise VerificationError(f"plan data must be an object, got {type(d).__name__}")
        missing = [k for k in ("strategy", "ranks") if k not in d]
        if d.get("format") != PLAN_FORMAT_VERSION and missing:  # another file (a history, a profile)
            names = ", ".join(map(str, list(d)[:8])) + (", ..." if len(d) > 8 else "")
            raise VerificationError(f"not plan data: it has no {' or '.join(missing)} field (its fields: "
                                    f"{names or 'none'}); a plan file is the JSON that Plan.save writes")
        if d.get("format") != PLAN_FORMAT_VERSION:
            raise VerificationError(f"plan format {d.get('format')!r} is not supported (this gnncompile "
                                    f"reads format {PLAN_FORMAT_VERSION})")
        for key, kind, what in (("options", dict, "an object"), ("info", dict, "an object"),
                                ("predictions", dict, "an object"), ("cluster", str, "a string"),
                                ("ranks", list, "a non-empty list")):
            if key in d and (not isinstance(d[key], kind) or (key == "ranks" and not d[key])):
                raise VerificationError(f"malformed plan data: {key} must be {what}, got {_short(d[key])}")
        try:
            # (options hold sequences as tuples, fanouts=(10, 5); JSON gives lists back)
            return cls(strategy=d["strategy"], semantics=d["semantics"], relaxations=tuple(d.get("relaxations", ())),
                       options={k: _as_tuple(v) for k, v in d["options"].items()}, cluster=d["cluster"],
                       schedule=Schedule.from_dict(d.get("schedule", "sequential")),
                       predictions=d.get("predictions", {}), info=d.get("info", {}),
                       ranks=[DevicePlan.from_dict(r) for r in d["ranks"]])
        except KeyError as e:
            raise VerificationError(f"plan data lacks the field {e.args[0]!r}") from None
        except TypeError as e:
            raise VerificationError(f"malformed plan data: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: Union[str, Path]) -> Path:
        """Write the plan as JSON to ``path``; :func:`read_plan` reads it back as data,
        :func:`gnncompile.load_plan` as a runnable plan. A path that cannot be written (a missing directory...:
        :func:`gnncompile.paths.output_problem`) is an :class:`~gnncompile.ArgumentError`; the file is
        replaced atomically (:func:`gnncompile.paths.write_text`: a write that fails, a full disk,
        raises its ``OSError`` and leaves the previous file whole)."""
        problem = output_problem(path)
        if problem is not None:
            raise ArgumentError(f"plan.save: cannot write {str(path)!r}: {problem}")
        return write_text(path, self.to_json())   # atomically: a failed write leaves the old file whole

    def __eq__(self, other: object) -> bool:
        """Plans are equal when their data fields are: a runnable plan (:class:`gnncompile.Plan`,
        a subclass adding behaviour, no data) equals the data-only plan it was made from."""
        if not isinstance(other, Plan):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self) if f.compare)

    __hash__ = None  # type: ignore[assignment]  # mutable data, as the dataclass default


def read_plan(path: Union[str, Path]) -> Plan:
    """The data-only plan that :meth:`Plan.save` wrote to ``path`` (no model: print it, verify it,
    cost it). A file that cannot be read raises :class:`PlanningError`, malformed data
    :class:`VerificationError`. :func:`gnncompile.load_plan` also rebuilds a runnable plan."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanningError(f"cannot read plan file {str(path)!r}: {e}") from None
    except UnicodeDecodeError:
        raise PlanningError(f"cannot read plan file {str(path)!r}: it is not UTF-8 text (a plan is the JSON "
                            "that Plan.save writes)") from None
    return Plan.from_dict(data)


def _short(v: Any, limit: int = 100) -> str:
    if isinstance(v, tuple) and v and all(isinstance(x, OpCost) for x in v):
        v = tuple(f"{x.name} ({x.kind})" for x in v)
    text = str(v) if isinstance(v, (Lin, Instruction)) else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_differences(what: str, a: Any, b: Any) -> list[str]:
    """``what field: saved X, rebuilt Y`` for each dataclass field of ``a`` and ``b`` that differs;
    nested tuples of dataclasses (a stage's op costs) are compared element by element."""
    out = []
    for f in fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va == vb:
            continue
        if isinstance(va, tuple) and isinstance(vb, tuple) and len(va) == len(vb) and va \
                and all(hasattr(x, "__dataclass_fields__") for x in va + vb):
            for k, (xa, xb) in enumerate(zip(va, vb)):
                if xa != xb:
                    label = f"{what} {f.name}[{k}]" + (f" ({xa.name})" if hasattr(xa, "name") else "")
                    out += _field_differences(label, xa, xb)
        else:
            out.append(f"{what} {f.name}: saved {_short(va)}, rebuilt {_short(vb)}")
    return out


def plan_differences(saved: "Plan", rebuilt: "Plan") -> list[str]:
    """What differs between two plans' data, one line per field (what :func:`gnncompile.load_plan` reports):
    the graph and model they were made for, then per rank the stages' fields and the first
    instruction that differs."""
    out = [f"{key}: saved {saved.info.get(key)!r}, rebuilt {rebuilt.info.get(key)!r}"
           for key in ("graph", "model") if saved.info.get(key) != rebuilt.info.get(key)]
    if saved.num_ranks != rebuilt.num_ranks:
        out.append(f"ranks: saved {saved.num_ranks}, rebuilt {rebuilt.num_ranks}")
    for a, b in zip(saved.ranks, rebuilt.ranks):
        if len(a.stages) != len(b.stages):
            out.append(f"rank {a.rank} stages: saved {len(a.stages)}, rebuilt {len(b.stages)}")
        for sa, sb in zip(a.stages, b.stages):
            if sa != sb:
                out += _field_differences(f"rank {a.rank} stage {sa.index}", sa, sb)
        if a.instructions != b.instructions:
            k = next((k for k, (x, y) in enumerate(zip(a.instructions, b.instructions)) if x != y),
                     min(len(a.instructions), len(b.instructions)))
            x = a.instructions[k] if k < len(a.instructions) else "(end of list)"
            y = b.instructions[k] if k < len(b.instructions) else "(end of list)"
            if str(x) == str(y):  # same short form: the difference is in a field the short form omits
                out += _field_differences(f"rank {a.rank} instruction {k} {x}", x, y)
            else:
                out.append(f"rank {a.rank} instruction {k}: saved {x}, rebuilt {y}")
    return out


def iter_collectives(instructions: Iterable[Instruction]) -> Iterable[Instruction]:
    return (i for i in instructions if isinstance(i, COLLECTIVES))


@dataclass
class StepInputs:
    """What one rank feeds its steps: a lowering's data, the runtime's step-input provider's source.

    ``inputs``: model inputs by name (``g``: the rank's graph, ``x``: its feature rows, dropout
    indices); ``chunk_inputs``: chunked plans' per-chunk inputs (``chunk -> {name: value}``: a
    chunk's graph slice, its feature rows), looked up before ``inputs``; ``labels``/``masks``: the
    rows the rank scores (its rows of ``y`` and the train/val/test masks) and ``owned`` their global
    ids, in chunk order, with ``chunk_offsets`` where each chunk's rows start (``()``: one chunk);
    ``halo``: the halo exchange lists ``(send_index per rank, recv_count per rank)``; ``regroup``: a
    regrouped chunk pipeline (NeutronTask Algorithm 1, a
    :class:`~gnncompile.graph.regroup.RegroupedInputs`) whose ``epoch(step)`` replaces the chunk
    inputs, scored rows, labels and training mask of every training step (evaluation keeps these);
    ``chunk_rows``: the rows of every chunk of the step (a stale read of a chunk not received yet
    is zeros of this many rows); ``step_sizes``: the values of the plan's per-step sizes
    (:class:`StepSize`) when they are the same every step (a step-input source whose steps differ,
    like ``regroup``, gives each step's own); ``history_refresh``: the copies that stale reads take
    (historical embeddings) are stored at the steps ``history_refresh``, ``2 history_refresh``, ...
    (1-based; 1: every step); ``historical_gradients``: the gradients that readers of those
    copies compute are added to the chunks' gradients of the next step (relaxed; otherwise they are
    dropped). ``sampled``: a sampled mini-batch source (a
    :class:`~gnncompile.graph.minibatch.SampledSteps`): every training step's graph inputs,
    features, scored seeds and per-layer exchange lists come from it (an epoch has several steps);
    ``halos``: the per-layer exchange lists of the program's own inputs, by graph input name.
    """

    inputs: dict[str, Any] = field(default_factory=dict)
    chunk_inputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    chunk_offsets: tuple[int, ...] = ()
    labels: Any = None
    masks: dict[str, Any] = field(default_factory=lambda: {"train": None, "val": None, "test": None})
    owned: Any = None
    halo: tuple[tuple[Any, ...], tuple[int, ...]] = ((), ())
    regroup: Any = None
    chunk_rows: tuple[int, ...] = ()
    step_sizes: dict[str, int] = field(default_factory=dict)
    history_refresh: int = 1
    historical_gradients: bool = False
    sampled: Any = None
    halos: dict[str, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)

    def to(self, device: Any) -> "StepInputs":
        """A copy with every tensor (and graph) on ``device``; ``regroup`` moves each epoch's itself."""
        def move(v: Any) -> Any:
            return v.to(device) if hasattr(v, "to") else v

        send_index, recv_count = self.halo
        return StepInputs(inputs={k: move(v) for k, v in self.inputs.items()},
                          chunk_inputs={c: {k: move(v) for k, v in ci.items()} for c, ci in self.chunk_inputs.items()},
                          chunk_offsets=self.chunk_offsets, labels=move(self.labels),
                          masks={k: move(v) for k, v in self.masks.items()}, owned=self.owned,
                          halo=(tuple(move(t) for t in send_index), recv_count), regroup=self.regroup,
                          chunk_rows=self.chunk_rows, step_sizes=dict(self.step_sizes),
                          history_refresh=self.history_refresh,
                          historical_gradients=self.historical_gradients, sampled=self.sampled,
                          halos={k: (tuple(move(t) for t in si), rc) for k, (si, rc) in self.halos.items()})


@dataclass(frozen=True)
class ParamPlacement:
    """Where a plan's parameters live, as one rank sees it.

    ``owner``: parameter name -> the rank holding it (the lowest rank whose stages use it: its value
    is the trained model's); ``main``: the rank for parameters no stage uses and the random
    stream a checkpoint continues (the owner of the model's first parameter); ``local``: the
    parameters this rank's stages use, which its gradient all-reduce sums (``None``: all of them).
    """

    owner: Mapping[str, int] = field(default_factory=dict)
    main: int = 0
    local: Optional[tuple[str, ...]] = None

    def holder(self, name: str) -> int:
        """The rank holding parameter ``name``."""
        return self.owner.get(name, self.main)

    def reduces(self, name: str) -> bool:
        """Whether this rank's gradient all-reduce sums parameter ``name``."""
        return self.local is None or name in self.local


@dataclass
class RankProgram:
    """Everything one rank needs to execute its part of a plan (built by a lowering, pickled to the rank).

    Plain data plus fx modules: the runtime executes it and imports nothing from the planner.

    ``modules``/``stages``/``instructions``: the training step; ``eval_*``: the forward-only program
    used for evaluation (traced in eval mode). ``step``: what the rank feeds its steps
    (:class:`StepInputs`). ``counts``: the global number of vertices in each mask (the loss is the
    sum over this rank's training rows divided by the global count, so the ranks' losses and
    gradients add up to the single-device ones). ``params``: the parameters in the user model's
    order with their names there (``param_names``), shared by all stage modules.
    """

    rank: int
    world_size: int
    modules: dict[int, Any]
    stages: tuple[StageSpec, ...]
    instructions: tuple[Instruction, ...]
    eval_modules: dict[int, Any]
    eval_stages: tuple[StageSpec, ...]
    eval_instructions: tuple[Instruction, ...]
    output: str
    eval_output: str
    step: StepInputs
    counts: dict[str, int]
    params: list[Any]
    param_names: list[str]
    #: whether every rank seeds its RNG like single-device training (replicated dropout masks)
    same_seed: bool = False
    #: how the rank's propagations compute their backward product (``ops.BACKWARD_PRODUCTS``)
    backward: str = "transposed"
    #: the process groups other than the world that the plan's collectives use (every rank creates
    #: them, in this order, before training)
    groups: tuple[tuple[int, ...], ...] = ()
    #: which rank holds each parameter, and which this rank's all-reduce sums
    placement: ParamPlacement = field(default_factory=ParamPlacement)
    #: replicated dropout masks when a rank runs only some of the model's dropouts: every mask of
    #: the step in single-device order, ``(stage, ordinal in stage, full shape, dtype, p)``; each
    #: training step draws them all first (so each lands on the single-device RNG position) and the
    #: stages look theirs up
    dropout_draws: tuple[tuple[int, int, tuple[int, ...], str, float], ...] = ()
