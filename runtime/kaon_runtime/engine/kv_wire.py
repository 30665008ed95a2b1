"""The K/V transfer's wire: frames on a byte stream, and the decode engine's client that reads them.

A prefill engine answers `POST /kaon/v1/kv/prefill` with a stream of frames, each a 4-byte big-endian
header length, a JSON header and `nbytes` of payload:

    {"type": "meta", "layout": {...KvLayout}, "start": S, "end": E}       first, no payload
    {"type": "chunk", "first": F, "tokens": T, "nbytes": B} + K/V bytes    as each step computes them
    {"type": "done"}                                                       after token E - 1
    {"type": "error", "message": "..."}                                    instead of the rest

A chunk's payload is [layers, 2, kv heads, T, head dim] in the layout's dtype, C order. The client
checks every frame (the layout against its own, chunks contiguous from S, the count, finite values):
anything else is garbage, and the decode engine prefills the prompt itself.

`TcpTransport` carries them over plain HTTP/1.1 on TCP (one port with the API, so the pod's Service and
NetworkPolicy cover it); `pick_transport` names the transport a decode engine uses. NIXL (the library
vLLM, llm-d, Dynamo and SGLang move K/V with, RDMA or GPU memory) is to sit behind the same `fetch`; it
is not wired in yet, and `pick_transport` says so (docs/disaggregation.md).
"""
from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Protocol

import aiohttp
import torch

from kaon_runtime.engine.kv_transfer import ImportedKv, KvLayout

PREFILL_PATH = "/kaon/v1/kv/prefill"
_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16


class TransferError(Exception):
    """A transfer that did not deliver; `reason` is one of kv_transfer.FALLBACK_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---- frames (pure) ---------------------------------------------------------------------------


def frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header | ({"nbytes": len(payload)} if payload else {})).encode()
    return _LENGTH.pack(len(head)) + head + payload


def meta_frame(layout: KvLayout, start: int, end: int) -> bytes:
    return frame({"type": "meta", "layout": asdict(layout), "start": start, "end": end})


def chunk_frame(first: int, kv: torch.Tensor) -> bytes:
    data = kv.contiguous().view(torch.uint8).numpy().tobytes()
    return frame({"type": "chunk", "first": first, "tokens": kv.shape[3]}, data)


def done_frame() -> bytes:
    return frame({"type": "done"})


def error_frame(message: str) -> bytes:
    return frame({"type": "error", "message": message})


class FrameReader:
    """Splits a byte stream into (header, payload) frames; raises TransferError("garbage") on a bad one."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= _LENGTH.size:
            (head_len,) = _LENGTH.unpack_from(self._buffer)
            if head_len > MAX_HEADER_BYTES:
                raise TransferError("garbage", f"a frame header of {head_len} bytes")
            if len(self._buffer) < _LENGTH.size + head_len:
                break
            try:
                header = json.loads(self._buffer[_LENGTH.size:_LENGTH.size + head_len])
            except ValueError as exc:
                raise TransferError("garbage", f"a frame header that is not JSON: {exc}") from None
            if not isinstance(header, dict):
                raise TransferError("garbage", "a frame header that is not an object")
            nbytes = header.get("nbytes", 0)
            if not isinstance(nbytes, int) or nbytes < 0:
                raise TransferError("garbage", f"a frame of {nbytes!r} bytes")
            total = _LENGTH.size + head_len + nbytes
            if len(self._buffer) < total:
                break
            frames.append((header, bytes(self._buffer[_LENGTH.size + head_len:total])))
            del self._buffer[:total]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buffer)


