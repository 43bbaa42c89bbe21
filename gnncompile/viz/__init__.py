"""Pictures: timelines of plans (measured and simulated) and predicted memory per rank.

``*_figure`` functions return the matplotlib figure (the caller closes it); ``draw_*`` write it to
a file.
"""

from .timeline import (KIND_COLORS, draw_memory, draw_timeline, draw_timelines, instruction_kind, memory_figure,
                       timelines_figure)

__all__ = ["KIND_COLORS", "draw_memory", "draw_timeline", "draw_timelines", "instruction_kind", "memory_figure",
           "timelines_figure"]
