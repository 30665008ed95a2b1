"""Issue 48, item 3, as the audit ran it: twelve 4 MiB bodies of `[{},{},...]` sent at once to a
router process, for an open service that has no ready pod (so each request waits, holding what it
parsed). Before the fix each parsed into ~100 MB of dicts and the process passed 1 GiB; now each
is refused on a scan of its bytes, and the process's peak memory barely moves.

The router is a process of its own (its peak RSS is what a pod's memory limit sees), serving
the real app behind the real listening edge, with its table filled by hand instead of a watch.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import aiohttp

from support.router import run

ROUTER = textwrap.dedent("""
    import asyncio, sys
    from kaon_operator.router import edge
    from kaon_operator.router.config import RouterConfig
    from kaon_operator.router.endpoints import EndpointTable
    from kaon_operator.router.proxy import Router

    async def main():
        table = EndpointTable(default_namespace="default")
        table.apply_service("ADDED", {"metadata": {"namespace": "default", "name": "open",
                                                   "creationTimestamp": "2026-01-01T00:00:00Z"},
                                      "spec": {"model": {"uri": "builtin://x", "servedName": "m"}}})
        table.synced = True
        router = Router(table, RouterConfig(queue_timeout=30))
        async with edge.serving(router.app(), "127.0.0.1", 0, max_connections=4096, header_timeout=10) as port:
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    asyncio.run(main())
""")


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_twelve_bodies_of_empty_objects_do_not_take_the_router_past_its_memory():
    process = subprocess.Popen([sys.executable, "-c", ROUTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        before = peak_rss_mib(process.pid)
        body = b'{"model": "m", "x": [' + b",".join([b"{}"] * ((4 << 20) // 3 - 20)) + b"]}"

        async def attack() -> list[int]:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(60)) as client:
                async def one() -> int:
                    try:
                        async with client.post("/v1/completions", data=body) as resp:
                            return resp.status
                    except (TimeoutError, aiohttp.ClientError):
                        return 0
                sent = [asyncio.ensure_future(one()) for _ in range(12)]
                done, _ = await asyncio.wait(sent, timeout=8)  # the old router holds them (no ready pod): 30 s
                peak.append(peak_rss_mib(process.pid))
                return [t.result() for t in done]

        peak: list[float] = []
        statuses = run(attack())
        grew = peak[0] - before
        print(f"router peak RSS: {before:.0f} MiB before, {peak[0]:.0f} MiB under 12 bodies ({grew:+.0f} MiB)")
        # Refused: on the scan (413), or past this one client's share of the byte budget (503) unread.
        assert len(statuses) == 12 and set(statuses) <= {413, 503} and 413 in statuses, statuses
        assert grew < 150, f"the router's peak RSS grew by {grew:.0f} MiB"
    finally:
        process.kill()
        process.wait()
