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

__all__ = ["instruction_kind", "KIND_COLORS", "draw_timeline", "draw_timelines", "draw_memory"]

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


def _draw_on(ax: Any, ranks: Sequence[Sequence[Any]], step: Optional[int], title: str) -> set[str]:
    """Draw one panel (the events of ``step`` per rank) on ``ax``; the kinds used."""
    if not ranks or not any(ranks):
        raise ValueError("draw_timeline: no events to draw")
    if step is None:
        step = max(e.step for events in ranks for e in events)
    chosen = [[e for e in events if e.step == step] for events in ranks]
    if not any(chosen):
        raise ValueError(f"draw_timeline: no events recorded for step {step}")
    t0 = min(e.start for events in chosen for e in events)
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
    return used


def draw_timeline(ranks: Sequence[Sequence[Any]], path: Union[str, Path], *, step: Optional[int] = None,
                  title: str = "") -> Path:
    """Draw the events of ``step`` (default: the last step recorded) for every rank into ``path``.

    ``ranks[r]`` is rank ``r``'s event list. Times are shown in milliseconds from the step's first
    event on any rank. The file type follows the suffix (``.png``, ``.svg``, ``.pdf``).
    """
    return draw_timelines([(title, ranks, step)], path)


def draw_timelines(panels: Sequence[tuple[str, Sequence[Sequence[Any]], Optional[int]]],
                   path: Union[str, Path]) -> Path:
    """Several timelines stacked in one figure (e.g. simulated above measured), same units.

    ``panels`` holds ``(title, ranks, step)`` triples as :func:`draw_timeline` takes them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("draw_timelines: no panels")
    heights = [1.0 + 0.45 * max(len(ranks), 1) for _, ranks, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    used: set[str] = set()
    for ax, (title, ranks, step) in zip(axes[:, 0], panels):
        used |= _draw_on(ax, ranks, step, title)
    axes[-1, 0].legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in KIND_COLORS if k in used],
                       loc="upper center", bbox_to_anchor=(0.5, -0.3 if len(panels) == 1 else -0.45),
                       ncol=min(len(used), 5), frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def draw_memory(curves: Sequence[Sequence[tuple[float, float]]], path: Union[str, Path], *,
                capacity: Optional[float] = None, title: str = "") -> Path:
    """Memory over one step per rank (``curves[r]``: ``(seconds, bytes)`` points), in GiB/ms.

    ``capacity`` draws the device's memory as a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curves or not any(curves):
        raise ValueError("draw_memory: no memory curve to draw")
    fig, ax = plt.subplots(figsize=(9, 4))
    for r, pts in enumerate(curves):
        if pts:
            ax.step([t * 1e3 for t, _ in pts], [b / 2**30 for _, b in pts], where="post",
                    label=f"rank {r}" if len(curves) <= 16 else None, linewidth=1)
    if capacity is not None:
        ax.axhline(capacity / 2**30, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel("memory (GiB)")
    ax.set_title(title or "memory per rank over one step")
    if len(curves) <= 16 or capacity is not None:
        ax.legend(loc="best", fontsize=8, ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
