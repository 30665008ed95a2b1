"""The tensor-parallel worker processes: ranks 1..N-1, each holding its shard of the model.

Rank 0 is the engine's own process: it owns the scheduler and plans every step. The
workers are spawned processes that load their shard, report how many KV blocks they hold,
then run every step plan they receive until told to stop. Loading needs no peer, so the
ranks join the process group only once every one of them has loaded: a worker that fails
to load is reported by pipe at once instead of leaving the others waiting at a rendezvous.
Plans travel by pipe, not by a collective, so a worker waits for the next step for as long as the engine is idle, and
sees the engine's end (a closed pipe) even if the engine dies without saying goodbye. The
activations travel by collectives inside the model (gloo on CPU, NCCL between GPUs).
"""
from __future__ import annotations

import logging
import os
import socket
import weakref
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from kaon_runtime.config import EngineConfig, ModelConfig
from kaon_runtime.distributed.parallel import Group, TensorParallel, join_group
from kaon_runtime.distributed.sharding import check_tensor_parallel
from kaon_runtime.distributed.stages import split_layers
from kaon_runtime.engine.model_loader import pick_device
from kaon_runtime.engine.model_runner import ModelRunner
from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.errors import ModelDoesNotFitError, ModelLoadError
from kaon_runtime.loader import open_checkpoint

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerReport:
    num_blocks: int
    weight_bytes: int


def check_devices(config: EngineConfig, model: ModelConfig, device: torch.device) -> None:
    """Refuse at start what cannot work: a split the model's shape does not allow, or more GPUs than exist."""
    size = config.tensor_parallel_size
    check_tensor_parallel(model, size)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ModelLoadError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")


def check_pipeline(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse at start a pipeline the model cannot be cut into (more stages than layers)."""
    check_tensor_parallel(model, config.tensor_parallel_size)
    try:
        split_layers(model.num_layers, config.pipeline_parallel_size)
    except ValueError as exc:
        raise ModelDoesNotFitError(str(exc)) from None


# A worker that finds itself re-running the user's script (spawn imports the main module again,
# and a script without a main guard creates its LLM there) exits with this code, quietly.
MAIN_GUARD_EXIT = 87


def main_guard_message(size: int, what: str = "tensor_parallel_size") -> str:
    return (f"{what} {size} starts {size - 1} worker process(es) with multiprocessing's spawn, which "
            "runs your script again in each: put the code that creates the LLM under "
            "`if __name__ == \"__main__\":`")


class WorkerPool:
    """Ranks 1..N-1 as seen from rank 0."""

    def __init__(self, config: EngineConfig, device: torch.device):
        size = config.tensor_parallel_size
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a spawned worker importing the main module, which creates an LLM at import
            # time: starting processes now fails with multiprocessing's bootstrap traceback. Exit
            # with a code rank 0 turns into the one line that says what to do.
            raise SystemExit(MAIN_GUARD_EXIT)
        port = _free_port()
        context = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=worker_main, args=(config, rank, size, port, theirs),
                                   name=f"kaon-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        # Rank 0's place (the engine's own process); its group is bound once the workers have loaded.
        self._group = Group()
        self.tp = TensorParallel(0, size, group=self._group, world=self._group)
        # Whatever happens to the engine, the workers are told to go and the group is released.
        self._finalizer = weakref.finalize(self, _shut_down, self._conns, self._procs, self._group)
        self._port, self._device, self._size = port, device, size
        self.lost: str | None = None  # (the pipeline group's watch; a pipe's end surfaces in the step)

    def wait_ready(self) -> list[WorkerReport]:
        """Block until every worker has loaded its shard (raising its error if one could not),
        then join the process group with them."""
        reports = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                kind, payload = conn.recv()
            except EOFError:
                proc = self._procs[rank - 1]
                proc.join(timeout=10)
                if proc.exitcode == MAIN_GUARD_EXIT:
                    self.close()
                    raise ModelLoadError(main_guard_message(self._size)) from None
                kind, payload = "error", f"exited with code {proc.exitcode} while loading"
            if kind == "error":
                self.close()
                raise ModelLoadError(f"tensor-parallel rank {rank}: {payload}")
            reports.append(payload)
        join_group(0, self._size, self._port, self._device, self._group)
        return reports

    def send(self, plan: StepPlan) -> None:
        for conn in self._conns:
            conn.send(plan)

    def close(self) -> None:
        self._finalizer()


def _shut_down(conns, procs, group: Group) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass  # that worker is gone already
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    for conn in conns:
        conn.close()
    for proc in procs:
        try:
            proc.close()  # its sentinel's descriptor
        except ValueError:
            pass  # still running after its kill: the OS reaps it with us
    group.release()


def worker_main(config: EngineConfig, rank: int, size: int, port: int, conn) -> None:
    """A worker's life: load the shard, join the group, run plans until None or a closed pipe."""
    group = Group()  # bound once every rank has loaded
    try:
        if pick_device(config.device, rank).type == "cpu":
            # CPU tensor parallelism is for tests: the ranks share the cores instead of fighting over them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        runner = ModelRunner(config, open_checkpoint(config.model), show_progress=False,
                             tp=TensorParallel(rank, size, group=group, world=group))
    except Exception as exc:  # noqa: BLE001 -- reported to rank 0, which raises it as the engine's start-up error
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", WorkerReport(runner.num_blocks, runner.weight_bytes)))
    try:
        join_group(rank, size, port, runner.device, group)
        while (plan := conn.recv()) is not None:
            runner.run(plan)
    except EOFError:
        log.warning("rank %d: the engine went away; exiting", rank)
    finally:
        group.release()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
