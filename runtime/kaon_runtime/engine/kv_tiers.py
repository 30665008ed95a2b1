"""The KV tiers below the pool: host memory (`--kv-offload-bytes`), then a disk directory
(`--kv-offload-dir`, `--kv-offload-dir-bytes`).

A cached block whose last owner lets go is copied down to host memory by the mover thread while
it is still intact in the pool (it may stay there for long: the copy is a spare, made early so
that evicting the block costs nothing). When the pool reuses a block the copy was being made
from, the copy is discarded: each pool block carries a generation that its eviction bumps, and a
copy is kept only if the generation it started from is still current when it is done. So nothing
on the engine's step waits for a copy to host or to disk.

The host tier keeps blocks in LRU order within its bytes; the oldest go down to disk, which
keeps its own LRU within its bytes. A prefix lookup that misses the pool asks the tiers
(BlockManager._restore): a hit is copied back into a free pool block (from host memory, or read
from disk). A queued request's prompt blocks found on disk are read into host memory by the
mover thread while it waits (prefetch).

The disk tier outlives the engine: a `manifest.json` names the model and the KV layout it was
written with, and a restarted engine with the same ones indexes the blocks it finds (each file
carries its block's parent hash and tokens, checked on every restore as the pool checks its own).
A directory written for another model, setting or format version is a cache gone stale, not an
error: the engine removes kaon's own files there (the manifest, its block files, leftover
temporaries; nothing else), says what differed, and starts with an empty tier, so a changed
`--quantization` or an upgrade never stops a pod on a persistent volume. Each block file's header
also carries the layout's fingerprint, checked on every read: two engines given one directory by
mistake never serve each other's K/V (the other's blocks read as misses). Chain hashes are stable
across processes (engine/block_manager.py) for this.

Why one module past 300 lines: the tier store, its mover thread and the disk format share KVLayout
and the block header; the disk format (check_manifest to read_block) is the piece to move out next.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kaon_runtime.arith import round_up
from kaon_runtime.engine.kv_events import MEDIUM_DISK, MEDIUM_HOST, KVEvent, block_removed, block_stored
from kaon_runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 3  # 2: each block file's header carries its data's CRC-32; 3: and the layout's fingerprint
# kaon's own files in a disk tier, the only ones it ever removes: block files, their temporaries (a write cut
# short), the manifest's temporary, the write probe. The manifest is named MANIFEST.
_OWN_FILE = re.compile(r"[0-9a-f]{16}\.(kv|tmp)|manifest\.json\.tmp|\.kaon-write-test")
_HEADER = struct.Struct(">I")  # the length of a block file's JSON header
DIRECTIONS = ("pool_to_host", "host_to_disk", "host_to_pool", "disk_to_pool", "disk_to_host")  # disk_to_host: prefetch


@dataclass(slots=True)
class TierStats:
    """The tiers' counters (`kaon_kv_tier_*`); blocks unless named bytes or seconds."""

    host_bytes: int = 0
    host_capacity_bytes: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    # Every direction from the start, at 0: a counter series that appears at its first move loses that move to
    # Prometheus's rate() and increase().
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    discarded: int = 0  # copies whose pool block was reused before they were done

    def count(self, direction: str, blocks: int, seconds: float) -> None:
        self.moved[direction] = self.moved.get(direction, 0) + blocks
        self.seconds[direction] = self.seconds.get(direction, 0.0) + seconds


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's bytes mean: the disk tier is only read back by an engine with the same one."""

    model: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]  # one block across layers: [layers, 2, kv heads, block size, head dim]
    # What else sets the K/V values a block holds: the checkpoint's files and the settings that change its
    # arithmetic (weights_fingerprint). Two engines of the same model id and layout but another --quantization,
    # --dtype or checkpoint at the same path compute other K/V: one's blocks are stale for the other.
    weights: str = ""
    # --prefix-caching-hash-algo and its seed (BlockHasher.tier_id; "" for builtin, absent from the manifest so
    # tiers written before the flag stay valid): blocks are found by hash, another algorithm's never match.
    block_hash: str = ""

    def manifest(self) -> dict:
        found = {"format": FORMAT_VERSION, "model": self.model, "dtype": self.dtype, "block_size": self.block_size,
                 "block_shape": list(self.block_shape), "weights": self.weights}
        return found | {"block_hash": self.block_hash} if self.block_hash else found

    def fingerprint(self) -> str:
        """The manifest's digest, in every block file's header: a block is only ever read as this layout's."""
        return hashlib.sha256(json.dumps(self.manifest(), sort_keys=True).encode()).hexdigest()[:16]


