"""The OpenAI-compatible HTTP app: routes, auth, readiness and drain.

Every route reads its request the same way (pipeline.py: the body, the model it names, the errors);
what is here is what the routes share besides (admission, the in-flight count the drain waits
on, the SSE response that aborts on a disconnect); what a route does with a request lives
elsewhere (serving.py, responses.py, embeddings.py, tokenize.py, lora_routes.py, limits.py).
Over 300 lines for a stated reason: the route table itself, one short handler a route, reads best
in one place beside the admission and drain state those handlers share.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.embed_input import check_length
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.server import embeddings, openapi as doc, protocol as p, sleep as sleep_mode
from kaon_runtime.server.batch import MAX_PROMPTS, GenerationBatch, batch_sse_events, merged_response, prompts_of
from kaon_runtime.server.extensions import ignored_fields_header
from kaon_runtime.server.keys import ApiKeys, matches
from kaon_runtime.server.limits import (
    Admission,
    Limits,
    check_chat,
    check_completion,
    check_logprobs,
    check_prompt,
    check_prompt_logprobs,
    utf8_length,
)
from kaon_runtime.server.lora_routes import routes as lora_routes
from kaon_runtime.server.metrics import Metrics
from kaon_runtime.server.pipeline import (
    CLIENT_CLOSED_REQUEST,
    RETRY_AFTER_S,
    APIError,
    bad_input,
    check_model,
    install_error_handlers,
    parse,
)
from kaon_runtime.server.responses import ResponsesFormat, ResponsesRequest
from kaon_runtime.server.serving import (
    ChatFormat,
    CompletionFormat,
    Generation,
    final_output,
    final_outputs,
    sse_events,
)
from kaon_runtime.server.tokenize import routes as tokenize_routes
from kaon_runtime.server.tokenizer_info import routes as tokenizer_info_routes
from kaon_runtime.server.tool_calls import plan_chat, tool_parser
from kaon_runtime.version import package_version


@dataclass(slots=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    api_key_file: str | None = None
    """A file (or a directory of files, one key each: a mounted Secret) of accepted keys, re-read on change."""
    max_body_bytes: int = 4 << 20
    tool_call_parser: str | None = None  # hermes, llama3, mistral; None or "auto": from the chat template
    limits: Limits = field(default_factory=Limits)
    """What one request may cost, checked before it is tokenized (server/limits.py)."""
    task: str = "generate"  # or "embed": /v1/embeddings instead of the generating routes (server/embeddings.py)
    pooling: str = "last"  # how --task embed pools the hidden states (engine/pooling.py)
    matryoshka: bool | list[int] = False  # the embedding lengths `dimensions` may ask for besides the model's own
    fetch_adapter: Callable[[str], str] | None = None
    """Downloads a LoRA adapter given as hf:// or s3:// (the CLI passes kaon fetch's); None: local paths only."""
    runtime_lora: bool = False
    """/v1/load_lora_adapter and /v1/unload_lora_adapter answer (with admin_key only); else they are a 404."""
    admin_key: str | None = None
    """The operator's key for the adapter routes; the serving keys do not open them (lora_routes.py)."""
    max_registered_loras: int = 16  # adapters registered at once (vLLM's --max-cpu-loras), checked before a download
    max_lora_bytes: int = 1 << 30  # one adapter's files, checked before they are read
    lora_load_timeout: float = 600.0  # seconds a load (its download included) is waited for
    sleep_mode: bool = False
    """/sleep, /wake_up and /is_sleeping answer (with admin_key only); else they are a 404 (server/sleep.py)."""
    sleep_grace_s: float = 30.0  # how long a sleep waits for the requests in flight before it aborts them


