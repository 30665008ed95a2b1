"""Plays the kubelet and the container runtime for engine pods on the local control plane.

KWOK runs pods without processes. For pods whose image is under `local/` (the stage
`kaon-pod-run-local` leaves them Running but not Ready), this does what a kubelet would:

- **Volumes**: each pod volume becomes a host directory: an emptyDir a fresh temp dir per pod,
  a persistentVolumeClaim the hostPath/local path of the PersistentVolume bound to it, a
  secret or configMap a directory of its keys, a hostPath that path under the folder of the
  pod's node (`<log dir>/nodes/<spec.nodeName>/...`: the fake nodes share this machine's disk, so
  each gets a folder; two pods on one node share it, a pod on another node does not). A mount's
  `subPath` or `subPathExpr` ($(VAR) of the container's env, e.g. the downward API's namespace)
  picks a folder inside the volume. Paths in a container's args and environment
  that lie under one of its volumeMounts are rewritten to the host directory, so a process
  reads and writes where it would inside the container (`/mnt/models/llama` -> the PV's dir).
- **Environment**: `value`, `valueFrom` (secretKeyRef, configMapKeyRef, fieldRef) and
  `envFrom` are resolved from the API, as the kubelet does; a missing non-optional key
  leaves the container waiting in CreateContainerConfigError.
- **Arguments**: `$(VAR)` in args is replaced by the container's env var VAR (`$$` escapes, an
  undefined VAR stays as written), as the kubelet does.
- **Init containers** run first, in order (`kaon fetch`, from this tree); one that fails is
  reported in `initContainerStatuses` (terminated, exit code, and as its message the
  termination message, or with FallbackToLogsOnError the log's tail) and restarted with a
  back-off, shown as CrashLoopBackOff.
- **Other containers**: a container with its own `command` that is not kaon's (the node-cache
  prefetch DaemonSet's `hold` container, `python3 -c ...`) runs as written, with this Python.
- **The engine**: the pod's own command line (`kaon serve ...`) as a real process bound to
  the pod's IP. Its startupProbe, livenessProbe and readinessProbe run as declared (e2e/probes.py:
  periods, thresholds, timeouts, initial delays; liveness and readiness only after startup):
  Ready follows the readiness probe; a startup probe exhausted or a liveness probe failed kills
  the process (SIGTERM, SIGKILL after the grace period) with the kubelet's Unhealthy and Killing
  Events. SIGTERM when the pod is deleted (so it drains), SIGKILL after its grace period. If it
  exits, its termination is reported the same way and it is restarted with a back-off.
- **Run to completion** (`restartPolicy: Never`: the operator's profiling Job, `kaon profile`): the
  container's `terminationMessagePath` is a file of the pod's (that path in its args is rewritten
  to it), and when the process exits the pod is reported `Succeeded` or `Failed` with the
  container terminated, its message that file's content (the kubelet's 4 KiB), else with
  FallbackToLogsOnError and a failure the log's tail; it is not restarted.
- **Memory limits**: a process tree whose resident memory passes the container's
  `limits.memory` is SIGKILLed, as the kernel's OOM killer would in the container's cgroup, and
  reported as `OOMKilled`, exit code 137 (RSS summed over the tree, sampled every poll: an
  approximation of the cgroup's accounting, which also counts page cache and counts shared pages once).

- **The C kernels' cache**: every engine process gets `KAON_KERNEL_CACHE`, the machine's own cache of
  kaon's compiled C kernels (where `kaon_runtime.kernels.cpu_decode.cache_dir()` puts them for this
  user), unless its spec sets the variable. Each pod's `XDG_CACHE_HOME` is its own emptyDir, so
  without this every engine start compiled `cpu_decode.c` again (~4-5 s of CPU each, warm caches or
  cold, measured 2026-11-29), a cost a cluster pays once per node image, not once per pod start. The
  build is race-free (built beside, renamed into place); the compile itself is tested in tests/unit.

- **Services**: a Service URL in `--prefill-url` (spec.prefill's `http://<name>-prefill:80`) reaches a ready
  pod behind the Service through a forwarder of the runner's (e2e/service_proxy.py: the local cluster has no
  DNS and no kube-proxy); the prefill pool's pods run as the engine pods do.
- **Paths sent at run time**: a pvc:// LoRA adapter reaches the engine as a path in the pod
  (`/mnt/adapters/<claim>/...`, the operator's `lora_path` in a POST), which no argument
  rewriting can reach: the runner links each such mount path on the host to the claim's
  directory (one claim name per host: the tests give each claim a name unique on the machine, and a
  link to another live cluster's volume is refused, not re-pointed under that cluster's engine); the
  runner removes the links it made when it stops.
- **Two clusters on one machine** share the host's network and disk: each gets its own pod range
  (e2e/pod_range.py), ports and folders; the engine binds its KV events' `tcp://*:` endpoints to the
  pod's IP, not every address (two kv-aware pods would otherwise share port 5557, and one cluster's
  router could read the other's events), as `--host` is.

The whole data path is then real: router -> pod IP -> engine, reading weights from a volume.
Not simulated: CPU limits, readOnly mounts and the container image itself (every process runs
this tree's Python). Of the kubelet's Events only a probe's threshold crossing (Unhealthy) and the
kill (Killing) are posted, not every failed probe.

Over 300 lines for a stated reason: it is one stand-in for the kubelet, and each duty above reads
the same pod and process table; split, the pieces would pass that state around.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from e2e.control_plane import ControlPlane, _die_with_parent, wait_or_kill
from e2e.probes import ProbeState, http_probe, parse_quantity, probes
from e2e.service_proxy import ServiceProxies, ready_endpoints
from kaon_operator import labels
from kaon_operator.autoscaling.profiling import PROFILER, TERMINATION_MESSAGE_BYTES
from kaon_operator.children.node_prefetch import PREFETCH
from kaon_operator.lora.adapter_pods import ADAPTER_MOUNT

LOCAL_IMAGE_PREFIX = "local/"
BACKOFF_START, BACKOFF_MAX = 2.0, 30.0  # a kubelet starts at 10 s and caps at 5 min; tests are impatient
KUBECTL_TIMEOUT = 15.0  # seconds per kubectl call; the /ready probe has 1 s
LOG_TAIL_LINES, LOG_TAIL_BYTES = 80, 2048  # what FallbackToLogsOnError takes from the log
TERMINATION_MESSAGE_PATH = "/dev/termination-log"  # a container's default terminationMessagePath
# The runner's own environment reaches the processes (PATH, the venv...), but not credentials
# or endpoints of its own: a pod gets those only from its spec.
_PRIVATE_ENV = ("HF_", "AWS_", "KAON_", "HUGGING_FACE")
KERNEL_CACHE_ENV = "KAON_KERNEL_CACHE"


def shared_kernel_cache() -> Path:
    """The runner's own cache of kaon's compiled C kernels, found as kaon_runtime.kernels.cpu_decode.cache_dir()
    finds it (not imported: the runner does not load torch); shared by every local engine pod (see above)."""
    if KERNEL_CACHE_ENV in os.environ:
        return Path(os.environ[KERNEL_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kaon" / "kernels"


@dataclass(slots=True)
class _Process:
    proc: subprocess.Popen
    ip: str
    ports: dict[str, int]  # named container ports, for probes on `port: http`
    probes: dict[str, ProbeState] = field(default_factory=dict)
    memory_limit: int | None = None  # bytes (limits.memory)
    ready: bool = False
    kill_at: float | None = None  # SIGKILL at this time (after a SIGTERM's grace period)
    oom_killed: bool = False


@dataclass(slots=True)
class _Pod:
    """What the runner knows of one pod beyond its engine process."""
    dirs: dict[str, Path] = field(default_factory=dict)  # volume name -> host directory
    init_done: int = 0  # init containers that completed
    init: subprocess.Popen | None = None
    init_log: Path | None = None
    restarts: dict[str, int] = field(default_factory=dict)  # container -> restarts
    last: dict[str, dict] = field(default_factory=dict)  # container -> its last termination (lastState)
    retry_at: float = 0.0  # back-off: no new start before this
    engine_reported: bool = False  # the engine's exit was written to the pod status


class ContainerConfigError(Exception):
    """What a kubelet reports as CreateContainerConfigError (e.g. a missing Secret key)."""


def _ports(container: dict, args: list[str]) -> dict[str, int]:
    """The container's named ports; a kaon engine listens on its --port (8000 by default)."""
    port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
    return {"": port, **{p["name"]: p["containerPort"] for p in container.get("ports") or [] if p.get("name")}}