class KvAssembler:
    """Checks the frames of one transfer and gathers its chunks into an ImportedKv."""

    def __init__(self, layout: KvLayout, start: int, end: int):
        self.layout, self.start, self.end = layout, start, end
        self.kv = layout.empty(end - start)
        self.received = start
        self.done = False

    def add(self, header: dict, payload: bytes) -> None:
        kind = header.get("type")
        if kind == "error":
            raise TransferError("refused", f"the prefill engine: {header.get('message')}")
        if kind == "meta":
            layout = header.get("layout")
            if layout != asdict(self.layout) or header.get("start") != self.start or header.get("end") != self.end:
                raise TransferError("garbage", f"a transfer of {layout} [{header.get('start')}, {header.get('end')}) "
                                               f"for one of {asdict(self.layout)} [{self.start}, {self.end})")
            return
        if kind == "done":
            if self.received != self.end:
                raise TransferError("garbage", f"done after {self.received - self.start} of "
                                               f"{self.end - self.start} tokens")
            self.done = True
            return
        if kind != "chunk":
            raise TransferError("garbage", f"a frame of type {kind!r}")
        first, tokens = header.get("first"), header.get("tokens")
        if first != self.received or not isinstance(tokens, int) or tokens < 1 or first + tokens > self.end:
            raise TransferError("garbage", f"chunk [{first}, +{tokens}) where [{self.received}, {self.end}) was due")
        if len(payload) != tokens * self.layout.token_bytes:
            raise TransferError("garbage", f"a chunk of {tokens} tokens in {len(payload)} bytes")
        shape = (self.layout.num_layers, 2, self.layout.num_kv_heads, tokens, self.layout.head_dim)
        chunk = torch.frombuffer(bytearray(payload), dtype=self.layout.torch_dtype).view(shape)
        if not torch.isfinite(chunk).all():
            raise TransferError("garbage", "a chunk with values that are not finite")
        offset = first - self.start
        self.kv[:, :, :, offset:offset + tokens] = chunk
        self.received += tokens

    def result(self) -> ImportedKv:
        assert self.done
        return ImportedKv(self.start, self.end, self.kv)


# ---- transports ------------------------------------------------------------------------------


class Transport(Protocol):
    name: str

    async def fetch(self, url: str, ask: dict, layout: KvLayout, timeout_s: float) -> ImportedKv: ...


class TcpTransport:
    """Frames over HTTP/1.1 on TCP, read as they arrive (aiohttp)."""

    name = "tcp"

    def __init__(self, api_key: Callable[[], str | None] = lambda: None):
        self.api_key = api_key  # read per transfer: a mounted key file may rotate
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str, ask: dict, layout: KvLayout, timeout_s: float) -> ImportedKv:
        assembler = KvAssembler(layout, ask["start"], len(ask["token_ids"]) - 1)
        reader = FrameReader()
        key = self.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            async with self._client().post(url.rstrip("/") + PREFILL_PATH, json=ask, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status != 200:
                    raise TransferError("refused", f"HTTP {response.status}: {(await response.text())[:200]}")
                async for data in _chunks(response):
                    for header, payload in reader.feed(data):
                        assembler.add(header, payload)
                        if assembler.done:
                            return assembler.result()
        except TimeoutError:
            raise TransferError("timeout", f"no complete transfer within {timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise TransferError("unreachable", f"{url}: {exc!r}") from None
        raise TransferError("garbage", f"the stream ended after {assembler.received - assembler.start} tokens")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for data in response.content.iter_any():
        yield data


def nixl_unavailable() -> str | None:
    """Why NIXL does not carry K/V here (None: it would): not installed, or kaon's NIXL transport not written yet."""
    try:
        import nixl  # noqa: F401  (an optional dependency, not in pyproject)
    except Exception as exc:  # noqa: BLE001 -- any failure to load means the same: not here
        return f"import nixl failed: {exc!r}"
    return "nixl imports, but kaon's NIXL transfer is not written yet (the interface, Transport, is ready)"


def pick_transport(api_key: Callable[[], str | None]) -> tuple[Transport, str]:
    """The transport a decode engine uses, and why not NIXL (the server logs both)."""
    return TcpTransport(api_key), nixl_unavailable() or ""
