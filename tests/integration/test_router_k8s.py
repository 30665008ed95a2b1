"""The router's watch against a real control plane, as the router's own ServiceAccount.

KWOK makes pods Running and Ready with an IP in the control plane's pod range, but nothing listens there:
these tests look at the endpoint table only, never connect to a pod.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from e2e.control_plane import free_port
from kaon_operator import api
from kaon_operator.children import resources
from kaon_operator.labels import service_labels
from kaon_operator.router import watch
from kaon_operator.router.endpoints import EndpointTable, ServiceKey
from kaon_operator.router.proxy import Router
from kaon_operator.router.watch import ApiServer, Watcher
from support.router import serving

ROUTER_RBAC = Path(__file__).resolve().parents[2] / "deploy" / "router-rbac.yaml"


@pytest.fixture(scope="module")
def router_kubeconfig(crd):
    crd.kubectl("apply", "-f", str(ROUTER_RBAC))
    return crd.service_account_kubeconfig("kaon-system", "kaon-router")


def isvc(name: str, served_name: str | None = None) -> str:
    model = {"uri": "builtin://smollm2-135m-instruct", **({"servedName": served_name} if served_name else {})}
    return json.dumps({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
                       "spec": {"model": model}})


def engine_pod(name: str, service: str, component: str = "engine") -> str:
    """A bare pod with the labels and port the operator's Deployment gives engine pods."""
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "labels": service_labels(service, component)},
                       "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                           "name": "engine", "image": "kwok-ready/engine:1",
                           "ports": [{"name": "http", "containerPort": resources.HTTP_PORT}]}]}})


class Cluster:
    """kubectl as admin in one namespace, off the event loop."""

    def __init__(self, cp, namespace: str):
        self.cp, self.ns = cp, namespace

    async def kubectl(self, *args: str, input: str | None = None):
        return await asyncio.to_thread(self.cp.kubectl, "-n", self.ns, *args, input=input)

    async def apply(self, manifest: str):
        await self.kubectl("apply", "-f", "-", input=manifest)

    async def set_ready(self, pod: str, ready: bool):
        status = {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        await self.kubectl("patch", "pod", pod, "--subresource=status", "-p", json.dumps(status))


async def until(what: str, check, timeout: float = 30.0):
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


async def watching(kubeconfig: Path, namespaces=()) -> tuple[EndpointTable, asyncio.Task]:
    table = EndpointTable(cluster_wide_names=True)  # the tests send bare names of their own namespaces
    task = asyncio.create_task(Watcher(ApiServer.from_environment(str(kubeconfig)), table, namespaces).run())
    await until("the first list", lambda: table.synced or task.done())
    assert not task.done(), task.exception()
    return table, task


def pods_of(table: EndpointTable, key: ServiceKey) -> list[str]:
    return [e.pod for e in table.endpoints(key)]


def test_the_router_identity_may_only_list_and_watch(crd, router_kubeconfig):
    def can(*args: str) -> bool:
        return crd.kubectl("auth", "can-i", *args, kubeconfig=router_kubeconfig, check=False).stdout.strip() == "yes"

    assert can("list", "pods", "-A") and can("watch", "pods", "-A")
    assert can("list", "inferenceservices.kaon.dev", "-A") and can("watch", "inferenceservices.kaon.dev", "-A")
    # No Secret at all: spec.auth's keys reach the router as digests in the InferenceService's status.
    for verb in ("get", "list", "watch"):
        assert not can(verb, "secrets", "-A") and not can(verb, "secrets", "-n", "kaon-system"), verb
    # InferenceRoutes: read, and only their status written (the router holds their figures), with Events.
    assert can("list", "inferenceroutes.kaon.dev", "-A") and can("watch", "inferenceroutes.kaon.dev", "-A")
    assert can("patch", "inferenceroutes.kaon.dev", "--subresource=status", "-A") and can("create", "events", "-A")
    for verb, resource in [("get", "pods"), ("create", "pods"), ("delete", "pods"), ("create", "secrets"),
                           ("patch", "inferenceservices.kaon.dev"), ("list", "services"),
                           ("patch", "inferenceroutes.kaon.dev"), ("delete", "events")]:
        assert not can(verb, resource, "-A"), (verb, resource)


def test_the_table_follows_pods_and_served_names(crd, namespace, router_kubeconfig):
    cluster = Cluster(crd, namespace)
    # Served names are global (one gateway for every namespace), so they carry the namespace:
    # other test modules leave InferenceServices called "llama" behind in terminating namespaces.
    name, served, other = f"llama-{namespace}", f"llama-3-{namespace}", f"plain-{namespace}"
    llama, plain = ServiceKey(namespace, name), ServiceKey(namespace, other)

    async def scenario():
        table, task = await watching(router_kubeconfig)
        try:
            await cluster.apply(isvc(name, served))
            await cluster.apply(isvc(other))
            await until("served names", lambda: table.resolve(served) == llama and table.resolve(other) == plain)
            assert table.resolve(name) is None

            await cluster.apply(engine_pod("llama-a", name))
            await cluster.apply(engine_pod("llama-router", name, component="router"))  # not an engine
            await until("llama-a ready", lambda: pods_of(table, llama) == ["llama-a"])
            (a,) = table.endpoints(llama)
            host, port = a.url.removeprefix("http://").rsplit(":", 1)
            assert ipaddress.ip_address(host) in crd.pod_network and int(port) == resources.HTTP_PORT, a.url

            await cluster.set_ready("llama-a", False)
            await until("llama-a not ready", lambda: pods_of(table, llama) == [])
            await cluster.set_ready("llama-a", True)
            await until("llama-a ready again", lambda: pods_of(table, llama) == ["llama-a"])

            await cluster.apply(engine_pod("llama-b", name))
            await cluster.apply(engine_pod("plain-a", other))
            await until("two llama pods", lambda: pods_of(table, llama) == ["llama-a", "llama-b"])
            await until("the plain pod", lambda: pods_of(table, plain) == ["plain-a"])

            await cluster.kubectl("delete", "pod", "llama-a", "--wait=false")
            await until("llama-a gone", lambda: pods_of(table, llama) == ["llama-b"])

            # GET /v1/models of a router on this table (it answers itself, no pod is contacted).
            async with serving(Router(table)) as client, client.get("/v1/models") as resp:
                names = {m["id"] for m in (await resp.json())["data"]}
            assert {served, other} <= names

            await cluster.kubectl("delete", "infsvc", name, "--wait=false")
            await until("the served name unknown", lambda: table.resolve(served) is None)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 50))


