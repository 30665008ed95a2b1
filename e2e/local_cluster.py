"""kaon on a local cluster, every part real and from the working tree.

The control plane (e2e/control_plane.py) with KWOK GPU nodes; the Helm chart installed
with no operator or router pods (KWOK pods run nothing); the operator and the router
from this tree as processes running as the chart's ServiceAccounts; and the pod runner
that gives each `local/*` engine pod a real `kaon serve` on the pod's IP.

    with LocalCluster() as cluster:          # or LocalCluster(existing_control_plane)
        cluster.cp.kubectl("apply", "-f", "examples/smollm2.yaml")
        OpenAI(base_url=cluster.router_url + "/v1", api_key="-")...
"""
from __future__ import annotations

import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from e2e.control_plane import ControlPlane, _die_with_parent, build_binaries, free_port, terminate, wait_until_answering
from e2e.lws_standin import CRD_PATH as LWS_CRD, GROUP as LWS_GROUP, LwsStandIn
from e2e.operator_process import OperatorProcess
from e2e.pod_runner import PodRunner

ROOT = Path(__file__).resolve().parents[1]
CRDS = (ROOT / "crds" / "inferenceservice.yaml", ROOT / "crds" / "kopf-peering.yaml")
CHART = ROOT / "charts" / "kaon"
NAMESPACE = "kaon-system"
LOCAL_IMAGE = "local/kaon:dev"  # engine pods with this image run in the pod runner


class RouterProcess:
    """`kaon-router` on a loopback port, as the given kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path, *extra_args: str):
        self.kubeconfig, self.log_path, self.extra_args = kubeconfig, log_path, extra_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> RouterProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kaon_operator.router", "--port", str(self.port),
                 "--kubeconfig", str(self.kubeconfig), *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        wait_until_answering(self.proc, f"{self.url}/ready", timeout, "the router", f"see {self.log_path}")
        return self

    def stop(self) -> None:
        if self.proc:
            terminate(self.proc, grace=30)


class LocalCluster:
    def __init__(self, cp: ControlPlane | None = None, *, release: str = "kaon", autoscale_interval: float = 1.0,
                 adapter_interval: float = 1.0, queue_timeout: float = 120.0, leader_worker_sets: bool = False,
                 probe_look: float | None = 1.0):
        """`leader_worker_sets`: LWS's CRD and the stand-in LWS controller (e2e/lws_standin.py), for
        multi-node InferenceServices. `probe_look`: the pod runner's quick looks between probe runs
        until a probe first succeeds (e2e/probes.py; None: only the declared runs, as a kubelet).
        The operator's loops run every `autoscale_interval` and `adapter_interval` seconds (its
        defaults, 5 and 10, would leave a change waiting for the next round on a small cluster)."""
        self.cp, self.release, self.leader_worker_sets = cp, release, leader_worker_sets
        self.probe_look = probe_look
        self.autoscale_interval, self.adapter_interval = autoscale_interval, adapter_interval
        self.queue_timeout = queue_timeout
        self.router_url = ""
        self.pods: PodRunner | None = None
        self._stack = ExitStack()

    def __enter__(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        if self.cp is None:
            self.cp = self._stack.enter_context(ControlPlane(build_binaries(), crds=CRDS))
        self._install_chart(self.cp)
        if self.leader_worker_sets:
            self.cp.kubectl("apply", "--server-side", "-f", str(LWS_CRD))
            self.cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/leaderworkersets." + LWS_GROUP)
            self._stack.enter_context(LwsStandIn(self.cp.kubeconfig, leader_ip=True))
        # The chart names its ServiceAccounts after kaon.fullname (_helpers.tpl): the release, plus "-kaon" if absent.
        work, name = self.cp.workdir, self.release if "kaon" in self.release else f"{self.release}-kaon"
        operator = OperatorProcess(self.cp.service_account_kubeconfig(NAMESPACE, f"{name}-operator"),
                                   work / "operator.log", "--autoscale-interval", str(self.autoscale_interval),
                                   "--adapter-interval", str(self.adapter_interval))
        self._stack.callback(operator.stop)
        operator.start()
        # --cluster-wide-names: each test has a namespace of its own and sends bare names to this one
        # router (tests/e2e/test_auth_e2e.py runs one with the defaults beside it).
        router = RouterProcess(self.cp.service_account_kubeconfig(NAMESPACE, f"{name}-router"), work / "router.log",
                               "--queue-timeout", str(self.queue_timeout), "--cluster-wide-names")
        self._stack.callback(router.stop)
        router.start()
        self.router_url = router.url
        self.pods = self._stack.enter_context(PodRunner(self.cp, work, probe_look=self.probe_look))

    def _install_chart(self, cp: ControlPlane) -> None:
        helm = [str(cp.bin / "helm"), "--kubeconfig", str(cp.kubeconfig)]
        subprocess.run([*helm, "install", self.release, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
                        "--set", "operator.replicas=0", "--set", "router.replicas=0", "--wait=false"],
                       check=True, capture_output=True, text=True, timeout=120)
        self._stack.callback(subprocess.run, [*helm, "uninstall", self.release, "--namespace", NAMESPACE],
                             capture_output=True, timeout=30)
