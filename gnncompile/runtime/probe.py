"""Debug probes: a context the training loops enter around each phase of an epoch, for audits.

:func:`gnncompile.train` and a plan's ranks (:func:`gnncompile.runtime.executor.execute_rank`)
enter ``probe(phase, epoch)`` around the two phases of every epoch: ``"step"``, the training
(what ``epoch_time`` measures: forward, backward and optimizer step, for every mini-batch of a
sampled epoch; not the wait for the device that ends the measurement), and ``"metrics"``, the
rest of the epoch (reading the loss, evaluation, reducing the metrics across ranks, the history,
the best parameters, checkpoints). With no probe installed (always, outside audits) the context
does nothing. A probe is installed per process (:func:`probing`): a launched rank installs its
own (:func:`gnncompile.testing.plan_host_syncs` does, to count host synchronizations there).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

__all__ = ["PHASES", "Probe", "probe", "probing"]

#: the phases of an epoch a probe sees, in order
PHASES = ("step", "metrics")

#: a probe: ``(phase, epoch) -> context manager`` entered around that phase of that epoch
Probe = Callable[[str, int], ContextManager[object]]

_installed: Optional[Probe] = None


def probe(phase: str, epoch: int) -> ContextManager[object]:
    """The installed probe's context for ``phase`` (one of :data:`PHASES`) of ``epoch`` (0-based;
    a resumed run continues the count); a context that does nothing when no probe is installed."""
    if _installed is None:
        return contextlib.nullcontext()
    return _installed(phase, epoch)


@contextlib.contextmanager
def probing(p: Probe) -> Iterator[None]:
    """Install ``p`` in this process for the block (the previous probe, usually none, afterwards)."""
    global _installed
    before, _installed = _installed, p
    try:
        yield
    finally:
        _installed = before
