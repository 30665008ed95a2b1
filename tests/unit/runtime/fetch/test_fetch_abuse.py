"""`kaon fetch` against a malicious or changing model store: names that would leave the model
directory, symlinks planted in a shared cache, a cached file altered at its size, and an object
replaced between two attempts of a resumed download. The store is a stand-in that lists and
serves what each test says, through the real part files, checks and marker."""
from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest

from kaon_runtime.fetch import evict, store
from kaon_runtime.fetch.source import INVALID, FetchError, cache_dir_name, check_file_name, parse_uri
from kaon_runtime.fetch.store import PartFile, RemoteFile

fetch_module = importlib.import_module("kaon_runtime.fetch.fetch")  # the package's `fetch` is the function
CONFIG = json.dumps({"num_attention_heads": 4}).encode()


class FakeStore:
    """Serves `objects` (name -> bytes); `checksums` off plays a store that gives none (a multipart
    S3 upload); `version` tags every object (an S3 ETag)."""

    revision_id = None

    def __init__(self, objects: dict[str, bytes], checksums: bool = True, version: str | None = None):
        self.objects, self.checksums, self.version = objects, checksums, version
        self.downloads: list[str] = []

    def list(self) -> list[RemoteFile]:
        return [RemoteFile(name, len(data), sha256=hashlib.sha256(data).hexdigest() if self.checksums else None,
                           version=self.version) for name, data in self.objects.items()]

    def download(self, remote: RemoteFile, directory: Path) -> None:
        self.downloads.append(remote.name)
        part = PartFile(directory / remote.name, remote.size, remote.name, None, remote.version)
        part.write(iter([self.objects[remote.name][part.done:]]))
        part.finish()


def model(weights: bytes = b"w" * 4096) -> dict[str, bytes]:
    return {"config.json": CONFIG, "tokenizer.json": b"{}", "model.safetensors": weights}


@pytest.fixture
def serve(monkeypatch):
    def use(fake: FakeStore) -> FakeStore:
        monkeypatch.setattr(fetch_module, "_store", lambda source, log: fake)
        return fake
    return use


def fetch(cache: Path) -> Path:
    return fetch_module.fetch("s3://bucket/model", cache, log=lambda _: None)


@pytest.mark.parametrize("name", ["../../escaped.gguf", "a/../../escaped.gguf", "/tmp/escaped.gguf",
                                  "//escaped.gguf", "a\\..\\escaped.gguf", "a//b.gguf", "./a.gguf", "a\x00.gguf"])
def test_a_key_that_could_leave_the_model_directory_refuses_the_model(tmp_path, serve, name):
    with pytest.raises(FetchError) as refused:
        check_file_name(name, "s3://bucket/model")
    assert refused.value.kind == INVALID
    serve(FakeStore({name: b"x" * 10}))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="not a plain relative path"):
        fetch(cache)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith((".lock", evict.IN_USE_SUFFIX))]
    assert written == []


def test_a_symlink_planted_in_the_cache_is_never_written_through(tmp_path, serve):
    serve(FakeStore(model()))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"victim")
    directory = tmp_path / "cache" / "s3" / "bucket" / "model"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(FetchError, match="symlink"):
        fetch(tmp_path / "cache")
    assert (outside / "model.safetensors").read_bytes() == b"victim"


@pytest.mark.parametrize("checksums", [True, False])
def test_a_cached_file_altered_at_its_size_is_fetched_again(tmp_path, serve, checksums):
    weights = bytes(range(256)) * 16
    fake = serve(FakeStore(model(weights), checksums=checksums))
    path = fetch(tmp_path)
    marker = json.loads(next(path.glob(".kaon-complete*.json")).read_text())
    assert {f["name"]: f["sha256"] for f in marker["files"]}["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    fake.downloads.clear()
    assert fetch(tmp_path) == path and fake.downloads == []  # whole: reused, nothing downloaded
    altered = bytearray(weights)
    altered[100] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(altered))  # same size, one bit flipped
    fetch(tmp_path)
    assert fake.downloads == ["model.safetensors"]  # the intact files were proved whole and kept
    assert (path / "model.safetensors").read_bytes() == weights


def test_an_object_replaced_between_attempts_is_not_resumed_into_a_mixed_file(tmp_path, serve):
    old, new = b"A" * 4096, b"B" * 4096
    directory = tmp_path / "s3" / "bucket" / "model"
    directory.mkdir(parents=True)
    store.part_path(directory / "model.safetensors", '"etag-1"').write_bytes(old[:1000])  # the first attempt
    serve(FakeStore(model(new), checksums=False, version='"etag-2"'))  # the object changed since
    path = fetch(tmp_path)
    assert (path / "model.safetensors").read_bytes() == new


def test_a_local_model_with_a_file_linking_outside_it_is_refused(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for name, data in model().items():
        (directory / name).write_bytes(data)
    (tmp_path / "secret").write_text("x")
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(FetchError, match="outside the model directory"):
        fetch_module.fetch(str(directory), tmp_path / "cache", log=lambda _: None)


@pytest.mark.parametrize("uri, revision", [
    ("s3://models/../../etc", None), ("s3://models/team/..", None), ("s3://models/./x/../../..", None),
    ("hf://org/name@..", None), ("hf://org/name", ".."), ("hf://org/name@.", None),
])
def test_a_prefix_or_revision_that_climbs_out_of_the_cache_is_refused(tmp_path, uri, revision):
    # The cache directory is a function of the URI (init container and engine agree on it without
    # talking): '..' in an S3 prefix or an HF revision must not make it a directory outside the cache.
    with pytest.raises(FetchError) as refused:
        parse_uri(uri, revision)
    assert refused.value.kind == INVALID and "leave the model cache" in str(refused.value)
    for fine in ("s3://models/team/llama", "hf://org/name@v1.0", "s3://models/a..b/c"):
        name = cache_dir_name(parse_uri(fine))
        assert (tmp_path / name).resolve().is_relative_to(tmp_path)
