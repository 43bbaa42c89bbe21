"""`TPGraph`: the annotated operator graph every pass and cost model reads.

A `TPGraph` is a :class:`torch.fx.GraphModule` (so it runs, and fx passes apply to it) whose nodes
carry ``node.meta["tp"]``, a :class:`TPInfo`:

=================  =====================================================================
kind               ``T`` (vertex-wise dense), ``P`` (propagation V->V), ``E`` (edge-wise),
                   ``input``, ``param``, ``output``
layer              GNN layer index (1-based; a layer ends with a P op or an ``aggregate``; see
                   :mod:`gnncompile.frontend.tracer`), ``0``
                   for inputs and parameters
rows               first dimension of the output as a :class:`~gnncompile.ir.symbolic.Lin`
space              ``V``, ``E``, ``E+V`` (edges plus implicit self loops), ``1`` or ``?``
dims               the output's trailing dimensions (feature dims), and its dtype
flops              floating-point operations of the op (forward)
bytes_read/written memory traffic of the op (forward)
saved_bytes        bytes the op keeps alive for backward (measured through autograd's
                   saved-tensor hooks on sample graphs, deduplicated by storage)
saves              the values (node names) whose memory the op saves for backward
replays            the replicated dropouts whose output the op saves and the runtime computes
                   again in backward from the dropout's input and mask
                   (:func:`~gnncompile.frontend.ops.replay_dropout_outputs`), where they run in
                   the op's stage; ``replayed_bytes``: their outputs' bytes (a temporary of the
                   op's backward); ``replay_saving``: what of ``saved_bytes`` the op then does not
                   hold (the outputs, where their inputs are held anyway)
params             number of parameters owned by the op (module parameters, or a get_attr)
mixes_rows         for a T op (or a non-primitive op on edge rows): why some output row depends
                   on other rows of its input (found on a sample graph: changing some vertices'
                   or edges' rows changed the others'); ``""`` for a row-local op
=================  =====================================================================

Size-dependent fields are linear forms in ``|V|`` and ``|E|``; :meth:`TPGraph.value` evaluates
them for the graph statistics the graph was traced (or re-bound) for.

Training and eval mode
----------------------
fx records ``self.training`` as a constant, so one fx graph holds one mode's behaviour of
functional code (``F.dropout(x, p, self.training)``, ``if self.training:``). A ``TPGraph`` is
therefore one of:

- **mode-following** (``specialized is None``, what ``gnncompile.trace(model, g)`` returns):
  ``graph`` is the training-mode graph and, where the model's eval-mode graph differs from it,
  :attr:`TPGraph.eval_graph` holds that graph (a ``TPGraph`` specialized to eval mode, sharing the
  submodules and parameters). Calling the module runs ``graph`` in training mode and
  ``eval_graph`` in eval mode, exactly like the eager model; ``tp.train()``/``tp.eval()`` switch
  it. With no ``eval_graph`` the one graph serves both modes (mode-dependent work, if any, is in
  ``torch.nn`` modules such as ``Dropout`` or ``BatchNorm1d``, which read their own mode).
- **specialized** (``specialized`` is ``True`` or ``False``: ``trace(..., training=...)``, the
  planner's per-mode graphs): mode constants are frozen; calling it in the other mode raises
  :class:`~gnncompile.errors.TraceError` instead of silently running the wrong behaviour.

Keeping the two modes as two plain graphs (rather than one graph whose dropout reads the mode at run
time) means every pass and lowering sees dropout in the one form they are written for (a call with
a constant ``training`` flag); graph passes registered with
:func:`gnncompile.passes.infra.graph_pass` transform both graphs.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

import torch
import torch.fx

from ..errors import TraceError
from ..graph.core import GraphStats
from .symbolic import Lin

__all__ = ["TPInfo", "TPGraph", "TraceSummary", "KINDS", "ends_layer", "graph_module"]

try:  # fx's deferred code generation, as torch.compile's passes use it
    from torch.fx._lazy_graph_module import _LazyGraphModule as _DeferredGraphModule
except ImportError:  # pragma: no cover - a torch without it generates the code at once
    _DeferredGraphModule = torch.fx.GraphModule


def graph_module(root: torch.nn.Module | dict, graph: torch.fx.Graph, class_name: str = "GraphModule"
                 ) -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph, class_name)`` whose Python code is generated when first
    needed (called, printed, pickled), not when built (as :class:`TPGraph`'s): the search builds
    stage modules for every candidate and runs only the winner's."""
    return _DeferredGraphModule(root, graph, class_name)

