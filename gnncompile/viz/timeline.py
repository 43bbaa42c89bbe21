"""Gantt charts of plan timelines: one row per rank, one bar per executed instruction.

Input is a list of :class:`~gnncompile.runtime.executor.TimelineEvent`-like records per rank (any
object with ``step``, ``instruction``, ``start``, ``end``); the runtime records them for every
training step (``result.ranks[r].timeline``), and the simulator produces the same shape. Bars are
coloured by kind: forward, backward and recomputation (compute), halo exchange / all-to-all /
send-receive / all-reduce (communication), optimizer step; gaps are idle time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

__all__ = ["instruction_kind", "KIND_COLORS", "draw_timeline"]

KIND_COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "recompute": "#8172b3",
    "halo": "#55a868",
    "all-to-all": "#64b5cd",
    "send/recv": "#937860",
    "all-reduce": "#c44e52",
    "optimizer": "#8c8c8c",
    "other": "#cccccc",
}

_COMM_KINDS = {"HALO": "halo", "HALO^T": "halo", "A2A": "all-to-all", "AG": "all-to-all", "RS": "all-to-all",
               "SEND": "send/recv", "RECV": "send/recv", "AR": "all-reduce"}


def instruction_kind(text: str) -> str:
    """The colour class of an instruction's short form (``"F0c1"`` -> ``"forward"``)."""
    head = text.split()[0] if text else ""
    if head[:1] in ("F", "B", "R") and head[1:2].isdigit():
        return {"F": "forward", "B": "backward", "R": "recompute"}[head[0]]
    if head == "OPT":
        return "optimizer"
    return _COMM_KINDS.get(head, "other")


def draw_timeline(ranks: Sequence[Sequence[Any]], path: Union[str, Path], *, step: Optional[int] = None,
                  title: str = "") -> Path:
    """Draw the events of ``step`` (default: the last step recorded) for every rank into ``path``.

    ``ranks[r]`` is rank ``r``'s event list. Times are shown in milliseconds from the step's first
    event on any rank. The file type follows the suffix (``.png``, ``.svg``, ``.pdf``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not ranks or not any(ranks):
        raise ValueError("draw_timeline: no events to draw")
    if step is None:
        step = max(e.step for events in ranks for e in events)
    chosen = [[e for e in events if e.step == step] for events in ranks]
    if not any(chosen):
        raise ValueError(f"draw_timeline: no events recorded for step {step}")
    t0 = min(e.start for events in chosen for e in events)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.45 * len(ranks)))
    used = set()
    for r, events in enumerate(chosen):
        for e in events:
            kind = instruction_kind(e.instruction)
            used.add(kind)
            ax.barh(r, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.7,
                    color=KIND_COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title or f"timeline of step {step}")
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in KIND_COLORS if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=min(len(used), 5), frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