def test_a_namespaced_router_sees_only_its_namespaces_and_resumes_its_watches(
        crd, namespace, router_kubeconfig, monkeypatch, caplog):
    monkeypatch.setattr(watch, "WATCH_SECONDS", 1)  # the apiserver ends every watch after a second
    other = f"{namespace}-other"
    crd.kubectl("create", "namespace", other)
    mine, theirs = Cluster(crd, namespace), Cluster(crd, other)

    async def scenario():
        table, task = await watching(router_kubeconfig, [namespace])
        try:
            await asyncio.sleep(1.5)  # what follows arrives on resumed watches
            for cluster in (theirs, mine):
                await cluster.apply(isvc("svc", f"svc-{cluster.ns}"))
                await cluster.apply(engine_pod("svc-a", "svc"))
            await until("this namespace's pod", lambda: pods_of(table, ServiceKey(namespace, "svc")) == ["svc-a"])
            assert table.resolve(f"svc-{other}") is None and table.endpoints(ServiceKey(other, "svc")) == ()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        crd.kubectl("delete", "namespace", other, "--wait=false", check=False)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("kaon.router")
                and r.levelname == "WARNING"]  # the watches ended and resumed without an error


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return 0, {}


def test_kaon_router_runs_as_a_process(crd, namespace, router_kubeconfig):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kaon_operator.router", "--kubeconfig", str(router_kubeconfig),
                             "--port", str(port), "--namespace", namespace, "--queue-timeout", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        crd.kubectl("-n", namespace, "apply", "-f", "-", input=isvc("cold", "cold-model"))
        deadline = time.monotonic() + 60  # a process start: seconds, and more on a busy machine
        while (http("GET", base + "/ready")[0] != 200
               or "cold-model" not in {m["id"] for m in http("GET", base + "/v1/models")[1].get("data", [])}):
            assert proc.poll() is None and time.monotonic() < deadline, "router not ready with the model"
            time.sleep(0.1)
        status, body = http("POST", base + "/v1/completions", {"model": "cold-model", "prompt": "x"})
        assert status == 503 and body["error"]["code"] == "no_ready_replica", body
        assert http("POST", base + "/v1/completions", {"model": "nope"})[0] == 404
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "router data path: " in out, out  # compiled or source, said at start (router/compiled.py)


