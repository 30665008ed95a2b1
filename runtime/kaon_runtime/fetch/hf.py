"""hf://: the Hugging Face hub through its own client (huggingface_hub), honouring HF_TOKEN and HF_ENDPOINT."""
from __future__ import annotations

import os
from pathlib import Path

from kaon_runtime.fetch.source import NOT_FOUND, UNAUTHORIZED, UNREACHABLE, FetchError, Source
from kaon_runtime.fetch.store import ErrorTranslation, PartFile, RemoteFile

CHUNK = 1 << 20
_TIMEOUT = 60.0  # seconds without a byte before a read fails (the next attempt resumes)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read per call: huggingface_hub reads it once, at import


class HubStore:
    def __init__(self, source: Source, log=None):
        self.source, self.log = source, log
        self.commit: str | None = None

    def list(self) -> list[RemoteFile]:
        from huggingface_hub import HfApi

        with _translated(self.source):
            info = HfApi(endpoint=_endpoint()).model_info(self.source.location, revision=self.source.revision,
                                                           files_metadata=True)
        self.commit = info.sha  # every file comes from this one commit, even if the branch moves meanwhile
        return [RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0),
                           sha256=s.lfs.sha256 if s.lfs else None,
                           git_sha1=None if s.lfs else s.blob_id,
                           version=s.lfs.sha256 if s.lfs else s.blob_id)
                for s in info.siblings or []]

    @property
    def revision_id(self) -> str | None:
        return self.commit

    def download(self, remote: RemoteFile, directory: Path) -> None:
        """Into directory/name through name.part; an interrupted download resumes with a ranged GET.

        huggingface_hub 1.x/2.x writes each download to a fresh temp file (no resume), so the bytes
        are read here, with the client's own URL, auth headers, HTTP session and error handling."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        part = PartFile(directory / remote.name, remote.size, remote.name, self.log, remote.version)
        url = hf_hub_url(self.source.location, remote.name, revision=self.commit or self.source.revision,
                         endpoint=_endpoint())
        headers = build_hf_headers()  # HF_TOKEN, user agent
        if part.done:
            headers["Range"] = f"bytes={part.done}-"
        with _translated(self.source, remote.name):
            if part.done < remote.size:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                          timeout=_TIMEOUT) as response:
                    if response.status_code >= 400:
                        response.read()
                        hf_raise_for_status(response)
                    # 206: the rest of the file; 200: the whole file again
                    part.write(response.iter_bytes(CHUNK), append=bool(part.done) and response.status_code == 206)
        part.finish()


class _translated(ErrorTranslation):
    """huggingface_hub's exceptions -> FetchError with the reason."""

    def __init__(self, source: Source, filename: str | None = None):
        self.source, self.filename = source, filename

    def translate(self, exc: BaseException) -> None:
        from huggingface_hub import errors as hf

        uri = self.source.uri
        token = " (HF_TOKEN is set)" if os.environ.get("HF_TOKEN") else " (no HF_TOKEN)"
        if isinstance(exc, hf.GatedRepoError):
            raise FetchError(UNAUTHORIZED, f"{uri}: the repository is gated; accept its terms on the hub with the "
                                           f"account of the token{token}") from None
        if isinstance(exc, hf.RepositoryNotFoundError):
            raise FetchError(NOT_FOUND, f"{uri}: repository not found, or private and the token cannot read "
                                        f"it{token}") from None
        if isinstance(exc, hf.RevisionNotFoundError):
            raise FetchError(NOT_FOUND, f"{uri}: revision {self.source.revision!r} not found") from None
        if isinstance(exc, (hf.EntryNotFoundError, getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError))):
            raise FetchError(NOT_FOUND, f"{uri}: file {self.filename} not found") from None
        if isinstance(exc, hf.HfHubHTTPError):
            status = getattr(exc.response, "status_code", None)
            if status in (401, 403):
                raise FetchError(UNAUTHORIZED, f"{uri}: the hub refused the credentials ({status}){token}") from None
            raise FetchError(UNREACHABLE, f"{uri}: the hub answered {status}: {str(exc).splitlines()[0]}") from None
        if isinstance(exc, OSError) or type(exc).__module__.startswith(("httpx", "requests", "urllib3")):
            if isinstance(exc, OSError) and exc.errno is not None:
                return  # disk errors (no space) are the caller's to name
            raise FetchError(UNREACHABLE, f"{uri}: cannot reach {_endpoint() or 'https://huggingface.co'}: "
                                          f"{exc}") from None
