"""What a strategy declares: its options (a validated dataclass with documentation and a search
space) and its lowering; the registry of strategies is :mod:`gnncompile.passes.registry`.

A strategy module defines

- an options class, a frozen dataclass deriving from :class:`StrategyOptions` whose fields are
  declared with :func:`option` (documentation, accepted values, and the *neutral* value: the value
  that means "this strategy does not do that", so that a caller fixing ``chunks=1`` keeps strategies
  without chunks among the candidates), and whose :meth:`~StrategyOptions.space` lists the option
  sets the search tries;
- a lowering ``lower(job, options) -> Lowered`` (:mod:`gnncompile.passes.driver`: the driver
  does everything that is not particular to the strategy);
- ``STRATEGY = Strategy(...)``, listed in :mod:`gnncompile.passes.registry`.

``gc.plan(**options)``, the CLI and the search read options from these declarations.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Optional, Sequence

import numpy as np

from ..errors import ArgumentError, PlanningError
from ..frontend.ops import BACKWARD_PRODUCTS
from ..graph.sampling import parse_fanouts

__all__ = ["option", "OptionSpec", "StrategyOptions", "Strategy", "SEMANTICS", "DROPOUT_MODES", "ANY"]

SEMANTICS = ("exact", "relaxed")
DROPOUT_MODES = ("replicated", "local")


class _Any:
    """Neutral value of an option that other strategies ignore whatever its value (``partitioner``)."""

    def __repr__(self) -> str:
        return "ANY"


#: the neutral value of an option that a strategy without it ignores
ANY: Any = _Any()

#: option kinds and what they accept
_KINDS = ("int", "positive_int", "bool", "choice", "optional_positive_int", "fanouts")


def option(default: Any, doc: str, *, kind: str, choices: Sequence[Any] = (), neutral: Any = dataclasses.MISSING,
           pinned: bool = False, cli: Optional[str] = None) -> Any:
    """Declare a strategy option (a dataclass field with its documentation and checks).

    ``kind``: ``int``, ``positive_int``, ``optional_positive_int``, ``bool``, ``choice`` (one of
    ``choices``) or ``fanouts`` (``None`` or sampled in-edges per GNN layer, each ``>= 1`` or ``-1`` for all:
    a sequence or a string ``"15,10,5"``, kept as a tuple: :func:`~gnncompile.graph.sampling.parse_fanouts`). ``neutral``: the value that means a strategy without this option is unaffected by
    it (default: ``default``); :data:`ANY` when strategies without it ignore it. ``pinned``: with
    a named strategy (``gc.plan(strategy=...)``) the option takes its default when not given,
    instead of being searched. ``cli``: help text of the command-line flag (default: ``doc``).
    """
    if kind not in _KINDS:
        raise ValueError(f"option kind {kind!r}; valid: {', '.join(_KINDS)}")
    return field(default=default, metadata={"doc": doc, "kind": kind, "choices": tuple(choices),
                                            "neutral": default if neutral is dataclasses.MISSING else neutral,
                                            "pinned": pinned, "cli": cli})


@dataclass(frozen=True)
class OptionSpec:
    """One declared option: name, default, documentation, kind, accepted values, neutral value,
    whether a named strategy pins it to its default, command-line help."""

    name: str
    default: Any
    doc: str
    kind: str
    choices: tuple[Any, ...]
    neutral: Any
    pinned: bool
    cli: Optional[str]

    def coerce(self, value: Any) -> Any:
        """``value`` as the option holds it: a NumPy int of an integer option as an int (gc.train
        takes them); anything else as it is (:meth:`check` judges it)."""
        if isinstance(value, np.integer) and self.kind in ("int", "positive_int", "optional_positive_int"):
            return int(value)
        return value

    def check(self, value: Any, owner: str = "", *, searched: bool = False) -> None:
        """Raise :class:`PlanningError` unless ``value`` is acceptable; ``owner`` (a strategy name)
        prefixes the message; ``searched``: the caller may also pass ``None`` (the planner chooses)."""
        if self.kind == "choice":
            if value not in self.choices:
                what = {"dropout": "dropout mode"}.get(self.name, self.name)
                raise PlanningError(f"{owner + ': ' if owner else ''}unknown {what} {value!r}; valid: "
                                    f"{', '.join(repr(c) if self.name == 'semantics' else str(c) for c in self.choices)}")
            return
        if self.kind == "bool":
            ok, want = isinstance(value, bool), "True or False"
        elif self.kind == "fanouts":  # None, or what parse_fanouts takes; its message names the entry
            try:
                ok, want = value is None or bool(parse_fanouts(value, self.name)), ""
            except ArgumentError as e:
                raise PlanningError(f"{owner + ': ' if owner else ''}{e}") from None
        else:
            low = 0 if self.kind == "int" else 1
            ok = (value is None and self.kind == "optional_positive_int") or \
                (isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**63)
            want = "an integer in [0, 2^63)" if low == 0 else "a positive integer below 2^63"
        if ok:
            return
        if searched:
            raise PlanningError(f"{self.name}: expected {want} or None (searched), got {value!r}")
        raise PlanningError(f"{owner + ': ' if owner else ''}{self.name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class StrategyOptions:
    """Base of every strategy's options: the fields all strategies have (``seed``, ``semantics``,
    ``dropout``) and the checks of :func:`option` declarations.

    A subclass sets ``strategy`` (its name), declares its fields with :func:`option`, may add
    checks in :meth:`check` and lists its search space in :meth:`space`.
    """

    strategy: ClassVar[str] = ""

    seed: int = option(0, "Seed of the strategy's random choices (partitioner, regrouping).", kind="int",
                       neutral=ANY)
    semantics: str = option("exact", "'exact' refuses transformations that change the model; 'relaxed' applies "
                                     "them and records them in plan.relaxations.", kind="choice", choices=SEMANTICS,
                            neutral=ANY)
    dropout: str = option("replicated", "'replicated': every rank draws each dropout mask of the whole tensor "
                                        "from the same seed and keeps its rows, as single-device training draws "
                                        "them; 'local': each rank draws its rows' masks from its own stream.",
                          kind="choice", choices=DROPOUT_MODES, neutral=ANY)
    backward: str = option("transposed", "How a propagation's backward computes A^T g: 'transposed' pulls through "
                                         "a transposed CSR of each directed graph, built once and held; 'push' "
                                         "scatters from the forward CSR (no transposed copy or edge permutation, "
                                         "a slower backward product). Exact either way. Not given, the planner "
                                         "takes 'push' for a candidate that fits only without the transposes.",
                           kind="choice", choices=BACKWARD_PRODUCTS, neutral=ANY,
                           cli="backward product of propagations (default: 'transposed', or 'push' for a plan "
                               "that fits only without the transposes)")

    def __post_init__(self) -> None:
        for spec in self.specs():
            object.__setattr__(self, spec.name, spec.coerce(getattr(self, spec.name)))
            spec.check(getattr(self, spec.name), self.strategy)
            if spec.kind == "fanouts" and getattr(self, spec.name) is not None:  # "15,10,5" too
                object.__setattr__(self, spec.name, parse_fanouts(getattr(self, spec.name), spec.name))
        self.check()

    def check(self) -> None:
        """Checks across fields (a subclass raises :class:`PlanningError`)."""

    @classmethod
    def specs(cls) -> tuple[OptionSpec, ...]:
        """The declared options, in field order."""
        return tuple(OptionSpec(f.name, f.default, f.metadata["doc"], f.metadata["kind"], f.metadata["choices"],
                                f.metadata["neutral"], f.metadata["pinned"], f.metadata["cli"])
                     for f in dataclasses.fields(cls) if "kind" in f.metadata)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(s.name for s in cls.specs())

    def to_dict(self) -> dict[str, Any]:
        """The recorded options of a plan (``Plan.options``): lowering again with them gives the same plan."""
        return {"strategy": self.strategy, **{s.name: getattr(self, s.name) for s in self.specs()}}

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        """The option sets the search tries on ``num_ranks`` ranks (``None``: not known), each a dict
        of this class's fields; options in ``fixed`` do not vary. Default: the fixed options with
        ``semantics``."""
        return [{**fixed, "semantics": semantics}]


def product(axes: dict[str, Iterable[Any]], fixed: dict[str, Any], **extra: Any) -> list[dict[str, Any]]:
    """Every combination of the ``axes`` values (an axis fixed by the caller takes its fixed value),
    each merged into the other fixed options and ``extra``."""
    axes = {k: [fixed[k]] if k in fixed else list(v) for k, v in axes.items()}
    rest = {k: v for k, v in fixed.items() if k not in axes}
    return [{**rest, **dict(zip(axes, combo)), **extra} for combo in itertools.product(*axes.values())]


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: its name, options class, lowering, and what the driver does for it.

    ``lower(job, options)``: the strategy-specific lowering (see :mod:`gnncompile.passes.driver`).
    ``check(job, options)``: refusals run after decoupling and before any other graph pass.
    ``dropout_spaces(options)``: the row spaces whose replicated masks the strategy can hand its
    ranks (``None``: all). ``row_mixing``: how the plan names the per-part statistics of row-mixing
    ops (``(each, unit)``: "each rank would use its own rows ... per-rank statistics"), and
    ``row_mixing_single``: whether a one-rank plan is checked too. ``decouple_source``: the paper
    section its decoupled form follows.
    """

    name: str
    options: type[StrategyOptions]
    lower: Callable[..., Any]
    summary: str
    check: Optional[Callable[..., None]] = None
    dropout_spaces: Callable[[Any], Optional[tuple[str, ...]]] = lambda options: None
    row_mixing: tuple[str, str] = ("rank", "rank")
    row_mixing_single: bool = True
    decouple_source: str = ""
    #: whether the search passes the cost model's device (NeutronTask Eq. 7 splits ranks by task times)
    needs_device: bool = False

    def make_options(self, values: dict[str, Any]) -> StrategyOptions:
        """The options object of ``values`` (unknown names raise :class:`PlanningError`)."""
        unknown = sorted(set(values) - set(self.options.names()))
        if unknown:
            raise PlanningError(f"strategy {self.name!r} has no option {', '.join(unknown)}; its options: "
                                f"{', '.join(self.options.names())}")
        return self.options(**values)

    def candidates(self, semantics: str, fixed: dict[str, Any], neutral: dict[str, Any],
                   num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        """The search's option sets of this strategy on ``num_ranks`` ranks under the caller's
        ``fixed`` options.

        A fixed option this strategy lacks must be at its ``neutral`` value (the value that means
        "not used"; :data:`ANY`: ignored), else the strategy is no candidate.
        """
        mine = set(self.options.names())
        own = {}
        for k, v in fixed.items():
            if k in mine:
                own[k] = v
            elif neutral.get(k, ANY) is not ANY and v != neutral[k]:
                return []
        return self.options.space(semantics, own, num_ranks)
