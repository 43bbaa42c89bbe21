"""The project's exception types.

Every error gnncompile raises on purpose derives from :class:`GnnCompileError`, so a caller can
catch the project's errors without catching unrelated bugs. Each subclass names one stage of the
pipeline; messages name the bad thing (field, index, node, rank) and, where there is one, the fix.
"""

from __future__ import annotations


class GnnCompileError(Exception):
    """Base class of every error raised by gnncompile."""


class ArgumentError(GnnCompileError, ValueError):
    """An argument is outside its domain (a number of epochs, a learning rate, fanouts, a model or
    layer option): the message names the argument and what is valid."""


class GraphError(GnnCompileError, ValueError):
    """A graph (or graph statistics) is malformed: bad ids, shapes, dtypes, non-finite values."""


class DatasetError(GnnCompileError, LookupError):
    """A dataset name or path cannot be resolved or its files cannot be read."""


class KernelError(GnnCompileError, RuntimeError):
    """A sparse kernel backend is unknown, unavailable, or was given incompatible inputs."""


class TraceError(GnnCompileError):
    """A model cannot be traced into a T/P operator graph."""


class VerificationError(GnnCompileError):
    """An operator graph or plan violates an invariant (raised by the verifiers)."""


class PassError(GnnCompileError):
    """A compiler pass failed or broke the IR; the message names the pass."""


class PlanningError(GnnCompileError):
    """No valid plan exists for the request (e.g. nothing fits in memory)."""


class RuntimeFailure(GnnCompileError, RuntimeError):
    """Executing a plan failed (a rank died, a collective timed out, ...)."""
