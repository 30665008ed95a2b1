"""The KV tiers below the pool (engine/kv_tiers.py), on a small stand-in pool tensor and the real
block manager: blocks move down when evictable, come back on a prefix hit holding the K/V they
left with, overflow from host memory to disk, survive a restart on disk, and another layout's
directory is cleared (kaon's files only) and started afresh. The engine-level checks (greedy answers
equal with and without tiers) are in test_kv_tiers_engine.py."""
from __future__ import annotations

import errno
import itertools
import json
import logging
import tempfile
from pathlib import Path

import pytest
import torch

from kaon_runtime.engine import kv_tiers
from kaon_runtime.engine.block_hash import BUILTIN, BlockHasher, make_hasher
from kaon_runtime.engine.block_manager import BlockManager, chain_hash, root_hash
from kaon_runtime.engine.kv_observer import KVObserver
from kaon_runtime.engine.kv_tiers import KVLayout, KVTiers, check_manifest, weights_fingerprint
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.sampling import SamplingParams

BS = 4
_ids = itertools.count()


def pool(num_blocks: int) -> torch.Tensor:
    return torch.zeros((2, 2, 1, num_blocks, BS, 3))  # [layers, 2, kv heads, blocks, block size, head dim]


def layout(kv: torch.Tensor, model: str = "m") -> KVLayout:
    return KVLayout(model, "float32", BS, tuple(kv[:, :, :, 0].shape))


def block_bytes(kv: torch.Tensor) -> int:
    return kv[:, :, :, 0].numel() * kv.element_size()


def file_bytes(kv: torch.Tensor) -> int:
    """What one block file takes on disk (its header and K/V in whole allocation units): the disk tier's unit."""
    with tempfile.TemporaryDirectory() as directory:
        return kv_tiers.write_block(Path(directory) / "probe.kv", 2**62, tuple(range(9000, 9000 + BS)), kv[:, :, :, 0],
                                    "0" * 16)


def fingerprint(block_hash: int) -> float:
    return float(block_hash % 100_003)


class Engine:
    """Plays the scheduler and the model: each computed block's K/V is a value derived from its chain hash."""

    def __init__(self, kv: torch.Tensor, tiers: KVTiers, hasher: BlockHasher = BUILTIN):
        self.kv, self.tiers = kv, tiers
        self.bm = BlockManager(kv.shape[3], BS, hasher=hasher)
        self.bm.listener = KVObserver(BS, None, tiers, hasher=hasher)

    def run(self, tokens: list[int]) -> int:
        """Prefill a prompt to the end, free it; returns the tokens found cached (pool or tiers)."""
        seq = Sequence(next(_ids), list(tokens), len(tokens), SamplingParams())
        cached = self.bm.allocate_prefix(seq)
        for i, block_id in enumerate(seq.block_table):  # every cached block holds its own prefix's K/V
            assert torch.all(self.kv[:, :, :, block_id] == fingerprint(seq.block_hashes[i])), "wrong K/V served"
        assert self.bm.ensure_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.commit(seq)
        for i, h in enumerate(seq.block_hashes):
            self.kv[:, :, :, seq.block_table[i]] = fingerprint(h)
        self.bm.free(seq)
        self.tiers.drain()
        return cached


def doc(i: int, blocks: int = 3) -> list[int]:
    return [1000 * i + t for t in range(blocks * BS + 1)]


def restarted_on_disk(tmp_path, prompts: int, host_blocks: int = 0, emit=None) -> tuple[torch.Tensor, KVTiers]:
    """A disk tier filled with `prompts` docs by one engine that stopped, found by the next (a zeroed pool)."""
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=host_blocks * block_bytes(kv), disk_dir=str(tmp_path),
                    disk_bytes=64 * file_bytes(kv))
    first = Engine(kv, tiers)
    for i in range(prompts):
        first.run(doc(i))
    tiers.close()
    kv2 = pool(4)
    return kv2, KVTiers(kv2, layout(kv2), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv2),
                        emit=emit)


