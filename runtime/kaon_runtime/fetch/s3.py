"""s3://: any S3-compatible store through MinIO's S3 client, credentials from the AWS_* variables.

AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (none: anonymous), AWS_SESSION_TOKEN, AWS_REGION (or
AWS_DEFAULT_REGION), AWS_ENDPOINT_URL (default: AWS S3; e.g. http://minio.storage:9000).
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from kaon_runtime.fetch.source import NOT_FOUND, UNAUTHORIZED, UNREACHABLE, FetchError, Source
from kaon_runtime.fetch.store import ErrorTranslation, PartFile, RemoteFile

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
           "AllAccessDisabled", "AccountProblem"}
_MISSING = {"NoSuchBucket", "NoSuchKey", "NoSuchObject"}
CHUNK = 1 << 20


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"


class S3Store:
    def __init__(self, source: Source, log=print):
        from minio import Minio

        url = urlparse(_endpoint())
        if url.scheme not in ("http", "https") or not url.netloc:
            raise FetchError(UNREACHABLE, f"AWS_ENDPOINT_URL {_endpoint()!r} is not an http(s) URL")
        self.source, self.log = source, log
        self.client = Minio(url.netloc, access_key=os.environ.get("AWS_ACCESS_KEY_ID") or None,
                            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
                            session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
                            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None,
                            secure=url.scheme == "https")
        self.keys: dict[str, str] = {}  # file name (relative to the prefix) -> object key

    revision_id = None

    def list(self) -> list[RemoteFile]:
        bucket, prefix = self.source.location, self.source.path
        files = []
        with _translated(self.source):
            for obj in self.client.list_objects(bucket, prefix=f"{prefix}/" if prefix else "", recursive=True):
                if obj.is_dir or obj.object_name.endswith("/"):
                    continue
                name = obj.object_name[len(prefix) + 1:] if prefix else obj.object_name
                self.keys[name] = obj.object_name
                files.append(RemoteFile(name, obj.size or 0, md5=_md5(obj.etag), version=obj.etag))
            if not files and prefix:  # s3://bucket/path/model.gguf names one object
                try:
                    stat = self.client.stat_object(bucket, prefix)
                except Exception as exc:  # a missing key is "not found" below
                    if getattr(exc, "code", None) not in _MISSING:
                        raise
                else:
                    name = prefix.rsplit("/", 1)[-1]
                    self.keys[name] = prefix
                    files.append(RemoteFile(name, stat.size or 0, md5=_md5(stat.etag), version=stat.etag))
        if not files:
            raise FetchError(NOT_FOUND, f"{self.source.uri}: no objects under this prefix")
        return files

    def download(self, remote: RemoteFile, directory: Path) -> None:
        """Into directory/name through name.part; an interrupted download resumes with a ranged GET.
        The GET asks for the listed version (If-Match its ETag): an object replaced meanwhile is a
        failure to retry, never bytes of two versions in one file."""
        part = PartFile(directory / remote.name, remote.size, remote.name, self.log, remote.version)
        if part.done < remote.size:
            with _translated(self.source, remote.name):
                match: dict[str, str | list[str] | tuple[str]] | None = \
                    {"If-Match": remote.version} if remote.version else None
                response = self.client.get_object(self.source.location, self.keys[remote.name], offset=part.done,
                                                  request_headers=match)
                try:
                    part.write(response.stream(CHUNK))
                finally:
                    response.close()
                    response.release_conn()
        part.finish()


def _md5(etag: str | None) -> str | None:
    etag = (etag or "").strip('"')
    return etag if len(etag) == 32 and "-" not in etag else None  # multipart ETags are not an MD5


class _translated(ErrorTranslation):
    """The S3 client's exceptions -> FetchError with the reason."""

    def __init__(self, source: Source, name: str | None = None):
        self.source, self.name = source, name

    def translate(self, exc: BaseException) -> None:
        from minio.error import S3Error, ServerError

        what = f"{self.source.uri}" + (f" ({self.name})" if self.name else "")
        keys = " (AWS_ACCESS_KEY_ID is set)" if os.environ.get("AWS_ACCESS_KEY_ID") else " (no AWS_ACCESS_KEY_ID)"
        if isinstance(exc, S3Error):
            if exc.code in _DENIED:
                raise FetchError(UNAUTHORIZED, f"{what}: the store refused the credentials: {exc.code}{keys}") from None
            if exc.code in _MISSING:
                raise FetchError(NOT_FOUND, f"{what}: {exc.code}") from None
            if exc.code == "PreconditionFailed":
                raise FetchError(UNREACHABLE, f"{what}: the object changed at the store while it was being "
                                              "downloaded; a retry fetches the new one") from None
            raise FetchError(UNREACHABLE, f"{what}: {exc.code}: {exc.message}") from None
        if isinstance(exc, ServerError):
            raise FetchError(UNREACHABLE, f"{what}: the store answered {exc.status_code}") from None
        if isinstance(exc, OSError) and exc.errno is not None and not type(exc).__module__.startswith("urllib3"):
            return  # disk errors (no space) are the caller's to name
        if isinstance(exc, OSError) or type(exc).__module__.startswith("urllib3"):
            raise FetchError(UNREACHABLE, f"{what}: cannot reach {_endpoint()}: {exc}") from None