def test_routes_are_watched_and_their_status_written_as_the_router(crd, namespace, router_kubeconfig, monkeypatch):
    """An InferenceRoute reaches the router's route table through the watch; the router's status writer
    patches its status as the router's own ServiceAccount; `kubectl get inferenceroute` shows the columns.
    The entry of a router replica gone for more than 10 minutes is removed by a live one, once."""
    import aiohttp

    from kaon_operator import clock, kubetime
    from kaon_operator.router import route_status
    from kaon_operator.router.route_gateway import RouteGateway
    from kaon_operator.routes.figures import Figures
    from kaon_operator.routes.table import RouteTable

    cluster = Cluster(crd, namespace)
    route = {"apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceRoute", "metadata": {"name": "assistant"},
             "spec": {"tiers": [{"service": "small", "costPerMillionTokens": 0.1},
                                {"service": "large", "costPerMillionTokens": 1.0}]}}
    bad = {**route, "metadata": {"name": "bad"}, "spec": {"tiers": [{"service": "a", "costPerMillionTokens": 1},
                                                                      {"service": "a", "costPerMillionTokens": 2}]}}
    refused = crd.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "distinct" in refused.stderr  # the CRD's CEL rule

    async def scenario():
        table = EndpointTable(default_namespace=namespace)
        routes = RouteTable(default_namespace=namespace)
        server = ApiServer.from_environment(str(router_kubeconfig))
        task = asyncio.create_task(Watcher(server, table, [namespace], routes=routes).run())
        try:
            await cluster.apply(isvc("small"))
            await cluster.apply(json.dumps(route))
            await until("the route", lambda: routes.resolve("assistant") is not None)
            # Two router replicas, each with its own figures, write in turn (and the first once more):
            # the status is their sum, not the last writer's figures.
            writers = []
            for replica, tier, cost in (("router-a", "small", 0.1), ("router-b", "large", 1.0)):
                gateway = RouteGateway(Router(table), routes)
                figures = gateway.figures.setdefault(routes.resolve("assistant").key, Figures())
                for _ in range(3 if replica == "router-a" else 1):
                    figures.answered(tier, 1000, cost, 1.0)
                writers.append(route_status.RouteStatusWriter(server, gateway, replica=replica))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=server.ssl)) as session:
                # A replica whose last write was 11 minutes ago (its pod is gone), then router-a's entry
                # (written without pruning, as before this rule):
                key = routes.resolve("assistant").key
                gone = route_status.RouteStatusWriter(server, RouteGateway(Router(table), routes), "router-gone")
                gone.gateway.figures.setdefault(key, Figures()).answered("large", 1000, 1.0, 1.0)

                async def write_gone():
                    with monkeypatch.context() as m:
                        m.setattr(route_status, "_now", lambda: kubetime.stamp(clock.seconds() - 660))
                        gone._written.clear()
                        await gone._write(session, routes.resolve("assistant"))

                async def no_prune(*args) -> bool:
                    return False

                await write_gone()
                with monkeypatch.context() as m:
                    m.setattr(writers[0], "prune", no_prune)
                    await writers[0]._write(session, routes.resolve("assistant"))
                listed = json.loads((await cluster.kubectl("get", "inferenceroute", "assistant", "-o", "json")).stdout)
                assert [e["name"] for e in listed["status"]["replicas"]] == ["router-gone", "router-a"]
                # Two live replicas that read this status both prune: the apiserver removes the gone entry for
                # the first and refuses the second's patch (its tests fail), which would otherwise remove
                # router-a's entry, now where router-gone's was.
                assert await writers[0].prune(session, key, listed["status"], clock.seconds())
                assert not await writers[1].prune(session, key, listed["status"], clock.seconds())
                names = await cluster.kubectl("get", "inferenceroute", "assistant", "-o",
                                              "jsonpath={.status.replicas[*].name}")
                assert names.stdout == "router-a", names.stdout
                # The gone replica's entry again: the live replicas' own rounds remove it.
                await write_gone()
                for writer in (*writers, writers[0]):
                    writer._written.clear()  # write now, not only when changed
                    await writer._write(session, routes.resolve("assistant"))
                    assert writer._written, "the status apply was refused"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 50))
    shown = crd.kubectl("-n", namespace, "get", "inferenceroute", "assistant").stdout
    assert "small 75% / large 25%" in shown and "0.325" in shown, shown  # Tiers, Cost-vs-Top of both replicas
    names = crd.kubectl("-n", namespace, "get", "inferenceroute", "assistant", "-o",
                        "jsonpath={.status.replicas[*].name} {.status.requests}").stdout
    assert names == "router-a router-b 4", names
    ready = crd.kubectl("-n", namespace, "get", "inferenceroute", "assistant", "-o",
                        "jsonpath={.status.conditions[0].reason}").stdout
    assert ready == "TierMissing"  # `large` does not exist in the namespace