def test_a_working_set_larger_than_the_pool_comes_back_from_host_memory():
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=64 * block_bytes(kv))
    engine = Engine(kv, tiers)
    for i in range(4):  # 12 blocks of prompts through a pool of 4
        assert engine.run(doc(i)) == 0
    assert engine.run(doc(0)) == 3 * BS  # all three blocks, restored
    stats = tiers.snapshot()
    assert stats.hits["host"] == 3 and stats.moved["pool_to_host"] >= 9
    tiers.close()


def test_without_tiers_the_same_run_misses():
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=0)  # no host, no disk: nothing is kept
    engine = Engine(kv, tiers)
    for i in range(4):
        engine.run(doc(i))
    assert engine.run(doc(0)) == 0
    tiers.close()


def test_host_overflow_goes_to_disk_and_comes_back(tmp_path):
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=2 * block_bytes(kv), disk_dir=str(tmp_path),
                    disk_bytes=64 * file_bytes(kv))
    engine = Engine(kv, tiers)
    for i in range(4):
        engine.run(doc(i))
    stats = tiers.snapshot()
    assert stats.host_bytes <= 2 * block_bytes(kv) and stats.moved["host_to_disk"] >= 6
    assert len(list(tmp_path.glob("*.kv"))) == stats.moved["host_to_disk"]
    assert engine.run(doc(0)) == 3 * BS
    assert tiers.snapshot().hits["disk"] >= 1
    tiers.close()


def test_disk_keeps_its_bytes(tmp_path):
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=5 * file_bytes(kv))
    engine = Engine(kv, tiers)
    for i in range(4):
        engine.run(doc(i))
    assert len(list(tmp_path.glob("*.kv"))) == 5 and tiers.snapshot().disk_bytes == 5 * file_bytes(kv)
    tiers.close()


def test_the_disk_tier_keeps_to_its_bytes_on_disk(tmp_path):
    """--kv-offload-dir-bytes counted each block's K/V alone, not its file (the header with its tokens, the
    filesystem's allocation unit): the directory grew past it (found by hand: 12 files of 4 KiB in a tier of 32 KiB;
    on a pod past the emptyDir's sizeLimit, which the operator sets from diskBytes, and the kubelet evicts it)."""
    kv = pool(4)
    capacity = 8 * 4096
    tiers = KVTiers(kv, layout(kv), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=capacity)
    engine = Engine(kv, tiers)
    for i in range(4):
        engine.run(doc(i))
    files = list(tmp_path.glob("*.kv"))
    held = sum(max(p.stat().st_blocks * 512, p.stat().st_size) for p in files)  # what du (and the kubelet) count
    assert files and held <= capacity
    assert held <= tiers.snapshot().disk_bytes <= capacity  # the metric says what the disk holds
    tiers.close()
    again = KVTiers(kv, layout(kv), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=capacity)  # a restart counts alike
    assert again.snapshot().disk_bytes == tiers.snapshot().disk_bytes
    again.close()


def test_a_restarted_engine_serves_from_its_disk_tier(tmp_path):
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=64 * block_bytes(kv), disk_dir=str(tmp_path),
                    disk_bytes=64 * file_bytes(kv))
    first = Engine(kv, tiers)
    for i in range(3):
        first.run(doc(i))
    assert not list(tmp_path.glob("*.kv"))  # all in host memory so far
    tiers.close()  # a clean stop writes host memory's blocks down
    kv2 = pool(4)  # a new process: a zeroed pool, a new block manager
    again = KVTiers(kv2, layout(kv2), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv2))
    assert Engine(kv2, again).run(doc(0)) == 3 * BS
    again.close()