def _exit_code(returncode: int) -> int:
    """A container's exit code: 128 + the signal for a process killed by one (SIGKILL: 137), as a shell shows."""
    return 128 - returncode if returncode < 0 else returncode


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (tensor-parallel workers), as one cgroup would hold."""
    try:
        root = psutil.Process(pid)
        total = 0
        for proc in (root, *root.children(recursive=True)):
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0


def _command(args: list[str], ip: str, command: list[str] | None = None) -> list[str]:
    """The pod's `kaon ...` arguments, run with this Python and bound to the pod's IP; a container's own
    `python3 ...` command runs with this Python as written."""
    if command and command[0].startswith("python"):
        return [sys.executable, *command[1:], *args]
    args = list(args)
    if args[1:2] == ["serve"]:
        if "--host" in args:
            args[args.index("--host") + 1] = ip
        else:
            args += ["--host", ip]
        if "--kv-events-config" in args:
            at = args.index("--kv-events-config") + 1
            args[at] = args[at].replace("tcp://*:", f"tcp://{ip}:")
    return [sys.executable, "-m", "kaon_runtime.cli", *args[1:]]


_VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of an argument from the container's own env."""
    return _VAR_REFERENCE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def translate(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A path inside the container -> the host directory of the volume mounted there (longest mount first)."""
    for mount_path, host in sorted(mounts, key=lambda m: -len(m[0])):
        if value == mount_path:
            return str(host)
        if value.startswith(mount_path.rstrip("/") + "/"):
            return str(host / value[len(mount_path.rstrip("/")) + 1:])
    return value


class SharedPathError(ContainerConfigError):
    """A host path that another live local cluster on this machine uses (reported on the pod, tried again)."""


def may_relink(current: Path | None, ours: Path, owner: int | None, alive: Callable[[int], bool]) -> bool:
    """Whether a host link now pointing at `current`, made by the process `owner`, may be pointed at `ours`:
    yes when it is unset, ours already, or made by this process or one that is gone; no while another live
    process's cluster uses it (re-pointing would swap the volume under that cluster's engine)."""
    return current is None or current == ours or owner is None or owner == os.getpid() or not alive(owner)


def _owner_file(link: Path) -> Path:
    return link.with_name(f".{link.name}.owner")


def link_runtime_mounts(mounts: list[tuple[str, Path]]) -> list[Path]:
    """Link the adapters' mount paths on the host to their volumes' directories (see the docstring); the
    link's owner (this process) is noted beside it, in `.<name>.owner`. Returns the links made."""
    made = []
    for mount_path, host in mounts:
        if not mount_path.startswith(f"{ADAPTER_MOUNT}/"):
            continue
        link = Path(mount_path)
        if link.is_symlink() and link.readlink() == host:
            continue
        owner_file = _owner_file(link)
        current = link.readlink() if link.is_symlink() else None
        try:
            owner: int | None = int(owner_file.read_text())
        except (OSError, ValueError):
            owner = None
        if not may_relink(current, host, owner, psutil.pid_exists):
            raise SharedPathError(f"{link} links the volume of another local cluster (process {owner}: {current}): "
                                  f"a claim name must be unique on this machine while both clusters run")
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(host, target_is_directory=True)
        owner_file.write_text(f"{os.getpid()}\n")
        made.append(link)
    return made


