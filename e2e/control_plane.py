"""A real Kubernetes control plane on loopback ports, for tests and the e2e harness.

etcd, kube-apiserver (TLS, RBAC), kube-controller-manager, kube-scheduler and KWOK,
from the binaries that `build-control-plane.sh` caches. KWOK plays the kubelet for
fake GPU nodes, so scheduled pods go Running with pod IPs from a loopback range of this
control plane's own (e2e/pod_range.py: a second cluster on the machine gets another).
Every process is ours and is stopped by PID; everything they write lives in one
temp dir.

    cp = ControlPlane(build_binaries()).start()
    cp.kubectl("get", "nodes")
    cp.stop()
"""
from __future__ import annotations

import base64
import ctypes
import datetime
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e import pod_range

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build-control-plane.sh"
KWOK_STAGES = HERE / "kwok-stages.yaml"
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CIDR = "10.96.0.0/16"  # bookkeeping for Services only (room for thousands); nothing connects to it


class ControlPlaneError(RuntimeError):
    pass


def build_binaries() -> Path:
    """Run build-control-plane.sh (instant when cached; a long build on a fresh machine)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


FIXED_PORTS = (10000, 32768)  # where free_port looks: below Linux's default ephemeral range (32768-60999)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (connect()'s source ports, bind to port 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_range_outside(ephemeral: tuple[int, int], wanted: tuple[int, int] = FIXED_PORTS) -> tuple[int, int] | None:
    """The part of `wanted` that the kernel never hands out by itself, or None if too little is left."""
    low, high = wanted
    if ephemeral[0] < high and ephemeral[1] >= low:  # overlapping: keep what lies below the kernel's range
        high = min(high, ephemeral[0])
    return (low, high) if high - low >= 1000 else None


def free_port() -> int:
    """A loopback port free now, for a process that binds it a moment later (see free_ports)."""
    return free_ports(1, "127.0.0.1")


def free_ports(count: int, host: str) -> int:
    """The first of `count` consecutive ports free on `host` now. Picked at random outside the kernel's
    ephemeral range: a port from bind(0) lies inside it, where on a busy machine any process's outgoing
    connection can take it as its source port before the server binds it (two local clusters and a test suite's
    thousands of connections widen that window); outside it only another caller of this could, by chance."""
    span = port_range_outside(ephemeral_ports())
    rng = random.SystemRandom()
    for _ in range(100):
        first = rng.randrange(span[0], span[1] - count + 1) if span else _kernel_port(host)
        if _all_free(host, range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _all_free(host: str, ports: range) -> bool:
    sockets = []
    try:
        for port in ports:
            sockets.append(s := socket.socket())
            s.bind((host, port))
        return True
    except OSError:
        return False  # someone holds one of them: another pick
    finally:
        for s in sockets:
            s.close()


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, so a killed pytest leaves no orphans;
    and a process group of its own, so a terminal's Ctrl-C (SIGINT to the foreground group) reaches
    only the harness, which stops its children in order (engines, operator, router, then the control
    plane newest first) instead of each dying on its own while the others wait on it."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stop_on_sigterm() -> None:
    """SIGTERM stops the harness like Ctrl-C does: KeyboardInterrupt, so every `with` unwinds."""
    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the unwinding must not be cut short
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def wait_or_kill(proc: subprocess.Popen, grace: float) -> None:
    """Give a process that was asked to stop `grace` seconds, then SIGKILL it."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (once: a second SIGTERM cuts a kaon engine's drain short), then wait_or_kill."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        wait_or_kill(proc, grace)