def test_a_restarted_engine_announces_its_disk_tier_parents_first(tmp_path):
    """A subscriber (kaon's kv-aware router, Dynamo's radix tree) follows a chain from a block whose parent it
    knows. The restart announced the disk tier's blocks oldest file first, and a prompt's tail block goes down
    first: each block came before its parent, and a router knew 1 block of each 3-block prompt (found by hand)."""
    from kaon_runtime.engine.kv_events import BlockStored

    events: list = []
    _, again = restarted_on_disk(tmp_path, prompts=4, host_blocks=2, emit=events.append)
    known: set[int | None] = {None}
    for event in events:
        assert isinstance(event, BlockStored) and event.medium == "DISK"
        assert event.parent_block_hash in known, "a block announced before its parent"
        known.update(event.block_hashes)
    assert len(known) - 1 == 12  # every block of the four prompts
    again.close()


def test_chain_hashes_are_the_same_in_every_process():
    """The disk tier names blocks by chain hash across restarts, so no per-process value (a string's
    seeded hash, None's address) may enter it: these values were computed by other processes with
    other PYTHONHASHSEEDs (and hold for CPython's tuple hash, unchanged since 3.8)."""
    salted = Sequence(0, [1], 1, SamplingParams(cache_salt="tenant"), lora_id=2)
    adapter = Sequence(0, [1], 1, SamplingParams(), lora_id=2)
    assert chain_hash(None, (1, 2, 3)) == 3584776007460696897
    assert root_hash(salted) == -638766419494089011
    assert root_hash(adapter) == -7201733514866981715


def filled(directory, model: str = "m", weights: str = "") -> None:
    """An engine of `model` (and `weights`) that leaves 3 documents' blocks in `directory`."""
    kv = pool(4)
    tiers = KVTiers(kv, KVLayout(model, "float32", BS, tuple(kv[:, :, :, 0].shape), weights), host_bytes=0,
                    disk_dir=str(directory), disk_bytes=64 * file_bytes(kv))
    engine = Engine(kv, tiers)
    for i in range(3):
        engine.run(doc(i))
    tiers.close()
    assert len(list(directory.glob("*.kv"))) >= 6


