"""The rule table of plan instructions (gnncompile.ir.rules): complete, looked up by class, layered."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import gnncompile.cost_models.model  # noqa: F401  (registers the cost rules)
import gnncompile.runtime.executor  # noqa: F401  (registers the execution rules)
from gnncompile.errors import PlanningError, RuntimeFailure, VerificationError
from gnncompile.ir import plan as plan_module
from gnncompile.ir.plan import (INSTRUCTIONS, AllGather, AllReduce, AllToAll, HaloExchange, Instruction, Recv,
                                Send)
from gnncompile.ir.rules import (RULE_TABLE, InstructionRule, MissingRuleError, channel, register_rule, rule,
                                 rule_for)

F32 = 4


def _instruction_classes() -> set[type]:
    """Every concrete instruction class ir.plan defines (subclasses of Instruction, walked)."""
    out, todo = set(), [Instruction]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__ == plan_module.__name__ and not sub.__name__.startswith("_"):
                out.add(sub)
    return out


def test_the_plan_module_defines_exactly_the_registered_classes() -> None:
    assert _instruction_classes() == set(INSTRUCTIONS.values())


@pytest.mark.parametrize("cls", sorted(INSTRUCTIONS.values(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_instruction_class_has_every_rule(cls: type) -> None:
    r = rule_for(cls)
    assert r is RULE_TABLE[cls] and r.cls is cls  # its own record, not a base class's
    assert r.kind in ("compute", "p2p", "collective", "memory", "optimizer")
    for name in ("effects", "volume", "signature", "problem"):
        assert callable(getattr(r, name)), name
    assert r.cost_rule() is not None and callable(r.cost_rule().cost)
    if r.communicates:
        assert r.cost_rule().transfer is not None
    assert callable(r.execute_rule())
    assert r.communicates == cls.communicates
    assert (r.kind == "p2p") == bool(r.side)
    assert (r.kind == "compute") == bool(r.runs)


def test_lookup_walks_the_mro() -> None:
    @dataclasses.dataclass(frozen=True)
    class TaggedSend(Send):
        tag: str = ""

    inst = TaggedSend("h", 0, 1, (2, 3))
    assert rule(inst) is RULE_TABLE[Send]
    assert rule(inst).volume(inst, 0) == (2 * 3 * F32, 0.0)


def test_a_class_without_a_rule_is_a_clear_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Custom(Instruction):
        pass

    with pytest.raises(MissingRuleError, match="no rule for instruction type Custom; known: Forward") as e:
        rule(Custom())
    assert isinstance(e.value, VerificationError) and isinstance(e.value, TypeError)


def test_a_class_has_one_record() -> None:
    with pytest.raises(VerificationError, match="Send already has a rule"):
        register_rule(dataclasses.replace(RULE_TABLE[Send]))


def test_missing_upper_layer_rules_name_the_class() -> None:
    bare = dataclasses.replace(RULE_TABLE[Send], cost=None, execute=None)
    with pytest.raises(PlanningError, match="no cost rule for instruction class Send"):
        bare.cost_rule()
    with pytest.raises(RuntimeFailure, match="no execution rule for instruction class Send"):
        bare.execute_rule()
    assert isinstance(bare, InstructionRule)


def test_volume_and_channel() -> None:
    halo = HaloExchange("h", 0, (0, 1), (0, 5), (0, 3), 2)
    assert rule(halo).volume(halo, 0) == (5 * 2 * F32, 3 * 2 * F32)
    back = dataclasses.replace(halo, grad=True)
    assert rule(back).volume(back, 0) == (3 * 2 * F32, 5 * 2 * F32)
    a2a = AllToAll("h", 0, (0, 1), "rows", "cols", ((6, 4), (6, 4)), ((6, 4), (4, 4)))
    assert rule(a2a).volume(a2a, 1) == (6 * 4 * F32, 6 * 4 * F32)  # its own entry is a local copy
    ag = AllGather("h", 0, (0, 1, 2), (30, 4), dtype="bfloat16")
    assert rule(ag).volume(ag, 0) == (2 * 30 * 4 * 2 // 3,) * 2
    ar = AllReduce("grads", (0, 1), numel=100)
    assert rule(ar).volume(ar, 1) == (100 * F32, 100 * F32)
    ar3 = AllReduce("grads", (0, 1, 2), numel=101)   # whole bytes, as the runtime's counter: 2 (n-1) s numel // n
    assert rule(ar3).volume(ar3, 0) == (2 * 2 * 101 * F32 // 3,) * 2
    assert channel(Send("h", 0, 2), 0) == (0, 2) and channel(Recv("h", 0, 0), 2) == (0, 2)


def test_signatures_ignore_per_member_fields_only() -> None:
    a = HaloExchange("h", 0, (0, 1), (0, 5), (0, 3), 2)
    b = HaloExchange("h", 0, (0, 1), (3, 0), (5, 0), 2)
    assert rule(a).signature(a) == rule(b).signature(b)
    assert rule(a).signature(a) != rule(a).signature(dataclasses.replace(a, dtype="float16"))
    s, r = Send("h", 0, 1, (2, 2)), Recv("h", 0, 0, (2, 2))
    assert rule(s).signature(s) == rule(r).signature(r)
    assert rule(s).signature(s) != rule(r).signature(dataclasses.replace(r, shape=(2, 3)))


_LAYERS_ABOVE_IR = ("kernels", "frontend", "nn", "cost_models", "passes", "runtime", "calibration", "api", "cli",
                    "viz", "testing")


@pytest.mark.parametrize("module", ["rules.py", "dataflow.py", "verify_plan.py"])
def test_the_rule_modules_import_nothing_above_the_ir(module: str) -> None:
    """Imports anywhere in the file, inside functions too (as import-linter sees them)."""
    path = Path(plan_module.__file__).parent / module
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
            assert node.module.split(".")[0] not in _LAYERS_ABOVE_IR, (module, node.module)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gnncompile."):
            assert node.module.split(".")[1] not in _LAYERS_ABOVE_IR, (module, node.module)
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                assert not (parts[0] == "gnncompile" and len(parts) > 1 and parts[1] in _LAYERS_ABOVE_IR)
