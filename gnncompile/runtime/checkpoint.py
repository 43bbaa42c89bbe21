"""Checkpoints of training runs: written with ``torch.distributed.checkpoint``, atomically, resumable.

A checkpoint directory ``D`` holds::

    D/epoch-N/            one checkpoint: N epochs done
        .metadata, *.distcp   torch.distributed.checkpoint files (every rank writes its own)
        meta.json         epoch, history, best validation epoch, fingerprint, file sizes, extra
        plan.json         the plan (plan runs)
    D/latest              the name of the newest complete checkpoint (``epoch-N``)
    D/best.pt             the parameters at the best validation accuracy (``torch.load``-able)

Tensor state lives under flat keys: ``params/<name>`` and ``optim/<name>/<field>`` (the optimizer
state of a parameter) are global, written once by the parameter's owner, so a run on another
number of ranks can read them; ``best/<name>`` are the best-validation parameters; per-rank state
is under ``rank<r>/...``: ``rank<r>/rng/cpu`` and ``rank<r>/rng/cuda`` (torch's generators, the
dropout masks' stream) and whatever the :data:`RANK_STATE` providers give (the executor's stale
chunks of relaxed plans, under ``rank<r>/stale/...``).

Atomicity: every rank writes into ``D/.staging-epochN``; after the collective save completed,
rank 0 adds ``meta.json`` (written last) and ``plan.json``, renames the staging directory to
``D/epoch-N`` and replaces ``D/latest`` (temporary file + ``os.replace``). A crash before the
rename leaves the previous checkpoint and ``latest`` untouched; a leftover staging directory is
removed by the next run. The two newest checkpoints are kept. A write that fails (a full disk) is a
:class:`~gnncompile.RuntimeFailure` and leaves the previous checkpoint too; a checkpoint that lost
``meta.json`` or ``.metadata`` afterwards is skipped with a warning (:func:`latest`).

Under ``torchrun`` on several machines ``D`` must be on a filesystem every machine shares (as
``torch.distributed.checkpoint``'s ``FileSystemWriter`` assumes): each rank writes its own files
into the staging directory and rank 0 alone creates ``D``, renames and reads them back. Every
process decides what to resume from the files it sees (:func:`prepare` with ``create=False``, read
only); a rank that sees another decision, or rank 0 missing a rank's files, is an error saying so.

Strategies with state of their own (historical embeddings, sampler positions) add it through
:func:`register_rank_state`: a name, a function returning the rank's tensors and one taking them
back. ``tests/test_checkpoint.py::check_resume_matches_straight`` is the test to reuse for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import ArgumentError, RuntimeFailure
from ..paths import write_text
from ..graph.core import tensor_hash  # noqa: F401 (fingerprints' hashes; re-exported)

__all__ = ["CheckpointOptions", "Checkpoint", "RANK_STATE", "register_rank_state", "claimed", "prepare", "make_directory", "save",
           "set_optimizer_state", "load_tensors", "write_best", "resume_hint", "tensor_hash", "compare_fingerprints",
           "latest", "SHARED_FS", "module_signature", "RECORDED_LATER"]

_EPOCH_DIR = re.compile(r"^epoch-(\d+)$")
FORMAT_VERSION = 1
#: the end of every error about a checkpoint one process wrote and another cannot see
SHARED_FS = ("under torchrun on several machines, checkpoint_dir must be on a filesystem every machine shares "
             "(NFS, Lustre, ...): each rank writes its own files there and rank 0 renames them into place")


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often a run writes checkpoints: ``directory``; ``every``: every this many
    epochs (and after the last one); ``resume``: continue from the newest checkpoint there;
    ``keep``: how many of the newest checkpoints stay on disk."""

    directory: str
    every: int = 10
    resume: bool = False
    keep: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ArgumentError(f"checkpoint_every must be an int >= 1, got {self.every!r}")
        if self.keep < 1:
            raise ArgumentError(f"keep must be >= 1, got {self.keep!r}")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk: its directory and its ``meta.json``."""

    path: Path
    meta: dict[str, Any]

    @property
    def epoch(self) -> int:
        return int(self.meta["epoch"])


StateGetter = Callable[[Any], dict[str, torch.Tensor]]
StateSetter = Callable[[Any, dict[str, torch.Tensor]], None]

#: per-rank state providers: name -> (get(rank) -> {key: tensor}, set(rank, {key: tensor}))
RANK_STATE: dict[str, tuple[StateGetter, StateSetter]] = {}


def register_rank_state(name: str, get: StateGetter, set_: StateSetter) -> None:
    """Add per-rank state to every checkpoint: ``get(rank)`` returns tensors by key (no ``/``
    needed, keys are stored under ``rank<r>/<name>/``), ``set_(rank, tensors)`` restores them on
    resume (called with the tensors saved by the same rank; only when the rank count is unchanged:
    a run on another number of ranks is refused while any such state is non-empty). ``rank`` is the
    executor's per-rank object (``_Rank``: ``prog``, ``ctx``, ``stale``, ...)."""
    if "/" in name:
        raise ArgumentError(f"rank state name {name!r} must not contain '/'")
    RANK_STATE[name] = (get, set_)


