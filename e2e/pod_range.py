"""A pod IP range of its own for each local cluster on this machine.

KWOK gives pods IPs from a loopback range, and the pod runner binds a real engine to each pod's
IP. Two clusters on one machine (a second `make demo`, a parallel test worker) that shared one
fixed range handed out the same IPs, so an engine bound an IP another cluster's pod also had,
and one router reached the other cluster's engine. So each control plane reserves a /16 of
127.0.0.0/8 that no other live cluster holds: an exclusive flock on a file per range in a
directory every user of the machine shares. The kernel drops a flock when its holder dies, so a
SIGKILLed cluster leaves no stale reservation behind.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
from pathlib import Path
from typing import IO

# /tmp, not the temp dir of the environment: every process on the machine must see the same files.
LOCK_DIR = Path(os.environ.get("KAON_POD_RANGE_LOCKS", "/tmp/kaon-pod-ranges"))
# 127.0.0.0/16 holds the host's own 127.0.0.1 (the apiserver, routers and test servers bind there).
SECOND_OCTETS = range(1, 255)


class PodRangeError(RuntimeError):
    pass


class PodRange:
    """A reserved 127.N.0.0/16, held until release() (or the process's death)."""

    def __init__(self, network: ipaddress.IPv4Network, lock: IO[str]):
        self.network, self._lock = network, lock

    @property
    def kwok_cidr(self) -> str:
        """KWOK's --cidr: the first address it hands out, and the prefix."""
        return f"{self.network[1]}/{self.network.prefixlen}"

    def release(self) -> None:
        if not self._lock.closed:
            self._lock.close()  # closing the file drops its flock

    def __contains__(self, ip: str) -> bool:
        return ipaddress.ip_address(ip) in self.network


def reserve(lock_dir: Path = LOCK_DIR) -> PodRange:
    """The first range no live holder has locked. flock is per open file, so it also keeps two
    clusters of one process apart."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock_dir.chmod(0o1777)  # like /tmp itself: other users may lock ranges too
    except PermissionError:
        pass  # made by another user, who opened it up
    for octet in SECOND_OCTETS:
        try:
            lock = open(lock_dir / f"127.{octet}.lock", "a")  # noqa: SIM115 (held open: the file is the lock)
        except PermissionError:
            continue  # another user's file: treat it as theirs
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")  # for a person wondering who holds it
        lock.flush()
        return PodRange(ipaddress.IPv4Network(f"127.{octet}.0.0/16"), lock)
    raise PodRangeError(f"every pod range in 127.0.0.0/8 is held ({lock_dir})")