KINDS = ("T", "P", "E", "input", "param", "output")


@dataclass(frozen=True)
class TPInfo:
    """Annotation of one operator-graph node (see the module docstring for the fields)."""

    kind: str
    layer: int = 0
    rows: Optional[Lin] = None
    dims: tuple[int, ...] = ()
    dtype: Optional[str] = None
    flops: Lin = field(default_factory=Lin)
    bytes_read: Lin = field(default_factory=Lin)
    bytes_written: Lin = field(default_factory=Lin)
    saved_bytes: Lin = field(default_factory=Lin)
    params: int = 0
    recompute: bool = False
    op: str = ""
    saves: tuple[str, ...] = ()
    replays: tuple[str, ...] = ()
    replayed_bytes: Lin = field(default_factory=Lin)
    replay_saving: Lin = field(default_factory=Lin)
    mixes_rows: str = ""

    @property
    def space(self) -> str:
        return "-" if self.rows is None else self.rows.space

    def with_(self, **changes: Any) -> "TPInfo":
        return replace(self, **changes)


def ends_layer(node: torch.fx.Node) -> bool:
    """Whether ``node`` ends a GNN layer: a P primitive, or ``aggregate`` (edge messages -> vertices)."""
    if node.op != "call_function":
        return False
    kind = getattr(node.target, "__gnncompile_kind__", None)
    return kind == "P" or (kind == "E" and getattr(node.target, "__name__", "") == "aggregate")


def _human(n: float, unit: str = "") -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


@dataclass
class TraceSummary:
    """Per-layer and total FLOPs and bytes of a traced model, split by T/P/E kind."""

    stats: GraphStats
    per_layer: dict[int, dict[str, dict[str, int]]]
    activation_bytes: int
    param_count: int

    def total(self, kind: str, what: str) -> int:
        return sum(layer.get(kind, {}).get(what, 0) for layer in self.per_layer.values())

    def __str__(self) -> str:
        lines = [f"summary for {self.stats}"]
        head = f"{'layer':>5}  {'T FLOPs':>10} {'P FLOPs':>10} {'E FLOPs':>10}  {'T bytes':>10} {'P bytes':>10} {'E bytes':>10}  {'saved':>10}"
        lines.append(head)
        for layer in sorted(self.per_layer):
            d = self.per_layer[layer]
            g = lambda k, w: d.get(k, {}).get(w, 0)  # noqa: E731
            lines.append(
                f"{layer:>5}  {_human(g('T', 'flops')):>10} {_human(g('P', 'flops')):>10} {_human(g('E', 'flops')):>10}  "
                f"{_human(g('T', 'bytes'), 'B'):>10} {_human(g('P', 'bytes'), 'B'):>10} {_human(g('E', 'bytes'), 'B'):>10}  "
                f"{_human(sum(g(k, 'saved') for k in ('T', 'P', 'E')), 'B'):>10}"
            )
        lines.append(
            f"{'total':>5}  {_human(self.total('T', 'flops')):>10} {_human(self.total('P', 'flops')):>10} "
            f"{_human(self.total('E', 'flops')):>10}  {_human(self.total('T', 'bytes'), 'B'):>10} "
            f"{_human(self.total('P', 'bytes'), 'B'):>10} {_human(self.total('E', 'bytes'), 'B'):>10}  "
            f"{_human(self.activation_bytes, 'B'):>10}"
        )
        lines.append(f"parameters: {self.param_count:,}; activation memory saved for backward: "
                     f"{_human(self.activation_bytes, 'B')}")
        return "\n".join(lines)


