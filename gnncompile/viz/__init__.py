"""Pictures: timelines of plans (measured and simulated)."""

from .timeline import KIND_COLORS, draw_timeline, instruction_kind

__all__ = ["KIND_COLORS", "draw_timeline", "instruction_kind"]