def test_another_models_disk_tier_is_cleared_and_other_files_are_kept(tmp_path, caplog):
    """A cache, not an error: a pod on a persistent volume restarted with another setting (or an upgraded
    kaon) must start, not crash-loop until someone empties the directory (it was refused before)."""
    filled(tmp_path, "model-a")
    (tmp_path / "NOTES.txt").write_text("someone else's")
    (tmp_path / "export.kv").write_text("not a kaon block file name")
    (tmp_path / "0123456789abcdef.tmp").write_bytes(b"a write cut short")
    kv = pool(4)
    with caplog.at_level(logging.WARNING, logger=kv_tiers.__name__):
        tiers = KVTiers(kv, layout(kv, "model-b"), host_bytes=0, disk_dir=str(tmp_path),
                        disk_bytes=64 * file_bytes(kv))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "model: 'model-a', here 'model-b'" in warned and "removed kaon's" in warned  # what differed, removed
    assert [p.name for p in tmp_path.glob("*.kv")] == ["export.kv"] and not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "NOTES.txt").read_text() == "someone else's" and (tmp_path / "export.kv").exists()
    assert tiers.snapshot().disk_bytes == 0 and Engine(kv, tiers).run(doc(0)) == 0  # an empty tier, no wrong K/V
    tiers.close()
    assert json.loads((tmp_path / "manifest.json").read_text())["model"] == "model-b"
    kv2 = pool(4)  # and the tier works again: a restart with model-b's settings serves from it
    again = KVTiers(kv2, layout(kv2, "model-b"), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert Engine(kv2, again).run(doc(0)) == 3 * BS
    again.close()
    other_shape = KVLayout("model-b", "float32", BS, (3, 2, 1, BS, 3))  # another block shape: cleared too
    KVTiers(kv, other_shape, host_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20).close()
    assert not list(tmp_path.glob("?" * 16 + ".kv")) and (tmp_path / "NOTES.txt").exists()


def test_a_manifest_that_is_not_kaons_is_refused(tmp_path):
    """Not written by kaon (its manifest is written atomically): not kaon's directory, nothing removed."""
    (tmp_path / "manifest.json").write_text('{"name": "some other program"}')
    (tmp_path / "0123456789abcdef.kv").write_bytes(b"x")
    kv = pool(4)
    with pytest.raises(ModelLoadError, match="not a kaon manifest"):
        check_manifest(tmp_path, layout(kv))
    (tmp_path / "manifest.json").write_text("{half")
    with pytest.raises(ModelLoadError, match="not a kaon disk tier"):
        check_manifest(tmp_path, layout(kv))
    assert (tmp_path / "0123456789abcdef.kv").exists()


def test_another_checkpoint_or_quantization_at_the_same_model_id_is_cleared(tmp_path, caplog):
    """Same model id and layout, other K/V: a float engine's blocks are stale for --quantization int8 (found by
    hand: a restart with int8 and a float32 KV cache served 12 blocks from the float engine's disk tier)."""
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    float_run = weights_fingerprint(ckpt, {"quantization": "none", "dtype": "auto"})
    assert weights_fingerprint(ckpt, {"quantization": "none", "dtype": "auto"}) == float_run
    assert weights_fingerprint(ckpt, {"quantization": "int8", "dtype": "auto"}) != float_run
    assert weights_fingerprint(ckpt, {"quantization": "none", "dtype": "bfloat16"}) != float_run
    (ckpt / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 16)  # a fine-tune: same size, shapes
    assert weights_fingerprint(ckpt, {"quantization": "none", "dtype": "auto"}) != float_run
    disk = tmp_path / "kv"
    filled(disk, weights=float_run)
    kv = pool(4)
    with caplog.at_level(logging.WARNING, logger=kv_tiers.__name__):
        tiers = KVTiers(kv, KVLayout("m", "float32", BS, tuple(kv[:, :, :, 0].shape), "another"), host_bytes=0,
                        disk_dir=str(disk), disk_bytes=1 << 20)
    assert "weights" in caplog.text and "--quantization" in caplog.text
    assert Engine(kv, tiers).run(doc(0)) == 0 and tiers.snapshot().hits["disk"] == 0
    tiers.close()


def test_a_block_file_of_another_layout_is_a_miss(tmp_path, caplog):
    """Two engines given one directory by mistake: each clears the other's manifest at its start, and then both
    write there. One's block file under a name the other indexed, or found at a restart, is never served."""
    filled(tmp_path, weights="ours")
    ours = KVLayout("m", "float32", BS, tuple(pool(4)[:, :, :, 0].shape), "ours")
    theirs = KVLayout("m", "float32", BS, ours.block_shape, "theirs")
    kv = pool(4)
    tiers = KVTiers(kv, ours, host_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert tiers.snapshot().disk_bytes > 0
    for path in tmp_path.glob("*.kv"):  # the other engine overwrote each file: same block, its own K/V
        parent, tokens, _ = kv_tiers.read_header(path, ours.fingerprint())
        kv_tiers.write_block(path, parent, tokens, torch.full(ours.block_shape, 123.0), theirs.fingerprint())
    assert Engine(kv, tiers).run(doc(0)) == 0  # read as misses (Engine.run asserts no wrong K/V was served)
    assert tiers.snapshot().hits["disk"] == 0
    tiers.close()
    kv2 = pool(4)
    with caplog.at_level(logging.WARNING, logger=kv_tiers.__name__):  # a restart: not indexed, not removed
        again = KVTiers(kv2, ours, host_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert "another layout" in caplog.text
    def written_by(path) -> str:
        data = path.read_bytes()
        return json.loads(data[4:4 + int.from_bytes(data[:4], "big")])["layout"]

    assert theirs.fingerprint() in {written_by(p) for p in tmp_path.glob("*.kv")}  # theirs left where they were
    assert Engine(kv2, again).run(doc(1)) == 0
    again.close()


def test_a_block_file_damaged_in_place_is_a_miss(tmp_path):
    """Same length, other bytes (found by hand: such files were served, and the greedy answers changed)."""
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv))
    first = Engine(kv, tiers)
    for i in range(3):
        first.run(doc(i))
    tiers.close()
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
        path.write_bytes(data)
    kv2 = pool(4)
    again = KVTiers(kv2, layout(kv2), host_bytes=0, disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv2))
    assert Engine(kv2, again).run(doc(0)) == 0  # Engine.run also asserts no wrong K/V was served
    assert again.snapshot().hits["disk"] == 0
    again.close()