class TPGraph(_DeferredGraphModule):
    """An fx ``GraphModule`` whose nodes carry :class:`TPInfo` in ``node.meta["tp"]``.

    Construct it with :func:`gnncompile.trace`. ``stats`` is the :class:`GraphStats` its numbers are
    evaluated for; :meth:`bind` returns the same graph evaluated for other statistics (the linear
    forms do not change). ``specialized`` and :attr:`eval_graph` say how it runs in training and
    eval mode (see the module docstring); ``mode_note`` is the one-line account the table prints.
    """

    stats: GraphStats
    #: ``None``: follows the module's mode; ``True``/``False``: traced for that mode only.
    specialized: Optional[bool] = None
    #: what differs in eval mode, in words ('' when nothing does or the graph is specialized)
    mode_note: str = ""

    def __init__(self, root: torch.nn.Module | dict, graph: torch.fx.Graph, stats: GraphStats,
                 class_name: str = "TPGraph") -> None:
        super().__init__(root, graph, class_name)
        self.stats = stats

    # ------------------------------------------------------------------ modes
    @property
    def eval_graph(self) -> Optional["TPGraph"]:
        """The graph run in eval mode when it differs from ``graph`` (``None``: ``graph`` serves both).

        A ``TPGraph`` specialized to eval mode that shares this graph's submodules, parameters and
        buffers. Kept out of the module tree (not a submodule), so parameters, ``state_dict`` and
        ``named_modules`` list everything once.
        """
        return self.__dict__.get("_eval_graph")

    def set_eval_graph(self, eval_graph: Optional["TPGraph"], note: str = "") -> None:
        """Attach (or with ``None`` drop) the eval-mode graph; ``note`` says what differs in eval mode."""
        if eval_graph is not None:
            if not isinstance(eval_graph, TPGraph) or eval_graph.specialized is not False:
                raise TypeError("the eval graph must be a TPGraph specialized to eval mode "
                                "(gnncompile.trace(..., training=False))")
            eval_graph.training = False  # its root only: the submodules are shared
        self.__dict__["_eval_graph"] = eval_graph
        self.mode_note = note if eval_graph is not None else ""

    def copy_modes_from(self, other: "TPGraph") -> None:
        """Take ``other``'s mode contract: ``specialized``, mode note, and each submodule's mode by name."""
        self.specialized = other.specialized
        self.mode_note = other.mode_note
        modes = {name: m.training for name, m in other.named_modules()}
        for name, m in self.named_modules():
            m.training = modes.get(name, other.training)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training and self.eval_graph is not None:
            return self.eval_graph(*args, **kwargs)
        if self.specialized is not None and self.specialized != self.training:
            traced, now = ("training", "eval") if self.specialized else ("eval", "training")
            raise TraceError(
                f"this {type(self).__name__} was traced for {traced} mode only "
                f"(gnncompile.trace(..., training={self.specialized})) and is called in {now} mode; "
                "trace without training= for a graph that follows .train()/.eval(), or call "
                f"{'.train()' if self.specialized else '.eval()'} first")
        return super().__call__(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> "TPGraph":
        # ``.to()``, ``.double()``...: the eval graph holds its own references to root-level
        # parameters and buffers (get_attr targets), so it is converted too (the conversions are
        # idempotent on the submodules the two graphs share).
        super()._apply(fn, recurse)
        if self.eval_graph is not None:
            self.eval_graph._apply(fn, recurse)
        return self

    def __deepcopy__(self, memo: dict) -> "TPGraph":
        # GraphModule.__deepcopy__ rebuilds the module through GraphModule.__init__, which drops
        # attributes it does not know (``stats``, the mode contract), resets the root's
        # ``training`` flag and renames the (per-instance) class "GraphModule".
        res = super().__deepcopy__(memo)
        res.stats = self.stats  # immutable
        res.training = self.training
        res.specialized = self.specialized
        res.mode_note = self.mode_note
        # same memo: the copy's eval graph shares the copy's submodules as the original's does
        res.__dict__["_eval_graph"] = copy.deepcopy(self.eval_graph, memo)
        type(res).__name__ = type(self).__name__
        return res

    # ------------------------------------------------------------------ access
    def info(self, node: torch.fx.Node) -> TPInfo:
        return node.meta["tp"]

    def value(self, lin: Optional[Lin]) -> int:
        """Evaluate a linear form for this graph's statistics."""
        return 0 if lin is None else lin(self.stats.num_nodes, self.stats.num_edges)

    def ops(self, kinds: Iterable[str] = ("T", "P", "E")) -> list[torch.fx.Node]:
        ks = set(kinds)
        return [n for n in self.graph.nodes if "tp" in n.meta and n.meta["tp"].kind in ks]

    def bind(self, stats: GraphStats) -> "TPGraph":
        """The same operator graph evaluated for ``stats``: same code and annotations.

        The fx graph is copied (rewriting the copy leaves ``self`` alone); submodules and
        parameters are shared, as :func:`~gnncompile.trace` shares them with the model, so binding
        costs nothing proportional to the model's parameters. ``copy.deepcopy`` gives a fully
        independent copy.
        """
        graph = copy.deepcopy(self.graph)
        new = TPGraph(self, graph, stats, class_name=type(self).__name__)
        new.training = self.training
        new.copy_modes_from(self)
        if self.eval_graph is not None:
            new.set_eval_graph(self.eval_graph.bind(stats), self.mode_note)
        return new

    @property
    def num_layers(self) -> int:
        """Number of GNN layers: the largest layer of a layer-ending op (see :func:`ends_layer`)."""
        return max((n.meta["tp"].layer for n in self.ops(("P", "E")) if ends_layer(n)), default=0)

    # ------------------------------------------------------------------ inspection
    def table(self) -> str:
        """The per-op table that ``print(tp)`` shows."""
        rows = [("op", "kind", "layer", "rows", "dims", "FLOPs", "bytes r+w", "saved", "params")]
        for n in self.graph.nodes:
            t: Optional[TPInfo] = n.meta.get("tp")
            if t is None:
                rows.append((n.name, "?", "", "", "", "", "", "", ""))
                continue
            rows_s = "-" if t.rows is None else f"{t.rows.space if t.rows.space not in ('?', '1') else t.rows}"
            if t.rows is not None and t.rows.space in ("V", "E", "E+V"):
                rows_s = f"{t.rows.space}={_human(self.value(t.rows))}"
            dims = "x".join(str(d) for d in t.dims) if t.dims else "-"
            rows.append((
                f"{n.name}{'*' if t.recompute else ''}", t.kind, str(t.layer) if t.kind in ("T", "P", "E") else "",
                rows_s, dims, _human(self.value(t.flops)) if t.kind in ("T", "P", "E") else "",
                _human(self.value(t.bytes_read) + self.value(t.bytes_written), "B") if t.kind in ("T", "P", "E") else "",
                _human(self.value(t.saved_bytes), "B") if t.kind in ("T", "P", "E") else "",
                f"{t.params:,}" if t.params else "",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out = [f"TPGraph for {self.stats}{self._mode_header()}"]
        for i, r in enumerate(rows):
            out.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
        if any(n.meta.get("tp") is not None and n.meta["tp"].recompute for n in self.graph.nodes):
            out.append("* recomputed in backward instead of saved")
        return "\n".join(out)

    def _mode_header(self) -> str:
        if self.specialized is not None:
            return f" (traced for {'training' if self.specialized else 'eval'} mode only)"
        if self.eval_graph is not None:
            return f" (training mode; eval mode runs tp.eval_graph: {self.mode_note})"
        return ""

    def __str__(self) -> str:
        return self.table()

    def summary(self) -> TraceSummary:
        """Per-layer and total T/P/E FLOPs, bytes, and activation memory saved for backward."""
        per: dict[int, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
        saved = 0
        params = 0
        for n in self.graph.nodes:
            t = n.meta.get("tp")
            if t is None:
                continue
            params += t.params
            if t.kind not in ("T", "P", "E"):
                continue
            d = per[t.layer][t.kind]
            d["flops"] += self.value(t.flops)
            d["bytes"] += self.value(t.bytes_read) + self.value(t.bytes_written)
            # A recomputed node's saved_bytes are what it really keeps (its checkpoint inputs).
            s = self.value(t.saved_bytes)
            d["saved"] += s
            saved += s
        plain = {k: {kk: dict(vv) for kk, vv in v.items()} for k, v in per.items()}
        return TraceSummary(self.stats, plain, saved, params)

    def to_dot(self) -> str:
        """Graphviz DOT text: T ops as boxes, P ops as blue ellipses, E ops as orange diamonds."""
        style = {
            "T": 'shape=box, style=filled, fillcolor="#e8e8e8"',
            "P": 'shape=ellipse, style=filled, fillcolor="#9ecae1"',
            "E": 'shape=diamond, style=filled, fillcolor="#fdae6b"',
            "input": "shape=invhouse",
            "param": 'shape=note, fontcolor="#666666"',
            "output": "shape=house",
        }
        lines = ["digraph TPGraph {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
        for n in self.graph.nodes:
            t = n.meta.get("tp")
            kind = t.kind if t else "T"
            label = n.name if t is None else f"{n.name}\\n{kind} L{t.layer} {t.space} {'x'.join(map(str, t.dims))}"
            lines.append(f'  "{n.name}" [label="{label}", {style.get(kind, "")}];')
        for n in self.graph.nodes:
            for inp in n.all_input_nodes:
                lines.append(f'  "{inp.name}" -> "{n.name}";')
        lines.append("}")
        return "\n".join(lines)
