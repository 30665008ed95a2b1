"""The model cache on disk: a completion marker written atomically, a lock file, free space.

A model directory is complete when its marker exists and every file it lists still has the
size and SHA-256 recorded there; the marker is written (temp file, fsync, rename) only after
every file was downloaded and verified, so a reader never takes a half-written (or since
altered) directory for a model. Files are written only at checked names (source.check_file_name)
and never through a symlink. Fetches of the same directory (a restarted init
container, a second replica on a shared ReadWriteMany cache) serialise on a lock file
beside it; the second one finds the marker and downloads nothing.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kaon_runtime.fetch.source import INVALID, NO_SPACE, FetchError, check_file_name, git_blob_sha1_header

MARKER_PREFIX = ".kaon-complete"


@dataclass(frozen=True, slots=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None = None  # hub LFS files
    git_sha1: str | None = None  # hub non-LFS files (the git blob id)
    md5: str | None = None  # S3 objects uploaded in one part (their ETag)
    version: str | None = None
    """What identifies this content at the store (an S3 ETag): a resumed download continues only
    bytes of the same version, and asks the store for that version alone."""

    @property
    def checkable(self) -> bool:
        """Whether the store gave a checksum, so that a file already on disk can be proved whole."""
        return bool(self.sha256 or self.git_sha1 or self.md5)


def marker_path(directory: Path, gguf_file: str | None) -> Path:
    return directory / (MARKER_PREFIX + (f"-{gguf_file.replace('/', '--')}" if gguf_file else "") + ".json")


def read_marker(directory: Path, gguf_file: str | None, log: Callable[[str], None] = lambda _: None) -> dict | None:
    """The marker, if the directory holds a complete model whose files still have the sizes and
    SHA-256 digests recorded in it (a marker without digests, from an older kaon, is not trusted)."""
    try:
        marker = json.loads(marker_path(directory, gguf_file).read_text())
        for f in marker["files"]:
            path = destination(directory, check_file_name(f["name"], str(directory)))
            if path.stat().st_size != f["size"] or not isinstance(f.get("sha256"), str):
                return None
            if sha256_of(path) != f["sha256"]:
                log(f"{f['name']}: its SHA-256 is not the one recorded when it was fetched; fetching again")
                return None
        return marker
    except (OSError, ValueError, KeyError, TypeError, FetchError):
        return None


def recorded_digests(directory: Path, gguf_file: str | None) -> dict[str, str]:
    """File name -> SHA-256 as the marker recorded them, whatever the files hold now: a file that
    still matches its record is whole, even where the store gives no checksum to prove it."""
    try:
        marker = json.loads(marker_path(directory, gguf_file).read_text())
        return {f["name"]: f["sha256"] for f in marker["files"] if isinstance(f.get("sha256"), str)}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def destination(directory: Path, name: str) -> Path:
    """Where the file `name` (checked: source.check_file_name) lives, refusing a symlink on the way:
    a link planted in a shared cache must not send a download, or a read, outside the directory."""
    path = directory
    for part in name.split("/"):
        path = path / part
        _no_symlink(path)
    return path


def _no_symlink(path: Path) -> None:
    if path.is_symlink():
        raise FetchError(INVALID, f"{path} is a symlink; kaon writes and reads model files only inside the "
                                  "model directory, never through a link")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(directory: Path, gguf_file: str | None, marker: dict) -> None:
    target = marker_path(directory, gguf_file)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)  # atomic: readers see no marker or the whole one
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def locked(directory: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold `<directory>.lock` (flock; shared caches on NFS support it) while fetching."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another fetch of this model is running (lock {lock.name}); waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_space(directory: Path, files: list[RemoteFile]) -> None:
    """Refuse before downloading when the files cannot fit (what is already there counts)."""
    needed = sum(max(0, f.size - _size(directory / f.name)) for f in files)
    free = shutil.disk_usage(_existing(directory)).free
    if needed > free:
        raise FetchError(NO_SPACE, f"the model needs {_gb(needed)} more but {_existing(directory)} has "
                                   f"{_gb(free)} free; raise model.cache.sizeLimit or use a larger volume")


def no_space(exc: OSError, directory: Path) -> FetchError | None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FetchError(NO_SPACE, f"the disk under {directory} filled up while downloading "
                                    f"({shutil.disk_usage(_existing(directory)).free // 2**20} MiB free)")
    return None


def verify(path: Path, remote: RemoteFile) -> str:
    """Size always; then the strongest checksum the store gave. Returns the file's SHA-256 (for the
    marker), computed in the same read."""
    size = _size(path)
    if size != remote.size:
        raise FetchError(INVALID, f"{remote.name}: downloaded {size} bytes, the store says {remote.size}")
    if remote.sha256:
        digest, expected = hashlib.sha256(), remote.sha256
    elif remote.git_sha1:
        digest, expected = hashlib.sha1(git_blob_sha1_header(size)), remote.git_sha1
    elif remote.md5:
        digest, expected = hashlib.md5(), remote.md5
    else:
        return sha256_of(path)
    ours = digest if remote.sha256 else hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            if ours is not digest:
                ours.update(chunk)
    if digest.hexdigest() != expected:
        path.unlink(missing_ok=True)  # a corrupt file must not be resumed
        raise FetchError(INVALID, f"{remote.name}: checksum mismatch (got {digest.hexdigest()}, "
                                  f"expected {expected}); deleted it, a retry downloads it again")
    return ours.hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class Progress:
    """Log lines for a long download: at most one every `every` seconds."""

    def __init__(self, name: str, total: int, log: Callable[[str], None], every: float = 5.0):
        self.name, self.total, self.log, self.every = name, total, log, every
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            self.log(f"{self.name}: {_gb(done)} of {_gb(self.total)} ({rate / 1e6:.1f} MB/s)")


def part_path(dest: Path, version: str | None) -> Path:
    """Where a download of `dest` in progress is kept: the bytes of one version of the object only,
    so when it changed at the store since an interrupted attempt, that attempt's part has another
    name and is not resumed."""
    tag = f".{hashlib.sha256(version.encode()).hexdigest()[:16]}" if version else ""
    return dest.with_name(dest.name + tag + ".part")


class PartFile:
    """A download in progress, `name.part` beside its destination. Bytes already there are kept
    (an interrupted download resumes after them) unless there are more than the file has."""

    def __init__(self, dest: Path, size: int, name: str, log: Callable[[str], None] | None, version: str | None = None):
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.dest, self.path = dest, part_path(dest, version)
        _no_symlink(self.path)
        self.done = self.path.stat().st_size if self.path.exists() else 0
        if self.done > size:
            self.path.unlink()
            self.done = 0
        if self.done and log:
            log(f"{name}: resuming at {self.done} of {size} bytes")
        self.size, self.progress = size, Progress(name, size, log or (lambda _: None))

    def write(self, chunks: Iterator[bytes], *, append: bool = True) -> None:
        """Append the chunks (or start over), logging progress."""
        if not append:
            self.done = 0
        with open(self.path, "ab" if append else "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                self.done += len(chunk)
                self.progress.update(self.done)

    def finish(self) -> None:
        self.path.touch()  # an empty file has no chunks
        os.replace(self.path, self.dest)


class ErrorTranslation:
    """A context manager that turns a client's exceptions into FetchError: `translate` raises
    one, or returns to let the exception go (disk errors, which the caller names)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and not isinstance(exc, FetchError):
            self.translate(exc)

    def translate(self, exc: BaseException) -> None:
        raise NotImplementedError
