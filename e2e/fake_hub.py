"""A stand-in for the Hugging Face hub: its HTTP API for a directory of repositories.

The hub cannot be reached from here, so the hf:// tests run the unmodified `huggingface_hub`
client (HF_ENDPOINT pointed at this server) against the endpoints its `model_info`,
`hf_hub_download` and `snapshot_download` call, answered as huggingface.co answers them:

    GET  /api/models/{org}/{name}[/revision/{rev}]   model info; ?blobs=true adds size, blobId, lfs.sha256
    HEAD /{org}/{name}/resolve/{rev}/{path}          X-Repo-Commit, ETag, Content-Length (X-Linked-* for LFS)
    GET  /{org}/{name}/resolve/{rev}/{path}          the bytes; honours Range (resumed downloads)

Errors carry the hub's X-Error-Code / X-Error-Message headers, which is how the client tells
them apart: 404 RepoNotFound, RevisionNotFound, EntryNotFound; 401 RepoNotFound for a private
repository without a token; 401 "Invalid credentials in Authorization header" for a wrong token.

`root/<org>/<name>/...` are the repositories (revision `main`, whose commit id is a hash of
the files); `tokens` maps a repository to the token that may read it (private), absent: public.
Large files (*.safetensors, *.gguf, *.bin) count as LFS files: their ETag is their sha256.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class FakeHub:
    def __init__(self, root: Path, tokens: dict[str, str] | None = None, host: str = "127.0.0.1"):
        self.root, self.tokens = Path(root), dict(tokens or {})
        self.downloads: Counter[str] = Counter()  # "org/name/path" -> full or ranged GETs of its bytes
        self.resumed: list[tuple[str, int]] = []  # ("org/name/path", first byte) of each ranged GET
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # The repositories ----------------------------------------------------------------------------------------------

    def files(self, repo: str) -> list[Path]:
        base = self.root / repo
        return sorted(p for p in base.rglob("*") if p.is_file())

    def commit(self, repo: str) -> str:
        h = hashlib.sha1()
        for p in self.files(repo):
            h.update(str(p.relative_to(self.root / repo)).encode() + b"\0" + _sha256(p).encode())
        return h.hexdigest()

    def sibling(self, repo: str, path: Path) -> dict:
        name, size = str(path.relative_to(self.root / repo)), path.stat().st_size
        entry = {"rfilename": name, "size": size, "blobId": _git_sha1(path)}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"size": size, "sha256": _sha256(path), "pointerSize": 134}
        return entry


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def do_GET(self) -> None:
        self._handle(head=False)

    def _error(self, status: int, code: str | None, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self, repo: str) -> bool:
        """Public, or the right token; answers the hub's 401s otherwise."""
        want = self.hub.tokens.get(repo)
        if want is None:
            return True
        auth = self.headers.get("Authorization", "")
        if not auth:
            self._error(401, "RepoNotFound", "Repository not found")  # the hub hides private repos
            return False
        if auth != f"Bearer {want}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def _repo(self, repo: str, rev: str | None) -> str | None:
        """The commit of repo@rev, or None after answering the error."""
        if not (self.hub.root / repo).is_dir():
            self._error(404 if self.headers.get("Authorization") else 401, "RepoNotFound", "Repository not found")
            return None
        if not self._authorized(repo):
            return None
        commit = self.hub.commit(repo)
        if rev not in (None, "main", commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return commit

    def _handle(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if m := _INFO.match(path):
            commit = self._repo(m["repo"], m["rev"] and unquote(m["rev"]))
            if commit is None:
                return
            repo = m["repo"]
            info = {"_id": commit[:24], "id": repo, "modelId": repo, "sha": commit, "private": repo in self.hub.tokens,
                    "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                    "siblings": [self.hub.sibling(repo, p) if "blobs=true" in self.path else
                                 {"rfilename": str(p.relative_to(self.hub.root / repo))} for p in self.hub.files(repo)]}
            body = json.dumps(info).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return
        if m := _RESOLVE.match(path):
            commit = self._repo(m["repo"], m["rev"])
            if commit is None:
                return
            file = self.hub.root / m["repo"] / m["path"]
            if not file.is_file() or ".." in m["path"].split("/"):
                self._error(404, "EntryNotFound", f"{m['path']} does not exist on \"{m['rev']}\"")
                return
            self._send_file(m["repo"], m["path"], file, commit, head)
            return
        self._error(404, None, "Not found")

    def _send_file(self, repo: str, name: str, file: Path, commit: str, head: bool) -> None:
        data = file.read_bytes()
        size, start = len(data), 0
        etag = _sha256(file) if name.endswith(LFS_SUFFIXES) else _git_sha1(file)
        ranged = re.match(r"^bytes=(\d+)-$", self.headers.get("Range", ""))
        if ranged and not head:
            start = int(ranged[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{etag}"')
        if name.endswith(LFS_SUFFIXES):
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        if not head:
            self.hub.downloads[f"{repo}/{name}"] += 1
            if start:
                self.hub.resumed.append((f"{repo}/{name}", start))
            self.wfile.write(data[start:])


if __name__ == "__main__":  # python -m e2e.fake_hub DIR [PORT]: serve a directory of repositories
    import sys
    import time

    with FakeHub(Path(sys.argv[1])) as hub:
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        while True:
            time.sleep(3600)
