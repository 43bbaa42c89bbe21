"""Compiler passes over the T/P operator graph and (later) lowerings, one module per pass/strategy."""

from ..ir.verify import verify
from .infra import PASSES, GraphPass, PassInstrument, PassManager, PrintIR, Timing, graph_pass
from .recompute import Recompute, TSegment, insert_recomputation, t_segments  # noqa: E402
from .decouple import DecouplingPlan, decouple, decouple_exact, plan_decoupling  # noqa: E402
from .fuse_masked_propagate import MaskedPropagation, find_masked_propagations, fuse_masked_propagate  # noqa: E402

__all__ = [
    "PASSES", "GraphPass", "PassInstrument", "PassManager", "PrintIR", "Timing", "graph_pass", "verify",
    "Recompute", "TSegment", "insert_recomputation", "t_segments",
    "DecouplingPlan", "decouple", "decouple_exact", "plan_decoupling",
    "MaskedPropagation", "find_masked_propagations", "fuse_masked_propagate",
]
