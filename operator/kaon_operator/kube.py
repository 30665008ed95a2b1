"""The operator's writes to the Kubernetes API (reads come from kopf's watch caches).

Children are server-side applied under one field manager: applying the same manifest
twice changes nothing, and `force` takes back any field someone else edited.

Over 300 lines for a stated reason: it is the one client of the apiserver (timeouts, field
manager, the error mapping every call shares); splitting it by verb would spread that contract.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from kaon_operator import api, clock, kubetime
from kaon_operator.children import ownership
from kaon_operator.children.ownership import FIELD_MANAGER

REQUEST_TIMEOUT_S = (5.0, 30.0)
"""(connect, read) seconds for every request to the apiserver: a hung apiserver is an error the
handler reports and kopf retries, never a worker thread blocked for good."""


class TimedApiClient(kubernetes.client.ApiClient):
    """The official client with a timeout on every request (it has none unless each call passes one)."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: float | tuple[float, float]):
        super().__init__(configuration)
        self.timeout = timeout

    def call_api(self, *args, **kwargs):
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = self.timeout
        return super().call_api(*args, **kwargs)


def held_by_another(spec, holder: str, now: datetime) -> bool:
    """Another holder renewed the Lease (a V1LeaseSpec) within its duration."""
    return (spec.holder_identity not in (None, holder) and spec.renew_time is not None
            and (now - spec.renew_time).total_seconds() < (spec.lease_duration_seconds or 0))


class NamespaceTerminating(Exception):
    """The namespace is being deleted: nothing new can be created there, nor needs to be."""


class NotOwned(Exception):
    """A child's name is taken by an object this InferenceService does not control: left untouched."""

    def __init__(self, kind: str, namespace: str, name: str, holder: str):
        super().__init__(f"{kind} {namespace}/{name} already exists and is not this InferenceService's "
                         f"(its controller: {holder}); kaon leaves it untouched: delete or rename it, or rename "
                         "the InferenceService")
        self.kind, self.name = kind, name


class Conflict(Exception):
    """A write with a resourceVersion precondition found the object changed since it was read (HTTP 409)."""