def module_signature(model: torch.nn.Module) -> list[list[str]]:
    """The hyperparameters of ``model`` that are not parameter shapes, for fingerprints: a row
    ``[qualified name, class name, extra_repr(), attributes]`` per module (the model itself first,
    named ``""``), where ``extra_repr()`` carries what torch's modules print (``nn.Dropout``'s
    ``p``, ``nn.Linear``'s sizes) and ``attributes`` the module's public attributes of type bool,
    int, float, str or None as ``name=repr, ...`` (a model's ``dropout=0.5``, ``num_layers=2``)
    that ``extra_repr()`` does not already show. Plain data: equal after a JSON round trip."""
    rows = []
    for name, module in model.named_modules():
        shown = set(module.extra_repr().split(", "))
        attrs = [f"{k}={v!r}" for k, v in sorted(vars(module).items()) if not k.startswith("_") and k != "training"
                 and (v is None or isinstance(v, (bool, int, float, str)))]
        rows.append([name, type(module).__name__, module.extra_repr(), ", ".join(a for a in attrs if a not in shown)])
    return rows


#: fingerprint fields added after checkpoints were first written: compared only when the
#: checkpoint records them (an older checkpoint still resumes, unchecked in these)
RECORDED_LATER = ("model.modules", "model.traced", "training.seed", "training.lr", "training.weight_decay",
                  "training.eval_every", "graph.data")


