"""`kaon fetch`: bring an hf:// or s3:// model into a local cache, or check a local one (pvc://, paths).

- `source.py`: pure decisions (parse a URI, which files the engine needs, where they go in the
  cache, whether tensorParallelSize fits the model's heads, what a failure is called).
- `store.py`: the cache on disk (completion marker written atomically, a lock file, free space).
- `evict.py`: the cache's size bound (`--cache-limit`): least recently used models no process holds go.
- `hf.py`, `s3.py`: the real clients (huggingface_hub, MinIO's S3 client).
- `fetch.py`: the sequence, shared by `kaon fetch` (the engine pod's init container) and
  `kaon serve --model hf://...`.

Nothing here imports torch: the init container starts in a second.
"""
from kaon_runtime.fetch.fetch import fetch, run_cli
from kaon_runtime.fetch.source import FetchError, Source, parse_uri

__all__ = ["FetchError", "Source", "fetch", "parse_uri", "run_cli"]
