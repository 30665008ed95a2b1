"""The K/V transfer's wire: frames on a byte stream, and the decode engine's client that reads them.

A prefill engine answers `POST /kaon/v1/kv/prefill` with a stream of frames, each a 4-byte big-endian
header length, a JSON header and `nbytes` of payload:

    {"type": "meta", "layout": {...KvLayout}, "start": S, "end": E}       first, no payload
    {"type": "chunk", "first": F, "tokens": T, "nbytes": B} + K/V bytes    as each step computes them
    {"type": "done"}                                                       after token E - 1
    {"type": "error", "message": "..."}                                    instead of the rest

A chunk's payload is token-major, [T, layers, 2, kv heads, head dim] in the layout's dtype, C order (one
token's K/V is one row: a chunk is contiguous in the decode engine's buffer, and lands there straight from
the socket). The client
checks every frame (the layout against its own, chunks contiguous from S, the count, finite values):
anything else is garbage, and the decode engine prefills the prompt itself.

`TcpTransport` carries them over plain HTTP/1.1 on TCP (one port with the API, so the pod's Service and
NetworkPolicy cover it). `NixlTransport` moves the bytes with NIXL (the library vLLM, llm-d, Dynamo and
SGLang move K/V with; UCX over host memory here, RDMA or GPU memory where there is one) into a staging
buffer the decode engine offers, the stream carrying only the frames' headers ("placed": true).
`pick_transport` chooses NIXL where it runs, else TCP, and says why.

Why one module past 300 lines: the frames, their reader and assembler and the two transports are
one wire protocol read together; the transports move out when a third one comes.
"""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Protocol

import aiohttp
import torch

from kaon_runtime.engine.kv_transfer import ImportedKv, KvLayout

PREFILL_PATH = "/kaon/v1/kv/prefill"
_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16
PROGRESS_INTERVAL_S = 0.001  # NIXL: how often a transfer's two agents ask UCX to progress
WRITE_TIMEOUT_S = 30.0  # a WRITE the decode engine does not take in this long: it has gone


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


def token_rows(kv: torch.Tensor) -> torch.Tensor:
    """A chunk's K/V ([layers, 2, kv heads, tokens, head dim]) as the wire carries it: token-major bytes,
    [tokens, token bytes]. No copy when kv came from gather_tokens (a view of token-major memory)."""
    rows = kv.permute(3, 0, 1, 2, 4).contiguous()
    return rows.view(torch.uint8).view(rows.shape[0], -1)


def chunk_frame_parts(first: int, kv: torch.Tensor) -> tuple[bytes, memoryview]:
    """A chunk frame as (length + header, payload): the payload is the K/V's own memory, sent without a copy."""
    payload = token_rows(kv).numpy().data.cast("B")
    head = json.dumps({"type": "chunk", "first": first, "tokens": kv.shape[3], "nbytes": payload.nbytes}).encode()
    return _LENGTH.pack(len(head)) + head, payload


def chunk_frame(first: int, kv: torch.Tensor) -> bytes:
    head, payload = chunk_frame_parts(first, kv)
    return head + payload.tobytes()


def done_frame() -> bytes:
    return frame({"type": "done"})


def error_frame(message: str) -> bytes:
    return frame({"type": "error", "message": message})


