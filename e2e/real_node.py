"""A real node for the local cluster: kubelet + containerd + runc, a bridge CNI and kube-proxy.

Next to KWOK's fake GPU nodes (or instead of them), this node runs real containers from
images built here (e2e/build-images.sh) and imported into its containerd: the kubelet pulls
nothing, evaluates the probes itself, sends real SIGTERMs and mounts real volumes.

    cp = ControlPlane(build_binaries(), nodes=0, crds=...).start()
    node = RealNode(cp, node_binaries(), images_list()).start()   # Ready, images imported
    ...
    node.stop(); cp.stop()

What it changes on the host, all undone by stop() (and scoped to what it creates):
- a bridge `kaon0` (10.244.0.1/24, the pods' network), IPv4 forwarding on that bridge only,
  and a route for the Service range (10.96.0.0/16) through it, so the host reaches ClusterIPs;
- kube-proxy's nftables tables (`ip kube-proxy`, `ip6 kube-proxy`), nothing in iptables;
- the kernel settings the kubelet sets at start (vm.overcommit_memory, kernel.panic...) are
  read before and written back after;
- containerd's image store persists in ${KAON_CACHE:-~/.cache/kaon}/node/containerd, so the
  images are imported once; everything else lives in a temp dir.

The apiserver listens on 127.0.0.1 only; pods reach it as the `kubernetes` Service
(10.96.0.1:443), whose EndpointSlice points at a socat forwarder on the bridge's address.
There is no cluster DNS: pods get the host's resolv.conf, and Services are reached by ClusterIP
(KUBERNETES_SERVICE_HOST and the like, or an address the test looked up).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from e2e.control_plane import ControlPlane, ControlPlaneError, _die_with_parent, free_port, terminate

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KAON_CACHE", Path.home() / ".cache" / "kaon"))
NODE_NAME = "kaon-node"
BRIDGE = "kaon0"
POD_SUBNET = "10.244.0.0/24"
GATEWAY = "10.244.0.1"
SERVICE_RANGE = "10.96.0.0/16"  # the control plane's SERVICE_CIDR
CNI_BIN = Path("/usr/lib/cni")
PAUSE_IMAGE = "kaon.local/pause:1"
# The kubelet sets these at start (protectKernelDefaults: false); stop() writes the old values back.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


class NodeError(ControlPlaneError):
    pass


def node_binaries() -> Path:
    """Run build-node.sh (kubelet, kube-proxy; instant when cached)."""
    out = subprocess.run(["bash", str(HERE / "build-node.sh")], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=3600).stdout
    return Path(out.strip().splitlines()[-1])


def images_list(*images: str, timeout: float = 3600) -> Path:
    """Run build-images.sh (instant when cached) and return its list of images and archives."""
    out = subprocess.run(["bash", str(HERE / "build-images.sh"), *images], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=timeout).stdout
    return Path(out.strip().splitlines()[-1])


def unavailable_reason(bin_dir: Path | None = None) -> str | None:
    """Why a real node cannot start on this machine (None: it can). Checks only what is
    installed and built; it starts nothing."""
    if os.geteuid() != 0:
        return "needs root (a kubelet and containerd)"
    missing = [tool for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "nft", "socat", "ip",
                                 "buildah", "debootstrap") if shutil.which(tool) is None]
    missing += [f"{CNI_BIN}/{p}" for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if missing:
        return f"not installed: {', '.join(missing)} (`make node` installs them)"
    if bin_dir is not None:
        absent = [b for b in ("kubelet", "kube-proxy") if not (Path(bin_dir) / b).exists()]
        if absent:
            return f"not built: {', '.join(absent)} (e2e/build-node.sh)"
    return None


def _run(*args: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and res.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def remove_rules() -> None:
    """Remove kube-proxy's nftables tables and the chains the kubelet adds through iptables
    (KUBE-FIREWALL, which drops DNATed packets from outside 127/8 to 127/8, and its canaries)."""
    for family in ("ip", "ip6"):
        _run("nft", "delete", "table", family, "kube-proxy", check=False)
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for chain in ("INPUT", "OUTPUT"):
            while _run(tool, "-t", "filter", "-D", chain, "-j", "KUBE-FIREWALL", check=False).returncode == 0:
                pass
        for table, chain in (("filter", "KUBE-FIREWALL"), ("filter", "KUBE-KUBELET-CANARY"),
                             ("nat", "KUBE-KUBELET-CANARY"), ("mangle", "KUBE-KUBELET-CANARY"),
                             ("mangle", "KUBE-IPTABLES-HINT")):
            if _run(tool, "-t", table, "-F", chain, check=False).returncode == 0:
                _run(tool, "-t", table, "-X", chain, check=False)


def cleanup_leftovers() -> None:
    """After a harness that died without stop(): what a RealNode leaves on the host."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and b"/kaon-node-" in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for workdir in Path(tempfile.gettempdir()).glob("kaon-node-*"):
        RealNode._unmount_under(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    RealNode._unmount_under(CACHE / "node" / "containerd")
    remove_rules()
    _run("ip", "route", "del", SERVICE_RANGE, "dev", BRIDGE, check=False)
    _run("ip", "link", "del", BRIDGE, check=False)
    RealNode._remove_cgroups()


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name


class RealNode:
    def __init__(self, cp: ControlPlane, bin_dir: Path, images: Path | None = None, *, name: str = NODE_NAME,
                 startup_timeout: float = 180):
        self.cp, self.bin, self.images, self.name = cp, Path(bin_dir), images, name
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="kaon-node-"))
        self.root = CACHE / "node" / "containerd"  # the image store, kept between runs
        self.socket = self.workdir / "containerd.sock"
        self._procs: dict[str, subprocess.Popen] = {}
        self._sysctls: dict[str, str] = {}
        self._netns_before: set[str] = set()
        self._lock: IO[str] | None = None
        self._made_bridge = False

    # lifecycle ---------------------------------------------------------------

    def start(self) -> RealNode:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        reason = unavailable_reason(self.bin)
        if reason:
            raise NodeError(reason)
        self.root.mkdir(parents=True, exist_ok=True)
        # One node per machine at a time: the bridge, the image store and the nftables tables are shared.
        self._lock = open(self.root.parent / ".lock", "w")  # noqa: SIM115  held (and locked) until stop()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise NodeError("another real node is running on this machine (the lock in ~/.cache/kaon/node)") from None
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            raise NodeError(f"a bridge {BRIDGE} already exists (left over? `ip link del {BRIDGE}`)")
        self._sysctls = {s: _sysctl_path(s).read_text().strip() for s in KUBELET_SYSCTLS}
        self._netns_before = set(os.listdir("/var/run/netns")) if Path("/var/run/netns").exists() else set()
        self._network()
        self._start_containerd(deadline)
        self._import_images()  # the first import of the engine image alone takes a minute or two
        deadline = max(deadline, time.monotonic() + 60)
        self._identities()
        self._start_apiserver_forwarder()
        self._start_kubelet()
        self._start_kube_proxy()
        self._wait(deadline, f"node {self.name} Ready", self._node_ready)

    def stop(self) -> None:
        """Stop the pods' containers, then kube-proxy, the kubelet, containerd and its shims; undo
        the network and kernel settings; remove the temp dir. Safe to call more than once."""
        if "kubelet" in self._procs:
            self._drain_pods()
        for name in ("kube-proxy", "kubelet", "apiserver-forwarder"):
            proc = self._procs.pop(name, None)
            if proc:
                terminate(proc, grace=15)
        if "containerd" in self._procs:
            self._kill_containers()
            terminate(self._procs.pop("containerd"), grace=15)
        self._kill_shims()
        self._unmount_under(self.workdir)
        self._unmount_under(self.root)
        self._remove_netns()
        remove_rules()
        if self._made_bridge:
            _run("ip", "route", "del", SERVICE_RANGE, "dev", BRIDGE, check=False)
            _run("ip", "link", "del", BRIDGE, check=False)
            self._made_bridge = False
        for name, value in self._sysctls.items():
            try:
                _sysctl_path(name).write_text(value)
            except OSError:
                pass
        self._sysctls = {}
        self._remove_cgroups()
        if not os.environ.get("KAON_KEEP_CONTROL_PLANE"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._lock:
            self._lock.close()
            self._lock = None

    # setup -------------------------------------------------------------------

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        # Forwarding for packets that arrive on the bridge only (a pod calling a ClusterIP whose
        # endpoint is another pod is DNATed by the host and sent back out of the bridge).
        _sysctl_path(f"net/ipv4/conf/{BRIDGE}/forwarding").write_text("1")
        _run("ip", "route", "add", SERVICE_RANGE, "dev", BRIDGE, "src", GATEWAY)
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True)
        (cni / "net.d" / "10-kaon.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "kaon",
            "plugins": [{"type": "bridge", "bridge": BRIDGE, "isGateway": True, "isDefaultGateway": True,
                         "ipMasq": False, "hairpinMode": True,
                         "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                                  "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]]}}],
        }, indent=2))

    def _start_containerd(self, deadline: float) -> None:
        config = self.workdir / "containerd.toml"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config.write_text(f"""version = 2
root = "{self.root}"
state = "{self.workdir / 'containerd-state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # root here may not lower oom_score_adj (no CAP_SYS_RESOURCE: "nsexec: failed to update
  # /proc/self/oom_score_adj: Permission denied"); keep containers' scores at or above containerd's.
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{self.workdir / 'cni' / 'net.d'}"
""")
        self._spawn("containerd", "containerd", "--config", str(config), "--log-level", "warn")
        self._wait(deadline, "containerd's socket",
                   lambda: self.socket.exists() and self.ctr("version", check=False).returncode == 0)

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return _run("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args, check=check,
                    timeout=timeout)

    def _import_images(self) -> None:
        """Import every archive of the list that this image store has not seen (a stamp per archive)."""
        if self.images is None:
            return
        stamps = self.root.parent / "imported"
        stamps.mkdir(exist_ok=True)
        present = self.ctr("images", "ls", "-q").stdout.split()
        for line in self.images.read_text().splitlines():
            if not line.strip():
                continue
            name, archive = line.split()
            stamp = stamps / Path(archive).name
            if name in present and stamp.exists():
                continue
            self.ctr("images", "import", archive, timeout=1800)
            if name not in self.ctr("images", "ls", "-q").stdout.split():
                raise NodeError(f"importing {archive} did not give an image named {name}")
            stamp.touch()

    def _identities(self) -> None:
        """The kubelet as system:node:<name> bound to the system:node role, kube-proxy as
        system:kube-proxy bound to system:node-proxier (what kubeadm gives them, minus the Node
        authorizer, which this control plane does not run)."""
        self.kubelet_kubeconfig = self.cp.user_kubeconfig("kubelet", f"system:node:{self.name}", ("system:nodes",))
        self.proxy_kubeconfig = self.cp.user_kubeconfig("kube-proxy", "system:kube-proxy")
        self.cp.kubectl("create", "clusterrolebinding", f"{self.name}-kubelet", "--clusterrole=system:node",
                        f"--user=system:node:{self.name}", check=False)
        self.cp.kubectl("create", "clusterrolebinding", f"{self.name}-kube-proxy",
                        "--clusterrole=system:node-proxier", "--user=system:kube-proxy", check=False)

    def _start_apiserver_forwarder(self) -> None:
        """Pods reach the apiserver as the `kubernetes` Service: its EndpointSlice points at a socat
        on the bridge's address that forwards to the apiserver's loopback port."""
        port = int(self.cp.server.rsplit(":", 1)[1])
        self._spawn("apiserver-forwarder", "socat", f"TCP-LISTEN:{port},bind={GATEWAY},reuseaddr,fork",
                    f"TCP:127.0.0.1:{port}")
        self.cp.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "kubernetes",
                                    "endpointslice.kubernetes.io/managed-by": "kaon-real-node"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}))

    def _start_kubelet(self) -> None:
        pki = self.cp.pki
        pki.issue("kubelet-serving", self.name, server=True)
        port, healthz = free_port(), free_port()
        config = self.workdir / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False,  # this machine mounts cgroup v1; 1.36 refuses it by default
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": GATEWAY, "port": port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "tlsCertFile": str(pki.dir / "kubelet-serving.crt"),
            "tlsPrivateKeyFile": str(pki.dir / "kubelet-serving.key"),
            # The apiserver presents no client certificate to kubelets here (kubectl logs, exec):
            # anonymous, on the bridge's address only.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki.ca_path)}},
            "authorization": {"mode": "AlwaysAllow"},
            "failSwapOn": False,
            "resolvConf": "/etc/resolv.conf",
            "staticPodPath": "",
            "maxPods": 40,
            "hairpinMode": "hairpin-veth",
            # The images are imported once and cannot be pulled again: never collect them, and
            # do not evict pods for a disk that is only moderately full.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "rotateCertificates": False, "serverTLSBootstrap": False,
            "syncFrequency": "10s", "fileCheckFrequency": "10s",
            "shutdownGracePeriod": "0s",
        }, indent=2))
        self._spawn("kubelet", str(self.bin / "kubelet"), f"--config={config}",
                    f"--kubeconfig={self.kubelet_kubeconfig}", f"--root-dir={self.workdir / 'kubelet'}",
                    f"--cert-dir={self.workdir / 'kubelet-pki'}", f"--hostname-override={self.name}",
                    f"--node-ip={GATEWAY}", "--node-labels=kaon.dev/real-node=true", "--v=1")

    def _start_kube_proxy(self) -> None:
        config = self.workdir / "kube-proxy.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.proxy_kubeconfig)},
            # nftables: kube-proxy's rules live in tables of its own, removed by stop().
            "mode": "nftables",
            "hostnameOverride": self.name, "bindAddress": GATEWAY, "clusterCIDR": POD_SUBNET,
            "healthzBindAddress": f"127.0.0.1:{free_port()}", "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "nodePortAddresses": [f"{GATEWAY}/32"],
            # 0: leave the host's conntrack settings as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s",
                          "udpTimeout": "0s", "udpStreamTimeout": "0s"},
        }, indent=2))
        self._spawn("kube-proxy", str(self.bin / "kube-proxy"), f"--config={config}", "--v=1")

    # helpers ------------------------------------------------------------------

    def _spawn(self, name: str, *cmd: str) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self._procs[name] = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=subprocess.STDOUT, cwd=self.workdir,
                                                 preexec_fn=_die_with_parent)

    def log(self, name: str, lines: int = 40) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _wait(self, deadline: float, what: str, ready) -> None:
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise NodeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise NodeError(f"timed out waiting for {what}\n--- kubelet:\n{self.log('kubelet')}")
            time.sleep(0.5)

    def _node_ready(self) -> bool:
        res = self.cp.kubectl("get", "node", self.name, "-o", "json", check=False)
        if res.returncode != 0:
            return False
        conditions = json.loads(res.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    # teardown -----------------------------------------------------------------

    def _drain_pods(self, timeout: float = 60) -> None:
        """Delete the node's pods through the apiserver, so the kubelet stops them properly
        (SIGTERM, CNI teardown) while it still runs; bounded by `timeout`."""
        try:
            self.cp.kubectl("taint", "node", self.name, "kaon.dev/stopping=:NoSchedule", "--overwrite", check=False)
            selector = f"spec.nodeName={self.name}"
            self.cp.kubectl("delete", "pods", "-A", "--field-selector", selector, "--grace-period=5",
                            "--wait=false", check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                running = self.ctr("tasks", "ls", "-q", check=False, timeout=10).stdout.split()
                if not running:
                    return
                time.sleep(1)
        except (subprocess.TimeoutExpired, ControlPlaneError):
            pass

    def _kill_containers(self) -> None:
        try:
            for task in self.ctr("tasks", "ls", "-q", check=False, timeout=10).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=10)
            time.sleep(0.5)
            for task in self.ctr("tasks", "ls", "-q", check=False, timeout=10).stdout.split():
                self.ctr("tasks", "delete", "-f", task, check=False, timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _kill_shims(self) -> None:
        """containerd's shims outlive it by design: kill those serving our socket, by PID."""
        marker = str(self.socket).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and marker in cmdline:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _unmount_under(path: Path) -> None:
        prefix = str(path.resolve())
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1].encode().decode("unicode_escape") for line in f]
        for mount in reversed(mounts):
            if mount == prefix or mount.startswith(prefix + "/"):
                _run("umount", "-l", mount, check=False)

    def _remove_netns(self) -> None:
        netns = Path("/var/run/netns")
        if not netns.exists():
            return
        for name in set(os.listdir(netns)) - self._netns_before:
            if name.startswith("cni-"):
                _run("umount", str(netns / name), check=False)
                (netns / name).unlink(missing_ok=True)

    @staticmethod
    def _remove_cgroups() -> None:
        """The kubelet's kubepods hierarchy (cgroup v1: one per controller), deepest first."""
        for controller in Path("/sys/fs/cgroup").iterdir():
            top = controller / "kubepods"
            if not top.is_dir():
                continue
            for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    path.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                pass


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["cleanup"]:
        cleanup_leftovers()
    else:
        sys.exit("usage: python -m e2e.real_node cleanup   (what a killed harness left behind)")