class ServerState:
    """Readiness and the requests in flight, which a drain waits for."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0

    async def drain(self, grace_s: float) -> None:
        """Refuse new work and wait (up to grace_s) for the requests in flight to finish."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110  a counter, polled to a deadline
            await asyncio.sleep(0.05)


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app for one engine. The routes below are module-level; what they share lives on
    `app.state` (engine, settings, server, metrics, keys) and reaches them through dependencies."""
    keys = ApiKeys(settings.api_key, settings.api_key_file)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    # The document is served below, behind the key like /v1 (FastAPI's own openapi_url would need none).
    app = FastAPI(title="kaon", version=doc.API_VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.settings, app.state.keys = engine, settings, keys
    app.state.server = ServerState()
    app.state.metrics = Metrics(engine.stats)
    app.state.admission = Admission(engine)
    app.state.lora_lock = asyncio.Lock()  # one adapter load at a time (lora_routes.py)
    install_error_handlers(app)
    doc.install(app, settings.model_name, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                secured=keys.enabled)
    app.include_router(probes)
    app.include_router(tokenizer_info_routes)  # open, for the router's kv-aware strategy
    app.include_router(document, dependencies=[Depends(_authorized)])
    app.include_router(v1)
    # vLLM serves these outside /v1; they need the key like /v1 does.
    app.include_router(tokenize_routes, dependencies=[Depends(_authorized), Depends(_not_draining)])
    app.include_router(lora_routes, dependencies=[Depends(_not_draining)])  # the admin key, not the serving keys
    sleep_mode.install(app, engine)  # /sleep, /wake_up, /is_sleeping: the admin key too
    app.add_middleware(_CountInFlight, state=app.state.server)
    return app


# ---- what the routes share: the app's state, as dependencies --------------------------------


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


def _settings(request: Request) -> ServerSettings:
    return request.app.state.settings


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


Engine = Annotated[AsyncEngine, Depends(_engine)]
Settings = Annotated[ServerSettings, Depends(_settings)]
State = Annotated[ServerState, Depends(_state)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]


async def _authorized(request: Request) -> None:
    keys: ApiKeys = request.app.state.keys
    if not keys.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    admin = request.app.state.settings.admin_key  # the operator reads /v1/models with it
    allowed = keys.accepts(token) | (admin is not None and matches(token.encode(), (admin.encode(),)))
    if not allowed or scheme.lower() != "bearer":  # compare first: same time either way
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                       code="invalid_api_key")


async def _not_draining(state: State) -> None:
    if state.draining:
        raise APIError(503, "the server is draining; retry on another replica", type="service_unavailable",
                       code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})


# A route of the other task is refused before its body is read, whatever the body (the embeddings
# route as the generating ones).
async def _generates(settings: Settings) -> None:
    if settings.task == "embed":
        raise APIError(400, "this server was started with --task embed: it serves /v1/embeddings, not generation",
                       param="model", code="wrong_task")


async def _embeds(settings: Settings) -> None:
    if settings.task != "embed":
        raise APIError(400, "this server generates text; embeddings are served by a server started with "
                       "--task embed", param="model", code="wrong_task")


# ---- routes --------------------------------------------------------------------------------

probes = APIRouter()  # no key needed: kubelets and Prometheus call these
v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorized), Depends(_not_draining)])


document = APIRouter()


@document.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@probes.get("/health", responses=doc.HEALTH)
async def health(engine: Engine):
    # Liveness: the engine thread runs and, with requests pending, completes steps (engine.health()).
    problem = engine.health()
    if problem is not None:
        raise APIError(503, problem, type="server_error",
                       code="engine_dead" if not engine.is_alive else "engine_stalled")
    return {"status": "ok"}


@probes.get("/ping", responses=doc.HEALTH)
async def ping(engine: Engine):
    # vLLM's (SageMaker's health probe, GET or POST): /health by another name.
    return await health(engine)


@probes.post("/ping", include_in_schema=False)  # one entry in the document is enough
async def ping_post(engine: Engine):
    return await health(engine)


@probes.get("/ready", responses=doc.HEALTH)
async def ready(request: Request, engine: Engine, state: State):
    if state.draining:
        raise APIError(503, "the server is draining", type="service_unavailable", code="draining")
    await sleep_mode.awake(request)  # asleep: not ready, so the router sends nothing
    return await health(engine)


@probes.get("/version")
async def version():
    # vLLM's /version: the serving software's release (kaon's package), open like /health.
    return {"version": package_version()}


@probes.get("/metrics", response_class=Response, responses=doc.METRICS)
async def prometheus(metrics: MetricsDep):
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@v1.get("/models", response_model=p.ModelList, responses=doc.V1_ERRORS)
async def models(engine: Engine, settings: Settings):
    now, length = int(time.time()), engine.max_model_len
    cards = [p.ModelCard(id=settings.model_name, created=now, max_model_len=length)]
    cards += [p.ModelCard(id=name, created=now, max_model_len=length, root=path, parent=settings.model_name)
              for name, path in engine.lora_adapters()]  # LoRA adapters, their base as parent (vLLM's)
    return p.ModelList(data=cards).model_dump()


@v1.get("/models/{model_id:path}", response_model=p.ModelCard, responses={**doc.V1_ERRORS, 404: doc.GENERATE[404]})
async def model(model_id: str, engine: Engine, settings: Settings):
    """OpenAI's retrieve: one card of /v1/models (the id may hold slashes: builtin://..., org/name)."""
    for card in (await models(engine, settings))["data"]:
        if card["id"] == model_id:
            return card
    raise APIError(404, f"the model {model_id!r} does not exist; this server serves {settings.model_name!r}",
                   param="model", code="model_not_found")