_FINGERPRINT_SPAN = 1 << 20  # bytes read at each end of a weight file


def weights_fingerprint(checkpoint: Path | None, settings: dict) -> str:
    """A digest of what makes a model's K/V: `settings` (quantization, dtype) and the checkpoint's files, each by
    name, size and its first and last MiB (a fine-tune of the same shapes differs there; reading whole files
    would cost a start a pass over the weights). Not the files' times: a fetched copy of the same model matches."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    files: list[Path] = []
    if checkpoint is not None and checkpoint.is_file():
        files = [checkpoint]
    elif checkpoint is not None and checkpoint.is_dir():
        files = sorted(p for p in checkpoint.iterdir() if p.is_file() and (
            p.suffix in (".safetensors", ".bin", ".gguf", ".pt") or p.name == "config.json"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_FINGERPRINT_SPAN))
            if size > 2 * _FINGERPRINT_SPAN:
                f.seek(size - _FINGERPRINT_SPAN)
                digest.update(f.read(_FINGERPRINT_SPAN))
    return digest.hexdigest()[:32]


def own_files(directory: Path) -> list[Path]:
    """kaon's files in a disk tier's directory (never another program's: only these are ever removed)."""
    return [p for p in directory.iterdir() if _OWN_FILE.fullmatch(p.name) and p.is_file()]


def manifest_differs(found: dict, layout: KVLayout) -> str:
    """What an existing manifest says that this engine's layout does not ("" when it is this layout's)."""
    wanted = layout.manifest()
    # Both ways: a key only one side has (block_hash, left out for builtin) differs too.
    differ = sorted(k for k in wanted.keys() | found.keys() if found.get(k) != wanted.get(k))
    what = "; ".join(f"{k}: {found.get(k)!r}, here {wanted.get(k)!r}" for k in differ)
    if "weights" in differ:
        what += " (weights: the checkpoint's files, --quantization or --dtype)"
    return what


def _write_manifest(directory: Path, layout: KVLayout) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(layout.manifest(), indent=1))
    os.replace(tmp, directory / MANIFEST)  # atomic: a crash never leaves half a manifest


def _clear_stale(directory: Path, why: str, layout: KVLayout) -> None:
    """Remove kaon's own files (block files and temporaries first, the manifest last, rewritten: a crash midway
    leaves the old manifest, and the next start clears again) and say so."""
    removed, freed = 0, 0
    for path in own_files(directory):
        with contextlib.suppress(FileNotFoundError):
            freed += path.stat().st_size
            path.unlink()
            removed += 1
    _write_manifest(directory, layout)
    log.warning("KV tiers: --kv-offload-dir %s held the KV cache of %s; removed kaon's %d files there (%d bytes; "
                "any other file is left) and started with an empty disk tier", directory, why, removed, freed)