class FrameReader:
    """Splits a byte stream into (header, payload) frames; raises TransferError("garbage") on a bad one.

    With `destination`, a frame's payload is copied straight from the received pieces into the memory
    `destination(header)` returns (exactly `nbytes` long; None: collect it as bytes) and the frame comes
    out as (header, None): a 46 MB chunk is copied once on the decode engine's core, not joined, sliced
    and copied again."""

    def __init__(self, destination: Callable[[dict], memoryview | None] | None = None) -> None:
        self._destination = destination
        self._head = bytearray()  # the length and header of the frame being read
        self._header: dict | None = None  # read; its payload is arriving
        self._into: memoryview | None = None
        self._collected = bytearray()
        self._left = 0  # payload bytes still to come

    def feed(self, data: bytes | memoryview) -> list[tuple[dict, bytes | None]]:
        frames: list[tuple[dict, bytes | None]] = []
        view = memoryview(data).cast("B")
        while view:
            if self._header is None:
                view = self._read_header(view)
                if self._header is not None and self._left == 0:
                    frames.append(self._finish())
                continue
            n = min(len(view), self._left)
            if self._into is not None:
                at = len(self._into) - self._left
                self._into[at:at + n] = view[:n]
            else:
                self._collected += view[:n]
            self._left -= n
            view = view[n:]
            if self._left == 0:
                frames.append(self._finish())
        return frames

    def _read_header(self, view: memoryview) -> memoryview:
        """Take what the frame's length and header still need from `view`; the rest of it."""
        need = _LENGTH.size - len(self._head)
        if need > 0:
            self._head += view[:need]
            view = view[need:]
            if len(self._head) < _LENGTH.size:
                return view
        (head_len,) = _LENGTH.unpack_from(self._head)
        if head_len > MAX_HEADER_BYTES:
            raise TransferError("garbage", f"a frame header of {head_len} bytes")
        need = _LENGTH.size + head_len - len(self._head)
        self._head += view[:need]
        view = view[need:]
        if len(self._head) < _LENGTH.size + head_len:
            return view
        try:
            header = json.loads(self._head[_LENGTH.size:])
        except ValueError as exc:
            raise TransferError("garbage", f"a frame header that is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise TransferError("garbage", "a frame header that is not an object")
        nbytes = header.get("nbytes", 0)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise TransferError("garbage", f"a frame of {nbytes!r} bytes")
        self._head.clear()
        self._header, self._left = header, nbytes
        self._into = self._destination(header) if nbytes and self._destination is not None else None
        if self._into is not None and len(self._into) != nbytes:
            raise TransferError("garbage", f"a payload of {nbytes} bytes for {len(self._into)} bytes of room")
        return view

    def _finish(self) -> tuple[dict, bytes | None]:
        assert self._header is not None
        done = (self._header, None if self._into is not None else bytes(self._collected))
        self._header, self._into = None, None
        self._collected.clear()
        return done

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete."""
        return len(self._head) + (len(self._collected) if self._header is not None else 0)


def all_finite(rows: torch.Tensor) -> bool:
    """Whether K/V holds only finite values, by one sum (a NaN or an infinity makes it non-finite): a tenth of
    isfinite().all()'s time on 46 MB. Finite values summing past float32's range are refused too: no model's
    K/V is that large."""
    return bool(torch.isfinite(rows.sum(dtype=torch.float32)))


class KvAssembler:
    """Checks the frames of one transfer and gathers its chunks into an ImportedKv, token-major ([tokens, token
    bytes], the wire's order): a chunk's payload lands in its rows straight from the socket (`destination`).
    With `staging` (NIXL), the chunks' bytes are written there by the prefill engine, and the frames only say
    which have landed."""

    def __init__(self, layout: KvLayout, start: int, end: int, staging: torch.Tensor | None = None,
                 on_chunk: Callable[[int, torch.Tensor], None] | None = None):
        self.layout, self.start, self.end = layout, start, end
        # (first token, its K/V as gather_tokens gives it) per checked chunk: the decode engine's blocks
        self.on_chunk = on_chunk
        self.rows = torch.empty((end - start, layout.token_bytes), dtype=torch.uint8)
        self.staging = staging
        self.received = start  # chunks checked and in place
        self.due = start  # the next chunk header's first token (ahead of `received` while a payload arrives)
        self.done = False

    def destination(self, header: dict) -> memoryview | None:
        """Where a chunk frame's payload goes (its rows), once its header is checked; None for other frames."""
        if header.get("type") != "chunk":
            return None
        if header.get("placed") or header.get("nbytes") != self._check_chunk(header) * self.layout.token_bytes:
            return None  # add() says what is wrong with it
        tokens = self._check_chunk(header, take=True)
        offset = header["first"] - self.start
        return self.rows[offset:offset + tokens].numpy().data.cast("B")

    def _check_chunk(self, header: dict, take: bool = False) -> int:
        """The chunk's tokens, if it is the one due; `take`: it is, and the next one is due after it."""
        first, tokens = header.get("first"), header.get("tokens")
        if first != self.due or not isinstance(tokens, int) or tokens < 1 or first + tokens > self.end:
            raise TransferError("garbage", f"chunk [{first}, +{tokens}) where [{self.due}, {self.end}) was due")
        if take:
            self.due += tokens
        return tokens

    def add(self, header: dict, payload: bytes | None) -> None:
        """One frame; `payload` None: a chunk whose bytes `destination` already put in place."""
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
        tokens = header["tokens"] if payload is None else self._check_chunk(header, take=True)
        offset = header["first"] - self.start
        rows = self.rows[offset:offset + tokens]
        if header.get("placed"):
            if self.staging is None or payload:
                raise TransferError("garbage", "a chunk said to be placed where no staging buffer was offered")
            rows.copy_(self.staging[offset:offset + tokens])
        elif payload is not None:
            if len(payload) != tokens * self.layout.token_bytes:
                raise TransferError("garbage", f"a chunk of {tokens} tokens in {len(payload)} bytes")
            rows.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(tokens, -1))
        if not all_finite(rows.view(self.layout.torch_dtype)):
            raise TransferError("garbage", "a chunk with values that are not finite")
        self.received += tokens
        if self.on_chunk is not None:
            self.on_chunk(header["first"], self._as_kv(rows))

    def _as_kv(self, rows: torch.Tensor) -> torch.Tensor:
        """Token-major rows as [layers, 2, kv heads, tokens, head dim] (a view)."""
        layout = self.layout
        kv = rows.view(layout.torch_dtype).view(rows.shape[0], layout.num_layers, 2, layout.num_kv_heads,
                                                layout.head_dim)
        return kv.permute(1, 2, 3, 0, 4)

    def result(self) -> ImportedKv:
        assert self.done
        return ImportedKv(self.start, self.end, self._as_kv(self.rows))


# ---- transports ------------------------------------------------------------------------------


class Transport(Protocol):
    name: str

    async def fetch(self, url: str, ask: dict, layout: KvLayout, timeout_s: float,
                    on_chunk: Callable[[int, torch.Tensor], None] | None = None) -> ImportedKv: ...


class TcpTransport:
    """Frames over HTTP/1.1 on TCP, read as they arrive (aiohttp)."""

    name = "tcp"

    def __init__(self, api_key: Callable[[], str | None] = lambda: None):
        self.api_key = api_key  # read per transfer: a mounted key file may rotate
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str, ask: dict, layout: KvLayout, timeout_s: float,
                    on_chunk: Callable[[int, torch.Tensor], None] | None = None) -> ImportedKv:
        assembler = KvAssembler(layout, ask["start"], len(ask["token_ids"]) - 1, on_chunk=on_chunk)
        return await self._stream(url, ask, assembler, timeout_s)

    async def _stream(self, url: str, ask: dict, assembler: KvAssembler, timeout_s: float) -> ImportedKv:
        reader = FrameReader(assembler.destination)
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


