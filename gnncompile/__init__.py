"""gnncompile: a dataflow compiler and scheduler that plans parallel GNN training."""

from .errors import (
    DatasetError,
    GnnCompileError,
    GraphError,
    KernelError,
    PlanningError,
    RuntimeFailure,
    TraceError,
)
from .graph import Graph, GraphStats

__version__ = "0.1.0"

__all__ = [
    "DatasetError",
    "GnnCompileError",
    "Graph",
    "GraphError",
    "GraphStats",
    "KernelError",
    "PlanningError",
    "RuntimeFailure",
    "TraceError",
]
