"""How the ranks of one engine find each other: the leader's address, the group's hosts, and the
control channel that carries step plans from the leader to every other rank.

The contract (docs/multinode.md, "engine contract"): the leader (host 0) listens on HOST:PORT for
torch.distributed's rendezvous and on HOST:PORT+1 for the control channel. HOST:PORT comes from
`--distributed-init-address`, else from LeaderWorkerSet's `LWS_LEADER_ADDRESS` (port 29500); the
number of hosts and this host's index from `LWS_GROUP_SIZE` and `LWS_WORKER_INDEX` (one host, index 0,
when they are unset). The control channel is multiprocessing's authenticated connection: plans are
pickled, so its key (`KAON_DIST_AUTHKEY`, from a Secret on Kubernetes) keeps anyone else from speaking
on it. A group of several hosts refuses to start without that key (the built-in one only with
`KAON_DIST_INSECURE_KEY=1`, for development); ranks on one host share a random key of the leader's.
"""
from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection

from kaon_runtime.errors import KaonError

DEFAULT_PORT = 29500
JOIN_TIMEOUT_S = 300.0  # how long the ranks wait for each other at start (KAON_DIST_JOIN_TIMEOUT_S)
DEV_KEY = b"kaon-pipeline"  # the built-in key: anyone who knows kaon knows it (KAON_DIST_INSECURE_KEY=1 only)


class GroupConfigError(KaonError, ValueError):
    """The group's flags or environment do not make a group (`kaon serve` says so in one line)."""


@dataclass(slots=True, frozen=True)
class Rendezvous:
    host: str = "127.0.0.1"
    port: int = 0  # 0: one host, a free port picked by the leader
    num_hosts: int = 1
    host_index: int = 0
    join_timeout_s: float = JOIN_TIMEOUT_S
    authkey: bytes = field(default_factory=lambda: secrets.token_hex(32).encode(), repr=False)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def control_address(self) -> tuple[str, int]:
        return self.host, self.port + 1

    @property
    def is_leader(self) -> bool:
        return self.host_index == 0


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GroupConfigError(f"a distributed init address is HOST:PORT, got {address!r}")
    return host, int(port)


def rendezvous_from(init_address: str | None, environ: Mapping[str, str] = os.environ) -> Rendezvous:
    """The group as the flags and LeaderWorkerSet's environment describe it."""
    timeout = float(environ.get("KAON_DIST_JOIN_TIMEOUT_S", JOIN_TIMEOUT_S))
    num_hosts = int(environ.get("LWS_GROUP_SIZE", "1"))
    index = int(environ.get("LWS_WORKER_INDEX", "0"))
    if not 0 <= index < num_hosts:
        raise GroupConfigError(f"LWS_WORKER_INDEX {index} is outside a group of {num_hosts}")
    if init_address is not None:
        host, port = parse_address(init_address)
    elif "LWS_LEADER_ADDRESS" in environ:
        host, port = environ["LWS_LEADER_ADDRESS"], DEFAULT_PORT
    elif num_hosts > 1:
        raise GroupConfigError("a group of several hosts needs the leader's address: --distributed-init-address "
                               "HOST:PORT or LWS_LEADER_ADDRESS")
    else:
        host, port = "127.0.0.1", 0
    return Rendezvous(host, port, num_hosts, index, timeout, group_key(num_hosts, environ))


def group_key(num_hosts: int, environ: Mapping[str, str] = os.environ) -> bytes:
    """The control channel's key: KAON_DIST_AUTHKEY; without it a group on one host makes a random one (its
    ranks are the leader's children), and a group of several hosts refuses to start: the plans are pickled, so
    a known key would let anyone who reaches the leader's port run code in every rank."""
    if key := environ.get("KAON_DIST_AUTHKEY"):
        return key.encode()
    if num_hosts == 1:
        return secrets.token_hex(32).encode()
    if environ.get("KAON_DIST_INSECURE_KEY") == "1":
        return DEV_KEY
    raise GroupConfigError("a group of several hosts needs KAON_DIST_AUTHKEY (the control channel's shared key, "
                           "the same on every host; the operator sets it from the Secret <name>-dist-key); "
                           "KAON_DIST_INSECURE_KEY=1 uses a built-in key, for development only")


def connect_to_leader(rdv: Rendezvous, rank: int) -> Connection:
    """The control channel to the leader, retried until the join timeout: the leader may start later."""
    deadline = time.monotonic() + rdv.join_timeout_s
    while True:
        try:
            return Client(rdv.control_address, authkey=rdv.authkey)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: the leader at {rdv.host}:{rdv.port + 1} did not answer within "
                                   f"{rdv.join_timeout_s:.0f}s ({exc})") from exc
            time.sleep(0.5)
