"""Linear forms in the graph's size: ``a*|V| + b*|E| + c``.

Every size-dependent annotation of the operator graph (rows of a tensor, FLOPs, bytes moved,
bytes saved for backward) is linear in the number of vertices and edges for the models gnncompile
traces, so the tracer records it as a :class:`Lin` once and evaluates it for any graph or
:class:`~gnncompile.graph.GraphStats`. That is why tracing a model for a billion-edge graph costs
the same as tracing it for Cora.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Union

Number = Union[int, float, Fraction]

__all__ = ["Lin", "solve_lin"]


@dataclass(frozen=True)
class Lin:
    """``v * |V| + e * |E| + c`` with exact rational coefficients."""

    v: Fraction = Fraction(0)
    e: Fraction = Fraction(0)
    c: Fraction = Fraction(0)

    @staticmethod
    def const(c: Number) -> "Lin":
        return Lin(Fraction(0), Fraction(0), Fraction(c))

    @staticmethod
    def of(v: Number = 0, e: Number = 0, c: Number = 0) -> "Lin":
        return Lin(Fraction(v), Fraction(e), Fraction(c))

    def __add__(self, other: "Lin | Number") -> "Lin":
        o = other if isinstance(other, Lin) else Lin.const(other)
        return Lin(self.v + o.v, self.e + o.e, self.c + o.c)

    __radd__ = __add__

    def __sub__(self, other: "Lin | Number") -> "Lin":
        o = other if isinstance(other, Lin) else Lin.const(other)
        return Lin(self.v - o.v, self.e - o.e, self.c - o.c)

    def __mul__(self, k: Number) -> "Lin":
        if isinstance(k, Lin):
            if k.v == 0 and k.e == 0:
                k = k.c
            elif self.v == 0 and self.e == 0:
                return k * self.c
            else:
                raise TypeError("Lin * Lin is not linear")
        k = Fraction(k)
        return Lin(self.v * k, self.e * k, self.c * k)

    __rmul__ = __mul__

    def __call__(self, num_nodes: int, num_edges: int) -> int:
        """Evaluate for a graph of ``num_nodes`` vertices and ``num_edges`` edges (rounded)."""
        ints = self._ints
        if ints is not None:
            out = ints[0] * num_nodes + ints[1] * num_edges + ints[2]
            return out if type(out) is int else round(out)
        return round(self.v * num_nodes + self.e * num_edges + self.c)

    @functools.cached_property
    def _ints(self) -> Optional[tuple[int, int, int]]:
        """The coefficients as ints when all are integers (nearly every form: rows, FLOPs, bytes),
        else ``None``: :meth:`__call__` then evaluates without a Fraction per call."""
        v, e, c = self.v, self.e, self.c
        return (int(v), int(e), int(c)) if all(getattr(x, "denominator", 0) == 1 for x in (v, e, c)) else None

    @property
    def is_const(self) -> bool:
        return self.v == 0 and self.e == 0

    @property
    def space(self) -> str:
        """Row-space name: ``V``, ``E``, ``E+V`` (edges plus implicit self loops), ``1`` or ``?``."""
        if (self.v, self.e, self.c) == (1, 0, 0):
            return "V"
        if (self.v, self.e, self.c) == (0, 1, 0):
            return "E"
        if (self.v, self.e, self.c) == (1, 1, 0):
            return "E+V"
        if self.is_const:
            return "1"
        return "?"

    def __str__(self) -> str:
        parts = []
        for coef, sym in ((self.e, "E"), (self.v, "V")):  # E first, as in the space name E+V
            if coef:
                parts.append(sym if coef == 1 else f"-{sym}" if coef == -1 else f"{_fmt(coef)}{sym}")
        if self.c or not parts:
            parts.append(_fmt(self.c))
        return "+".join(parts).replace("+-", "-")

    def to_json(self) -> list[str]:
        return [str(self.v), str(self.e), str(self.c)]

    @staticmethod
    def from_json(obj: list[str]) -> "Lin":
        return Lin(*(Fraction(x) for x in obj))


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"({x})"


def solve_lin(samples: list[tuple[int, int, Number]]) -> Lin:
    """The exact ``Lin`` through three ``(num_nodes, num_edges, value)`` samples.

    Raises ``ValueError`` when the samples are not consistent with a linear form (checked on a
    fourth sample when given) or the sample sizes are degenerate.
    """
    if len(samples) < 3:
        raise ValueError("solve_lin needs at least 3 samples")
    (n1, e1, y1), (n2, e2, y2), (n3, e3, y3) = samples[:3]
    if all(isinstance(y, int) for _, _, y in samples):
        return _solve_int(samples)
    # Cramer's rule on [[n, e, 1]] (a, b, c) = y, in exact arithmetic.
    det = Fraction(n1 * (e2 - e3) - e1 * (n2 - n3) + (n2 * e3 - n3 * e2))
    if det == 0:
        raise ValueError("degenerate sample sizes")
    y1, y2, y3 = Fraction(y1), Fraction(y2), Fraction(y3)
    a = (y1 * (e2 - e3) - e1 * (y2 - y3) + (y2 * e3 - y3 * e2)) / det
    b = (n1 * (y2 - y3) - y1 * (n2 - n3) + (n2 * y3 - n3 * y2)) / det
    c = (n1 * (e2 * y3 - e3 * y2) - e1 * (n2 * y3 - n3 * y2) + y1 * (n2 * e3 - n3 * e2)) / det
    lin = Lin(a, b, c)
    for n, e, y in samples[3:]:
        if lin.v * n + lin.e * e + lin.c != Fraction(y):
            raise ValueError(f"value {y} at (|V|={n}, |E|={e}) is not linear in the graph size")
    return lin


_ZERO = Fraction(0)


def _solve_int(samples: list[tuple[int, int, Number]]) -> Lin:
    """:func:`solve_lin` for integer values, in integer arithmetic (the tracer's hot path).

    Same result as the rational version; Fractions are built only for the three coefficients.
    """
    (n1, e1, y1), (n2, e2, y2), (n3, e3, y3) = samples[:3]
    det = n1 * (e2 - e3) - e1 * (n2 - n3) + (n2 * e3 - n3 * e2)
    if det == 0:
        raise ValueError("degenerate sample sizes")
    if y1 == y2 == y3 and all(y == y1 for _, _, y in samples[3:]):
        return Lin(_ZERO, _ZERO, Fraction(y1))
    a = y1 * (e2 - e3) - e1 * (y2 - y3) + (y2 * e3 - y3 * e2)
    b = n1 * (y2 - y3) - y1 * (n2 - n3) + (n2 * y3 - n3 * y2)
    c = n1 * (e2 * y3 - e3 * y2) - e1 * (n2 * y3 - n3 * y2) + y1 * (n2 * e3 - n3 * e2)
    for n, e, y in samples[3:]:
        if a * n + b * e + c != y * det:
            raise ValueError(f"value {y} at (|V|={n}, |E|={e}) is not linear in the graph size")
    return Lin(Fraction(a, det), Fraction(b, det), Fraction(c, det))