def unlink_owned(links: set[Path]) -> None:
    """Remove the links this process made and still owns (a cluster's stop leaves no link behind)."""
    for link in links:
        owner_file = _owner_file(link)
        try:
            mine = int(owner_file.read_text()) == os.getpid()
        except (OSError, ValueError):
            continue
        if mine:
            link.unlink(missing_ok=True)
            owner_file.unlink(missing_ok=True)


def _tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_bytes()[-64 * 1024:].decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(lines)[-LOG_TAIL_BYTES:]


def _field(pod: dict, path: str) -> str:
    """A downward-API fieldRef's value."""
    return {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
            "status.podIP": (pod.get("status") or {}).get("podIP", ""), "spec.nodeName": pod["spec"].get("nodeName", "")
            }.get(path, "")


def _runs_to_completion(pod: dict) -> bool:
    return pod["spec"].get("restartPolicy") == "Never"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class PodRunner:
    def __init__(self, cp: ControlPlane, log_dir: Path, *, poll: float = 0.5, probe_look: float | None = None):
        """`probe_look`: quick looks between a probe's declared runs until it first succeeds
        (e2e/probes.py: a new engine is seen serving sooner; failures count as declared)."""
        self.cp, self.log_dir, self.poll, self.probe_look = cp, log_dir, poll, probe_look
        self._links: set[Path] = set()  # the adapter links on the host this runner made (removed at its stop)
        self.processes: dict[str, _Process] = {}  # "namespace/name" -> its engine
        self.pods: dict[str, _Pod] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        # Probe GETs run here: a hung engine costs its probe's timeout, never the loop's.
        self._probe_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self.services = ServiceProxies(self._service_endpoints)  # Service URLs in args: e2e/service_proxy.py

    def __enter__(self) -> PodRunner:
        self._thread.start()
        return self

    def _kubectl(self, *args: str, **kwargs):
        """kubectl with a short timeout: a wedged apiserver must not hold up the loop or a stop."""
        return self.cp.kubectl(*args, timeout=KUBECTL_TIMEOUT, **kwargs)

    def _kubectl_json(self, *args: str) -> dict:
        return self.cp.kubectl_json(*args, timeout=KUBECTL_TIMEOUT)

    def _service_endpoints(self, namespace: str, name: str, port: int) -> list[tuple[str, int]]:
        """The ready pods behind a Service, read at each connection a forwarder takes (none if unreadable)."""
        try:
            service = self._kubectl_json("get", "service", name, "-n", namespace)
            selector = ",".join(f"{k}={v}" for k, v in (service["spec"].get("selector") or {}).items())
            pods = self._kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"] if selector else []
        except Exception:  # noqa: BLE001 - as a Service without endpoints: the connection is refused
            return []
        return ready_endpoints(service, pods, port)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.services.close()
        for key in self.processes:
            self._terminate(key)
        for pod in self.pods.values():
            if pod.init and pod.init.poll() is None:
                pod.init.send_signal(signal.SIGTERM)
        for engine in self.processes.values():  # all asked first, so they drain side by side
            wait_or_kill(engine.proc, grace=30)
        for pod in self.pods.values():
            if pod.init:
                wait_or_kill(pod.init, grace=10)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        unlink_owned(self._links)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._sync()
            except Exception as exc:  # noqa: BLE001  keep playing the runtime; the test's own checks fail loudly
                print(f"pod runner: {exc}", file=sys.stderr)

    def _sync(self) -> None:
        # engine pods, a group's workers, prefill pools' pods, profiling pods, the node-cache prefetch DaemonSet's pods
        components = ",".join((labels.ENGINE, labels.ENGINE_WORKER, labels.PREFILL, PROFILER, PREFETCH))
        items = self._kubectl_json("get", "pods", "-A", "-l", f"{labels.COMPONENT} in ({components})")["items"]
        pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in items
                if p["spec"]["containers"][0].get("image", "").startswith(LOCAL_IMAGE_PREFIX)}
        for key, pod in pods.items():
            ip = (pod.get("status") or {}).get("podIP")
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(key, pod["metadata"].get("deletionGracePeriodSeconds",
                                                         pod["spec"].get("terminationGracePeriodSeconds", 30)))
            elif ip:
                try:
                    self._advance(key, pod, ip)
                except ContainerConfigError as exc:
                    self._report(pod, "containerStatuses", pod["spec"]["containers"][0]["name"],
                                 {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}})
                    if key in self.pods:  # else its volumes are not ready: tried again next round
                        self.pods[key].retry_at = time.monotonic() + BACKOFF_MAX
        self._refresh_secret_volumes(pods)
        for key in list(self.processes):
            going = key not in pods or pods[key]["metadata"].get("deletionTimestamp")
            if going:
                self._terminate(key)
                if self.processes[key].proc.poll() is not None:
                    del self.processes[key]
        for key in list(self.pods):
            if key not in pods and key not in self.processes:
                state = self.pods.pop(key)
                if state.init and state.init.poll() is None:
                    state.init.kill()
                for d in state.dirs.values():
                    if self.log_dir in d.parents and "pods" in d.parts:
                        shutil.rmtree(d, ignore_errors=True)

    # One step of a pod's life ---------------------------------------------------------------------------------------

    def _advance(self, key: str, pod: dict, ip: str) -> None:
        state = self.pods.get(key)
        if state is None:
            state = self.pods[key] = _Pod(dirs=self._volumes(key, pod))
        if key in self.processes:
            engine = self.processes[key]
            if engine.proc.poll() is None:
                self._supervise(key, pod)
            elif _runs_to_completion(pod):
                if not state.engine_reported:
                    self._completed(key, pod, state)
            elif not state.engine_reported:
                self._engine_exited(key, pod, state)
            elif time.monotonic() >= state.retry_at:
                del self.processes[key]  # restart after the back-off, as a kubelet would
                state.engine_reported = False
            return
        if time.monotonic() < state.retry_at:
            return
        inits = pod["spec"].get("initContainers") or []
        if state.init_done < len(inits):
            self._run_init(key, pod, state, inits[state.init_done])
            return
        self._start(key, pod, ip, state)

    def _run_init(self, key: str, pod: dict, state: _Pod, container: dict) -> None:
        name = container["name"]
        if state.init is None:
            state.init_log = self.log_dir / f"{name}-{key.replace('/', '-')}.log"
            with open(state.init_log, "wb") as log:  # a fresh log per attempt, like a container's
                command, env = self.init_command(pod, state, container)
                state.init = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              preexec_fn=_die_with_parent)
            self._report(pod, "initContainerStatuses", name, {"running": {"startedAt": _now()}}, initialized=False,
                         last=state.last.get(name), restarts=state.restarts.get(name, 0))
            return
        code = state.init.poll()
        if code is None:
            return
        state.init = None
        if code == 0:
            state.init_done += 1
            self._report(pod, "initContainerStatuses", name,
                          {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": _now()}},
                          initialized=state.init_done == len(pod["spec"]["initContainers"]),
                          last=state.last.get(name), restarts=state.restarts.get(name, 0))
            return
        restarts = state.restarts[name] = state.restarts.get(name, 0) + 1
        state.retry_at = time.monotonic() + min(BACKOFF_START * 2 ** (restarts - 1), BACKOFF_MAX)
        state.last[name] = self._terminated(code, container, state.init_log)  # kept as lastState, as a kubelet does
        self._report(pod, "initContainerStatuses", name,
                     {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off restarting failed container {name}"}},
                     last=state.last[name], restarts=restarts, initialized=False)

    def init_command(self, pod: dict, state: _Pod, container: dict) -> tuple[list[str], dict[str, str]]:
        """An init container's command line and environment, as the kubelet would start it."""
        env = self._env(pod, container, state)
        args = [translate(expand(a, self._own_env(container, env)), self._mounts(container, state, pod))
                for a in container.get("args") or []]
        return _command(args, pod["status"]["podIP"], container.get("command")), env

    def _engine_exited(self, key: str, pod: dict, state: _Pod) -> None:
        container = pod["spec"]["containers"][0]
        engine = self.processes[key]
        self._set_ready(key, engine, False)
        code = _exit_code(engine.proc.returncode)
        restarts = state.restarts[container["name"]] = state.restarts.get(container["name"], 0) + 1
        state.retry_at = time.monotonic() + min(BACKOFF_START * 2 ** (restarts - 1), BACKOFF_MAX)
        state.engine_reported = True
        state.last[container["name"]] = self._terminated(code, container, self._engine_log(key),
                                                         oom_killed=engine.oom_killed)
        self._report(pod, "containerStatuses", container["name"],
                     {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off restarting failed container {container['name']}"}},
                     last=state.last[container["name"]], restarts=restarts)

    def _completed(self, key: str, pod: dict, state: _Pod) -> None:
        """A run-to-completion pod's process exited: the pod Succeeded or Failed, for good."""
        container = pod["spec"]["containers"][0]
        engine = self.processes[key]
        code = _exit_code(engine.proc.returncode)
        terminated = self._terminated(code, container, self._engine_log(key), oom_killed=engine.oom_killed,
                                      message_file=self._termination_file(key))
        status = {"name": container["name"], "image": "local", "ready": False, "restartCount": 0,
                  "state": terminated}
        conditions = [{"type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": _now()}
                      for t in ("ContainersReady", "Ready")]
        patch = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [status],
                 "conditions": conditions}
        meta = pod["metadata"]
        self._kubectl("patch", "pod", meta["name"], "-n", meta["namespace"], "--subresource=status",
                      "--type=strategic", "-p", json.dumps({"status": patch}), check=False)
        engine.ready, state.engine_reported = False, True

    def _termination_file(self, key: str) -> Path:
        return self.log_dir / f"termination-{key.replace('/', '-')}"

    @staticmethod
    def _terminated(code: int, container: dict, log: Path | None, oom_killed: bool = False,
                    message_file: Path | None = None) -> dict:
        message = ""
        if message_file is not None and message_file.exists():
            message = message_file.read_bytes()[:TERMINATION_MESSAGE_BYTES].decode(errors="replace")
        if not message and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = _tail(log)
        reason = "OOMKilled" if oom_killed else "Error" if code else "Completed"
        return {"terminated": {"exitCode": code, "reason": reason, "message": message, "finishedAt": _now()}}

    def _report(self, pod: dict, field_name: str, container: str, state: dict, *, last: dict | None = None,
                restarts: int = 0, initialized: bool | None = None) -> None:
        status = {"name": container, "image": "local", "ready": False, "restartCount": restarts, "state": state}
        if last:
            status["lastState"] = last
        patch: dict = {field_name: [status]}
        if initialized is not None:
            patch["conditions"] = [{"type": "Initialized", "status": "True" if initialized else "False",
                                    "lastTransitionTime": _now()}]
        meta = pod["metadata"]
        self._kubectl("patch", "pod", meta["name"], "-n", meta["namespace"], "--subresource=status",
                        "--type=strategic", "-p", json.dumps({"status": patch}), check=False)

    def _engine_log(self, key: str) -> Path:
        return self.log_dir / f"engine-{key.replace('/', '-')}.log"

    def _start(self, key: str, pod: dict, ip: str, state: _Pod) -> None:
        container = pod["spec"]["containers"][0]
        env = self._env(pod, container, state)
        mounts = self._mounts(container, state, pod)
        if _runs_to_completion(pod):  # its termination message is read back (the profiling Job's model)
            self._termination_file(key).unlink(missing_ok=True)
            mounts.append((container.get("terminationMessagePath", TERMINATION_MESSAGE_PATH),
                           self._termination_file(key)))
        args = [translate(expand(a, self._own_env(container, env)), mounts) for a in container.get("args") or []]
        args = self.services.rewrite(args, pod["metadata"]["namespace"])
        self._links.update(link_runtime_mounts(self._mounts(container, state, pod)))
        log_path = self._engine_log(key)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(_command(args, ip, container.get("command")), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        self.processes[key] = _Process(proc, ip, _ports(container, args),
                                       probes(container, time.monotonic(), self.probe_look),
                                       memory_limit=parse_quantity(limit) if limit else None)
        if container["name"] in state.last:  # a restart: running again, the failure kept as lastState
            self._report(pod, "containerStatuses", container["name"], {"running": {"startedAt": _now()}},
                         last=state.last[container["name"]], restarts=state.restarts.get(container["name"], 0))

    # Volumes and environment ----------------------------------------------------------------------------------------

    def _volumes(self, key: str, pod: dict) -> dict[str, Path]:
        namespace = pod["metadata"]["namespace"]
        base = self.log_dir / "pods" / key.replace("/", "-")
        dirs = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                dirs[name] = self._claim_dir(namespace, volume["persistentVolumeClaim"]["claimName"])
                continue
            if "hostPath" in volume:  # the node's own folder: kept when the pod goes, shared by its pods
                dirs[name] = self.node_dir(pod) / volume["hostPath"]["path"].lstrip("/")
                dirs[name].mkdir(parents=True, exist_ok=True)
                continue
            path = base / name
            path.mkdir(parents=True, exist_ok=True)
            for source, kind in (("secret", "secretName"), ("configMap", "name")):
                if source in volume:
                    obj = self._get(source.lower(), namespace, volume[source][kind]) or {}
                    for k, v in (obj.get("data") or {}).items():
                        (path / k).write_bytes(base64.b64decode(v) if source == "secret" else v.encode())
            dirs[name] = path
        return dirs

    SECRET_SYNC_S = 2.0  # the kubelet takes up to about a minute; tests need not wait that long
    _secrets_synced_at = 0.0

    def _refresh_secret_volumes(self, pods: dict[str, dict]) -> None:
        """As the kubelet does: a Secret edited while its pod runs is rewritten in the pod's volume
        (spec.auth's key rotation), each file replaced atomically, keys gone from the Secret removed."""
        now = time.monotonic()
        if now < self._secrets_synced_at + self.SECRET_SYNC_S:
            return
        self._secrets_synced_at = now
        for key, state in list(self.pods.items()):
            pod = pods.get(key)
            if pod is None:
                continue
            for volume in pod["spec"].get("volumes") or []:
                if "secret" not in volume or volume["name"] not in state.dirs:
                    continue
                secret = self._get("secret", pod["metadata"]["namespace"], volume["secret"]["secretName"]) or {}
                data, path = secret.get("data") or {}, state.dirs[volume["name"]]
                for stale in {p.name for p in path.iterdir() if not p.name.startswith(".")} - set(data):
                    (path / stale).unlink()
                for k, v in data.items():
                    tmp = path / f".{k}.tmp"  # hidden: readers skip it, as they skip the kubelet's ..data
                    tmp.write_bytes(base64.b64decode(v))
                    os.replace(tmp, path / k)

    def node_dir(self, pod: dict) -> Path:
        """The folder that stands for the disk of the pod's node."""
        return self.log_dir / "nodes" / (pod["spec"].get("nodeName") or "unscheduled")

    def _claim_dir(self, namespace: str, claim: str) -> Path:
        pvc = self._get("pvc", namespace, claim)
        volume = (pvc or {}).get("spec", {}).get("volumeName")
        if not volume:
            raise ContainerConfigError(f"persistentvolumeclaim {claim!r} is not bound")
        pv = self._get("pv", None, volume) or {}
        path = (pv.get("spec", {}).get("hostPath") or pv.get("spec", {}).get("local") or {}).get("path")
        if not path:
            raise ContainerConfigError(f"persistentvolume {volume!r} is neither hostPath nor local")
        return Path(path)

    def _get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
        res = self._kubectl(*args, check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    @staticmethod
    def _mounts(container: dict, state: _Pod, pod: dict | None = None) -> list[tuple[str, Path]]:
        mounts = []
        for m in container.get("volumeMounts") or []:
            host = state.dirs.get(m["name"])
            if host is None:
                continue
            sub = m.get("subPath") or ""
            if m.get("subPathExpr") and pod is not None:  # $(VAR) of the container's plain and downward-API env
                own = {v["name"]: v["value"] if "value" in v else _field(pod, v["valueFrom"]["fieldRef"]["fieldPath"])
                       for v in container.get("env") or []
                       if "value" in v or "fieldRef" in (v.get("valueFrom") or {})}
                sub = expand(m["subPathExpr"], own)
                (host / sub).mkdir(parents=True, exist_ok=True)  # the kubelet creates it
            mounts.append((m["mountPath"], host / sub if sub else host))
        return mounts

    def _env(self, pod: dict, container: dict, state: _Pod) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV)}
        env["OMP_NUM_THREADS"] = "1"
        for source in container.get("envFrom") or []:
            for ref, kind in (("secretRef", "secret"), ("configMapRef", "configmap")):
                if ref in source:
                    obj = self._get(kind, namespace, source[ref]["name"])
                    if obj is None and not source[ref].get("optional"):
                        raise ContainerConfigError(f"{kind} {source[ref]['name']!r} not found")
                    for k, v in ((obj or {}).get("data") or {}).items():
                        env[source.get("prefix", "") + k] = base64.b64decode(v).decode() if kind == "secret" else v
        for var in container.get("env") or []:
            value = self._env_value(pod, namespace, var)
            if value is not None:
                env[var["name"]] = value
        mounts = self._mounts(container, state, pod)
        env = {k: translate(v, mounts) for k, v in env.items()}
        # After translating: the machine's cache may lie under a path a pod mounts (/tmp in a cold CI).
        if not any(var["name"] == KERNEL_CACHE_ENV for var in container.get("env") or []):
            env[KERNEL_CACHE_ENV] = str(shared_kernel_cache())
        return env

    @staticmethod
    def _own_env(container: dict, env: dict[str, str]) -> dict[str, str]:
        """What $(VAR) may name: the container's `env` entries (not the runner's own environment)."""
        return {var["name"]: env[var["name"]] for var in container.get("env") or [] if var["name"] in env}

    def _env_value(self, pod: dict, namespace: str, var: dict) -> str | None:
        if "valueFrom" not in var:
            return var.get("value", "")
        source = var["valueFrom"]
        for ref, kind in (("secretKeyRef", "secret"), ("configMapKeyRef", "configmap")):
            if ref in source:
                sel = source[ref]
                data = ((self._get(kind, namespace, sel["name"]) or {}).get("data") or {})
                if sel["key"] not in data:
                    if sel.get("optional"):
                        return None
                    raise ContainerConfigError(f"couldn't find key {sel['key']} in {kind} {namespace}/{sel['name']}")
                return base64.b64decode(data[sel["key"]]).decode() if kind == "secret" else data[sel["key"]]
        if "fieldRef" in source:
            return _field(pod, source["fieldRef"]["fieldPath"])
        return None

    # Probes, memory and termination ---------------------------------------------------------------------------------

    def _supervise(self, key: str, pod: dict) -> None:
        """One look at a running engine, as a kubelet's probe workers and the kernel would take."""
        engine, now = self.processes[key], time.monotonic()
        if engine.kill_at is not None:  # being stopped: SIGKILL once its grace period is over
            if now >= engine.kill_at:
                engine.proc.kill()
            return
        if engine.memory_limit and _tree_rss(engine.proc.pid) > engine.memory_limit:
            engine.oom_killed = True
            try:
                for proc in psutil.Process(engine.proc.pid).children(recursive=True):
                    proc.kill()
            except psutil.Error:
                pass  # gone already
            engine.proc.kill()  # the OOM killer does not ask first
            engine.kill_at = now
            self._set_ready(key, engine, False)
            return
        for probe in engine.probes.values():
            if probe.in_flight is not None and probe.in_flight.done():
                ok, why = probe.in_flight.result()
                before = probe.result
                verdict = probe.record(ok, now)
                if verdict is False and before is not False:
                    name = probe.kind.removesuffix("Probe").capitalize()
                    self._event(pod, "Warning", "Unhealthy", f"{name} probe failed: {why}")
                if probe.kind == "startupProbe" and verdict is True and before is not True:
                    for other in engine.probes.values():  # started: liveness and readiness begin now
                        other.next_at = max(other.next_at, now) if other is probe else now
        startup, liveness = engine.probes.get("startupProbe"), engine.probes.get("livenessProbe")
        for failing, what in ((startup, "startup"), (liveness, "liveness")):
            if failing is not None and failing.result is False:
                grace = failing.spec.get("terminationGracePeriodSeconds",
                                         pod["spec"].get("terminationGracePeriodSeconds", 30))
                self._event(pod, "Normal", "Killing", f"Container {pod['spec']['containers'][0]['name']} failed "
                                                      f"{what} probe, will be restarted")
                self._kill(engine, grace)
                self._set_ready(key, engine, False)
                return
        started = startup is None or startup.result is True
        for kind, probe in engine.probes.items():
            if (kind == "startupProbe") == started:  # startup until it succeeds, then the other two
                continue
            if probe.due(now):
                probe.begin(self._probe_pool.submit(http_probe, probe.spec, engine.ip, engine.ports), now)
        readiness = engine.probes.get("readinessProbe")
        self._set_ready(key, engine, started and (readiness is None or readiness.result is True))

    def _kill(self, engine: _Process, grace: float) -> None:
        if engine.proc.poll() is None and engine.kill_at is None:
            engine.proc.send_signal(signal.SIGTERM)
            engine.kill_at = time.monotonic() + grace

    def _set_ready(self, key: str, engine: _Process, ready: bool) -> None:
        if ready != engine.ready:
            now = _now()
            status = "True" if ready else "False"
            conditions = [{"type": t, "status": status, "lastTransitionTime": now}
                          for t in ("ContainersReady", "Ready")]
            namespace, name = key.split("/")
            self._kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=strategic",
                          "-p", json.dumps({"status": {"conditions": conditions}}), check=False)
            engine.ready = ready

    def _event(self, pod: dict, type_: str, reason: str, message: str) -> None:
        """An Event on the pod, as the kubelet posts it (`kubectl describe pod` shows it)."""
        meta, now = pod["metadata"], _now()
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                 "involvedObject": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta.get("uid"),
                                    "fieldPath": f"spec.containers{{{pod['spec']['containers'][0]['name']}}}"},
                 "type": type_, "reason": reason, "message": message[:1024], "count": 1,
                 "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "kubelet (pod runner)"}}
        self._kubectl("create", "-f", "-", input=json.dumps(event), check=False)

    def _terminate(self, key: str, grace: float | None = None) -> None:
        engine = self.processes.get(key)
        if engine and engine.proc.poll() is None:
            if engine.kill_at is None:
                self._kill(engine, BACKOFF_MAX if grace is None else grace)  # the engine drains, as under a kubelet
            elif time.monotonic() >= engine.kill_at:
                engine.proc.kill()  # past the grace period (a hung process ignores SIGTERM)
        state = self.pods.get(key)
        if state and state.init and state.init.poll() is None:
            state.init.send_signal(signal.SIGTERM)