@v1.post("/completions", response_model=p.CompletionResponse, openapi_extra=doc.json_body(p.CompletionRequest),
         responses=doc.GENERATE, dependencies=[Depends(_generates), Depends(sleep_mode.awake)])
async def completions(request: Request, engine: Engine, settings: Settings, metrics: MetricsDep):
    body = await parse(request, p.CompletionRequest)
    adapter = check_model(request, body.model)
    prompts = prompts_of(body.prompt)
    if len(prompts) > 1:  # OpenAI's and vLLM's batch: one engine request per prompt, one response
        return await _batched_completions(request, engine, settings, metrics, body, prompts, adapter)
    prompt = prompts[0]
    check_completion(body, prompt, settings.limits, engine.max_model_len)
    params = _salted(request, body.to_sampling_params())
    with request.app.state.admission.slot():
        gen = await _start(engine, settings, metrics, "cmpl", prompt, params, adapter)
    fmt = CompletionFormat(gen, engine.tokenizer, echo=body.echo, prompt_logprobs=body.prompt_logprobs)
    return await _respond(request, gen, fmt, body)


@v1.post("/chat/completions", response_model=p.ChatCompletionResponse,
         openapi_extra=doc.json_body(p.ChatCompletionRequest), responses=doc.GENERATE,
         dependencies=[Depends(_generates), Depends(sleep_mode.awake)])
async def chat_completions(request: Request, engine: Engine, settings: Settings, metrics: MetricsDep):
    body = await parse(request, p.ChatCompletionRequest)
    adapter = check_model(request, body.model)
    check_chat(body, body.max_output_tokens, settings.limits, engine.max_model_len)
    plan = plan_chat(body, engine.tokenizer, tool_parser(engine.tokenizer, settings.tool_call_parser))
    params = _salted(request, body.to_sampling_params(plan.constraint))
    with request.app.state.admission.slot():
        prompt = await asyncio.to_thread(engine.tokenizer.apply_chat_template, plan.messages, tools=plan.tools)
        gen = await _start(engine, settings, metrics, "chatcmpl", prompt, params, adapter)
    return await _respond(request, gen, ChatFormat(gen, engine.tokenizer, plan.calling, body.prompt_logprobs), body)


@v1.post("/responses", openapi_extra=doc.json_body(ResponsesRequest), responses=doc.GENERATE,
         dependencies=[Depends(_generates), Depends(sleep_mode.awake)])  # server/responses.py