def compare_fingerprints(saved: dict[str, Any], current: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> list[str]:
    """``section.field: checkpoint X, this run Y`` for each field that differs (sections: model,
    graph, plan, training; fields in ``ignore``, as ``section.field``, are skipped, and so are
    those of :data:`RECORDED_LATER` the checkpoint does not record)."""
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if f"{section}.{key}" in ignore or (f"{section}.{key}" in RECORDED_LATER and key not in a):
                continue
            out += _differences(f"{section}.{key}", a.get(key), b.get(key))
    return out


def _differences(where: str, a: Any, b: Any) -> list[str]:
    """``where: checkpoint a, this run b`` where they differ; two dicts by their differing keys
    (``plan.options.stages: ...``: a long dict cut short would hide the key that differs); two
    lists of named rows (``[name, ...]``, e.g. ``model.params``) by the rows only one of them has
    and the rows that changed (:func:`_row_differences`); other lists by their first differing
    index and their lengths."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b), key=str) for d in _differences(f"{where}.{key}", a.get(key),
                                                                                     b.get(key))]
    if isinstance(a, list) and isinstance(b, list):
        if _named_rows(a) and _named_rows(b):
            return _row_differences(where, a, b)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out = [] if first is None else _differences(f"{where}[{first}]", a[first], b[first])
        if len(a) != len(b):
            out.append(f"{where}: checkpoint {len(a)} entries, this run {len(b)}")
        return out
    return [f"{where}: checkpoint {_short(a)}, this run {_short(b)}"]


#: how many rows :func:`_row_differences` names of each kind before it counts the rest
_ROWS_NAMED = 4


def _named_rows(rows: list) -> bool:
    """Whether ``rows`` is a list of rows ``[name, ...]`` with distinct string names."""
    names = [r[0] for r in rows if isinstance(r, (list, tuple)) and r and isinstance(r[0], str)]
    return len(names) == len(rows) and len(set(names)) == len(names)


def _row_differences(where: str, a: list, b: list) -> list[str]:
    """Two lists of named rows compared by name: ``where: only in this run: <rows>``, ``where: only
    in the checkpoint: <rows>`` and ``where[name]: checkpoint <row>, this run <row>`` for changed
    rows (the first few of each kind, then a count); the same rows in another order: the first
    position that differs."""
    old, new = {r[0]: r for r in a}, {r[0]: r for r in b}
    added = [r for r in b if r[0] not in old]
    removed = [r for r in a if r[0] not in new]
    changed = [r[0] for r in a if r[0] in new and list(new[r[0]]) != list(r)]
    out = []
    for rows, side in ((added, "this run"), (removed, "the checkpoint")):
        if rows:
            out.append(f"{where}: only in {side}: " + ", ".join(_row(r) for r in rows[:_ROWS_NAMED])
                       + (f" and {len(rows) - _ROWS_NAMED} more" if len(rows) > _ROWS_NAMED else ""))
    for name in changed[:_ROWS_NAMED]:
        out.append(f"{where}[{name or '(root)'}]: checkpoint {_row(old[name], named=False)}, "
                   f"this run {_row(new[name], named=False)}")
    if len(changed) > _ROWS_NAMED:
        out.append(f"{where}: {len(changed) - _ROWS_NAMED} more rows changed")
    if not out:  # the same rows, reordered
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if list(x) != list(y))
        out.append(f"{where}[{first}]: checkpoint {_row(a[first])}, this run {_row(b[first])} (the same rows in "
                   "another order)")
    return out


def _row(row: list, named: bool = True) -> str:
    """A row ``[name, ...]`` as text: its name (``(root)`` when empty) and its other values,
    strings as they are, the rest as JSON (cut short)."""
    values = [v if isinstance(v, str) else _short(v, 80) for v in row[1:] if v != ""]
    return " ".join(([row[0] or "(root)"] if named else []) + values)


def _short(v: Any, limit: int = 160) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def latest(directory: str | os.PathLike, *, warn: bool = True) -> Optional[Path]:
    """The newest complete checkpoint in ``directory``: the highest complete ``epoch-N`` (``latest``
    names it too, unless a run died between renaming it into place and updating ``latest``), else
    ``None``. A newer ``epoch-N`` without ``meta.json`` or ``.metadata`` is skipped, with a
    ``UserWarning`` (when ``warn``) naming it and the missing files: saves are atomic, so it was
    damaged after it was written."""
    d = Path(directory)
    epochs = sorted(((int(m.group(1)), p) for p in d.glob("epoch-*") if (m := _EPOCH_DIR.match(p.name))
                     and p.is_dir()), reverse=True)
    found = next((p for _, p in epochs if _complete(p)), None)
    newest = -1 if found is None else int(_EPOCH_DIR.match(found.name).group(1))
    for epoch, path in epochs:
        missing = [f for f in ("meta.json", ".metadata") if not (path / f).is_file()]
        if warn and epoch > newest and missing:
            warnings.warn(f"checkpoint {path} skipped: {' and '.join(missing)} missing (it was damaged after it was "
                          "written); " + (f"using {found.name}" if found is not None else "no complete checkpoint "
                                          "is left"), UserWarning, stacklevel=2)
    return found


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeFailure(f"checkpoint {path} is damaged: cannot read meta.json ({e}); delete {path} to resume "
                             "from the checkpoint before it") from None
    if meta.get("format") != FORMAT_VERSION:
        raise RuntimeFailure(f"checkpoint {path} has format {meta.get('format')!r}, this gnncompile reads "
                             f"{FORMAT_VERSION}; start a new run in another directory")
    return meta


def _digest(f: Path) -> str:
    """BLAKE2b digest of file ``f`` (hex), read in 8 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_files(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose files are missing, have another size than when they were written,
    or other contents (their digests; checkpoints written before digests were recorded: sizes only)."""
    digests = meta.get("digests", {})
    for name, size in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise RuntimeFailure(f"checkpoint {path} is damaged: file {name} is missing; delete {path} to resume "
                                 "from the checkpoint before it")
        actual = f.stat().st_size
        if actual != size:
            raise RuntimeFailure(f"checkpoint {path} is damaged: {name} has {actual:,} bytes, {size:,} were written "
                                 f"(truncated or overwritten); delete {path} to resume from the checkpoint before it")
        if name in digests and _digest(f) != digests[name]:
            raise RuntimeFailure(f"checkpoint {path} is damaged: the contents of {name} changed since they were "
                                 f"written (its digest differs); delete {path} to resume from the checkpoint before it")


def make_directory(options: CheckpointOptions) -> None:
    """Create ``options.directory`` and remove the staging directories (and the temporary ``latest``)
    a crashed run left there (the one process that writes: the launcher, or rank 0 under torchrun)."""
    d = Path(options.directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeFailure(f"checkpoint_dir {str(d)!r} cannot be created: {e.strerror or e}") from None
    for stale in [*d.glob(".staging-epoch*"), *d.glob(".replaced-epoch*")]:
        shutil.rmtree(stale, ignore_errors=True)
    for stale in d.glob(".latest.tmp*"):  # a 'latest' being written when its run died
        stale.unlink(missing_ok=True)


@contextlib.contextmanager
def claimed(directory: Optional[str | os.PathLike], resume: bool = False) -> Iterator[None]:
    """Hold ``directory`` (a run's ``checkpoint_dir``; ``None``: nothing) for the run: an exclusive
    ``flock`` of the directory, taken before the run decides what the directory holds and kept to
    its end, so that a second run into it at the same time is refused (:class:`RuntimeFailure`)
    instead of mixing its checkpoints with the first's (where the filesystem cannot lock a
    directory, a warning says the run is unguarded). A directory that does not exist is created
    (not for ``resume``: :func:`prepare` refuses that), and removed again if the run fails before
    writing into it. Local runs only: a torchrun job's ranks decide from the shared files."""
    if directory is None:
        yield
        return
    d = Path(directory)  # (as the run writes it: not expanded)
    created = False
    if not d.is_dir():
        if resume:
            yield
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RuntimeFailure(f"checkpoint_dir {str(d)!r} cannot be created: {e.strerror or e}") from None
        created = True
    try:
        fd = os.open(d, os.O_RDONLY)  # the directory itself: no file of its own in it
    except OSError as e:
        raise RuntimeFailure(f"checkpoint_dir {str(d)!r} cannot be opened: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeFailure(f"checkpoint_dir {str(d)!r} is in use by another run writing checkpoints there; "
                                 "wait for it to end, or use another directory") from None
        except OSError as e:  # a filesystem without locks on directories (NFS): run unguarded
            warnings.warn(f"checkpoint_dir {str(d)!r} cannot be locked ({e.strerror or e}): a second run into it at "
                          "the same time would not be refused", UserWarning, stacklevel=3)
        yield
    except BaseException:
        if created and not any(d.iterdir()):  # refused before anything was written: leave nothing behind
            d.rmdir()
        raise
    finally:
        os.close(fd)  # (releases the lock)


def prepare(options: CheckpointOptions, fingerprint: dict[str, Any], *,
            reshard: Callable[[Path, dict[str, Any]], Optional[str]] = lambda path, meta: "the rank count differs",
            create: bool = True, missing_note: str = "") -> Optional[Checkpoint]:
    """Before a run starts: with ``create``, :func:`make_directory`; then, with ``resume``, return the
    checkpoint to continue from (``create=False``: only reads, so every torchrun process can decide
    from the files it sees and one rank creates the directory later).

    Refuses (:class:`~gnncompile.RuntimeFailure`): a fresh run (``resume=False``) into a directory
    that already holds checkpoints (they would be mixed with the new run's); ``resume=True`` with no
    checkpoint there (the message ends with ``missing_note``); a damaged checkpoint (a file missing
    or of another size); a checkpoint of another model, graph, plan or training settings (each
    differing field named: :func:`compare_fingerprints`).
    A different rank count (``plan.ranks``) is accepted when ``reshard(path, meta)`` returns
    ``None``, else refused with its reason.
    """
    d = Path(options.directory)
    if d.exists() and not d.is_dir():
        raise RuntimeFailure(f"checkpoint_dir {str(d)!r} exists and is not a directory")
    if options.resume and not d.is_dir():   # refused before anything is created
        raise RuntimeFailure(f"resume=True but checkpoint_dir {str(d)!r} holds no complete checkpoint (it does not "
                             "exist); run without resume to start from scratch"
                             + (f" ({missing_note})" if missing_note else ""))
    if create:
        make_directory(options)
    found = latest(d)
    if not options.resume:
        if found is not None:
            raise RuntimeFailure(f"checkpoint_dir {str(d)!r} already holds checkpoints (newest: {found.name}); pass "
                                 "resume=True (CLI: --resume) to continue that run, or use an empty directory")
        return None
    if found is None:
        raise RuntimeFailure(f"resume=True but checkpoint_dir {str(d)!r} holds no complete checkpoint; run without "
                             "resume to start from scratch" + (f" ({missing_note})" if missing_note else ""))
    meta = _read_meta(found)
    _check_files(found, meta)
    saved = meta.get("fingerprint", {})
    diffs = compare_fingerprints(saved, fingerprint, ignore=("plan.ranks", "graph.structure_by_rank"))
    if diffs:
        raise RuntimeFailure(f"checkpoint {found} was written by another run; what differs:\n  " + "\n  ".join(diffs)
                             + "\nresume with the same model, graph, plan options and training settings, or use another "
                             "checkpoint_dir")
    if saved.get("plan", {}).get("ranks") != fingerprint.get("plan", {}).get("ranks"):
        why = reshard(found, meta)
        if why is not None:
            raise RuntimeFailure(f"checkpoint {found} was written on {saved['plan'].get('ranks')} ranks, this plan has "
                                 f"{fingerprint['plan'].get('ranks')}: {why}; resume with a plan of "
                                 f"{saved['plan'].get('ranks')} ranks")
    elif compare_fingerprints(saved, fingerprint):  # same ranks: the per-rank structure must match too
        raise RuntimeFailure(f"checkpoint {found} was written for another graph (the ranks' graph structure "
                             "differs: same size, other edges); resume with the same graph")
    return Checkpoint(found, meta)


def save(options: CheckpointOptions, epoch: int, tensors: dict[str, torch.Tensor], *, rank: int,
         meta: Callable[[], dict[str, Any]], plan_json: Optional[str] = None, process_group: Any = None,
         distributed: bool = True) -> Path:
    """Write the checkpoint of ``epoch`` completed epochs (collective: every rank calls it with its
    own ``tensors``; rank 0 also gives ``meta()`` and ``plan_json``). Returns ``D/epoch-N``.

    A write that fails (a full disk, a directory that became unwritable) raises
    :class:`~gnncompile.RuntimeFailure` naming ``D`` and the OS error (its ``__cause__``); the
    staging directory is removed and the previous checkpoint and ``D/latest`` stay as they were."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    d = Path(options.directory)
    staging = d / f".staging-epoch{epoch}"
    final = d / f"epoch-{epoch}"
    state = {k: v.detach().cpu() for k, v in tensors.items()}
    try:
        if rank == 0:  # the other ranks' FileSystemWriter creates it where they do not see it yet
            staging.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # the single-process note of a no_dist save
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), process_group=process_group,
                     no_dist=not distributed)
        # dcp.save returns on every rank after rank 0 wrote .metadata: every rank's files are complete
        if rank != 0:
            return final
        return _publish(options, epoch, staging, final, meta, plan_json)
    except (OSError, CheckpointException) as e:  # (CheckpointException is a BaseException)
        cause = _os_error(e)
        published = rank == 0 and not staging.exists() and (final / "meta.json").is_file()  # renamed into place
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if published:
            raise RuntimeFailure(f"checkpoint of epoch {epoch} is complete in {final} but updating 'latest' failed: "
                                 f"{_describe(cause)}; a resume continues from it (the newest complete "
                                 "checkpoint)") from cause
        previous = latest(d, warn=False) if d.is_dir() else None
        raise RuntimeFailure(f"checkpoint of epoch {epoch} could not be written to checkpoint_dir {str(d)!r}: "
                             f"{_describe(cause)}; "
                             + (f"the previous checkpoint ({previous.name}) is unchanged" if previous is not None
                                else "no earlier checkpoint is there")) from cause


def _os_error(e: BaseException) -> BaseException:
    """The OS error behind ``e``: ``e`` itself, or the first one a rank of a
    ``CheckpointException`` reports (``failures``: rank -> (exception, traceback)), else ``e``."""
    for exc, *_ in getattr(e, "failures", {}).values():
        if isinstance(exc, OSError):
            return exc
    return e


def _describe(e: BaseException) -> str:
    """``e`` in one line: an OS error as Python prints it (``[Errno 28] No space left on device:
    'path'``), anything else as ``Type: first line``."""
    text = str(e).strip().splitlines()
    first = text[0][:300] if text else ""
    if isinstance(e, OSError) and first:
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _publish(options: CheckpointOptions, epoch: int, staging: Path, final: Path, meta: Callable[[], dict[str, Any]],
             plan_json: Optional[str]) -> Path:
    """Rank 0's part of :func:`save` once every rank's files are in ``staging``: check they are all
    there, add ``plan.json`` and ``meta.json`` (last), rename ``staging`` to ``final``, point
    ``latest`` at it and remove the checkpoints beyond ``options.keep``."""
    import torch.distributed.checkpoint as dcp

    d = Path(options.directory)
    written = {info.relative_path for info in dcp.FileSystemReader(str(staging)).read_metadata().storage_data.values()}
    unseen = sorted(name for name in written if not (staging / name).is_file())
    if unseen:
        raise RuntimeFailure(f"checkpoint of epoch {epoch}: rank 0 cannot find {', '.join(unseen)} that other ranks "
                             f"wrote into {staging}; {SHARED_FS}")
    if plan_json is not None:
        (staging / "plan.json").write_text(plan_json)
    info = dict(meta())
    info["format"] = FORMAT_VERSION
    info["epoch"] = epoch
    files = [f for f in sorted(staging.iterdir()) if f.is_file()]
    info["files"] = {f.name: f.stat().st_size for f in files}
    info["digests"] = {f.name: _digest(f) for f in files}   # checked before a resume reads them
    write_text(staging / "meta.json", json.dumps(info, indent=1, default=_json_default))
    replaced = None
    if final.exists():  # a checkpoint of the same epoch (a resumed run that stopped where it began)
        replaced = d / f".replaced-epoch{epoch}"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    write_text(d / "latest", final.name + "\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    done = sorted((int(m.group(1)), p) for p in d.glob("epoch-*") if (m := _EPOCH_DIR.match(p.name)))
    for _, old in done[:-options.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _json_default(v: Any) -> Any:
    if isinstance(v, float):
        return v
    return str(v)


def set_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, torch.Tensor],
                        device: torch.device) -> None:
    """Install a checkpoint's Adam state (``optim/<name>/<field>`` tensors) for ``param``: the moments
    on ``device``; the scalar step there too when the optimizer is fused (its kernel reads it on the
    device), else on the CPU as torch keeps it."""
    fused = bool(optimizer.defaults.get("fused"))
    optimizer.state[param] = {f: v if v.dim() == 0 and not fused else v.to(device) for f, v in state.items()}


def load_tensors(path: Path, wanted: Callable[[str], bool], *, process_group: Any = None,
                 distributed: bool = True) -> dict[str, torch.Tensor]:
    """Read the tensors whose keys ``wanted`` accepts from checkpoint ``path`` (collective when
    ``distributed``: every rank calls it), on the CPU. A file that cannot be read raises
    :class:`~gnncompile.RuntimeFailure` naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not path.is_dir():
        raise RuntimeFailure(f"checkpoint {path} is not there as this process sees the filesystem (removed, or "
                             f"found by another rank on another machine); {SHARED_FS}")
    reader = dcp.FileSystemReader(str(path))
    try:
        md = reader.read_metadata()
        state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                 for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata) and wanted(k)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=process_group,
                     no_dist=not distributed)
    except RuntimeFailure:
        raise
    except (Exception, CheckpointException) as e:  # (CheckpointException is a BaseException) pickle, OSError ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeFailure(f"checkpoint {path} cannot be read ({type(e).__name__}: {first[:300]}); delete it to "
                             "resume from the checkpoint before it") from None
    return state


