"""Graphs: the CSR container, statistics, loaders (and, later, partitioners and reordering)."""

from .core import Graph, GraphStats

__all__ = ["Graph", "GraphStats"]
