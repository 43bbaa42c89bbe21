"""Output paths: why a file cannot be written, checked before the work that would write it, and
one way to write a file that never leaves it half written.

One check for every writer (the CLI's output flags, ``Plan.save``, pictures of plans and runs), so
that a missing or unwritable directory is refused the same way everywhere, before a run or a
drawing is wasted on it; one atomic text writer (:func:`write_text`) for plans, cluster profiles
and checkpoints' small files.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Optional, Union

__all__ = ["output_problem", "write_text"]


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


def write_text(path: Union[str, os.PathLike], text: str) -> Path:
    """Write ``text`` to ``path`` so that no reader or crash ever sees it half written; returns the
    path written.

    A regular file (or a new one) is replaced atomically: a temporary file of this write's own in
    the same directory, flushed to disk, then renamed over it (the old file's permission bits
    kept; a symbolic link is followed, its target replaced and the link kept). A file that is not
    regular (``/dev/stdout``, a pipe) is written as it is: nothing is renamed over a device, and a
    pipe nobody reads is an ``OSError`` (``ENXIO``), not a hang. Errors are the ``OSError`` of the
    step that failed; the old file is then unchanged and no temporary file is left."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file() and not target.is_dir():
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # (the umask applies)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the old one
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(path)