class NixlTransport(TcpTransport):
    """The K/V bytes by NIXL (UCX here: host memory between processes; RDMA or GPU memory where there is one):
    the decode engine registers one staging buffer with its NIXL agent at startup and offers each transfer a
    range of it; the prefill engine WRITEs every chunk there and sends only the chunk's header on the stream.
    A transfer that does not fit the free staging range goes with its bytes on the stream, as TcpTransport's."""

    name = "nixl"

    def __init__(self, api_key: Callable[[], str | None], layout: KvLayout, staging_tokens: int):
        super().__init__(api_key)
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = f"kaon-decode-{uuid.uuid4().hex[:16]}"
        # No progress thread: it polls a core even when idle (a quarter of one here). UCX progresses when
        # asked instead, by `_progress` while a transfer is in flight.
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.staging = torch.empty((staging_tokens, layout.token_bytes), dtype=torch.uint8)
        self.agent.register_memory(self.staging)
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.ranges = TokenRanges(staging_tokens)

    async def fetch(self, url: str, ask: dict, layout: KvLayout, timeout_s: float,
                    on_chunk: Callable[[int, torch.Tensor], None] | None = None) -> ImportedKv:
        start, end = ask["start"], len(ask["token_ids"]) - 1
        offset = self.ranges.take(end - start)
        if offset is None:
            return await super().fetch(url, ask, layout, timeout_s, on_chunk)
        progress = asyncio.create_task(self._progress())
        try:
            staging = self.staging[offset:offset + end - start]
            ask = ask | {"nixl": {"agent": self.agent_name, "metadata": self.metadata, "addr": staging.data_ptr()}}
            return await self._stream(url, ask, KvAssembler(layout, start, end, staging, on_chunk), timeout_s)
        finally:
            progress.cancel()
            self.ranges.give(offset, end - start)

    async def _progress(self) -> None:
        """Let UCX complete the prefill engine's WRITEs into our memory while the transfer is open (its TCP
        transport needs the target's progress too, and there is no progress thread: see __init__)."""
        while True:
            self.agent.get_new_notifs()
            await asyncio.sleep(PROGRESS_INTERVAL_S)


