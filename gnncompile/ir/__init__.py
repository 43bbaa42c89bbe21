"""IR: the annotated operator graph (TPGraph), symbolic sizes (and, later, plans)."""

from .symbolic import Lin
from .tpgraph import TPGraph, TPInfo, TraceSummary

__all__ = ["Lin", "TPGraph", "TPInfo", "TraceSummary"]
