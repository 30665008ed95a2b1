"""The API keys `kaon serve` accepts: `--api-key`, and `--api-key-file` (a file, or a directory
of files with one key each: a Kubernetes Secret mounted as a volume).

The file is re-read when it changes, so rotating a key (editing the Secret; the kubelet swaps
the volume's `..data` link) needs no restart. A key file that is missing or empty accepts no
key at all: it fails closed, never open.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("kaon.server")

RECHECK_S = 1.0  # how stale the keys may be; a stat of a few small files per second is nothing


def read_keys(path: Path) -> tuple[bytes, ...]:
    """Every key under `path`: its lines when a file, one key per file when a directory.
    Hidden entries (the kubelet's `..data` and timestamped directories) are skipped; the
    visible names are links into them."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
        values = [p.read_bytes().strip() for p in files]
    else:
        values = [line.strip() for line in path.read_bytes().splitlines()]
    return tuple(v for v in values if v)


def matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether `token` is one of `keys`, in time that depends neither on where it matches, on how
    much of a key it shares, nor on a key's length: the digests are compared (compare_digest
    returns at once on a length mismatch), every key, with no early exit."""
    digest = hashlib.sha256(token).digest()
    found = False
    for key in keys:
        found |= hmac.compare_digest(digest, hashlib.sha256(key).digest())
    return found


def _signature(path: Path) -> tuple:
    """What changes when the keys do: names, sizes and mtimes (links followed)."""
    def stamp(p) -> tuple:
        st = os.stat(p)
        return st.st_mtime_ns, st.st_size, st.st_ino

    try:
        if not path.is_dir():
            return stamp(path)
        return tuple(sorted((e.name, *stamp(e.path)) for e in os.scandir(path) if not e.name.startswith(".")))
    except OSError:
        return ()


class ApiKeys:
    """The accepted keys: a fixed one and/or those of a key file. `enabled` is False when
    neither was given (no auth, as before)."""

    def __init__(self, key: str | None = None, key_file: str | os.PathLike | None = None,
                 clock=time.monotonic):
        self.fixed = (key.encode(),) if key else ()
        self.path = Path(key_file) if key_file is not None else None
        self.enabled = bool(self.fixed) or self.path is not None
        self._clock = clock
        self._checked = float("-inf")
        self._signature: tuple | None = None
        self._from_file: tuple[bytes, ...] = ()
        if self.path is not None:
            self._reload(self.path, clock())

    def keys(self) -> tuple[bytes, ...]:
        if self.path is not None:
            now = self._clock()
            if now - self._checked >= RECHECK_S:
                self._reload(self.path, now)
        return self.fixed + self._from_file

    def accepts(self, token: str) -> bool:
        return matches(token.encode(), self.keys())

    def _reload(self, path: Path, now: float) -> None:
        self._checked = now
        signature = _signature(path)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            self._from_file = read_keys(path)
        except OSError as exc:
            self._from_file = ()
            logger.warning("API key file %s unreadable (%s): every request to /v1 is refused", path, exc)
            return
        if not self._from_file:
            logger.warning("API key file %s holds no key: every request to /v1 is refused", path)
        else:
            logger.info("API keys read from %s: %d", self.path, len(self._from_file))