async def responses(request: Request, engine: Engine, settings: Settings, metrics: MetricsDep):
    body = await parse(request, ResponsesRequest)
    try:
        chat = body.as_chat()
    except ValidationError as exc:
        raise bad_input(exc.errors()) from None
    adapter = check_model(request, chat.model)
    check_chat(chat, chat.max_output_tokens, settings.limits, engine.max_model_len)
    plan = plan_chat(chat, engine.tokenizer, tool_parser(engine.tokenizer, settings.tool_call_parser))
    params = _salted(request, chat.to_sampling_params(plan.constraint))
    with request.app.state.admission.slot():
        prompt = await asyncio.to_thread(engine.tokenizer.apply_chat_template, plan.messages, tools=plan.tools)
        gen = await _start(engine, settings, metrics, "resp", prompt, params, adapter)
    fmt, headers = ResponsesFormat(gen, plan.calling), ignored_fields_header(body)
    if body.stream:
        return await _stream(request, gen, fmt.events(), headers)
    try:
        output = await final_output(gen, lambda: _disconnected(request))
    finally:
        gen.close()
    if output is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.response(output), headers=headers)


@v1.post("/embeddings", openapi_extra=doc.json_body(embeddings.EmbeddingRequest), responses=doc.GENERATE,
         dependencies=[Depends(_embeds), Depends(sleep_mode.awake)])
async def create_embeddings(request: Request, engine: Engine, settings: Settings, metrics: MetricsDep):
    body = await parse(request, embeddings.EmbeddingRequest)
    check_model(request, body.model, adapters=False)  # an embedding runs on the base model
    prompts = body.prompts()
    keep = embeddings.kept(body.truncate_prompt_tokens, engine.max_model_len)
    for prompt in prompts:  # token ids are checked here; a text once tokenized, by the engine (engine/embed_input.py)
        text, ids = (prompt, []) if isinstance(prompt, str) else ("", prompt)
        check_prompt(utf8_length(text), 0, settings.limits, engine.max_model_len)
        check_length(len(ids) if keep is None else min(len(ids), keep), engine.max_model_len)
    embeddings.check_dimensions(body.dimensions, engine.engine.model_config.hidden_size, settings.matryoshka)
    with request.app.state.admission.slot():
        outputs = await embeddings.embed(engine, metrics, prompts, settings.pooling, body.truncate_prompt_tokens)
    reply = await asyncio.to_thread(embeddings.encoded_response, body, settings.model_name, outputs)  # off the loop
    return Response(reply, media_type="application/json", headers=ignored_fields_header(body))


async def _batched_completions(request: Request, engine: AsyncEngine, settings: ServerSettings, metrics: Metrics,
                               body: p.CompletionRequest, prompts: list[str | list[int]], adapter: str | None
                               ) -> Response:
    """A batch of prompts (server/batch.py): each checked as a prompt alone, all admitted before any runs."""
    if len(prompts) > min(MAX_PROMPTS, engine.max_queue):  # past the queue a retry could never succeed: no 429
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {min(MAX_PROMPTS, engine.max_queue)} "
                       "(each waits in the queue: --max-queue)", param="prompt")
    for prompt in prompts:
        check_completion(body, prompt, settings.limits, engine.max_model_len)
    check_logprobs(body.n * len(prompts), body.logprobs, body.max_tokens, settings.limits, engine.max_model_len)
    params = _salted(request, body.to_sampling_params())
    batch = GenerationBatch()
    try:
        with request.app.state.admission.slot():
            engine.admit_batch(len(prompts))  # the whole batch or none of it, as one request (vLLM queues it all)
            for prompt in prompts:
                batch.gens.append(await _start(engine, settings, metrics, "cmpl", prompt, params, adapter,
                                               admitted=True))
    except BaseException:
        batch.close()  # the prompts already queued do not run for nobody
        raise
    fmts = [CompletionFormat(gen, engine.tokenizer, echo=body.echo, prompt_logprobs=body.prompt_logprobs)
            for gen in batch.gens]
    for fmt in fmts:
        fmt.token_ids_as_names = body.return_tokens_as_token_ids
    headers = ignored_fields_header(body)
    if body.stream:
        try:  # the head goes once the first prompt has a token; the others stream in as theirs come
            if not await batch.start(lambda: _disconnected(request)):
                batch.close()
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            batch.close()
            raise
        return _SSEResponse(batch_sse_events(batch, fmts, body.n, body.include_usage, body.continuous_usage),
                            batch, headers)
    try:
        outputs = await final_outputs(batch.gens, lambda: _disconnected(request))
    finally:
        batch.close()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    def encoded() -> bytes:
        merged = merged_response([fmt.response(out) for fmt, out in zip(fmts, outputs)], body.n)
        return merged.model_dump_json().encode()
    return Response(await asyncio.to_thread(encoded), media_type="application/json", headers=headers)


