"""The operator's writes to the Kubernetes API (reads come from kopf's watch caches).

Children are server-side applied under one field manager: applying the same manifest
twice changes nothing, and `force` takes back any field someone else edited.
"""
from __future__ import annotations

import kubernetes
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient

from kaon_operator import api

FIELD_MANAGER = "kaon-operator"


class NamespaceTerminating(Exception):
    """The namespace is being deleted: nothing new can be created there, nor needs to be."""


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient):
        self.dynamic = DynamicClient(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)

    @classmethod
    def from_environment(cls, pool_size: int = 32) -> Kube:
        """In-cluster credentials when running in a pod, $KUBECONFIG otherwise."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        config.connection_pool_maxsize = pool_size  # handlers run in a thread pool
        return cls(kubernetes.client.ApiClient(config))

    def apply(self, manifest: dict) -> dict:
        resource = self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        try:
            return self.dynamic.server_side_apply(
                resource, body=manifest, namespace=manifest["metadata"]["namespace"],
                field_manager=FIELD_MANAGER, force_conflicts=True).to_dict()
        except ApiException as exc:
            if exc.status == 403 and "NamespaceTerminating" in (exc.body or ""):
                raise NamespaceTerminating(manifest["metadata"]["namespace"]) from None
            raise

    def get_inference_service(self, namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_replicas(self, namespace: str, name: str, replicas: int) -> None:
        self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"spec": {"replicas": replicas}})

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource; a vanished InferenceService is not an error."""
        try:
            self.custom.patch_namespaced_custom_object_status(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": status})
        except ApiException as exc:
            if exc.status != 404:
                raise
