"""Output paths: why a file cannot be written, checked before the work that would write it.

One check for every writer (the CLI's output flags, ``Plan.save``, pictures of plans and runs), so
that a missing or unwritable directory is refused the same way everywhere, before a run or a
drawing is wasted on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["output_problem"]


def output_problem(path: Union[str, os.PathLike], *, parents_made: bool = False) -> Optional[str]:
    """Why the file ``path`` cannot be written (a directory; in a directory that is missing or not
    writable), or ``None``. ``parents_made``: the writer creates missing directories itself (only
    a directory at ``path`` is a problem). Cheap: nothing is created. (Where the write fails anyway,
    ``/proc/version`` as root, the writer's ``OSError`` says why.)"""
    if not os.fspath(path):
        return "an empty path (give a file name)"
    p = Path(path).expanduser() if parents_made else Path(path)
    if p.is_dir():
        return f"{path} is a directory (give a file name)"
    if parents_made:
        return None
    parent = p.parent
    if not parent.is_dir():
        return f"{parent} is not a directory" if parent.exists() else f"directory {parent} does not exist"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{path} is not writable"
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None
