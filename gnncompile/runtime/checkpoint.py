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
removed by the next run. The two newest checkpoints are kept.

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

import hashlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import ArgumentError, RuntimeFailure

__all__ = ["CheckpointOptions", "Checkpoint", "RANK_STATE", "register_rank_state", "prepare", "make_directory", "save",
           "set_optimizer_state", "load_tensors", "write_best", "resume_hint", "tensor_hash", "compare_fingerprints",
           "latest", "SHARED_FS"]

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


def tensor_hash(*tensors: Optional[torch.Tensor]) -> str:
    """A short SHA-256 of the tensors' bytes (a graph's ``indptr`` and ``indices``, for fingerprints).

    Integer tensors are hashed as int64, so a compact (int32) and a wide copy of one structure agree.
    """
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.int32:
            t = t.to(torch.int64)
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def compare_fingerprints(saved: dict[str, Any], current: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> list[str]:
    """``section.field: checkpoint X, this run Y`` for each field that differs (sections: model,
    graph, plan; fields in ``ignore``, as ``section.field``, are skipped)."""
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if f"{section}.{key}" in ignore:
                continue
            out += _differences(f"{section}.{key}", a.get(key), b.get(key))
    return out


def _differences(where: str, a: Any, b: Any) -> list[str]:
    """``where: checkpoint a, this run b`` where they differ; two dicts by their differing keys
    (``plan.options.stages: ...``: a long dict cut short would hide the key that differs)."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b), key=str) for d in _differences(f"{where}.{key}", a.get(key),
                                                                                     b.get(key))]
    return [f"{where}: checkpoint {_short(a)}, this run {_short(b)}"]


def _short(v: Any, limit: int = 160) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / ".metadata").is_file()


def latest(directory: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint in ``directory``: the one ``latest`` names, or (when that
    file is missing or names a removed directory) the highest complete ``epoch-N``; ``None``."""
    d = Path(directory)
    pointer = d / "latest"
    if pointer.is_file():
        target = d / pointer.read_text().strip()
        if _EPOCH_DIR.match(target.name) and _complete(target):
            return target
    found = [(int(m.group(1)), p) for p in d.glob("epoch-*") if (m := _EPOCH_DIR.match(p.name)) and _complete(p)]
    return max(found)[1] if found else None


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
    """Create ``options.directory`` and remove the staging directories a crashed run left there
    (the one process that writes: the launcher, or rank 0 under torchrun)."""
    d = Path(options.directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeFailure(f"checkpoint_dir {str(d)!r} cannot be created: {e.strerror or e}") from None
    for stale in [*d.glob(".staging-epoch*"), *d.glob(".replaced-epoch*")]:
        shutil.rmtree(stale, ignore_errors=True)


def prepare(options: CheckpointOptions, fingerprint: dict[str, Any], *,
            reshard: Callable[[Path, dict[str, Any]], Optional[str]] = lambda path, meta: "the rank count differs",
            create: bool = True, missing_note: str = "") -> Optional[Checkpoint]:
    """Before a run starts: with ``create``, :func:`make_directory`; then, with ``resume``, return the
    checkpoint to continue from (``create=False``: only reads, so every torchrun process can decide
    from the files it sees and one rank creates the directory later).

    Refuses (:class:`~gnncompile.RuntimeFailure`): a fresh run (``resume=False``) into a directory
    that already holds checkpoints (they would be mixed with the new run's); ``resume=True`` with no
    checkpoint there (the message ends with ``missing_note``); a damaged checkpoint (a file missing
    or of another size); a checkpoint of another model, graph or plan (each differing field named).
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
                             + "\nresume with the same model, graph and plan options, or use another checkpoint_dir")
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
    own ``tensors``; rank 0 also gives ``meta()`` and ``plan_json``). Returns ``D/epoch-N``."""
    import torch.distributed.checkpoint as dcp

    d = Path(options.directory)
    staging = d / f".staging-epoch{epoch}"
    final = d / f"epoch-{epoch}"
    if rank == 0:  # the other ranks' FileSystemWriter creates it where they do not see it yet
        staging.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in tensors.items()}
    with warnings.catch_warnings():  # the single-process note of a no_dist save
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), process_group=process_group,
                 no_dist=not distributed)
    # dcp.save returns on every rank after rank 0 wrote .metadata: every rank's files are complete
    if rank != 0:
        return final
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
    _write_atomic(staging / "meta.json", json.dumps(info, indent=1, default=_json_default))
    replaced = None
    if final.exists():  # a checkpoint of the same epoch (a resumed run that stopped where it began)
        replaced = d / f".replaced-epoch{epoch}"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    _write_atomic(d / "latest", final.name + "\n")
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    "state_dict"}``; ``torch.load(path)["state_dict"]`` goes into ``model.load_state_dict``."""
    path = Path(directory) / "best.pt"
    tmp = path.with_name(f".best.pt.tmp{os.getpid()}")
    torch.save({"epoch": epoch, "val_acc": val_acc, "state_dict": {k: v.detach().cpu() for k, v in params.items()}},
               tmp)
    os.replace(tmp, path)
    return path


def resume_hint(directory: str | os.PathLike, call: str) -> str:
    """The one line a failed run's error ends with: how to continue from its last checkpoint."""
    last = latest(directory)
    if last is None:
        return (f"no checkpoint was written before the failure: rerun from the start with {call}(..., "
                f"checkpoint_dir={str(directory)!r}) (CLI: --checkpoint-dir {directory}, without --resume)")
    return (f"to resume from the last checkpoint ({last.name}): {call}(..., checkpoint_dir={str(directory)!r}, "
            f"resume=True) (CLI: add --checkpoint-dir {directory} --resume)")
