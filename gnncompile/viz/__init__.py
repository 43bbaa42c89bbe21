"""Pictures: timelines of plans (measured and simulated) and predicted memory per rank.

``*_figure`` functions return the matplotlib figure (the caller closes it); ``draw_*`` write it to
a file and return the path written (:func:`image_path`: ``.png`` added when the path has no
suffix; an unsupported suffix is refused before anything is drawn).
"""

from .timeline import (KIND_COLORS, draw_memory, draw_timeline, draw_timelines, image_formats, image_path,
                       instruction_kind, memory_figure, timelines_figure)

__all__ = ["KIND_COLORS", "draw_memory", "draw_timeline", "draw_timelines", "image_formats", "image_path",
           "instruction_kind", "memory_figure", "timelines_figure"]
