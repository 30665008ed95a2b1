"""The fetch sequence, and `kaon fetch`'s command line.

    kaon fetch --model hf://Qwen/Qwen2.5-0.5B-Instruct [--revision R] [--gguf-file F]
               [--model-cache DIR] [--tensor-parallel-size N] [--termination-log /dev/termination-log]

Prints the local path of the model on stdout; progress on stderr; on failure one line
`<reason>: <details>` last on stderr (and in the termination log, for the pod's status) and
a distinct exit code (source.EXIT_CODES).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.fetch import evict, store
from kaon_runtime.fetch.source import (
    FETCHED_SCHEMES,
    INVALID,
    NOT_FOUND,
    FetchError,
    Source,
    cache_dir_name,
    check_file_name,
    check_fit,
    parse_config,
    parse_uri,
    select_files,
)

DEFAULT_CACHE = Path(os.environ.get("KAON_MODEL_CACHE") or Path.home() / ".cache" / "kaon" / "models")


def _stderr(message: str) -> None:
    print(f"kaon fetch: {message}", file=sys.stderr, flush=True)


def fetch(uri: str, cache: Path = DEFAULT_CACHE, *, revision: str | None = None, gguf_file: str | None = None,
          tensor_parallel_size: int = 1, log: Callable[[str], None] = _stderr, hold: bool = False,
          cache_limit: int | None = None) -> Path:
    """The local path (HF directory or .gguf file) of `uri`, downloaded into `cache` unless already complete.

    The model is marked in use while this runs (evict.py), and for the rest of the process with `hold`
    (`kaon serve`); with `cache_limit` (bytes), least recently used models no process uses are then removed
    from `cache` until its models fit (the node cache's bound)."""
    source = parse_uri(uri, revision)
    if source.scheme == "local":
        return check_local(Path(source.location), tensor_parallel_size, log)
    directory = Path(cache) / cache_dir_name(source)
    in_use = evict.use(directory)
    try:
        path = _fetch_into(source, directory, gguf_file, tensor_parallel_size, log)
        if cache_limit is not None:
            evict.sweep(Path(cache), cache_limit, keep=directory, log=log)
    except BaseException:
        evict.release(in_use)
        raise
    if hold:
        evict.keep_open(in_use)
    else:
        evict.release(in_use)
    return path


def _fetch_into(source: Source, directory: Path, gguf_file: str | None, tensor_parallel_size: int,
                log: Callable[[str], None]) -> Path:
    marker = store.read_marker(directory, gguf_file, log)
    if marker is None:
        with store.locked(directory, log):
            marker = store.read_marker(directory, gguf_file, log)  # the holder of the lock may have finished it
            if marker is None:
                marker = _download(source, directory, gguf_file, tensor_parallel_size, log)
            else:
                log(f"{source.uri}: completed by another fetch meanwhile")
    else:
        log(f"{source.uri}: already complete in {directory} (revision {marker.get('revision')}); nothing to download")
    path = directory / marker["model"]
    if gguf_file is None and (path / "config.json").is_file():
        check_fit(parse_config((path / "config.json").read_text(), source.uri), tensor_parallel_size)
    return path


def adapter_fetcher(cache: Path = DEFAULT_CACHE) -> Callable[[str], str]:
    """How a LoRA adapter's path becomes a local directory: hf:// and s3:// are downloaded into the
    model cache as models are (with the same credentials); a fetch that fails is a bad request
    naming the adapter's URI, so a failed adapter never stops the base model. The CLI hands it to
    the server, which may not import kaon fetch itself (they are siblings)."""
    def fetch_adapter(path: str) -> str:
        if not path.startswith(FETCHED_SCHEMES):
            return path
        try:
            return str(fetch(path, cache))
        except FetchError as e:
            raise InvalidRequestError(f"adapter {path}: {e.kind}: {e.message}") from e
    return fetch_adapter


def _store(source: Source, log):
    if source.scheme == "hf":
        from kaon_runtime.fetch.hf import HubStore
        return HubStore(source, log)
    from kaon_runtime.fetch.s3 import S3Store
    return S3Store(source, log)


def _download(source: Source, directory: Path, gguf_file: str | None, tp: int, log) -> dict:
    start = time.monotonic()
    remote = _store(source, log)
    files = remote.list()
    for f in files:  # one name that could leave the directory refuses the model, before anything is written
        check_file_name(f.name, source.uri)
    by_name = {f.name: f for f in files}
    wanted = [by_name[n] for n in select_files(list(by_name), gguf_file, source.uri)]
    total = sum(f.size for f in wanted)
    log(f"{source.uri}: {len(wanted)} of {len(files)} files, {store._gb(total)}"
        + (f", revision {remote.revision_id}" if remote.revision_id else ""))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if tp > 1 and "config.json" in by_name and gguf_file is None:  # refuse before the weights come
            _get(remote, by_name["config.json"], directory, log, None)
            check_fit(parse_config((directory / "config.json").read_text(), source.uri), tp)
        store.check_space(directory, wanted)
        recorded = store.recorded_digests(directory, gguf_file)
        digests = {f.name: _get(remote, f, directory, log, recorded.get(f.name)) for f in wanted}
    except OSError as exc:
        full = store.no_space(exc, directory)
        if full:
            raise full from None
        raise
    marker = {"uri": source.uri, "revision": remote.revision_id, "model": gguf_file or ".",
              "files": [{"name": f.name, "size": f.size, "sha256": digests[f.name]} for f in wanted],
              "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    store.write_marker(directory, gguf_file, marker)
    log(f"{source.uri}: complete in {time.monotonic() - start:.1f}s ({store._gb(total)}) -> {directory}")
    return marker


def _get(remote, f: store.RemoteFile, directory: Path, log, recorded: str | None) -> str:
    """Download `f` unless a whole copy is there; its SHA-256. A copy left by an earlier fetch is
    kept only when the store's checksum, or the digest the last marker recorded, proves it whole."""
    path = store.destination(directory, f.name)
    if path.is_file() and path.stat().st_size == f.size:
        if f.checkable:
            try:
                return store.verify(path, f)
            except FetchError:
                pass
        elif recorded and store.sha256_of(path) == recorded:
            return recorded
    t = time.monotonic()
    log(f"{f.name}: downloading {store._gb(f.size)}")
    remote.download(f, directory)
    digest = store.verify(path, f)
    log(f"{f.name}: done in {time.monotonic() - t:.1f}s, size and checksum verified")
    return digest


def check_local(path: Path, tp: int, log) -> Path:
    """A model already on a volume (pvc://) or in the image: present, complete, and does tp fit?"""
    if not path.exists():
        raise FetchError(NOT_FOUND, f"{path} does not exist (for pvc://<claim>/<path>: is the path inside the "
                                    "claim right?)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise FetchError(INVALID, f"{path} is a file but not a .gguf")
        log(f"{path}: a GGUF file, {store._gb(path.stat().st_size)}")
        return path
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
    root = path.resolve()
    outside = [n for n in names if root not in (path / n).resolve().parents]
    if outside:
        raise FetchError(INVALID, f"{path}: {', '.join(outside[:3])} link outside the model directory")
    select_files(names, None, str(path))
    if (path / "config.json").is_file():
        check_fit(parse_config((path / "config.json").read_text(), str(path)), tp)
    log(f"{path}: a model directory ({len(names)} files)")
    return path


# The command line ----------------------------------------------------------------------------------------------------


def add_model_source_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `kaon fetch` and `kaon serve` share for hf:// and s3:// models."""
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE,
                        help="where hf:// and s3:// models are downloaded (default: $KAON_MODEL_CACHE or "
                             "~/.cache/kaon/models)")
    parser.add_argument("--revision", help="hf://: the branch, tag or commit (default main)")
    parser.add_argument("--gguf-file", help="hf://, s3://: download this GGUF file instead of the safetensors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaon fetch", description="download an hf:// or s3:// model into the "
                                     "cache (or check a local one) and print its local path")
    parser.add_argument("--model", required=True, help="hf://<org>/<name>[@rev], s3://<bucket>/<prefix>, or a path")
    add_model_source_flags(parser)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="refuse (exit 6) when this does not divide the model's heads")
    parser.add_argument("--cache-limit", type=evict.parse_size, metavar="SIZE",
                        help="after the fetch, remove the least recently used models no process uses until the "
                             "cache's models fit in SIZE (bytes, or a quantity: 100Gi, 500G); the node cache's bound")
    parser.add_argument("--termination-log", type=Path,
                        help="also write the failure line here if the file exists (a kubelet's /dev/termination-log)")
    return parser


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = fetch(args.model, args.model_cache, revision=args.revision, gguf_file=args.gguf_file,
                     tensor_parallel_size=args.tensor_parallel_size, cache_limit=args.cache_limit)
    except FetchError as exc:
        line = exc.line()
        if args.termination_log is not None and args.termination_log.is_file():
            try:
                args.termination_log.write_text(line + "\n")
            except OSError:
                pass
        print(f"kaon fetch: {line}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kaon fetch: interrupted; the next run resumes", file=sys.stderr)
        return 130
    print(path)
    return 0


def marker_of(path: Path) -> dict | None:
    """For tests and tools: the completion marker of a fetched model directory."""
    for marker in sorted(path.glob(store.MARKER_PREFIX + "*.json")):
        return json.loads(marker.read_text())
    return None
