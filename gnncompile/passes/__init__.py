"""Compiler passes over the T/P operator graph and (later) lowerings, one module per pass/strategy."""

from ..ir.verify import verify
from .infra import PASSES, GraphPass, PassInstrument, PassManager, PrintIR, Timing, graph_pass

__all__ = ["PASSES", "GraphPass", "PassInstrument", "PassManager", "PrintIR", "Timing", "graph_pass", "verify"]