def _precondition(body: dict, resource_version: str | None) -> dict:
    return {**body, "metadata": {"resourceVersion": resource_version}} if resource_version else body


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient):
        self.dynamic = DynamicClient(client)
        # The discovery cache is a file shared by every process on the host: another process's copy may list
        # a CRD removed since (the LeaderWorkerSet API), so start from what the apiserver serves now.
        self.dynamic.resources.invalidate_cache()
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.coordination = kubernetes.client.CoordinationV1Api(client)

    @classmethod
    def from_environment(cls, pool_size: int = 32, timeout: float | tuple[float, float] = REQUEST_TIMEOUT_S) -> Kube:
        """In-cluster credentials when running in a pod, $KUBECONFIG otherwise."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        config.connection_pool_maxsize = pool_size  # handlers run in a thread pool
        return cls(TimedApiClient(config, timeout=timeout))

    def apply(self, manifest: dict) -> dict:
        """Server-side apply, unless the name is taken by an object this manifest's controller does
        not control (NotOwned; ownership.py). (Between the read and the apply another client could
        still create it: the window is one round trip, and the next reconcile reports it.)"""
        resource = self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        meta = manifest["metadata"]
        holder = ownership.foreign_holder(self._get(resource, meta["namespace"], meta["name"]), manifest)
        if holder is not None:
            raise NotOwned(manifest["kind"], meta["namespace"], meta["name"], holder)
        try:
            return self.dynamic.server_side_apply(
                resource, body=manifest, namespace=manifest["metadata"]["namespace"],
                field_manager=FIELD_MANAGER, force_conflicts=True).to_dict()
        except ApiException as exc:
            if exc.status == 403 and "NamespaceTerminating" in (exc.body or ""):
                raise NamespaceTerminating(manifest["metadata"]["namespace"]) from None
            raise

    def create_once(self, manifest: dict) -> dict:
        """Create the object unless it stands already (then it is left as it is: a generated key is never
        rotated under the pods that use it); NotOwned when what stands is someone else's, as apply says."""
        resource = self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        meta = manifest["metadata"]
        existing = self._get(resource, meta["namespace"], meta["name"])
        if existing is None:
            try:
                return self.dynamic.create(resource, body=manifest, namespace=meta["namespace"]).to_dict()
            except ApiException as exc:
                if exc.status == 403 and "NamespaceTerminating" in (exc.body or ""):
                    raise NamespaceTerminating(meta["namespace"]) from None
                if exc.status != 409:
                    raise
                existing = self._get(resource, meta["namespace"], meta["name"]) or {}  # made meanwhile
        holder = ownership.foreign_holder(existing, manifest)
        if holder is not None:
            raise NotOwned(manifest["kind"], meta["namespace"], meta["name"], holder)
        return existing

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the apiserver serves this kind (a CRD such as the LeaderWorkerSet's is installed).
        A miss refreshes the discovery cache first, so a CRD installed since is found."""
        try:
            self.dynamic.resources.get(api_version=api_version, kind=kind)
            return True
        except ResourceNotFoundError:
            return False

    def delete_controlled(self, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object `name` if the owner `owner_uid` controls it (the workload of the kind the spec no
        longer asks for: a Deployment after a switch to multi-node, or back); whether one was deleted."""
        try:
            resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            return False
        existing = self._get(resource, namespace, name)
        if existing is None or (ownership.controller(existing) or {}).get("uid") != owner_uid:
            return False
        self.delete({"apiVersion": api_version, "kind": kind, "metadata": existing["metadata"]})
        return True

    @staticmethod
    def _get(resource, namespace: str, name: str) -> dict | None:
        try:
            return resource.get(name=name, namespace=namespace).to_dict()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_inference_service(self, namespace: str, name: str) -> dict | None:
        try:
            return cast(dict, self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_replicas(self, namespace: str, name: str, replicas: int, resource_version: str | None = None) -> dict:
        """Merge-patch spec.replicas; with `resource_version`, only if the object is still at that version
        (else Conflict: someone else wrote it since, and their change must not be overwritten)."""
        try:
            return cast(dict, self.custom.patch_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name,
                _precondition({"spec": {"replicas": replicas}}, resource_version)))
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{namespace}/{name} changed since resourceVersion {resource_version}") from None
            raise

    def patch_prefill_replicas(self, namespace: str, name: str, replicas: int) -> dict:
        """Merge-patch spec.prefill.replicas (the prefill pool's autoscaler, docs/disaggregation.md)."""
        return cast(dict, self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"spec": {"prefill": {"replicas": replicas}}}))

    def patch_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None,
                     plural: str = api.PLURAL) -> dict | None:
        """Merge-patch the status subresource (with `resource_version`: only at that version, else Conflict);
        the object as written, or None when the InferenceService (or, by `plural`, the InferenceRoute) has
        vanished (not an error)."""
        try:
            return cast(dict, self.custom.patch_namespaced_custom_object_status(
                api.GROUP, api.VERSION, namespace, plural, name,
                _precondition({"status": status}, resource_version)))
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(f"{namespace}/{name} changed since resourceVersion {resource_version}") from None
            if exc.status != 404:
                raise
            return None

    def delete(self, manifest: dict, propagation: str | None = None) -> None:
        """Delete one object, only if it is still the one named (uid precondition); gone already is fine.
        `propagation`: the DeleteOptions' propagationPolicy (`Background`: a Job's pods go too)."""
        meta = manifest["metadata"]
        resource = self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        options: dict[str, Any] = {"preconditions": {"uid": meta["uid"]}} if meta.get("uid") else {}
        if propagation:
            options["propagationPolicy"] = propagation
        try:
            resource.delete(name=meta["name"], namespace=meta["namespace"], body=options or None)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's data (the predictive autoscaler's performance model); None when it does not exist."""
        try:
            return self.core.read_namespaced_config_map(name, namespace).data or {}
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def set_pod_condition(self, namespace: str, name: str, condition: dict) -> None:
        """Set one condition of a pod's status (a readiness gate's), merged by type with the kubelet's;
        a pod that has gone meanwhile is not an error."""
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": {"conditions": [condition]}},
                                                  _content_type="application/strategic-merge-patch+json")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def get_config_map(self, namespace: str, name: str) -> dict | None:
        """A ConfigMap, metadata and all (profile: auto checks whose it is); None when it does not exist."""
        return self._get(self.dynamic.resources.get(api_version="v1", kind="ConfigMap"), namespace, name)

    def get_job(self, namespace: str, name: str) -> dict | None:
        """A batch/v1 Job (the profiling Job of spec.autoscaling.profile: auto); None when it does not exist."""
        return self._get(self.dynamic.resources.get(api_version="batch/v1", kind="Job"), namespace, name)

    def secret_data(self, namespace: str, name: str, owner_uid: str | None = None) -> dict[str, str] | None:
        """An Opaque Secret's data (base64 values: spec.auth's API keys, whose digests only are
        published); None when it does not exist or is of another type (a ServiceAccount token, a
        TLS key, a Helm release are never read as API keys), or, given `owner_uid`, when that
        object does not control it (a Secret the operator made: not one planted under its name)."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if owner_uid is not None and not any(
                ref.uid == owner_uid and ref.controller
                for ref in (secret.metadata.owner_references if secret.metadata else None) or ()):
            return None
        data = cast(dict[str, str], secret.data or {})  # base64 text, as the apiserver sends it
        return data if secret.type == "Opaque" else None

    def list_objects(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        """The objects of a kind in a namespace that carry these labels, each with its apiVersion and kind
        (a list's items come without them)."""
        resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
        items = resource.get(namespace=namespace, label_selector=label_selector).to_dict().get("items") or []
        return [{**item, "apiVersion": api_version, "kind": kind} for item in items]

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=label_selector)
        return [self.core.api_client.sanitize_for_serialization(pod) for pod in pods.items]

    def hold_lease(self, namespace: str, name: str, holder: str, seconds: int) -> bool:
        """Take or renew a coordination.k8s.io Lease; False while another holder's is current.
        A lost race (409 on create or replace) is a no for this round."""
        now = clock.now()
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        spec = {"holderIdentity": holder, "leaseDurationSeconds": seconds, "renewTime": kubetime.micro_stamp(now)}
        try:
            lease = self.coordination.read_namespaced_lease(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._lease_write(self.coordination.create_namespaced_lease, namespace,
                                     {"metadata": metadata, "spec": spec})
        if held_by_another(lease.spec, holder, now):
            return False
        metadata["resourceVersion"] = lease.metadata.resource_version if lease.metadata else None
        return self._lease_write(lambda ns, body: self.coordination.replace_namespaced_lease(name, ns, body),
                                 namespace, {"metadata": metadata, "spec": spec})

    @staticmethod
    def _lease_write(write, namespace: str, body: dict) -> bool:
        try:
            write(namespace, body)
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise

    def post_event(self, body: dict, type_: str, reason: str, message: str, instance: str) -> None:
        """A core/v1 Event about an InferenceService, for code outside kopf's handlers (the
        autoscale loop), where kopf.event has no queue to post through."""
        meta, now = body["metadata"], clock.now()
        event = {"metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta.get("uid")},
                 "type": type_, "reason": reason, "message": message[:1024], "count": 1,
                 "firstTimestamp": now, "lastTimestamp": now, "source": {"component": FIELD_MANAGER},
                 "reportingComponent": FIELD_MANAGER, "reportingInstance": instance}
        try:
            self.core.create_namespaced_event(meta["namespace"], cast(Any, event))  # a dict serializes as well
        except ApiException as exc:
            if exc.status not in (403, 404):  # a terminating namespace takes no Events: nothing to tell
                raise
