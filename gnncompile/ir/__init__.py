"""IR: the annotated operator graph (TPGraph), symbolic sizes, plans, their dataflow table and their verifier."""

from .dataflow import Effects, effects
from .plan import DevicePlan, Instruction, Plan, StageSpec
from .symbolic import Lin
from .tpgraph import TPGraph, TPInfo, TraceSummary
from .verify_plan import PlanReport, verify_plan

__all__ = ["Lin", "TPGraph", "TPInfo", "TraceSummary", "Plan", "DevicePlan", "StageSpec", "Instruction",
           "Effects", "effects", "PlanReport", "verify_plan"]
