"""A STAND-IN for the LeaderWorkerSet controller on the local control plane (like KWOK for the
kubelet and pod_runner.py for the container runtime): the real one (kubernetes-sigs/lws) is a Go
module this machine cannot build. It does what LWS does for kaon's groups, no more:

- **Groups**: for a LeaderWorkerSet with `replicas` R and `leaderWorkerTemplate.size` S, groups
  0..R-1, each a leader pod `<lws>-<g>` (leaderTemplate, else workerTemplate) and workers
  `<lws>-<g>-<w>`, w = 1..S-1 (workerTemplate), all created together (startupPolicy LeaderCreated).
- **Labels, annotations, environment** as LWS sets them: `leaderworkerset.sigs.k8s.io/name`,
  `group-index`, `worker-index` ("0" on the leader), `group-key`, `template-revision-hash`; the
  annotations `size` and (workers) `leader-name`; in every container LWS_LEADER_ADDRESS
  (`<leader>.<lws>.<namespace>`, the headless Service's DNS name, which here nothing resolves: see
  e2e/README.md), LWS_GROUP_SIZE, LWS_WORKER_INDEX and LWS_NAME.
- **Failure** (restartPolicy RecreateGroupOnPodRestart): a pod of a group gone, Failed or with a
  container restarted makes the whole group go (every pod deleted) and come back whole.
- **Scale-down** deletes the highest groups, the leader first (it drains); its workers follow once it is
  gone (they are owned by the leader pod, as LWS's worker StatefulSet is).
- **Rollout**: a group whose pods carry an old template hash is recreated, one group at a time, while the
  others are ready.
- **Status**: `replicas` (groups with a leader), `readyReplicas` (groups whose S pods are all ready),
  `updatedReplicas`, `hpaPodSelector` and an Available condition.

- **Local cluster only** (`leader_ip`): every pod here shares the host's network, so two groups'
  leaders cannot both listen on LWS's port 29500 (and 29501). The stand-in then picks a free port
  pair per group, notes it on the leader pod (annotation `lws-standin.kaon.dev/distributed-port`) and
  appends `--distributed-init-address $(LWS_LEADER_ADDRESS):<port>` to every pod of the group (the pod
  runner expands `$(VAR)` as the kubelet does). A local artefact: on a cluster each pod has its own
  network namespace, and the operator never sets a port.

Not done: the headless Service and its DNS, exclusive topology, subgroups, maxSurge (a rollout here
replaces in place), partitions. The operator never talks to this: it writes LeaderWorkerSets, as it
would on a cluster with LWS installed, and this reads them.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException

from e2e.control_plane import free_ports

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
CRD_PATH = Path(__file__).with_name("lws-crd.yaml")
PREFIX = "leaderworkerset.sigs.k8s.io/"
NAME, GROUP_INDEX, WORKER_INDEX = PREFIX + "name", PREFIX + "group-index", PREFIX + "worker-index"
GROUP_KEY, REVISION = PREFIX + "group-key", PREFIX + "template-revision-hash"
SIZE, LEADER_NAME = PREFIX + "size", PREFIX + "leader-name"
DISTRIBUTED_PORT = "lws-standin.kaon.dev/distributed-port"  # leader_ip only: this group's port on the shared host


def free_port_pair() -> int:
    """A port whose successor is free too (a group's rendezvous and control channel), on every interface: the
    leader binds them only once it starts, so they are picked outside the kernel's ephemeral range
    (control_plane.free_ports)."""
    return free_ports(2, "0.0.0.0")


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def revision(lws: Mapping) -> str:
    return _hash(lws["spec"]["leaderWorkerTemplate"])


def pod_manifest(lws: Mapping, group: int, worker: int, leader_address: str | None = None,
                 leader_ip: bool = False, port: int | None = None) -> dict:
    """Pod `worker` (0: the leader) of group `group`, as the LWS controller would make it. With `leader_ip`
    the leader's pod IP stands in for its DNS name (which nothing resolves on the local cluster): the
    leader reads its own from the downward API, a worker gets `leader_address`; `port` is then the
    group's own distributed port (the host's network is shared: see the module's docstring)."""
    meta, template = lws["metadata"], lws["spec"]["leaderWorkerTemplate"]
    name, namespace, size = meta["name"], meta["namespace"], template.get("size", 1)
    source = template.get("leaderTemplate") if worker == 0 and template.get("leaderTemplate") else template[
        "workerTemplate"]
    pod_template = copy.deepcopy(source)
    leader = f"{name}-{group}"
    labels = {**(pod_template.get("metadata") or {}).get("labels", {}), NAME: name, GROUP_INDEX: str(group),
              WORKER_INDEX: str(worker), GROUP_KEY: _hash([namespace, name, group]), REVISION: revision(lws)}
    annotations = {**(pod_template.get("metadata") or {}).get("annotations", {}), SIZE: str(size)}
    if worker:
        annotations[LEADER_NAME] = leader
    address: dict = {"value": leader_address or f"{leader}.{name}.{namespace}"}
    if leader_ip and worker == 0:
        address = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    env = [{"name": "LWS_LEADER_ADDRESS", **address},
           {"name": "LWS_GROUP_SIZE", "value": str(size)}, {"name": "LWS_WORKER_INDEX", "value": str(worker)},
           {"name": "LWS_NAME", "value": name}]
    spec = pod_template["spec"]
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        container["env"] = [*env, *container.get("env", [])]
    if leader_ip and port is not None:
        annotations[DISTRIBUTED_PORT] = str(port)
        for container in spec.get("containers", []):
            container["args"] = [*container.get("args", []), "--distributed-init-address",
                                 f"$(LWS_LEADER_ADDRESS):{port}"]
    spec.setdefault("hostname", leader if worker == 0 else f"{leader}-{worker}")
    spec.setdefault("subdomain", name)
    owner = ({"apiVersion": f"{GROUP}/{VERSION}", "kind": "LeaderWorkerSet", "name": name, "uid": meta["uid"],
              "controller": True, "blockOwnerDeletion": True})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": leader if worker == 0 else f"{leader}-{worker}", "namespace": namespace,
                         "labels": labels, "annotations": annotations, "ownerReferences": [owner]},
            "spec": spec}


