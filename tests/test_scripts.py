"""``plan.run`` from programs as users run them: a script without and with a main guard,
``python -c``, a script piped to ``python -``, an interactive session (``python -i`` reading
stdin: no ``__file__``), each defining its own model class in ``__main__``.

Each case runs a fresh interpreter (the venv's) on a tiny graph over 2 ranks for 2 epochs and
checks: it exits 0, the program's body ran once (the ranks never re-run the user's script), and
the plan trained the model exactly as ``gc.train`` does (a ``data`` plan is exact).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# No blank line inside a block and one after each: the interactive interpreter reads it too.
_PROGRAM = '''\
import torch
import gnncompile as gc
from gnncompile import ops
print("BODY-RAN", flush=True)

@torch.fx.wrap
def clipped(h):
    """A torch.fx.wrap leaf of __main__: the traced code imports it from __main__."""
    return h.clamp(-30.0, 30.0) if h.shape[0] > 0 else h

class TwoHop(torch.nn.Module):
    """The user's model: defined in __main__, which the ranks do not import."""
    def __init__(self, d_in, d_hidden, d_out, lin=torch.nn.Linear, wrap=False):
        super().__init__()
        self.lin1, self.lin2 = lin(d_in, d_hidden), torch.nn.Linear(d_hidden, d_out)
        self.wrap = wrap
    def forward(self, g, x):
        x = torch.relu(ops.propagate(g, self.lin1(x), norm="gcn", add_self_loops=True))
        if self.wrap:
            x = clipped(x)
        return ops.propagate(g, self.lin2(x), norm="gcn", add_self_loops=True)

class HalfLinear(torch.nn.Linear):
    """A torch.nn.Linear subclass: a leaf of the traced graph, so the plan's programs hold it."""
    def forward(self, x):
        return super().forward(x) * 0.5

def main(lin=torch.nn.Linear, wrap=False):
    graph = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=5, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = TwoHop(graph.num_features, 16, graph.num_classes, lin, wrap)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    result = gc.plan(model, graph, gpus=2, strategy="data").run(epochs=2)
    reference = TwoHop(graph.num_features, 16, graph.num_classes, lin, wrap)
    reference.load_state_dict(initial)
    history = gc.train(reference, graph, epochs=2)
    print("ACC", result.history.val_acc[-1], flush=True)
    print("LOSS", *result.history.loss, "REF", *history.loss, flush=True)

'''


def _run(tmp_path: Path, how: str, call: str = "main()") -> subprocess.CompletedProcess:
    """Run ``_PROGRAM`` followed by ``call`` the way ``how`` says, in a fresh interpreter in ``tmp_path``."""
    program = _PROGRAM + call + "\n"
    if how == "guarded":
        program = _PROGRAM + 'if __name__ == "__main__":\n    ' + call + "\n"
    script = tmp_path / "train_it.py"
    script.write_text(program)
    argv, stdin = {
        "script": ([str(script)], None),
        "guarded": ([str(script)], None),
        "dash_c": (["-c", program], None),
        "stdin": (["-"], program),
        "interactive": (["-i"], program),
    }[how]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


def _check(proc: subprocess.CompletedProcess) -> None:
    """Exit 0, the body ran once, the run trained and matched ``gc.train``."""
    report = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert "Traceback" not in proc.stderr, report     # the interactive interpreter goes on after an error
    assert proc.stdout.count("BODY-RAN") == 1, report
    acc = re.search(r"^ACC (\S+)$", proc.stdout, re.MULTILINE)
    assert acc is not None and 0.0 <= float(acc.group(1)) <= 1.0, report
    losses = re.search(r"^LOSS (.*) REF (.*)$", proc.stdout, re.MULTILINE)
    assert losses is not None, report
    planned, reference = ([float(v) for v in part.split()] for part in losses.groups())
    assert len(planned) == len(reference) == 2
    assert planned == pytest.approx(reference, rel=1e-4, abs=1e-5), report


# Each case is a fresh interpreter that imports torch, as does its ranks' forkserver: about 5 s of
# CPU each. They are separate tests, so pytest-xdist spreads them over its workers.
@pytest.mark.parametrize("how", ["script", "guarded", "dash_c", "stdin", "interactive"])
def test_plan_run_from_user_program(tmp_path: Path, how: str) -> None:
    _check(_run(tmp_path, how))


def test_plan_run_with_a_leaf_module_class_from_main(tmp_path: Path) -> None:
    # the traced graph keeps torch.nn.Linear subclasses as modules: the programs hold a __main__ class
    _check(_run(tmp_path, "script", "main(HalfLinear)"))


@pytest.mark.parametrize("how", ["guarded", "stdin"])
def test_plan_run_with_a_wrapped_function_from_main(tmp_path: Path, how: str) -> None:
    # the traced code imports a torch.fx.wrap function from __main__, which a rank's own __main__
    # lacked ("cannot import name 'clipped' from '__main__'")
    _check(_run(tmp_path, how, "main(wrap=True)"))
