"""The model cache's size bound (evict.py, issue 53's node cache): least recently used models no process uses go."""
from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kaon_runtime.fetch import evict
from kaon_runtime.fetch.store import PartFile, RemoteFile

fetch_module = importlib.import_module("kaon_runtime.fetch.fetch")
SIZE = 4096


class Store:
    """A stand-in S3 store: every prefix is one model of a config and SIZE bytes of weights."""

    revision_id = None

    def __init__(self) -> None:
        self.downloads: list[str] = []

    def list(self) -> list[RemoteFile]:
        return [RemoteFile(n, len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in self.objects().items()]

    @staticmethod
    def objects() -> dict[str, bytes]:
        return {"config.json": b'{"num_attention_heads": 4}', "tokenizer.json": b"{}", "model.safetensors": b"w" * SIZE}

    def download(self, remote: RemoteFile, directory: Path) -> None:
        self.downloads.append(f"{directory.name}/{remote.name}")
        part = PartFile(directory / remote.name, remote.size, remote.name, None, remote.version)
        part.write(iter([self.objects()[remote.name]]))
        part.finish()


def test_choose_takes_the_least_recently_used_that_are_not_busy_until_the_rest_fit():
    a, b, c, d = (evict.Model(Path(n), 10, t) for n, t in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)))
    assert evict.choose([d, c, b, a], 20, lambda m: m is a) == [b, c]  # a in use: skipped, not waited for
    assert evict.choose([a, b, c, d], 40, lambda m: False) == []
    assert evict.choose([a, b], 0, lambda m: True) == []  # all in use: over the bound rather than removed


def test_parse_size_reads_quantities():
    assert evict.parse_size("100Gi") == 100 * 2**30 and evict.parse_size("5G") == 5 * 10**9
    assert evict.parse_size("1234") == 1234
    with pytest.raises(ValueError):
        evict.parse_size("12Qi")


def test_the_bound_removes_the_least_recently_used_model_no_process_uses(tmp_path, monkeypatch):
    store = Store()
    monkeypatch.setattr(fetch_module, "_store", lambda source, log: store)
    cache = tmp_path / "cache"
    old, used = (fetch_module.fetch(f"s3://bucket/{n}", cache, log=lambda _: None) for n in ("old", "used"))
    os.utime(evict.in_use_path(used), (500, 500))  # used least recently of all, but an engine holds it
    os.utime(evict.in_use_path(old), (1000, 1000))
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from kaon_runtime.fetch import evict
        evict.keep_open(evict.use(Path({str(used)!r})))
        print("holding", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "holding"
        os.utime(evict.in_use_path(used), (500, 500))
        logged: list[str] = []
        new = fetch_module.fetch("s3://bucket/new", cache, log=logged.append, cache_limit=2 * SIZE + 2000)
        assert not old.exists() and used.exists() and new.exists()
        assert any("removed from the model cache" in line for line in logged)
    finally:
        engine.communicate("")  # the engine ends: its lock goes with it
    assert evict.sweep(cache, 2 * SIZE + 2000, keep=new) == []  # within the bound now: nothing else goes
    assert evict.sweep(cache, SIZE + 2000, keep=new) == [used]  # no longer in use: it may go
    store.downloads.clear()
    fetch_module.fetch("s3://bucket/old", cache, log=lambda _: None)  # removed: fetched again, never half-trusted
    assert store.downloads == ["old/config.json", "old/tokenizer.json", "old/model.safetensors"]
