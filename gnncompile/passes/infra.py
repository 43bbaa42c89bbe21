"""Pass infrastructure: graph passes as functions with contracts, a pass manager, instruments.

A graph pass is a function ``TPGraph -> TPGraph`` registered with :func:`graph_pass`, whose
docstring states what it **Requires**, **Ensures** and **Preserves**, and whether it is *exact*
(the model computes the same function and gradients) or *relaxed* (it changes the model; such
passes run only when the caller opts in with ``semantics="relaxed"``). The decorator gives every
pass the same guarantees: it receives a private copy (a pass never mutates its input), and its
result is re-verified by the :class:`PassManager`.

Both modes: a mode-following :class:`~gnncompile.ir.tpgraph.TPGraph` (``gnncompile.trace(model, g)``)
may carry an eval-mode graph (``tp.eval_graph``). The decorator applies the pass to the training
graph (in training mode) and to the eval graph (in eval mode) and returns a mode-following result
with the same mode contract and submodule modes as the input; a pass that fails on the eval graph is
a :class:`~gnncompile.errors.PassError` saying so (trace with ``training=True`` to transform the
training graph alone).

The :class:`PassManager` (after TVM's ``Sequential``/``PassContext`` and torch.fx's pass manager)
runs a list of passes, verifies the IR before and after each one (on by default), calls
instruments around each pass (:class:`PrintIR`, :class:`Timing`), and on any failure raises
:class:`~gnncompile.errors.PassError` naming the pass.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, TextIO

from ..errors import GnnCompileError, PassError, VerificationError
from ..ir.tpgraph import TPGraph
from ..ir.verify import verify

__all__ = ["GraphPass", "graph_pass", "PASSES", "PassManager", "PassInstrument", "PrintIR", "Timing",
           "SEMANTICS"]

SEMANTICS = ("exact", "relaxed")


@dataclass(frozen=True)
class GraphPass:
    """A registered graph pass: the function, its name, and whether it is exact."""

    name: str
    fn: Callable[..., TPGraph]
    exact: bool
    doc: str = ""

    def __call__(self, tp: TPGraph, **options: object) -> TPGraph:
        return self.fn(tp, **options)

    def bind(self, **options: object) -> "GraphPass":
        """This pass with ``options`` fixed (what a :class:`PassManager`, which calls passes with
        the graph alone, runs)."""
        return GraphPass(self.name, functools.partial(self.fn, **options), self.exact, self.doc)


PASSES: dict[str, GraphPass] = {}


def graph_pass(*, exact: bool, name: Optional[str] = None) -> Callable[[Callable[..., TPGraph]], GraphPass]:
    """Register a graph pass. The docstring must have Requires/Ensures/Preserves sections."""

    def deco(fn: Callable[..., TPGraph]) -> GraphPass:
        doc = fn.__doc__ or ""
        missing = [s for s in ("Requires", "Ensures", "Preserves") if s not in doc]
        if missing:
            raise TypeError(f"graph pass {fn.__name__}: docstring lacks {', '.join(missing)}")

        @functools.wraps(fn)
        def run(tp: TPGraph, *, share_parameters: bool = False, **options: object) -> TPGraph:
            """Run the pass on a copy of ``tp``; with ``share_parameters`` the copy keeps ``tp``'s
            parameters and buffers (the same tensors: training the result trains the model)."""
            if not isinstance(tp, TPGraph):
                raise PassError(f"pass {pass_name}: expected a TPGraph, got {type(tp).__name__}")
            memo: dict[int, object] = {}
            if share_parameters:
                memo = {id(t): t for t in (*tp.parameters(), *tp.buffers())}
            work = copy.deepcopy(tp, memo)
            if tp.eval_graph is not None:
                return _both_modes(fn, pass_name, tp, work, options)
            out = fn(work, **options)
            if isinstance(out, TPGraph):  # a pass that re-traces must not change the mode contract
                out.specialized = tp.specialized
            return out

        pass_name = name or fn.__name__
        p = GraphPass(pass_name, run, exact, doc)
        PASSES[pass_name] = p
        return p

    return deco


def _both_modes(fn: Callable[..., TPGraph], pass_name: str, original: TPGraph, work: TPGraph,
                options: dict[str, object]) -> TPGraph:
    """Run ``fn`` on ``work`` (a private copy of ``original``) in training mode and on its eval graph
    in eval mode; return the training result carrying the eval result and ``original``'s modes."""
    eval_work = work.eval_graph
    assert eval_work is not None
    work.set_eval_graph(None)
    work.train(True)  # the passes read module modes (e.g. whether a Dropout module is active)
    out = fn(work, **options)
    eval_work.train(False)  # shares submodules with ``work``: they are now in eval mode
    try:
        out_eval = fn(eval_work, **options)
    except Exception as exc:
        raise PassError(f"pass {pass_name} cannot transform the eval-mode graph (tp.eval_graph) of this model: "
                        f"{type(exc).__name__}: {exc}; passes apply to both modes of a graph from "
                        "gnncompile.trace(model, g): trace with training=True to transform the training graph "
                        "alone") from exc
    if not isinstance(out, TPGraph) or not isinstance(out_eval, TPGraph):
        return out  # the PassManager reports a result that is not a TPGraph
    out_eval.specialized = False
    out.copy_modes_from(original)
    out.set_eval_graph(out_eval, original.mode_note)
    return out