@pytest.mark.parametrize("damage", [b"", b"\x00\x00", b"\x00\x00\x00\x02[]"])
def test_a_block_file_cut_short_while_serving_is_a_miss_and_announced(tmp_path, damage):
    """A file indexed at the start, then cut short or overwritten (a crashed copy, another program): reading it
    raised struct.error or AttributeError out of the block manager's lookup on the engine's step (found by hand;
    the async engine fails every request after that), and the damaged file stayed, still announced as on DISK."""
    from kaon_runtime.engine.kv_events import BlockRemoved

    events: list = []
    kv2, again = restarted_on_disk(tmp_path, prompts=3, emit=events.append)
    first_block = chain_hash(None, tuple(doc(0)[:BS]))
    path = tmp_path / f"{first_block & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"
    path.write_bytes(damage)
    assert Engine(kv2, again).run(doc(0)) == 0  # a miss, not an exception out of the step
    assert BlockRemoved(block_hashes=[first_block], medium="DISK") in events
    assert not path.exists() or path.read_bytes() != damage  # removed (then written again, recomputed)
    again.close()


def test_a_directory_that_cannot_be_written_is_refused_at_start(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    kv = pool(4)
    with pytest.raises(ModelLoadError, match="cannot write there"):  # was a FileExistsError's traceback
        KVTiers(kv, layout(kv), host_bytes=0, disk_dir=str(not_a_dir), disk_bytes=1 << 20)


def test_a_full_disk_drops_blocks_and_the_engine_goes_on(tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=2 * block_bytes(kv), disk_dir=str(tmp_path),
                    disk_bytes=64 * file_bytes(kv))
    monkeypatch.setattr(kv_tiers.os, "replace", full)  # then the disk fills: each block file's write fails
    engine = Engine(kv, tiers)
    with caplog.at_level(logging.WARNING, logger=kv_tiers.__name__):
        for i in range(4):
            engine.run(doc(i))
        assert engine.run(doc(3)) == 3 * BS  # still served: the pool and host memory work
        tiers.close()  # writing host memory down at the stop fails too, quietly
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.kv"))  # no partial file fills it more
    assert tiers.snapshot().disk_bytes == 0
    warned = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warned) == 1 and not any(r.exc_info for r in caplog.records)  # one line, no traceback per block


def test_a_copy_whose_block_the_pool_reused_is_discarded():
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=64 * block_bytes(kv))
    kv[:, :, :, 1] = 7.0
    tiers.pool_reuses(1)  # evicted after the copy was queued (generation 0), before it was done
    tiers._offload(1, 42, None, (1, 2, 3, 4), generation=0)
    assert not tiers.holds(42) and tiers.snapshot().discarded == 1
    tiers._offload(1, 42, None, (1, 2, 3, 4), generation=1)
    assert tiers.holds(42)
    tiers.close()


def test_restore_checks_the_tokens():
    kv = pool(4)
    tiers = KVTiers(kv, layout(kv), host_bytes=64 * block_bytes(kv))
    kv[:, :, :, 0] = 3.0
    tiers.offload(0, 42, None, (1, 2, 3, 4))
    tiers.drain()
    assert not tiers.restore(42, None, (9, 9, 9, 9), 2)  # a colliding hash: another prefix's K/V
    assert not torch.any(kv[:, :, :, 2] == 3.0)
    assert tiers.restore(42, None, (1, 2, 3, 4), 2) and torch.all(kv[:, :, :, 2] == 3.0)
    tiers.close()


