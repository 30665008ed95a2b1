"""`kaon serve`: load the model, then run the app under uvicorn with a graceful drain on SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import uvicorn

from kaon_runtime.config import EngineConfig
from kaon_runtime.engine import startup
from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.kv_transfer import KvLayout
from kaon_runtime.engine.kv_wire import pick_transport
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.engine.pooling import matryoshka_of_checkpoint, pooling_of_checkpoint
from kaon_runtime.engine.remote_prefill import RemotePrefill
from kaon_runtime.server import disagg, limits
from kaon_runtime.server.app import ServerSettings, ServerState, create_app
from kaon_runtime.server.keys import ApiKeys

logger = logging.getLogger("uvicorn.error")  # configured by uvicorn, so these lines reach its log

# After the drain, uvicorn's own shutdown only has to close idle connections.
SHUTDOWN_AFTER_DRAIN_S = 2


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first.

    uvicorn on SIGTERM stops listening at once, so a load balancer would see refused
    connections instead of a failing readiness probe. Here the first SIGTERM turns /ready
    and new requests into 503s, lets in-flight requests finish (up to the grace period),
    then shuts down and exits 0. SIGINT, or a second SIGTERM, still stops at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: /ready answers from here on
            logger.info("%s", startup.serving())

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self._drain_task is None and self._loop is not None:
            # Signal handlers run between bytecodes; hand the work to the loop.
            self._loop.call_soon_threadsafe(self._begin_drain)
        else:
            super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        logger.info("SIGTERM: draining (up to %.0fs for in-flight requests)", self._grace_s)
        await self._state.drain(self._grace_s)
        if self._state.in_flight:
            logger.warning("grace period over with %d request(s) in flight; cutting them", self._state.in_flight)
        self.should_exit = True


def serve(config: EngineConfig, args, fetch_adapter: Callable[[str], str] | None = None) -> int:
    """Serve `config`'s model: the CLI built the engine configuration; `args` are the server's own flags;
    `fetch_adapter` turns a LoRA adapter's hf:// or s3:// path into a local directory."""
    llm_engine = LLMEngine(config, show_progress=False)
    try:
        return _run(args, AsyncEngine(llm_engine, max_queue=args.max_queue, stall_timeout_s=args.stall_timeout,
                                      max_queue_wait_s=args.max_queue_wait or None,
                                      max_running=config.max_num_seqs), fetch_adapter)
    finally:
        llm_engine.close()  # the tensor-parallel workers, if any


def _remote_prefill(args, engine: AsyncEngine) -> RemotePrefill | None:
    """A decode engine's prefill engines, over the transport pick_transport names; None for other roles."""
    if getattr(args, "role", "both") != "decode":
        return None
    llm = engine.engine
    own = ApiKeys(args.api_key, args.api_key_file)  # the prefill engines take the same keys (the operator mounts them)

    def first_key() -> str | None:
        return next((key.decode() for key in own.keys()), None)  # noqa: SIM118 -- ApiKeys.keys(), not a dict's

    layout = KvLayout.of_cache(llm.runner.kv_cache)
    transport, why_not_nixl = pick_transport(first_key, layout, args.kv_transport)
    remote = RemotePrefill(args.prefill_url, transport, layout, llm.block_manager, args.disagg_min_prompt_tokens,
                           args.disagg_timeout, getattr(args, "disagg_max_in_flight", 2))
    remote.why_not_nixl = why_not_nixl
    return remote


def _run(args, engine: AsyncEngine, fetch_adapter: Callable[[str], str] | None) -> int:
    settings = ServerSettings(model_name=args.served_model_name or args.model, api_key=args.api_key,
                              api_key_file=args.api_key_file, max_body_bytes=args.max_body_bytes,
                              tool_call_parser=args.tool_call_parser, limits=limits.from_args(args),
                              task="embed" if args.task == "embed" else "generate",
                              pooling=pooling_of_checkpoint(args.model) if args.pooling == "auto" else args.pooling,
                              matryoshka=matryoshka_of_checkpoint(args.model), fetch_adapter=fetch_adapter,
                              runtime_lora=args.enable_runtime_lora, admin_key=args.admin_key or None,
                              max_registered_loras=args.max_cpu_loras, max_lora_bytes=args.max_lora_bytes,
                              lora_load_timeout=args.lora_load_timeout, sleep_mode=args.enable_sleep_mode,
                              sleep_grace_s=args.sleep_grace_period)
    app = create_app(engine, settings)
    bounds = settings.limits
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_AFTER_DRAIN_S,
                            http=limits.deadline_protocol(bounds.header_timeout, bounds.body_timeout,
                                                          bounds.write_timeout),
                            limit_concurrency=bounds.max_connections)
    # After uvicorn's Config, which sets up the log it writes to.
    disagg.install(app, engine, getattr(args, "role", "both"), _remote_prefill(args, engine))
    server = _DrainingServer(config, app.state.server, args.drain_timeout)
    server.run()
    return 0 if server.started else 1  # uvicorn returns quietly when startup fails