def _salted(request: Request, params: SamplingParams) -> SamplingParams:
    """With several API keys, each key's requests get their own prefix cache (a salt from the key); a
    request's own cache_salt (vLLM's) divides its key's cache further, never reaching past it: one tenant
    cannot probe another's cached prompts, not even by sending the other's salt."""
    keys: ApiKeys = request.app.state.keys
    if len(keys.keys()) < 2:
        return params
    token = request.headers.get("authorization", "").partition(" ")[2]
    salt = "key:" + hashlib.sha256(token.encode()).hexdigest()
    if params.cache_salt is not None:
        salt += ":" + params.cache_salt
    return dataclasses.replace(params, cache_salt=salt)


async def _start(engine: AsyncEngine, settings: ServerSettings, metrics: Metrics, prefix: str,
                 prompt: str | list[int], params: SamplingParams, adapter: str | None = None,
                 admitted: bool = False) -> Generation:
    if params.prompt_logprobs is not None:  # scored prompts count against --max-logprob-entries by their length
        ids = prompt if isinstance(prompt, list) else await asyncio.to_thread(engine.tokenizer.encode, prompt)
        check_prompt_logprobs(len(ids), params, settings.limits, engine.max_model_len)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    timer = metrics.track()
    stream = await engine.add_request(request_id, prompt, params, adapter, admitted=admitted)
    return Generation(request_id, adapter or settings.model_name, stream, timer, params.stop, params.logprobs)


async def _respond(request: Request, gen: Generation, fmt, body) -> Response:
    headers = ignored_fields_header(body)
    fmt.token_ids_as_names = body.return_tokens_as_token_ids
    if body.stream:
        return await _stream(request, gen, sse_events(gen, fmt, body.n, body.include_usage, body.continuous_usage),
                             headers)
    try:
        output = await final_output(gen, lambda: _disconnected(request))
    finally:
        gen.close()
    if output is None:  # nobody is listening; the status is for the access log
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # Off the event loop: a response with many choices and log-probabilities takes a while to
    # build and encode, and /health must not wait for it.
    return Response(await asyncio.to_thread(_encoded, fmt, output), media_type="application/json", headers=headers)


async def _stream(request: Request, gen: Generation, events, headers: dict[str, str]) -> Response:
    """An SSE response once the request has its first token: an error before it (refused past capacity,
    the engine gone) is the response's status, not an event inside a 200 stream."""
    try:
        started = await gen.start(lambda: _disconnected(request))
    except BaseException:
        gen.close()
        raise
    if not started:
        gen.close()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return _SSEResponse(events, gen, headers)


def _encoded(fmt, output) -> bytes:
    return fmt.response(output).model_dump_json().encode()


class _CountInFlight:
    """Counts HTTP exchanges until their last byte is sent (a stream included), for the drain.

    Counted from arrival, not from admission, so a request still being validated when the
    drain starts is waited for too.
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class _SSEResponse(StreamingResponse):
    """An SSE stream that closes its generation however the response ends.

    A disconnect cancels the send mid-stream, possibly before the body iterator ever ran,
    so cleanup belongs here rather than in the iterator.
    """

    def __init__(self, events, gen: Generation | GenerationBatch, headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


# ---- request plumbing --------------------------------------------------------------------


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