def check_manifest(directory: Path, layout: KVLayout) -> None:
    """Write the layout's manifest into a new directory, or check an existing one against it: another model's,
    setting's or format's tier is cleared (kaon's files only) and started afresh. Raises ModelLoadError when
    the directory cannot be written, or its manifest is not kaon's (another program's file of that name)."""
    path = directory / MANIFEST
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".kaon-write-test").write_bytes(b"")  # a tier that could not write would fail every move
        (directory / ".kaon-write-test").unlink()         # down, one log line each: refuse it at start
        if not path.exists():
            if any(p.suffix == ".kv" for p in own_files(directory)):
                _clear_stale(directory, f"an engine whose {MANIFEST} is gone", layout)
            else:
                _write_manifest(directory, layout)
            return
    except OSError as e:
        raise ModelLoadError(f"--kv-offload-dir {directory}: cannot write there ({e})") from None
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        # kaon writes its manifest atomically: an unreadable one is not kaon's, and neither is the directory.
        raise ModelLoadError(f"--kv-offload-dir {directory}: unreadable {MANIFEST} ({e}); not a kaon disk tier: "
                             "give this engine its own directory") from None
    if not isinstance(found, dict) or "format" not in found:
        raise ModelLoadError(f"--kv-offload-dir {directory}: its {MANIFEST} is not a kaon manifest; give this engine "
                             "its own directory")
    what = manifest_differs(found, layout)
    if what:
        try:
            _clear_stale(directory, f"another model, setting or format: {what}", layout)
        except OSError as e:
            raise ModelLoadError(f"--kv-offload-dir {directory} holds a stale KV cache ({what}) that cannot be "
                                 f"removed ({e})") from None


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_block(kv_cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """A contiguous host copy of one pool block. On CPU through numpy, one thread: torch's copy of a
    strided view would start an OpenMP team of its own beside the step's (twice the threads on the cores)."""
    view = kv_cache[:, :, :, block_id]
    if kv_cache.device.type != "cpu":
        return view.to("cpu", copy=True).contiguous()
    raw = view.view(_SAME_SIZE_INTS[kv_cache.element_size()]).numpy()  # bfloat16 has no numpy type: its bits do
    return torch.from_numpy(np.ascontiguousarray(raw)).view(kv_cache.dtype)


def _file_name(block_hash: int) -> str:
    return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"


def on_disk(stat: os.stat_result) -> int:
    """The bytes a file takes on its filesystem (what du and the kubelet count against an emptyDir's sizeLimit):
    its header and data, in whole allocation units."""
    return max(stat.st_blocks * 512, round_up(stat.st_size, stat.st_blksize or 1))


def write_block(path: Path, parent: int | None, tokens: tuple[int, ...], data: torch.Tensor, layout: str,
                block_hash: int | None = None) -> int:
    """One block file: header length, JSON header (parent, tokens, CRC, the layout's fingerprint), the raw
    bytes. Atomic (rename). Returns the bytes it takes on disk: the tier's size counts those, not the K/V alone
    (with small blocks a file's header and allocation unit add several times the K/V)."""
    raw = data.contiguous().view(torch.uint8).numpy().tobytes()
    # The CRC: a file damaged in place (same length: a bad sector, a stray write) must read as a miss, never
    # as K/V (a short file already fails its size check). The layout: another engine's file, of another layout,
    # under the same name (one directory given to two engines) must read as a miss too.
    fields = {"parent": parent, "tokens": list(tokens), "crc32": zlib.crc32(raw), "layout": layout}
    if block_hash is not None and not -(1 << 63) <= block_hash < 1 << 63:
        # A hash the file name's 64 bits cannot hold (sha256_cbor's 256): kept whole, for the next start's index.
        fields["hash"] = block_hash
    header = json.dumps(fields).encode()
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(len(header)) + header + raw)
        os.replace(tmp, path)
        return on_disk(path.stat())
    except BaseException:  # a full disk: no partial file left to fill it further
        tmp.unlink(missing_ok=True)
        raise


class OtherLayout(ValueError):
    """A block file written by an engine of another layout: a miss."""


def _parse_header(start: bytes, read: Callable[[int], bytes], layout: str) -> tuple[dict, int]:
    """A block file's header (from its first bytes, `start`, and `read` for the JSON) and its length with the
    length field. Raises ValueError for a file cut short or not a block file (it is read on the engine's step: no
    other exception may leave it), OtherLayout for another layout's."""
    if len(start) < _HEADER.size:
        raise ValueError("cut short")
    (n,) = _HEADER.unpack_from(start)
    header = json.loads(read(n))
    if not isinstance(header, dict) or not {"parent", "tokens"} <= header.keys():
        raise ValueError("not a block file's header")
    if header.get("layout") != layout:
        raise OtherLayout("written by an engine of another layout")
    return header, _HEADER.size + n


def read_header(path: Path, layout: str) -> tuple[int | None, tuple[int, ...], int]:
    """A block file's parent, tokens and data size, without its data; OtherLayout if not `layout`'s."""
    header, size = _read_header(path, layout)
    return header["parent"], tuple(header["tokens"]), size


