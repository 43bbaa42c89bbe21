"""gnncompile: a dataflow compiler and scheduler that plans parallel GNN training.

The public API (see DESIGN.md)::

    import gnncompile as gc
    graph = gc.datasets.load("cora")
    model = gc.nn.GCN(graph.num_features, 256, graph.num_classes, num_layers=2)
    history = gc.train(model, graph, epochs=200, lr=0.01)
    plan = gc.plan(model, graph, gpus=4)          # per-rank programs, strategy chosen by the cost models
    plan = gc.plan(model, graph, gc.Cluster.parse("2x4xA5000-ib200"))
    result = plan.run(epochs=200, lr=0.01)        # trains across 4 local processes
    plan.save("plan.json"); plan = gc.load_plan("plan.json", model, graph)
    gc.calibrate("profile.json")                  # measure this host for the cost models
"""

import warnings as _warnings

# torch warns once per process that CSR tensors are "beta"; gnncompile uses them by design
# (sparse input features) and tests them, so the notice is noise for our users.
_warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")

from . import datasets, nn, ops  # noqa: E402
from .errors import (
    ArgumentError,
    DatasetError,
    GnnCompileError,
    GraphError,
    KernelError,
    PassError,
    PlanningError,
    RuntimeFailure,
    TraceError,
    VerificationError,
)
from .frontend.pyg_import import PygConverted, from_pyg
from .frontend.tracer import trace
from .graph import Graph, GraphStats
from .ir import TPGraph, verify_plan
from .api import Plan, load_plan, plan
from .calibration import calibrate
from .cost_models.hardware import Cluster
from .runtime.launcher import RankFailure
from .runtime.trainer import History, train

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "ArgumentError",
    "DatasetError",
    "GnnCompileError",
    "Graph",
    "GraphError",
    "GraphStats",
    "History",
    "PassError",
    "PygConverted",
    "from_pyg",
    "TPGraph",
    "Plan",
    "plan",
    "load_plan",
    "calibrate",
    "verify_plan",
    "VerificationError",
    "trace",
    "KernelError",
    "PlanningError",
    "RuntimeFailure",
    "RankFailure",
    "TraceError",
    "datasets",
    "nn",
    "ops",
    "train",
]
