"""kaon on the local cluster's real node: every pod a real container from kaon's own images.

The control plane (e2e/control_plane.py, no KWOK nodes) with a real node (e2e/real_node.py:
kubelet, containerd, runc, bridge CNI, kube-proxy), the images built by e2e/build-images.sh,
and the Helm chart installed as it is, with only the image names set: the operator and the
router run as the chart's pods, and engine pods run `kaon serve` from kaon.local/kaon:dev,
probed, signalled and given volumes by the kubelet.

    with RealCluster() as cluster:
        cluster.cp.kubectl("apply", "-f", ...)
        OpenAI(base_url=cluster.router_url + "/v1", api_key="-")...

The engine runs on the CPU. Engine pods request `nvidia.com/gpu` (one per tensor-parallel
rank), so the node advertises GPUS fake GPUs as an extended resource (the kubelet admits
them; no device plugin, nothing is mounted): the pod placement is real, the GPU is not.
"""
from __future__ import annotations

import json
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

from e2e.control_plane import ControlPlane, build_binaries
from e2e.real_node import RealNode, images_list, node_binaries, unavailable_reason
from kaon_operator import labels

ROOT = Path(__file__).resolve().parents[1]
CRDS = (ROOT / "crds" / "inferenceservice.yaml", ROOT / "crds" / "kopf-peering.yaml")
CHART = ROOT / "charts" / "kaon"
NAMESPACE = "kaon-system"
ENGINE_IMAGE = "kaon.local/kaon:dev"
OPERATOR_IMAGE = ("kaon.local/kaon-operator", "dev")
GPUS = 4


class RealCluster:
    def __init__(self, *, release: str = "kaon", helm_set: tuple[str, ...] = (), timeout: float = 300):
        self.release, self.helm_set, self.timeout = release, helm_set, timeout
        self._cp: ControlPlane | None = None
        self.node: RealNode | None = None
        self.router_url = ""
        self._stack = ExitStack()

    @property
    def cp(self) -> ControlPlane:
        if self._cp is None:
            raise RuntimeError("the real cluster has not started")
        return self._cp

    def __enter__(self) -> RealCluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        bin_dir = build_binaries()
        node_bin = node_binaries()
        reason = unavailable_reason(node_bin)
        if reason:
            raise RuntimeError(f"no real node on this machine: {reason}")
        images = images_list()
        self._cp = self._stack.enter_context(ControlPlane(bin_dir, nodes=0, crds=CRDS))
        self.node = self._stack.enter_context(RealNode(self.cp, node_bin, images))
        self.cp.kubectl("patch", "node", self.node.name, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"capacity": {"nvidia.com/gpu": str(GPUS)}}}))
        self._install_chart()
        name = self.release if "kaon" in self.release else f"{self.release}-kaon"
        svc = self.cp.kubectl_json("get", "service", f"{name}-router", "-n", NAMESPACE)
        port = svc["spec"]["ports"][0]["port"]
        self.router_url = f"http://{svc['spec']['clusterIP']}:{port}"

    def _install_chart(self) -> None:
        helm = [str(self.cp.bin / "helm"), "--kubeconfig", str(self.cp.kubeconfig)]
        repository, tag = OPERATOR_IMAGE
        res = subprocess.run([*helm, "install", self.release, str(CHART), "--namespace", NAMESPACE,
                              "--create-namespace", "--set", f"image.repository={repository}",
                              "--set", f"image.tag={tag}", *(a for s in self.helm_set for a in ("--set", s)),
                              "--wait", f"--timeout={int(self.timeout)}s"],
                             capture_output=True, text=True, timeout=self.timeout + 30)
        if res.returncode != 0:
            pods = self.cp.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
            raise RuntimeError(f"helm install failed: {res.stderr.strip()}\n{pods}")
        # Uninstall first on the way out, while the node still runs: the pods stop with SIGTERM.
        self._stack.callback(subprocess.run, [*helm, "uninstall", self.release, "--namespace", NAMESPACE,
                                              "--wait", "--timeout=60s"], capture_output=True, timeout=90)

    # helpers for tests and the demo -----------------------------------------------------------

    def engine_pods(self, name: str, namespace: str = "default") -> list[dict]:
        return self.cp.kubectl_json("get", "pods", "-n", namespace, "-l",
                                    f"{labels.INSTANCE}={name}")["items"]

    def wait(self, what: str, check, timeout: float, interval: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                pods = self.cp.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{pods}")
            time.sleep(interval)
