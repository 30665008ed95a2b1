"""Pipeline (x tensor) parallel ranks across processes and hosts: the leader's view and every other rank's life.

The leader (rank 0, host 0) keeps the scheduler; every other rank, spawned here or started on its
own host by `kaon serve` (LeaderWorkerSet's worker pods), connects to the leader's control channel
(distributed.rendezvous) and says which rank it is. Once all have, the leader says "go" and the
world joins torch.distributed; each rank loads only its stage's share of the model and reports
its KV pool; then every rank runs every step plan the leader sends until told to stop. The
activations go stage to stage (distributed.transport); the plans only by the control channel, so an
idle rank waits there, and sees the leader's end as a closed connection.

A group is all or nothing: when any rank's connection closes the leader closes every other one (so
every rank exits), and a served leader ends its own process too (its /health stops answering; the
LeaderWorkerSet recreates the group). A rank that never joins fails the start naming the rank.

Why one module just past 300 lines: both ends of the control channel (the leader's group, a rank's loop)
speak one protocol, and this keeps them side by side.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from kaon_runtime.config import EngineConfig
from kaon_runtime.distributed.parallel import TensorParallel, join_world
from kaon_runtime.distributed.rendezvous import Rendezvous, connect_to_leader, rendezvous_from
from kaon_runtime.distributed.stages import Placement, ranks_of_host
from kaon_runtime.engine.model_loader import pick_device
from kaon_runtime.engine.model_runner import ModelRunner
from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.engine.workers import MAIN_GUARD_EXIT, WorkerReport, main_guard_message
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader import open_checkpoint

log = logging.getLogger(__name__)

# Set by `kaon serve`: a leader whose group lost a rank ends its process (in a Python program the
# engine's next step raises instead).
exit_on_peer_loss = False
HANDSHAKE_TIMEOUT_S = 10.0  # a rank answers the control channel's challenge in milliseconds


def _receive_deadline(conn: Connection, seconds: float) -> None:
    """Make `conn`'s blocking reads fail after `seconds` (0: wait forever), through the socket's
    SO_RCVTIMEO: a Connection has no timeout of its own, and the option is the socket's, shared
    with the duplicate set here."""
    whole = int(seconds)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", whole, int((seconds - whole) * 1_000_000)))


def uses_pipeline(config: EngineConfig, rdv: Rendezvous) -> bool:
    return config.pipeline_parallel_size > 1 or rdv.num_hosts > 1


def world_rendezvous(config: EngineConfig) -> Rendezvous:
    return rendezvous_from(config.distributed_init_address)


class PipelineGroup:
    """Ranks 1..N-1 as the leader sees them. Constructing it starts this host's other ranks and
    blocks until every rank has joined; `tp` is then the leader's own place in the world."""

    def __init__(self, config: EngineConfig, rdv: Rendezvous, num_layers: int):
        if getattr(mp.current_process(), "_inheriting", False):
            raise SystemExit(MAIN_GUARD_EXIT)  # a spawned rank re-running the user's script (engine.workers)
        if rdv.port == 0:
            rdv = replace(rdv, port=_free_port_pair())
        self.world = config.pipeline_parallel_size * config.tensor_parallel_size
        self.rdv, self._closing = rdv, False
        self.lost: str | None = None  # why the group broke up, once a rank went away
        self._procs: dict[int, BaseProcess] = {}
        self._conns: dict[int, Connection] = {}
        self._all_joined = threading.Event()
        # The given address only (the leader's pod IP under a LeaderWorkerSet, 127.0.0.1 on one host),
        # never every interface. The handshake is ours (_handshake), so a connection that says nothing
        # holds only its own thread, for HANDSHAKE_TIMEOUT_S, not the accept loop.
        self._listener = Listener(rdv.control_address, backlog=self.world + 16)
        self._joining = threading.Lock()
        threading.Thread(target=self._accept, name="kaon-pp-accept", daemon=True).start()
        self._procs = _spawn_local_ranks(config, rdv, ranks_of_host(self.world, rdv.num_hosts, 0)[1:])
        try:
            self._wait_joined()
            for conn in self._conns.values():
                conn.send(("go", num_layers))
            device = pick_device(config.device)
            self.tp = join_world(Placement(0, config.tensor_parallel_size, config.pipeline_parallel_size),
                                 rdv.host, rdv.port, num_layers, device)
        except BaseException:
            self.close()
            raise

    def _accept(self) -> None:
        while not self._all_joined.is_set():
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                continue
            if self._closing:  # close()'s own wake-up call (_wake_accept)
                conn.close()
                return
            threading.Thread(target=self._handshake, args=(conn,), name="kaon-pp-handshake", daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        """Authenticate one connection (both ways, as Listener(authkey=...) does) and take its rank,
        within HANDSHAKE_TIMEOUT_S: a stranger, or one that never speaks, is dropped."""
        try:
            _receive_deadline(conn, HANDSHAKE_TIMEOUT_S)
            deliver_challenge(conn, self.rdv.authkey)
            answer_challenge(conn, self.rdv.authkey)
            _, rank = conn.recv()
            _receive_deadline(conn, 0)  # from now on the channel waits as long as the group lives
        except Exception:  # noqa: BLE001 -- a stranger failing or sitting on the handshake: dropped
            conn.close()
            return
        with self._joining:
            self._conns[rank] = conn
            if len(self._conns) >= self.world - 1:
                self._all_joined.set()

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self.rdv.join_timeout_s
        while not self._all_joined.wait(0.2):
            for rank, proc in self._procs.items():
                if proc.exitcode == MAIN_GUARD_EXIT:
                    what = "pipeline_parallel_size x tensor_parallel_size"
                    raise ModelLoadError(main_guard_message(self.world, what))
                if proc.exitcode is not None and rank not in self._conns:
                    raise ModelLoadError(f"pipeline rank {rank} exited with code {proc.exitcode} before joining")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world)) - set(self._conns))
                raise ModelLoadError(
                    f"pipeline rank(s) {', '.join(map(str, missing))} of {self.world} did not join within "
                    f"{self.rdv.join_timeout_s:.0f}s: the leader listens at {self.rdv.host}:{self.rdv.port + 1} "
                    "(start every host with the same --distributed-init-address or LeaderWorkerSet's LWS_* "
                    "environment)")

    def wait_ready(self) -> list[WorkerReport]:
        """Block until every rank has loaded its stage (raising the first error), then watch them."""
        reports = []
        for rank in sorted(self._conns):
            try:
                kind, payload = self._conns[rank].recv()
            except (EOFError, OSError):
                kind, payload = "error", "exited while loading"
            if kind == "error":
                self.close()
                raise ModelLoadError(f"pipeline rank {rank}: {payload}")
            reports.append(payload)
        threading.Thread(target=self._watch, name="kaon-pp-watch", daemon=True).start()
        return reports

    def _watch(self) -> None:
        """Ranks never write after their report: a readable connection is one that closed."""
        ranks = {conn: rank for rank, conn in self._conns.items()}
        ready = wait(list(ranks))
        if self._closing:
            return
        rank = ranks[ready[0]]  # type: ignore[index]
        self.lost = f"pipeline rank {rank} went away; the group shuts down"
        log.error(self.lost)
        for conn in self._conns.values():
            conn.close()  # every other rank sees the end and exits
        if exit_on_peer_loss:
            os.kill(os.getpid(), signal.SIGINT)  # the server stops at once (no drain: the group is gone)
            threading.Timer(10, os._exit, (1,)).start()  # and the process ends regardless, if a step is wedged

    def _wake_accept(self) -> None:
        """The accept thread waits in accept() for a connection that never comes once every rank has
        joined, and closing the listener does not wake it on Linux: left there, the thread (and through
        its bound method this group, its processes' pipes) lived as long as the process, one per pipeline
        engine a notebook built. A connection of our own wakes it; it sees _closing and ends."""
        try:
            with socket.create_connection(self.rdv.control_address, timeout=5):
                pass
        except OSError:
            pass  # not listening (never bound, or already closed): nothing waits in accept()

    def send(self, plan: StepPlan) -> None:
        for conn in self._conns.values():
            conn.send(plan)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for conn in self._conns.values():
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass  # gone already
        for proc in self._procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns.values():
            conn.close()
        self._wake_accept()
        self._listener.close()
        tp: TensorParallel | None = getattr(self, "tp", None)  # absent when the group never formed
        if tp is not None:
            tp.release()


