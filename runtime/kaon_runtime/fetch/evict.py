"""A size bound on a shared model cache (the node cache, issue 53): the least recently used models that no
running engine uses are removed until the cache fits.

Which models are in use is known without a per-node agent, through the file system itself: every process that
uses a model directory (`kaon fetch` while it reads or downloads, `kaon serve` for its whole life) holds a shared
flock on `<directory>.in-use` beside it, and touches that file (its mtime is the "last used" clock). The sweep
removes a model only while it holds that lock exclusively (non-blocking: a model in use is skipped, never waited
for), and the fetch lock too (a fetch of it running is left alone); it deletes the completion marker first, so a
process that reads the directory afterwards fetches it again rather than trusting what is left. A process that
dies, however, releases its flock with it: a crashed engine never pins a model. flock works between containers
on one node (one inode on the node's disk) and on NFS.

`choose` is the pure decision; `sweep` does the I/O.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kaon_runtime.fetch.store import MARKER_PREFIX

IN_USE_SUFFIX = ".in-use"
_held: list[IO] = []  # the in-use locks `kaon serve` keeps for its whole life


def in_use_path(directory: Path) -> Path:
    return directory.with_name(directory.name + IN_USE_SUFFIX)


def use(directory: Path) -> IO | None:
    """Mark `directory` as in use (a shared flock, released when the returned file is closed or the process
    ends) and as used now (its mtime). Blocks while a sweep removes that model, so that the caller then finds
    no marker and fetches it again, rather than a half-removed directory."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        handle = open(in_use_path(directory), "a")  # noqa: SIM115 - held past this function on purpose
    except OSError:
        return None  # a cache this process cannot write to: nothing here sweeps it either
    fcntl.flock(handle, fcntl.LOCK_SH)
    os.utime(handle.fileno())
    return handle


def keep_open(handle: IO | None) -> None:
    """Keep an in-use lock until this process ends (`kaon serve`: the engine maps its weights from the files)."""
    if handle is not None:
        _held.append(handle)


def release(handle: IO | None) -> None:
    if handle is not None:
        handle.close()


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a plain number or a Kubernetes quantity ("100Gi", "500G"): spec.model.cache.sizeLimit."""
    number = text.rstrip("kMGTi")
    unit = text[len(number):]
    try:
        if unit not in _UNITS:
            raise ValueError(unit)
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size (bytes, or a quantity such as 100Gi)") from None
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value


@dataclass(frozen=True, slots=True)
class Model:
    directory: Path
    size: int
    last_used: float
    """The in-use file's mtime (or the marker's, for a model fetched before this existed)."""


def choose(models: list[Model], limit: int, busy: Callable[[Model], bool]) -> list[Model]:
    """The models to remove, least recently used first, so that the rest fit in `limit` bytes; models for
    which `busy` is true (in use, being fetched, just fetched) are never chosen and are asked about only
    while the cache is still over its bound. It may leave the cache over `limit` when what is in use does not
    fit: nothing in use is ever removed."""
    total = sum(m.size for m in models)
    out = []
    for model in sorted(models, key=lambda m: (m.last_used, str(m.directory))):
        if total <= limit:
            break
        if busy(model):
            continue
        out.append(model)
        total -= model.size
    return out


def models(cache: Path) -> list[Model]:
    """The complete model directories under `cache` (those with a completion marker), with their size on disk.
    A directory that holds another model's directory is left out (never removed with the other inside)."""
    found: dict[Path, list[Path]] = {}
    for marker in cache.rglob(MARKER_PREFIX + "*.json"):
        found.setdefault(marker.parent, []).append(marker)
    out = []
    for directory, markers in found.items():
        if any(other != directory and directory in other.parents for other in found):
            continue
        files = [p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()]
        stamp = in_use_path(directory)
        last = stamp.stat().st_mtime if stamp.exists() else max(m.stat().st_mtime for m in markers)
        out.append(Model(directory, sum(p.stat().st_size for p in files), last))
    return out


def _try_lock(path: Path) -> IO | None:
    handle = open(path, "a")  # noqa: SIM115 - closed by the caller, or here when it is taken
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return handle
    except BlockingIOError:
        handle.close()
        return None


def sweep(cache: Path, limit: int, keep: Path | None = None, log: Callable[[str], None] = lambda _: None
          ) -> list[Path]:
    """Remove least recently used models nobody uses until `cache` holds at most `limit` bytes of models;
    `keep` (the model just fetched) stays. The directories removed."""
    if not cache.is_dir():
        return []
    locks: dict[Path, list[IO]] = {}

    def busy(model: Model) -> bool:
        if keep is not None and model.directory == keep:
            return True
        taken: list[IO] = []
        for path in (in_use_path(model.directory), model.directory.with_name(model.directory.name + ".lock")):
            handle = _try_lock(path)
            if handle is None:
                for h in taken:
                    h.close()
                return True
            taken.append(handle)
        locks[model.directory] = taken
        return False

    removed = []
    try:
        for model in choose(models(cache), limit, busy):
            for marker in model.directory.glob(MARKER_PREFIX + "*.json"):
                marker.unlink(missing_ok=True)  # first: a reader from now on fetches again
            shutil.rmtree(model.directory, ignore_errors=True)
            log(f"{model.directory}: removed from the model cache ({model.size / 2**30:.2f} GiB, unused, least "
                f"recently used) to keep it within {limit / 2**30:.2f} GiB")
            removed.append(model.directory)
    finally:
        for taken in locks.values():
            for handle in taken:
                handle.close()
    return removed