class TokenRanges:
    """First fit over a staging buffer's rows: the ranges that transfers in flight hold."""

    def __init__(self, size: int):
        self.size = size
        self.held: dict[int, int] = {}  # offset -> length

    def take(self, length: int) -> int | None:
        at = 0
        for offset, held in sorted(self.held.items()):
            if offset - at >= length:
                break
            at = offset + held
        if at + length > self.size:
            return None
        self.held[at] = length
        return at

    def give(self, offset: int, length: int) -> None:
        assert self.held.pop(offset) == length


class NixlWriter:
    """The prefill engine's side of NixlTransport: one NIXL agent, and the decode engines' agents it has met."""

    def __init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"kaon-prefill-{uuid.uuid4().hex[:16]}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.peers: set[str] = set()

    def write(self, peer: dict, offset_bytes: int, kv: torch.Tensor) -> None:
        """WRITE one chunk ([layers, 2, kv heads, tokens, head dim]) token-major into the decode engine's staging
        range, `offset_bytes` in; blocks until it is done (call it off the event loop)."""
        if peer["agent"] not in self.peers:
            self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
            self.peers.add(peer["agent"])
        rows = token_rows(kv)
        nbytes = rows.numel()
        registered = self.agent.register_memory(rows)
        try:
            remote = self.agent.get_xfer_descs([(peer["addr"] + offset_bytes, nbytes, 0)], "DRAM")
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(rows), remote, peer["agent"])
            state, deadline = self.agent.transfer(handle), time.monotonic() + WRITE_TIMEOUT_S
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(PROGRESS_INTERVAL_S / 4)  # not a spin: the engine thread shares the core
                state = self.agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"the NIXL WRITE to {peer['agent']} ended {state}")
        finally:
            self.agent.deregister_memory(registered)


def nixl_unavailable() -> str | None:
    """Why NIXL cannot carry K/V here (None: it can): not installed (pip install kaon[nixl])."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any failure to load means the same: not here
        return f"import nixl failed: {exc!r}"
    return None


def pick_transport(api_key: Callable[[], str | None], layout: KvLayout, choice: str = "auto",
                   staging_tokens: int = 4096) -> tuple[Transport, str]:
    """The transport a decode engine uses (NIXL where it runs, else TCP), and why not NIXL ("" when it is)."""
    why = "--kv-transport tcp" if choice == "tcp" else nixl_unavailable()
    if why is None:
        try:
            return NixlTransport(api_key, layout, staging_tokens), ""
        except Exception as exc:  # noqa: BLE001 -- an agent that does not start: TCP, and the log says why
            why = f"its agent did not start: {exc!r}"
    if choice == "nixl":
        raise RuntimeError(f"--kv-transport nixl: NIXL is not available here ({why})")
    return TcpTransport(api_key), why
