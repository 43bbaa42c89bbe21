"""The registered strategies: adding a strategy is its module plus one line here.

``STRATEGIES`` maps a name to its :class:`~gnncompile.passes.strategy.Strategy`; ``PLANNED`` names
the strategies of the papers that have no lowering yet (``gc.plan`` says so instead of "unknown").
"""

from __future__ import annotations

from typing import Any

from ..errors import PlanningError
from . import data, layer, mop, split, task, tensor
from .strategy import ANY, OptionSpec, Strategy

__all__ = ["STRATEGIES", "PLANNED", "get", "option_specs", "neutral_values"]

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    data.STRATEGY,
    tensor.STRATEGY,
    mop.STRATEGY,
    task.STRATEGY,
    layer.STRATEGY,
    split.STRATEGY,
)}

#: strategies of DESIGN.md without a lowering yet
PLANNED: tuple[str, ...] = ()


def get(name: str) -> Strategy:
    """The registered strategy ``name``; :class:`PlanningError` naming the registered ones otherwise."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in PLANNED:
        raise PlanningError(f"strategy {name!r} has no lowering yet; implemented: {', '.join(STRATEGIES)}")
    raise PlanningError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")


def option_specs() -> dict[str, list[tuple[str, OptionSpec]]]:
    """Every option name any strategy declares -> ``(strategy, spec)`` of each strategy declaring it."""
    out: dict[str, list[tuple[str, OptionSpec]]] = {}
    for s in STRATEGIES.values():
        for spec in s.options.specs():
            out.setdefault(spec.name, []).append((s.name, spec))
    return out


def neutral_values() -> dict[str, Any]:
    """Option name -> the value meaning "not used" (:data:`~gnncompile.passes.strategy.ANY`: ignored
    by strategies without it); the first declaring strategy's that is not ``ANY``."""
    out: dict[str, Any] = {}
    for name, specs in option_specs().items():
        values = [spec.neutral for _, spec in specs if spec.neutral is not ANY]
        out[name] = values[0] if values else ANY
    return out