def wait_until_answering(proc: subprocess.Popen, url: str, timeout: float, what: str, log: str) -> None:
    """Poll `url` until it answers 2xx; fail at once, pointing at `log`, if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {timeout}s: {log}")


class _PKI:
    """A CA plus the certificates and keys the components need (ECDSA: generated in milliseconds)."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kaon-test-ca")])
        self.ca_cert = (self._builder(name, self.ca_key.public_key())
                        .issuer_name(name)
                        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                        .sign(self.ca_key, hashes.SHA256()))
        self.ca_path = self._write("ca.crt", self.ca_cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject: x509.Name, public_key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2)))

    def _write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    @staticmethod
    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def issue(self, name: str, common_name: str, *, groups: tuple[str, ...] = (), server: bool = False
              ) -> tuple[bytes, bytes]:
        """Sign a client (or serving) certificate; returns (cert PEM, key PEM) and writes both."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
                            + [x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (self._builder(subject, key.public_key()).issuer_name(self.ca_cert.subject)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
                 # the `kubernetes` Service's ClusterIP: pods on e2e/real_node.py's node connect to it
                 x509.IPAddress(ipaddress.ip_network(SERVICE_CIDR)[1]),
                 x509.DNSName("kubernetes.default.svc")]), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        key_pem = self.key_pem(key)
        self._write(f"{name}.crt", cert)
        self._write(f"{name}.key", key_pem)
        return cert, key_pem

    def service_account_keys(self) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
        return self._write("sa.key", self.key_pem(key)), self._write("sa.pub", pub)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kubeconfig(server: str, ca_pem: bytes, user: str, credentials: dict) -> str:
    return json.dumps({  # JSON is YAML, and kubectl and client libraries read it
        "apiVersion": "v1", "kind": "Config", "current-context": "kaon",
        "clusters": [{"name": "kaon", "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "kaon", "context": {"cluster": "kaon", "user": user}}],
    }, indent=2)


def fake_gpu_node(name: str, gpus: int) -> dict:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {FAKE_NODE_ANNOTATION[0]: FAKE_NODE_ANNOTATION[1]},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "type": "kwok", "nvidia.com/gpu.present": "true"}},
        "status": {"capacity": resources, "allocatable": resources},
    }


class ControlPlane:
    """Start with start(), stop with stop() (or use it as a context manager)."""

    def __init__(self, bin_dir: Path, *, nodes: int = 4, gpus_per_node: int = 8, crds: tuple[Path, ...] = (),
                 startup_timeout: float = 120.0, workdir: Path | None = None):
        self.bin = Path(bin_dir)
        self.crds = tuple(crds)
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.startup_timeout = startup_timeout
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kaon-cp-"))
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.server = ""
        self._procs: dict[str, subprocess.Popen] = {}
        self._pki: _PKI | None = None
        self._pod_range: pod_range.PodRange | None = None

    @property
    def pod_network(self) -> ipaddress.IPv4Network:
        """The loopback /16 KWOK gives this cluster's pods IPs from (so a real process can listen
        on a fake pod's IP), reserved by start() for as long as it runs."""
        if self._pod_range is None:
            raise ControlPlaneError("the control plane has not started")
        return self._pod_range.network

    @property
    def pki(self) -> _PKI:
        """The certificate authority and the certificates issued so far (made by start())."""
        if self._pki is None:
            raise ControlPlaneError("the control plane has not started")
        return self._pki

    # lifecycle ---------------------------------------------------------------

    def start(self) -> ControlPlane:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pki = self._pki = _PKI(self.workdir / "pki")
        pods = self._pod_range = pod_range.reserve()
        etcd_port, api_port = free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        self._start_etcd(etcd_port)
        self._start_apiserver(api_port, etcd_port, pki)  # it retries etcd until that is up
        self.kubeconfig.write_text(self._user_kubeconfig("admin", "kaon-admin", ("system:masters",)))
        self._wait_ready(deadline)
        self._install_crds()
        # Components get the identities kubeadm gives them, so their bootstrap RBAC is what runs.
        scheduler = self.user_kubeconfig("kube-scheduler", "system:kube-scheduler")
        manager = self.user_kubeconfig("kube-controller-manager", "system:kube-controller-manager")
        self._start_controller_manager(manager, pki)
        self._start_scheduler(scheduler)
        self._start_kwok(pods.kwok_cidr)
        if self.nodes:  # nodes=0: no fake nodes (e2e/real_node.py adds a real one)
            self.kubectl("apply", "-f", "-", input=json.dumps(
                {"apiVersion": "v1", "kind": "List",
                 "items": [fake_gpu_node(f"gpu-node-{i}", self.gpus_per_node) for i in range(self.nodes)]}))
        self._wait(deadline, "fake nodes Ready", self._nodes_ready)
        self._wait(deadline, "the default ServiceAccount (controller-manager working)",
                   lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0)

    def _install_crds(self) -> None:
        """Install CRDs before the controller-manager starts: its garbage collector only
        rediscovers resource kinds every 30 s, so owners of a later CRD would not be watched
        (and their children not collected) for up to that long."""
        for path in self.crds:
            self.kubectl("apply", "--server-side", "-f", str(path))
        for path in self.crds:
            self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(path))

    def stop(self) -> None:
        """Stop every process we started, newest first, by PID; then remove the work dir."""
        for proc in reversed(list(self._procs.values())):
            terminate(proc, grace=15)
        self._procs.clear()
        if self._pod_range is not None:  # after KWOK and every engine of ours is gone
            self._pod_range.release()
        if self._own_workdir and not os.environ.get("KAON_KEEP_CONTROL_PLANE"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # clients -----------------------------------------------------------------

    def user_kubeconfig(self, user: str, common_name: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for a client-certificate identity (for RBAC tests: bind a role to `common_name`)."""
        path = self.workdir / f"{user}.kubeconfig"
        path.write_text(self._user_kubeconfig(user, common_name, groups))
        path.chmod(0o600)
        return path

    def _user_kubeconfig(self, user: str, common_name: str, groups: tuple[str, ...]) -> str:
        cert, key = self.pki.issue(user, common_name, groups=groups)
        return _kubeconfig(self.server, self.pki.ca_path.read_bytes(), user,
                           {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)})

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig with a token of the ServiceAccount (what a pod running as it would use)."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=24h").stdout.strip()
        path = self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(_kubeconfig(self.server, self.pki.ca_path.read_bytes(), f"{namespace}-{name}",
                                    {"token": token}))
        path.chmod(0o600)
        return path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl as admin (or as `kubeconfig`); raise with its stderr if `check` and it fails."""
        cmd = [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig),
               "--cache-dir", str(self.workdir / "kubectl-cache"), *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def kubectl_json(self, *args: str, **kwargs) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def log(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # processes ---------------------------------------------------------------

    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self._procs[name] = subprocess.Popen(
                [str(self.bin / name), *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)

    def _start_etcd(self, port: int) -> None:
        peer = f"http://127.0.0.1:{free_port()}"
        client = f"http://127.0.0.1:{port}"
        self._spawn("etcd", "--name", "kaon", "--data-dir", str(self.workdir / "etcd"), "--unsafe-no-fsync",
                    "--log-level", "warn", "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"kaon={peer}", "--listen-metrics-urls", "")

    def _start_apiserver(self, port: int, etcd_port: int, pki: _PKI) -> None:
        pki.issue("apiserver", "kube-apiserver", server=True)
        sa_key, sa_pub = pki.service_account_keys()
        d = pki.dir
        # --advertise-address: no default route here, so it cannot pick one itself.
        # --endpoint-reconciler-type=none: the reconciler rejects a loopback address.
        self._spawn("kube-apiserver",
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
                    f"--cert-dir={self.workdir / 'apiserver-certs'}",
                    f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
                    f"--client-ca-file={pki.ca_path}", "--authorization-mode=RBAC",
                    # As in OpenShift: setting blockOwnerDeletion needs update on the owner's finalizers.
                    "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                    "--endpoint-reconciler-type=none",
                    # e2e/real_node.py's kubelet: its node name does not resolve, its InternalIP does.
                    "--kubelet-preferred-address-types=InternalIP,Hostname",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false")

    def _start_controller_manager(self, kubeconfig: Path, pki: _PKI) -> None:
        # --use-service-account-credentials: each controller acts as its own ServiceAccount
        # with its bootstrap role, as in kubeadm clusters (garbage collection included).
        self._spawn("kube-controller-manager", f"--kubeconfig={kubeconfig}",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki.dir / 'sa.key'}",
                    f"--root-ca-file={pki.ca_path}", f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--secure-port=0", "--leader-elect=false", "--profiling=false")

    def _start_scheduler(self, kubeconfig: Path) -> None:
        self._spawn("kube-scheduler", f"--kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}", "--leader-elect=false", "--profiling=false")

    def _start_kwok(self, pod_cidr: str) -> None:
        key, value = FAKE_NODE_ANNOTATION
        # HOME points at the work dir so a stray ~/.kwok/kwok.yaml is not read.
        self._spawn("kwok", f"--kubeconfig={self.kubeconfig}", f"--config={KWOK_STAGES}",
                    "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={key}={value}",
                    f"--cidr={pod_cidr}", "--node-ip=127.0.0.1", "--node-lease-duration-seconds=40",
                    env={"HOME": str(self.workdir)})

    # readiness ---------------------------------------------------------------

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def _wait(self, deadline: float, what: str, ready) -> None:
        while True:
            self._check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out waiting for {what}\n{self.log('kube-apiserver')}")
            time.sleep(0.2)

    def _wait_ready(self, deadline: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_path))
        ctx.load_cert_chain(self.pki.dir / "admin.crt", self.pki.dir / "admin.key")

        def readyz() -> bool:
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        self._wait(deadline, "kube-apiserver /readyz", readyz)

    def _nodes_ready(self) -> bool:
        res = self.kubectl("get", "nodes", "-o", "json", check=False)
        if res.returncode != 0:
            return False
        nodes = json.loads(res.stdout)["items"]
        ready = [n for n in nodes for c in n.get("status", {}).get("conditions", [])
                 if c["type"] == "Ready" and c["status"] == "True"]
        return len(ready) >= self.nodes