def _ready(pod: Mapping) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _broken(pod: Mapping) -> bool:
    """Failed, or a container restarted: LWS recreates the group rather than wait for the pod alone."""
    status = pod.get("status") or {}
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    return status.get("phase") == "Failed" or restarts > 0


class LwsStandIn:
    """Runs the stand-in in a thread against the cluster of `kubeconfig` (admin), polling every `interval` s."""

    def __init__(self, kubeconfig: Path, interval: float = 0.5, *, leader_ip: bool = False):
        """`leader_ip`: LWS_LEADER_ADDRESS is the leader pod's IP (workers are made once it has one), for
        real engine groups on the local cluster, where the headless Service's DNS name resolves to nothing."""
        self.interval, self.leader_ip = interval, leader_ip
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lws-standin", daemon=True)
        self._whole: set[str] = set()  # leader pods' uids whose group had all its pods once
        self.recreated: list[tuple[str, str, int, str]] = []
        """(namespace, lws, group, why) of every group recreated: what the tests assert on."""

    def start(self) -> LwsStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> LwsStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                listed = cast(dict, self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL))
                for lws in listed["items"]:
                    if not lws["metadata"].get("deletionTimestamp"):
                        self.reconcile(lws)
            except ApiException as exc:  # a namespace going away, a conflict: the next round sees anew
                log.debug("lws stand-in: %s", exc.reason)
            except Exception:  # a stand-in that died silently would hang the tests instead
                log.exception("lws stand-in round failed")

    def _pods(self, lws: Mapping) -> dict[int, dict[int, dict]]:
        meta = lws["metadata"]
        pods = self.core.list_namespaced_pod(meta["namespace"], label_selector=f"{NAME}={meta['name']}").items
        groups: dict[int, dict[int, dict]] = {}
        for pod in pods:
            body = self.core.api_client.sanitize_for_serialization(pod)
            if body["metadata"].get("deletionTimestamp"):
                continue
            labels = body["metadata"]["labels"]
            groups.setdefault(int(labels[GROUP_INDEX]), {})[int(labels[WORKER_INDEX])] = body
        return groups

    def _delete(self, namespace: str, pods: Mapping[int, dict], *, leader_only: bool = False) -> None:
        for worker in sorted(pods):
            if leader_only and worker != 0:
                continue
            try:
                self.core.delete_namespaced_pod(pods[worker]["metadata"]["name"], namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def reconcile(self, lws: Mapping) -> None:
        meta, spec = lws["metadata"], lws["spec"]
        namespace, replicas = meta["namespace"], spec.get("replicas", 1)
        size, current = spec["leaderWorkerTemplate"].get("size", 1), revision(lws)
        groups = self._pods(lws)
        for group, pods in groups.items():
            if group >= replicas:  # scale-down: the leader first; its workers once it is gone
                self._delete(namespace, pods, leader_only=0 in pods)
                continue
            leader_uid = (pods.get(0) or {}).get("metadata", {}).get("uid")
            if len(pods) == size:
                self._whole.add(leader_uid)
            lost = bool(pods) and (0 not in pods or (len(pods) < size and leader_uid in self._whole))
            if lost or any(_broken(p) for p in pods.values()):
                why = "a pod of the group is gone" if lost else "a pod of the group failed or restarted"
                self.recreated.append((namespace, meta["name"], group, why))
                self._event(lws, f"group {group}: {why}; recreating the whole group (RecreateGroupOnPodRestart)")
                self._delete(namespace, pods)
                groups[group] = {}
        ready_groups = [g for g, pods in groups.items()
                        if g < replicas and len(pods) == size and all(_ready(p) for p in pods.values())]
        outdated = [g for g, pods in groups.items() if g < replicas and pods
                    and any(p["metadata"]["labels"].get(REVISION) != current for p in pods.values())]
        if outdated and all(g in ready_groups for g in range(replicas) if g not in outdated):
            self._delete(namespace, groups[max(outdated)])  # one group at a time
            groups[max(outdated)] = {}
        for group in range(replicas):
            have = groups.get(group, {})
            address = port = None
            if self.leader_ip:
                leader = have.get(0)
                address = ((leader or {}).get("status") or {}).get("podIP")
                port = (int(leader["metadata"]["annotations"][DISTRIBUTED_PORT]) if leader
                        else free_port_pair())  # a new group: its leader is made below, with this port
            for worker in range(size):
                if worker in have or (self.leader_ip and worker and address is None):
                    continue
                if worker == 0 or 0 in have or not have:
                    self._create(namespace, pod_manifest(lws, group, worker, address, self.leader_ip, port))
        self._write_status(lws, groups, ready_groups, current)

    def _create(self, namespace: str, pod: dict) -> None:
        try:
            self.core.create_namespaced_pod(namespace, cast(Any, pod))  # a dict serializes as well
        except ApiException as exc:
            if exc.status != 409:  # made already (an earlier round's pod not yet in our list)
                raise

    def _write_status(self, lws: Mapping, groups: Mapping[int, Mapping[int, dict]], ready: list[int],
                      current: str) -> None:
        meta, replicas = lws["metadata"], lws["spec"].get("replicas", 1)
        updated = sum(1 for g, pods in groups.items() if g < replicas and pods
                      and all(p["metadata"]["labels"].get(REVISION) == current for p in pods.values()))
        status: dict[str, Any] = {"replicas": sum(1 for g, pods in groups.items() if g < replicas and 0 in pods),
                  "readyReplicas": len(ready), "updatedReplicas": updated,
                  "hpaPodSelector": f"{NAME}={meta['name']},{WORKER_INDEX}=0"}
        available = len(ready) >= replicas
        status["conditions"] = [{"type": "Available", "status": "True" if available else "False",
                                 "reason": "AllGroupsReady" if available else "GroupsNotReady",
                                 "message": f"{len(ready)}/{replicas} groups ready"}]
        old = lws.get("status") or {}
        if all(old.get(k) == v for k, v in status.items() if k != "conditions") and \
                [(c.get("status"), c.get("message")) for c in old.get("conditions") or []] == \
                [(c["status"], c["message"]) for c in status["conditions"]]:
            return
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
                                                          {"status": status})

    def _event(self, lws: Mapping, message: str) -> None:
        meta = lws["metadata"]
        self.core.create_namespaced_event(meta["namespace"], cast(Any, {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LeaderWorkerSet", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": "Warning", "reason": "RecreateGroupOnPodRestart", "message": message,
            "source": {"component": "lws-standin"}}))
