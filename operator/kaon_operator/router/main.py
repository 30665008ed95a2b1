"""`kaon-router` (or `python -m kaon_operator.router`): the OpenAI-compatible gateway in front of every
InferenceService."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import resource
import signal
import sys

from kaon_operator.router import compiled, edge
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.event_loop import CHOICES, LoopUnavailable, loop_factory
from kaon_operator.router.proxy import Router

DEFAULTS = RouterConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaon-router", description="route OpenAI requests to the ready engine "
                                     "pods of the InferenceService their `model` names (least connections, or "
                                     "prefix affinity with bounded loads: spec.routing)")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--namespace", action="append", default=[],
                        help="route to InferenceServices of this namespace only (repeatable; default: all)")
    parser.add_argument("--default-namespace",
                        help="where a bare `model` (no `<namespace>/`) resolves; `<namespace>/<name>` reaches "
                        "any served namespace (default: the first --namespace, else `default`)")
    parser.add_argument("--cluster-wide-names", action="store_true",
                        help="let a bare `model` also resolve in other namespaces (the oldest InferenceService "
                        "serving it) when the default namespace has none")
    parser.add_argument("--kubeconfig", help="default: the pod's ServiceAccount, else $KUBECONFIG or ~/.kube/config")
    parser.add_argument("--queue-timeout", type=float, default=DEFAULTS.queue_timeout,
                        help="seconds a request waits for a ready pod of its InferenceService, then 503")
    parser.add_argument("--max-queued", type=int, default=DEFAULTS.max_queued,
                        help="requests that may wait per InferenceService; more get a 503 at once")
    parser.add_argument("--backoff", type=float, default=DEFAULTS.backoff,
                        help="seconds a pod that just failed (refused, reset, broke off, timed out) gets no new "
                        "requests; doubles while it keeps failing (at most 8x), cleared by an answer or the watch")
    parser.add_argument("--connect-timeout", type=float, default=DEFAULTS.connect_timeout,
                        help="seconds to connect to an engine pod")
    parser.add_argument("--first-byte-timeout", type=float, default=DEFAULTS.first_byte_timeout,
                        help="seconds from sending a request to the engine's response headers (a request without "
                        "`stream` gets them with the whole completion); then another pod, or a 504")
    parser.add_argument("--idle-timeout", type=float, default=DEFAULTS.idle_timeout,
                        help="seconds a stream may send nothing; then it ends with an OpenAI error event")
    parser.add_argument("--write-timeout", type=float, default=DEFAULTS.write_timeout,
                        help="seconds one write of a response may wait for a client that stopped reading; then "
                        "its connection is dropped and the engine's request cancelled")
    parser.add_argument("--max-attempts", type=int, default=DEFAULTS.max_attempts,
                        help="pods one request tries when attempts fail before a response began")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes,
                        help="larger request bodies get a 413, unread when their Content-Length says so")
    parser.add_argument("--max-buffered-bytes", type=int, default=DEFAULTS.max_buffered_bytes,
                        help="request bytes held at once over all requests (bodies, then what parsing them "
                        "costs); a request past it gets a 503 with Retry-After, unread when its length says so")
    parser.add_argument("--max-client-share", type=float, default=DEFAULTS.max_client_share,
                        help="the part of --max-buffered-bytes one client (an address, an IPv6 /64) may hold; past "
                        "it, its own requests get the 503")
    parser.add_argument("--max-connections", type=int, default=DEFAULTS.max_connections,
                        help="client connections open at once; more get a 503 with Retry-After and are closed")
    parser.add_argument("--header-timeout", type=float, default=DEFAULTS.header_timeout,
                        help="seconds a connection may wait for a whole request head (new or kept alive), "
                        "then it is closed")
    parser.add_argument("--body-timeout", type=float, default=DEFAULTS.body_timeout,
                        help="seconds to receive a request body once its head is in, then a 408")
    parser.add_argument("--admin-port", type=int,
                        help="serve /health, /ready and every series of /metrics here too (for the kubelet and "
                        "the scraper only): the main port's /metrics leaves out those naming an InferenceService "
                        "or InferenceRoute with spec.auth, and refuses connections past --max-connections")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--event-loop", choices=CHOICES, default="auto",
                        help="auto (default): uvloop's when installed (the router's install brings it), else "
                             "asyncio's; asyncio: asyncio's own (router/event_loop.py)")
    return parser


def default_namespace(args: argparse.Namespace) -> str:
    return args.default_namespace or (args.namespace[0] if args.namespace else "default")


def _raise_open_file_limit() -> None:
    # Every stream holds two sockets (client and engine); the usual soft limit of 1024 caps
    # the router at ~500 streams.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


GC_GENERATION0 = 100_000
"""Net container allocations between collections of the youngest generation (CPython's default: 700).
Each request allocates a few hundred objects (aiohttp's request and response, headers, futures) that
reference counting frees; at the default the collector ran every few requests and cost ~13% of the
router's CPU per request (bench/router.py, 238 -> 208 us under load). Cycles are still collected,
just in batches."""


def quiet_gc() -> None:
    """After start-up: what was imported and built so far (the kubernetes client, the app) is moved out of
    the collector's view for good (gc.freeze), and the youngest generation is collected less often."""
    gc.freeze()
    gc.set_threshold(GC_GENERATION0, 50, 100)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kaon.router").info("%s", compiled.chosen().line())
    from kaon_operator.router.watch import ApiServer, NoCredentials, Watcher  # kubernetes is slow to import

    try:
        server = ApiServer.from_environment(args.kubeconfig)
    except NoCredentials as exc:
        print(f"kaon-router: error: {exc}", file=sys.stderr)
        return 2
    _raise_open_file_limit()
    table = EndpointTable(default_namespace=default_namespace(args), cluster_wide_names=args.cluster_wide_names)
    router = Router(table, RouterConfig(
        queue_timeout=args.queue_timeout, max_queued=args.max_queued, backoff=args.backoff,
        connect_timeout=args.connect_timeout, first_byte_timeout=args.first_byte_timeout,
        idle_timeout=args.idle_timeout, write_timeout=args.write_timeout,
        max_attempts=args.max_attempts, max_body_bytes=args.max_body_bytes,
        max_buffered_bytes=args.max_buffered_bytes, max_client_share=args.max_client_share,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout))
    from kaon_operator.router.route_gateway import RouteGateway
    from kaon_operator.router.route_status import RouteStatusWriter
    from kaon_operator.routes.table import RouteTable

    routes = RouteTable(default_namespace=table.default_namespace)
    router.routes = RouteGateway(router, routes)
    watcher = Watcher(server, table, args.namespace, routes=routes)
    statuses = RouteStatusWriter(server, router.routes)
    try:
        factory = loop_factory(args.event_loop)
    except LoopUnavailable as exc:
        print(f"kaon-router: error: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(router, watcher, args, statuses.run))
    except KeyboardInterrupt:
        pass
    return 0


async def serve(router: Router, watcher, args: argparse.Namespace, *loops) -> None:
    """Until SIGTERM or SIGINT: the watch, the router's port and, with --admin-port, the kubelet's and the scraper's."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    config = router.config
    watch = asyncio.create_task(watcher.run())
    others = [asyncio.create_task(loop()) for loop in loops]  # the InferenceRoutes' status writer
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(edge.serving(
            router.app(), args.host, args.port, max_connections=config.max_connections,
            header_timeout=config.header_timeout, refused=router.metrics.overloaded.inc))
        if args.admin_port:
            await stack.enter_async_context(edge.serving(
                router.admin_app(), args.host, args.admin_port, max_connections=64,
                header_timeout=config.header_timeout))
        logging.getLogger("kaon.router").info("listening on http://%s:%d", args.host, args.port)
        quiet_gc()
        await stop.wait()
    for task in (watch, *others):
        task.cancel()
    await asyncio.gather(watch, *others, return_exceptions=True)