class PassInstrument:
    """Hooks called around every pass a :class:`PassManager` runs."""

    def run_before_pass(self, p: GraphPass, tp: TPGraph) -> None:  # noqa: B027 - optional hook
        pass

    def run_after_pass(self, p: GraphPass, tp: TPGraph) -> None:  # noqa: B027 - optional hook
        pass


@dataclass
class PrintIR(PassInstrument):
    """Print the operator graph after (and optionally before) each pass."""

    before: bool = False
    stream: Optional[TextIO] = None

    def _print(self, title: str, tp: TPGraph) -> None:
        print(f"=== {title} ===\n{tp}", file=self.stream)

    def run_before_pass(self, p: GraphPass, tp: TPGraph) -> None:
        if self.before:
            self._print(f"before {p.name}", tp)

    def run_after_pass(self, p: GraphPass, tp: TPGraph) -> None:
        self._print(f"after {p.name}", tp)


@dataclass
class Timing(PassInstrument):
    """Record the wall time of each pass in ``self.times`` (pass name -> seconds)."""

    times: dict[str, float] = field(default_factory=dict)
    _t0: float = 0.0

    def run_before_pass(self, p: GraphPass, tp: TPGraph) -> None:
        self._t0 = time.perf_counter()

    def run_after_pass(self, p: GraphPass, tp: TPGraph) -> None:
        self.times[p.name] = self.times.get(p.name, 0.0) + time.perf_counter() - self._t0

    def __str__(self) -> str:
        return "\n".join(f"{name:30s} {secs * 1e3:8.2f} ms" for name, secs in self.times.items())


class PassManager:
    """Run graph passes in order, verifying the IR around each one.

    A mode-following graph (``gnncompile.trace(model, g)``) with an eval-mode graph has every pass
    applied to both graphs (see :func:`graph_pass`) and both verified; a pass that cannot transform
    the eval graph fails with a :class:`~gnncompile.errors.PassError` that says so.

    Parameters
    ----------
    passes:
        :class:`GraphPass` objects or registered pass names.
    semantics:
        ``"exact"`` (default) refuses relaxed passes; ``"relaxed"`` allows them.
    verify_ir:
        Run :func:`~gnncompile.ir.verify.verify` before the first pass and after every pass.
    instruments:
        :class:`PassInstrument` objects called around every pass.
    """

    def __init__(self, passes: Sequence[GraphPass | str], *, semantics: str = "exact", verify_ir: bool = True,
                 instruments: Iterable[PassInstrument] = ()) -> None:
        if semantics not in SEMANTICS:
            raise PassError(f"semantics: unknown {semantics!r}; valid: {', '.join(SEMANTICS)}")
        resolved = []
        for p in passes:
            if isinstance(p, str):
                if p not in PASSES:
                    raise PassError(f"unknown pass {p!r}; registered: {', '.join(sorted(PASSES))}")
                p = PASSES[p]
            if not p.exact and semantics != "relaxed":
                raise PassError(f"pass {p.name} is relaxed (it changes the model); run it only with "
                                "semantics='relaxed'")
            resolved.append(p)
        self.passes: list[GraphPass] = resolved
        self.semantics = semantics
        self.verify_ir = verify_ir
        self.instruments = list(instruments)

    def __call__(self, tp: TPGraph) -> TPGraph:
        if self.verify_ir:
            try:
                verify(tp)
            except VerificationError as exc:
                raise PassError(f"input IR is invalid before any pass ran: {exc}") from exc
        for p in self.passes:
            for ins in self.instruments:
                ins.run_before_pass(p, tp)
            try:
                out = p(tp)
            except GnnCompileError as exc:
                raise PassError(f"pass {p.name} failed: {exc}") from exc
            except Exception as exc:
                raise PassError(f"pass {p.name} failed: {type(exc).__name__}: {exc}") from exc
            if not isinstance(out, TPGraph):
                raise PassError(f"pass {p.name} returned {type(out).__name__}, not a TPGraph")
            if self.verify_ir:
                try:
                    verify(out)
                except VerificationError as exc:
                    raise PassError(f"pass {p.name} produced invalid IR: {exc}") from exc
            for ins in self.instruments:
                ins.run_after_pass(p, out)
            tp = out
        return tp