def test_the_tier_metrics_are_exported():
    from kaon_runtime.engine.kv_tiers import TierStats
    from kaon_runtime.engine.llm_engine import EngineStats
    from kaon_runtime.server.metrics import Metrics

    tiers = TierStats(host_bytes=3, host_capacity_bytes=8, hits={"host": 5, "disk": 2})
    tiers.count("pool_to_host", 4, 0.5)
    text = Metrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, kv_tiers=tiers)).render().decode()
    for line in ('kaon_kv_tier_bytes{tier="host"} 3.0', 'kaon_kv_tier_capacity_bytes{tier="host"} 8.0',
                 'kaon_kv_tier_hits_total{tier="disk"} 2.0',
                 'kaon_kv_tier_blocks_moved_total{direction="pool_to_host"} 4.0',
                 'kaon_kv_tier_seconds_total{direction="pool_to_host"} 0.5'):
        assert line in text
    assert "kaon_kv_tier" not in Metrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)).render().decode()


def test_every_tier_series_is_on_metrics_from_the_start():
    """A direction's counters appeared only at its first move: Prometheus's rate() and increase() lose a series'
    first increment (nothing to compare it with), and a dashboard of disk hits showed no data until one came."""
    from prometheus_client.parser import text_string_to_metric_families

    from kaon_runtime.engine.kv_tiers import TierStats
    from kaon_runtime.engine.llm_engine import EngineStats
    from kaon_runtime.server.metrics import Metrics

    text = Metrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, kv_tiers=TierStats())).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    directions = {"pool_to_host", "host_to_disk", "host_to_pool", "disk_to_pool", "disk_to_host"}
    for name in ("kaon_kv_tier_blocks_moved", "kaon_kv_tier_seconds"):
        assert families[name].type == "counter"
        assert {s.labels["direction"] for s in families[name].samples if s.name.endswith("_total")} == directions
    assert {s.labels["tier"] for s in families["kaon_kv_tier_hits"].samples if s.name.endswith("_total")} == {
        "host", "disk"}


def test_an_asleep_engines_pool_is_neither_read_nor_written():
    """engine/sleep.py frees the pool and attaches a new one on wake: the tiers hold no reference to it."""
    kv = pool(4)
    current: list[torch.Tensor | None] = [kv]
    tiers = KVTiers(lambda: current[0], layout(kv), host_bytes=64 * block_bytes(kv))
    kv[:, :, :, 0] = 5.0
    tiers.offload(0, 42, None, (1, 2, 3, 4))
    tiers.drain()
    current[0] = None  # asleep
    assert not tiers.restore(42, None, (1, 2, 3, 4), 1)
    tiers._offload(2, 43, None, (5, 6, 7, 8), generation=0)
    assert not tiers.holds(43)
    current[0] = woken = pool(4)  # awake: a new pool
    assert tiers.restore(42, None, (1, 2, 3, 4), 1) and torch.all(woken[:, :, :, 1] == 5.0)
    tiers.close()


def test_the_engines_settings_reach_the_disk_tiers_manifest(tmp_path):
    """attach_kv_observer (what LLMEngine calls) fingerprints the checkpoint and --quantization: an engine of
    the same model with int8 weights finds the float engine's directory cleared."""
    from kaon_runtime.config import EngineConfig
    from kaon_runtime.engine.kv_observer import attach_kv_observer

    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"w" * 64)
    disk = str(tmp_path / "kv")

    def attach(**settings):
        config = EngineConfig(model=str(ckpt), block_size=BS, kv_offload_dir=disk, kv_offload_dir_bytes=1 << 20,
                              **settings)
        kv = pool(4)
        return attach_kv_observer(config, BlockManager(4, BS), lambda: kv, config.model, ckpt)

    def weights_in_manifest() -> str:
        return json.loads((tmp_path / "kv" / "manifest.json").read_text())["weights"]

    attach().close()
    float_run = weights_in_manifest()
    attach().close()  # the same settings find their directory
    assert weights_in_manifest() == float_run
    attach(quantization="int8").close()
    int8_run = weights_in_manifest()
    assert int8_run != float_run  # the int8 engine cleared the float one's tier and wrote its own manifest
    (ckpt / "model.safetensors").write_bytes(b"v" * 64)  # other weights at the same path
    attach(quantization="int8").close()
    assert weights_in_manifest() not in (float_run, int8_run)


