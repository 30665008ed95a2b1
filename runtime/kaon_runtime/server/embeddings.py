"""/v1/embeddings in OpenAI's wire format, served by `kaon serve --task embed`.

Each input is one engine request that ends with its prefill (SamplingParams.pooling; how the
hidden states are pooled, and why last-token for decoders, is in engine/pooling.py), so a batch
of inputs is batched by the scheduler with whatever else runs. The vector is L2-normalized
here (vLLM's default for embedding models, and what Qwen3-Embedding's config asks for), unless
the request sends vLLM's `normalize: false`.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from kaon_runtime.engine.async_engine import AsyncEngine, RequestStream
from kaon_runtime.engine.embed_input import kept_tokens
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.server import protocol as p
from kaon_runtime.server.metrics import Metrics
from kaon_runtime.server.pipeline import APIError

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(p._OpenTopLevel):
    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        p._NON_EMPTY, p._TOKEN_IDS, {"type": "array", "items": p._NON_EMPTY, "minItems": 1, "maxItems": MAX_INPUTS},
        {"type": "array", "items": p._TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS}]})
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    normalize: bool = True  # vLLM's: false returns the pooled vector as it is
    # vLLM's: an input past the model's maximum is a 400 unless this asks for the cut (k: its first k tokens;
    # -1: the maximum); engine/embed_input.py
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _inputs(self):
        items = self.prompts()
        if not items or len(items) > MAX_INPUTS:
            raise ValueError(f"input: 1 to {MAX_INPUTS} items")
        if any(len(item) == 0 for item in items):
            raise ValueError("input: an empty string or token list cannot be embedded")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be an integer >= 1 or -1, got 0")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The inputs, one per embedding: a string, token ids, or a list of either."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)  # type: ignore[arg-type]


def check_dimensions(dimensions: int | None, hidden_size: int, matryoshka: bool | list[int]) -> None:
    """`dimensions` cuts a Matryoshka model's embeddings short (the checkpoint's config says it was
    trained so: engine/pooling.py); any other model only has its own size (a vector cut short that
    was not trained for it would silently lose meaning)."""
    if dimensions is None or dimensions == hidden_size:
        return
    if matryoshka is True and dimensions < hidden_size:
        return
    if isinstance(matryoshka, list) and dimensions in matryoshka:
        return
    allowed = (f"one of {sorted(matryoshka)}" if isinstance(matryoshka, list) and matryoshka else
               f"at most {hidden_size}" if matryoshka is True else f"only {hidden_size}: not a Matryoshka model")
    raise InvalidRequestError(f"dimensions: this model embeds in {hidden_size} dimensions; it can return {allowed}")


def encode(vector: list[float], normalize: bool, encoding_format: str,
           dimensions: int | None = None) -> list[float] | str:
    """The vector as the response carries it: its first `dimensions`, normalized (L2) or not;
    floats, or base64 of little-endian float32s (what OpenAI's client decodes)."""
    vector = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def encoded_response(body: EmbeddingRequest, model: str, outputs: list[RequestOutput]) -> bytes:
    """The response's JSON: normalizing and serializing 2,048 vectors takes seconds, so the route
    calls this on a worker thread, never on the event loop (/health must not wait for it)."""
    whole = response(body, model, outputs)
    # One vector at a time: json.dumps holds the GIL for the whole of one call (8M floats: a second),
    # so /health, on the event loop's thread, gets its turn between vectors. `"data":null` cannot
    # occur inside a string of the head (its quotes would be escaped there).
    items = b",".join(_dumps(item) for item in whole["data"])
    return _dumps({**whole, "data": None}).replace(b'"data":null', b'"data":[' + items + b"]", 1)


def _dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()  # as JSONResponse


def response(body: EmbeddingRequest, model: str, outputs: list[RequestOutput]) -> dict[str, Any]:
    data = []
    for index, output in enumerate(outputs):
        assert output.embedding is not None, "a finished embedding request carries its vector"
        data.append({"object": "embedding", "index": index,
                     "embedding": encode(output.embedding, body.normalize, body.encoding_format, body.dimensions)})
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def kept(truncate: int | None, limit: int) -> int | None:
    """The request's truncate_prompt_tokens as the number of tokens an input keeps (engine/embed_input.py), a 400
    naming the field when it asks for more than the model takes."""
    try:
        return kept_tokens(truncate, limit)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens") from None


async def embed(engine: AsyncEngine, metrics: Metrics, prompts: list[str | list[int]],
                pooling: str, truncate: int | None = None) -> list[RequestOutput]:
    """Run every input through the engine at once; the first failure aborts the rest. `truncate`: vLLM's
    truncate_prompt_tokens (None: an input past the context is refused)."""
    params = SamplingParams(max_tokens=0, pooling=pooling, truncate_prompt_tokens=truncate)
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:  # each is validated (tokenized) before it is queued
            streams.append(await engine.add_request(f"embd-{uuid.uuid4().hex}", prompt, params))
        return await asyncio.gather(*(_last(stream, metrics) for stream in streams))
    finally:
        for stream in streams:
            stream.abort()  # a no-op for the finished ones


async def _last(stream: RequestStream, metrics: Metrics) -> RequestOutput:
    timer, last = metrics.track(), None
    try:
        async for last in stream:
            timer.observe(last)
    finally:
        timer.finish(last, aborted=last is None or not last.finished)
    assert last is not None, "a stream ends with a finished output"
    return last