def write_best(directory: str | os.PathLike, params: dict[str, torch.Tensor], epoch: Optional[int],
               val_acc: float) -> Path:
    """Write the best-validation parameters to ``D/best.pt`` (atomically): ``{"epoch", "val_acc",
    "state_dict"}``; ``torch.load(path)["state_dict"]`` goes into ``model.load_state_dict``. A write
    that fails raises :class:`~gnncompile.RuntimeFailure` naming the file (the previous one stays)."""
    path = Path(directory) / "best.pt"
    tmp = path.with_name(f".best.pt.tmp{os.getpid()}")
    try:
        torch.save({"epoch": epoch, "val_acc": val_acc,
                    "state_dict": {k: v.detach().cpu() for k, v in params.items()}}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise RuntimeFailure(f"the best parameters could not be written to {str(path)!r}: {_describe(e)}") from e
    return path


def resume_hint(directory: str | os.PathLike, call: str) -> str:
    """The one line a failed run's error ends with: how to continue from its last checkpoint."""
    last = latest(directory, warn=False)
    if last is None:
        return (f"no checkpoint was written before the failure: rerun from the start with {call}(..., "
                f"checkpoint_dir={str(directory)!r}) (CLI: --checkpoint-dir {directory}, without --resume)")
    return (f"to resume from the last checkpoint ({last.name}): {call}(..., checkpoint_dir={str(directory)!r}, "
            f"resume=True) (CLI: add --checkpoint-dir {directory} --resume)")