@pytest.mark.parametrize("settings", [{"kv_offload_bytes": 100},
                                      {"kv_offload_dir_bytes": 100, "kv_offload_dir": "kv"}])
def test_a_tier_too_small_for_one_block_is_refused_at_start(tmp_path, settings):
    """A tier smaller than one block (bytes taken for MB, say) held nothing and said nothing: the engine started
    with a tier that never kept a block, its capacity on /metrics as if it worked (found by hand)."""
    from kaon_runtime.config import EngineConfig
    from kaon_runtime.engine.kv_observer import attach_kv_observer
    from kaon_runtime.errors import InvalidRequestError

    if "kv_offload_dir" in settings:
        settings = {**settings, "kv_offload_dir": str(tmp_path / "kv")}
    config = EngineConfig(model="m", block_size=BS, **settings)
    kv = pool(4)
    with pytest.raises(InvalidRequestError, match=f"holds no KV block: one takes {block_bytes(kv)} bytes"):
        attach_kv_observer(config, BlockManager(4, BS), lambda: kv, config.model)


@pytest.mark.parametrize("written, read", [("", "sha256_cbor:0123"), ("sha256_cbor:0123", ""),
                                           ("sha256_cbor:0123", "sha256_cbor:4567")])
def test_a_disk_tier_of_another_hash_algo_or_seed_is_not_read(tmp_path, caplog, written, read):
    """Blocks are found by hash: a tier written with another --prefix-caching-hash-algo (or PYTHONHASHSEED)
    names its blocks by other hashes, so it is a stale cache (cleared), never read ("" is builtin's)."""
    kv = pool(4)
    shape = tuple(kv[:, :, :, 0].shape)
    first = KVTiers(kv, KVLayout("m", "float32", BS, shape, "", written), host_bytes=0, disk_dir=str(tmp_path),
                    disk_bytes=64 * file_bytes(kv))
    Engine(kv, first).run(doc(0))
    first.close()
    assert list(tmp_path.glob("?" * 16 + ".kv"))
    with caplog.at_level(logging.WARNING, logger=kv_tiers.__name__):
        KVTiers(kv, KVLayout("m", "float32", BS, shape, "", read), host_bytes=0, disk_dir=str(tmp_path),
                disk_bytes=1 << 20).close()
    assert "block_hash" in " ".join(r.getMessage() for r in caplog.records)
    assert not list(tmp_path.glob("?" * 16 + ".kv"))


def test_a_restart_serves_sha256_cbor_blocks_from_disk(tmp_path):
    """sha256_cbor's hashes are 256 bits, more than a block file's name holds: the restarted engine must index
    each block under its whole hash (else no lookup finds it: every block a miss)."""
    hasher = make_hasher("sha256_cbor", "0")
    kv = pool(4)
    shape = tuple(kv[:, :, :, 0].shape)
    tiers = KVTiers(kv, KVLayout("m", "float32", BS, shape, "", hasher.tier_id()), host_bytes=0,
                    disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv))
    first = Engine(kv, tiers, hasher)
    for i in range(3):
        first.run(doc(i))
    tiers.close()
    kv2 = pool(4)
    again = KVTiers(kv2, KVLayout("m", "float32", BS, shape, "", hasher.tier_id()), host_bytes=0,
                    disk_dir=str(tmp_path), disk_bytes=64 * file_bytes(kv2))
    assert Engine(kv2, again, hasher).run(doc(0)) == 3 * BS  # every whole block from disk, the right K/V
    again.close()