def _spawn_local_ranks(config: EngineConfig, rdv: Rendezvous, ranks: range) -> dict[int, BaseProcess]:
    context = mp.get_context("spawn")
    procs: dict[int, BaseProcess] = {}
    for rank in ranks:
        proc = context.Process(target=rank_main, args=(config, rank, rdv, rank - ranks.start + 1, len(ranks) + 1),
                               name=f"kaon-pp-rank{rank}", daemon=True)
        proc.start()
        procs[rank] = proc
    return procs


def rank_main(config: EngineConfig, rank: int, rdv: Rendezvous, local_index: int, ranks_here: int) -> None:
    """A rank other than the leader: join, load its stage, run plans until None or a closed channel."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    conn = connect_to_leader(rdv, rank)
    conn.send(("hello", rank))
    try:
        _, num_layers = conn.recv()
    except EOFError:
        return  # the leader gave up on the group before it formed
    device = pick_device(config.device, local_index)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    placement = Placement(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    try:
        tp = join_world(placement, rdv.host, rdv.port, num_layers, device)
        checkpoint = open_checkpoint(config.model)
        runner = ModelRunner(config, checkpoint, show_progress=False, tp=tp)
    except Exception as exc:  # noqa: BLE001 -- reported to the leader, which raises it as the start-up error
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)  # at once: the others may never reach a shutdown
    conn.send(("ready", WorkerReport(runner.num_blocks, runner.weight_bytes)))
    try:
        while (plan := conn.recv()) is not None:
            runner.run(plan)
    except (EOFError, OSError):
        log.warning("rank %d: the leader went away; exiting", rank)
        os._exit(1)
    except Exception:  # a peer died mid-step (the transport fails): the group is over
        log.exception("rank %d: the step failed; exiting", rank)
        os._exit(1)
    tp.release()


def serve_stage(config: EngineConfig, rdv: Rendezvous, health_address: tuple[str, int] | None = None) -> int:
    """`kaon serve` on a worker host (LWS_WORKER_INDEX > 0): run this host's ranks until the group ends,
    answering GET /health with 200 at `health_address` meanwhile (the HTTP API is the leader's)."""
    ranks = ranks_of_host(config.pipeline_parallel_size * config.tensor_parallel_size, rdv.num_hosts,
                          rdv.host_index)
    log.info("worker host %d of %d: ranks %d-%d, leader %s:%d", rdv.host_index, rdv.num_hosts, ranks.start,
             ranks.stop - 1, rdv.host, rdv.port)
    if health_address is not None:
        _serve_health(health_address)
    procs = _spawn_local_ranks(config, rdv, ranks[1:])
    try:
        rank_main(config, ranks.start, rdv, 0, len(ranks))
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return 0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass  # probes every few seconds: not worth a line each


def _serve_health(address: tuple[str, int]) -> None:
    server = ThreadingHTTPServer(address, _Health)
    threading.Thread(target=server.serve_forever, name="kaon-pp-health", daemon=True).start()


def _free_port_pair() -> int:
    """A port whose successor is free too (the rendezvous and the control channel)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