def _read_header(path: Path, layout: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        header, offset = _parse_header(f.read(_HEADER.size), f.read, layout)
        return header, os.fstat(f.fileno()).st_size - offset


def file_block_hash(path: Path, header: dict) -> int:
    """A block file's hash: its header's when kept there (wider than 64 bits), else its name's (two's complement)."""
    if isinstance(header.get("hash"), int):
        return header["hash"]
    block_hash = int(path.stem, 16)
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash


def read_block(path: Path, dtype: torch.dtype, shape: tuple[int, ...], layout: str) -> tuple[
        int | None, tuple[int, ...], torch.Tensor]:
    data = path.read_bytes()
    header, offset = _parse_header(data, lambda n: data[_HEADER.size:_HEADER.size + n], layout)
    raw = bytearray(data[offset:])
    if zlib.crc32(raw) != header.get("crc32"):
        raise ValueError("its data does not match its checksum")
    tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    return header["parent"], tuple(header["tokens"]), tensor


@dataclass(slots=True)
class _HostBlock:
    parent: int | None
    tokens: tuple[int, ...]
    data: torch.Tensor


@dataclass(slots=True)
class _DiskBlock:
    parent: int | None
    tokens: tuple[int, ...]
    size: int


def parents_first(blocks: dict[int, _DiskBlock]) -> list[int]:
    """The blocks' hashes, each after its parent when the parent is among them: subscribers (kaon's kv-aware
    router, Dynamo's radix tree) follow a chain from a parent they know. The files' own order (oldest first) is
    the other way: a prompt's tail block goes down first."""
    children: dict[int | None, list[int]] = {}
    for h, block in blocks.items():
        children.setdefault(block.parent, []).append(h)
    order: list[int] = []
    seen: set[int] = set()
    stack = [h for h, block in reversed(blocks.items()) if block.parent not in blocks]
    while stack:
        h = stack.pop()
        if h not in seen:
            seen.add(h)
            order.append(h)
            stack.extend(reversed(children.get(h, [])))
    return order + [h for h in blocks if h not in seen]  # (a cycle of hashes: no order serves it)


class KVTiers:
    """The host and disk tiers of one engine's pool, and the mover thread between them.

    `pool` returns the pool ([layers, 2, kv heads, blocks, block size, head dim]; a block is its
    slice on dimension 3), or None while the engine sleeps: read at each move, never kept, so a
    sleeping engine's pool is freed and a woken one's new pool is the one used (engine/sleep.py).
    `emit` receives the tiers' KV events (none when events are off).
    """

    def __init__(self, pool: torch.Tensor | Callable[[], torch.Tensor | None], layout: KVLayout, host_bytes: int,
                 disk_dir: str | None = None, disk_bytes: int = 0, emit: Callable[[KVEvent], None] | None = None):
        self._pool = pool if callable(pool) else (lambda: pool)
        kv_cache = self._pool()
        assert kv_cache is not None, "the tiers start beside a pool"
        self.layout = layout
        self.dtype = kv_cache.dtype
        self.block_bytes = kv_cache[:, :, :, 0].numel() * kv_cache.element_size()
        self.stats = TierStats(host_capacity_bytes=host_bytes, disk_capacity_bytes=disk_bytes if disk_dir else 0)
        self._emit = emit or (lambda event: None)
        self._lock = threading.Lock()
        self._host: OrderedDict[int, _HostBlock] = OrderedDict()
        self._disk: OrderedDict[int, _DiskBlock] = OrderedDict()
        self._generation = [0] * kv_cache.shape[3]  # per pool block: bumped when the pool reuses it
        self._in_flight: set[int] = set()  # hashes queued for the move down
        self._disk_errors = 0  # blocks the disk tier could not write (a full disk)
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self._layout_id = layout.fingerprint()
        if self.disk_dir is not None:
            check_manifest(self.disk_dir, layout)
            self._index_disk()
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # ---- the engine thread -------------------------------------------------------------

    def offload(self, block_id: int, block_hash: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Queue a copy of a pool block that just became evictable (nothing if a tier has it)."""
        with self._lock:
            if block_hash in self._host or block_hash in self._disk or block_hash in self._in_flight:
                if block_hash in self._host:
                    self._host.move_to_end(block_hash)  # used again: the last to go down
                return
            self._in_flight.add(block_hash)
            generation = self._generation[block_id]
        self._jobs.put(("offload", block_id, block_hash, parent, tokens, generation))

    def pool_reuses(self, block_id: int) -> None:
        """The pool is about to overwrite a block: a copy of it still in flight is void."""
        with self._lock:
            self._generation[block_id] += 1

    def holds(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._host or block_hash in self._disk

    def restore(self, block_hash: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> bool:
        """Copy a block held below into pool block `block_id`; False when gone or not the same tokens."""
        start = time.perf_counter()
        with self._lock:
            host = self._host.get(block_hash)
            disk = self._disk.get(block_hash) if host is None else None
        kv_cache = self._pool()
        if kv_cache is None:
            return False
        if host is not None:
            if (host.parent, host.tokens) != (parent, tokens):
                return False  # a hash collision: never serve another prefix's K/V
            kv_cache[:, :, :, block_id].copy_(host.data)
            with self._lock:
                if block_hash in self._host:
                    self._host.move_to_end(block_hash)
                self.stats.hits["host"] += 1
                self.stats.count("host_to_pool", 1, time.perf_counter() - start)
            return True
        if disk is None or (disk.parent, disk.tokens) != (parent, tokens):
            return False
        loaded = self._read(block_hash)
        if loaded is None:
            return False
        kv_cache[:, :, :, block_id].copy_(loaded)
        with self._lock:
            self.stats.hits["disk"] += 1
            self.stats.count("disk_to_pool", 1, time.perf_counter() - start)
        return True

    def prefetch(self, block_hashes: list[int]) -> None:
        """Read a queued prompt's blocks that only the disk holds into host memory, in the background."""
        with self._lock:
            wanted = [h for h in block_hashes if h in self._disk and h not in self._host]
        if wanted and self.stats.host_capacity_bytes >= self.block_bytes:
            self._jobs.put(("prefetch", wanted))

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued move is done (tests, benchmarks, shutdown)."""
        done = threading.Event()
        self._jobs.put(("mark", done))
        done.wait(timeout)

    def close(self) -> None:
        """Finish the queued moves, then write host memory's blocks down to disk (when there is one), so a
        restarted engine finds them there too."""
        self._jobs.put(None)
        self._thread.join(timeout=30)
        if self.disk_dir is not None and self.stats.disk_capacity_bytes >= self.block_bytes:
            with self._lock:
                kept = [(h, b) for h, b in self._host.items() if h not in self._disk]
            for h, block in kept:  # oldest first: the newest stay if the disk tier is full
                self._put_disk(h, block)

    def snapshot(self) -> TierStats:
        with self._lock:
            s = self.stats
            return TierStats(s.host_bytes, s.host_capacity_bytes, s.disk_bytes, s.disk_capacity_bytes, dict(s.hits),
                             dict(s.moved), dict(s.seconds), s.discarded)

    # ---- the mover thread --------------------------------------------------------------

    def _run(self) -> None:
        # The copies are spares: under contention for the CPU (an engine on CPU, its step's threads) they
        # yield to the step. On Linux a thread's id is its own scheduling entity.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "offload":
                    self._offload(*job[1:])
                elif job[0] == "prefetch":
                    self._prefetch(job[1])
                else:
                    job[1].set()
            except Exception:  # a failed move loses a spare copy, never the engine: logged
                log.exception("KV tiers: a %s failed", job[0])

    def _offload(self, block_id: int, block_hash: int, parent: int | None, tokens: tuple[int, ...],
                 generation: int) -> None:
        start = time.perf_counter()
        kv_cache = self._pool()
        data = None if kv_cache is None else copy_block(kv_cache, block_id)
        with self._lock:
            self._in_flight.discard(block_hash)
            # Reused (or the pool freed: asleep) while we copied: the copy is void.
            if data is None or self._generation[block_id] != generation:
                self.stats.discarded += 1
                return
        self._put_host(block_hash, _HostBlock(parent, tokens, data))
        with self._lock:
            self.stats.count("pool_to_host", 1, time.perf_counter() - start)

    def _put_host(self, block_hash: int, block: _HostBlock) -> None:
        """Into host memory, the oldest blocks beyond its bytes down to disk (or dropped without one)."""
        down: list[tuple[int, _HostBlock]] = []
        with self._lock:
            # A host tier of at least one block never sends the newest block down at once.
            kept = self.stats.host_capacity_bytes >= self.block_bytes
            if kept:
                self._host[block_hash] = block
                self.stats.host_bytes += self.block_bytes
                while self.stats.host_bytes > self.stats.host_capacity_bytes:
                    down.append(self._host.popitem(last=False))
                    self.stats.host_bytes -= self.block_bytes
            else:
                down.append((block_hash, block))  # no host tier: straight to disk
        if kept:
            self._emit(block_stored([block_hash], block.parent, block.tokens, self.layout.block_size, MEDIUM_HOST))
        for h, old in down:
            if kept:
                self._emit(block_removed([h], MEDIUM_HOST))
            self._put_disk(h, old)

    def _put_disk(self, block_hash: int, block: _HostBlock) -> None:
        if self.disk_dir is None or self.stats.disk_capacity_bytes < self.block_bytes:
            return
        with self._lock:
            if block_hash in self._disk:
                self._disk.move_to_end(block_hash)
                return
        start = time.perf_counter()
        try:
            size = write_block(self.disk_dir / _file_name(block_hash), block.parent, block.tokens, block.data,
                               self._layout_id, block_hash)
        except OSError as e:  # the disk filled, or went away: the block is dropped, the engine goes on
            self._disk_errors += 1
            if self._disk_errors == 1 or self._disk_errors % 1000 == 0:
                log.warning("KV tiers: cannot write to %s (%s); %d blocks not kept on disk so far", self.disk_dir,
                            e, self._disk_errors)
            return
        gone: list[int] = []
        with self._lock:
            self._disk[block_hash] = _DiskBlock(block.parent, block.tokens, size)
            self.stats.disk_bytes += size
            while self.stats.disk_bytes > self.stats.disk_capacity_bytes:
                h, old = self._disk.popitem(last=False)
                self.stats.disk_bytes -= old.size
                gone.append(h)
            self.stats.count("host_to_disk", 1, time.perf_counter() - start)
        self._emit(block_stored([block_hash], block.parent, block.tokens, self.layout.block_size, MEDIUM_DISK))
        for h in gone:
            (self.disk_dir / _file_name(h)).unlink(missing_ok=True)
        if gone:
            self._emit(block_removed(gone, MEDIUM_DISK))

    def _prefetch(self, block_hashes: list[int]) -> None:
        for h in block_hashes:
            start = time.perf_counter()
            with self._lock:
                disk = self._disk.get(h)
                if disk is None or h in self._host:
                    continue
            data = self._read(h)
            if data is None:
                continue
            self._put_host(h, _HostBlock(disk.parent, disk.tokens, data))
            with self._lock:
                self.stats.count("disk_to_host", 1, time.perf_counter() - start)

    def _read(self, block_hash: int) -> torch.Tensor | None:
        assert self.disk_dir is not None
        try:
            _, _, data = read_block(self.disk_dir / _file_name(block_hash), self.dtype, self.layout.block_shape,
                                    self._layout_id)
        except (OSError, ValueError, RuntimeError) as e:  # deleted or damaged under us: a miss
            log.warning("KV tiers: block file %s unreadable (%s); dropped", _file_name(block_hash), e)
            if isinstance(e, ValueError) and not isinstance(e, OtherLayout):  # damaged: ours, and useless
                (self.disk_dir / _file_name(block_hash)).unlink(missing_ok=True)
            with self._lock:
                old = self._disk.pop(block_hash, None)
                if old is not None:
                    self.stats.disk_bytes -= old.size
            if old is not None:  # subscribers (kv-aware routers) stop counting on it
                self._emit(block_removed([block_hash], MEDIUM_DISK))
            return None
        return data

    def _index_disk(self) -> None:
        """Index the blocks a previous engine left, oldest first (their files' modification times)."""
        assert self.disk_dir is not None
        own = own_files(self.disk_dir)
        for partial in (p for p in own if p.suffix == ".tmp"):  # a write cut short by a crash
            partial.unlink(missing_ok=True)
        files = sorted((p for p in own if p.suffix == ".kv"), key=lambda p: p.stat().st_mtime)
        others = 0
        for path in files:
            try:
                header, size = _read_header(path, self._layout_id)
                parent, tokens = header["parent"], tuple(header["tokens"])
                block_hash = file_block_hash(path, header)
            except OtherLayout:  # another engine's, sharing this directory by mistake: not ours to serve or remove
                others += 1
                continue
            except (OSError, ValueError) as e:
                log.warning("KV tiers: %s unreadable (%s); removed", path.name, e)
                path.unlink(missing_ok=True)
                continue
            if size != self.block_bytes:
                path.unlink(missing_ok=True)
                continue
            held = on_disk(path.stat())
            self._disk[block_hash] = _DiskBlock(parent, tokens, held)
            self.stats.disk_bytes += held
        while self.stats.disk_bytes > self.stats.disk_capacity_bytes and self._disk:
            h, old = self._disk.popitem(last=False)
            self.stats.disk_bytes -= old.size
            (self.disk_dir / _file_name(h)).unlink(missing_ok=True)
        if self._disk:
            log.info("KV tiers: %d blocks found in %s from an earlier run", len(self._disk), self.disk_dir)
        if others:
            log.warning("KV tiers: %d block files in %s were written by an engine of another layout: is this "
                        "directory shared? They are never served here", others, self.disk_dir)
        for h in parents_first(self._disk):  # subscribers learn what this engine holds from its last life
            found = self._disk[h]
            self._emit(block_stored([h], found.parent, found.tokens, self.layout.block_size, MEDIUM_DISK))
