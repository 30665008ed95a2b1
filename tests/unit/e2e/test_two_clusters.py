"""What two local clusters on one machine share, made per cluster by the pod runner (e2e/pod_runner.py):
an engine's KV events are bound to its pod's IP, as its HTTP port is (bound to every address, two
kv-aware pods would share port 5557 and a router could read another cluster's events), and the host
link of a pvc:// adapter's mount is not re-pointed while another live cluster's engine uses it; and the
ports the harness picks (e2e/control_plane.py free_port) lie outside the kernel's ephemeral range.
(The pod range, the third shared thing, is tests/unit/e2e/test_pod_range.py's.)"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from e2e import pod_runner
from e2e.control_plane import ephemeral_ports, free_port, port_range_outside
from e2e.lws_standin import free_port_pair
from e2e.pod_runner import SharedPathError, _command, link_runtime_mounts, may_relink, unlink_owned
from kaon_operator.children.kv_cache_args import KV_EVENTS_PORT, KV_REPLAY_PORT


def test_an_engines_kv_events_are_bound_to_its_pod_ip_as_its_port_is():
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{KV_EVENTS_PORT}", "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}"})
    command = _command(["kaon", "serve", "--host", "0.0.0.0", "--kv-events-config", events], "127.7.0.3")
    config = json.loads(command[command.index("--kv-events-config") + 1])
    assert config["endpoint"] == f"tcp://127.7.0.3:{KV_EVENTS_PORT}"
    assert config["replay_endpoint"] == f"tcp://127.7.0.3:{KV_REPLAY_PORT}"
    assert command[command.index("--host") + 1] == "127.7.0.3"


def test_a_link_is_re_pointed_only_when_no_other_live_process_made_it():
    ours, theirs = Path("/ours"), Path("/theirs")
    never = lambda pid: False  # noqa: E731
    always = lambda pid: True  # noqa: E731
    assert may_relink(None, ours, None, always)  # no link yet
    assert may_relink(ours, ours, 1, always)  # ours already
    assert may_relink(theirs, ours, None, always)  # nobody noted: an older runner's
    assert may_relink(theirs, ours, 4242, never)  # its cluster is gone
    assert not may_relink(theirs, ours, 4242, always)  # another live cluster's volume


def test_another_live_clusters_adapter_link_is_refused_and_taken_once_it_is_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(pod_runner, "ADAPTER_MOUNT", str(tmp_path / "adapters"))
    mount = f"{tmp_path}/adapters/shared-claim"
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        Path(mount).parent.mkdir()
        Path(mount).symlink_to(theirs, target_is_directory=True)
        (tmp_path / "adapters" / ".shared-claim.owner").write_text(f"{other.pid}\n")
        with pytest.raises(SharedPathError, match="another local cluster"):
            link_runtime_mounts([(mount, ours)])
        assert Path(mount).readlink() == theirs  # left as it was
    finally:
        other.communicate(b"")
    assert link_runtime_mounts([(mount, ours)]) == [Path(mount)]
    assert Path(mount).readlink() == ours
    assert link_runtime_mounts([(mount, ours)]) == []  # our own again: kept
    unlink_owned({Path(mount)})  # the runner's stop: the link and its owner note go
    assert not Path(mount).is_symlink() and not (tmp_path / "adapters" / ".shared-claim.owner").exists()


def test_free_ports_lie_outside_the_range_the_kernel_hands_out_by_itself():
    # A port from bind(0) lies in the ephemeral range, where any process's outgoing connection may take it as its
    # source port before the cluster's server binds it; a free_port lies below it.
    assert port_range_outside((32768, 60999)) == (10000, 32768)
    assert port_range_outside((15000, 60999)) == (10000, 15000)
    assert port_range_outside((40000, 60999)) == (10000, 32768)  # no overlap: all of it
    assert port_range_outside((10500, 60999)) is None  # too little left: bind(0) after all
    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports) and len(ports) > 1, ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
    pair = free_port_pair()  # an LWS group's rendezvous and control channel, bound by its leader on every address
    assert pair + 1 < low
    with socket.socket() as first, socket.socket() as second:
        first.bind(("0.0.0.0", pair))
        second.bind(("0.0.0.0", pair + 1))
