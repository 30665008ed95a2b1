"""The router's CPU per request, old against new, side by side on the same fake engines.

    git archive <old commit> operator bench e2e | tar -x -C /tmp/old
    python bench/router_ab.py --base /tmp/old [--rounds 6] [--seconds 5] [--concurrency 64]
    python bench/router_ab.py --loops asyncio uvloop    # this tree on asyncio's loop (old) against uvloop's (new)

Starts bench/router.py's fake engines once and two routers (bench/router.py --role router: the old tree's
and this one's), then sends each in turn (alternating which goes first) --concurrency clients in a closed
loop for --seconds, and prints each round's and the totals' requests/s and CPU microseconds per request
(the router process's user + system time). On a shared machine only the comparison within one run means
anything: both routers see the same load. No nginx: bench/router.py is the comparison the issue names.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import router as bench  # noqa: E402  (bench/router.py: the engines, the load generator, the CPU reading)

from e2e.control_plane import free_port  # noqa: E402


async def compare(trees: dict[str, Path], rounds: int, seconds: float, clients: int,
                  loops: dict[str, str] | None = None) -> None:
    engines = [free_port(), free_port()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # each router imports its own tree
    children = [subprocess.Popen([sys.executable, str(HERE / "router.py"), "--role", "engines",
                                  "--ports", ",".join(map(str, engines))], env=env)]
    routers: dict[str, tuple[int, int]] = {}
    for name, tree in trees.items():
        port = free_port()
        child = subprocess.Popen([sys.executable, str(tree / "bench" / "router.py"), "--role", "router",
                                  "--loops", (loops or {}).get(name, "asyncio"),
                                  "--ports", ",".join(map(str, [port, *engines]))], env=env)
        children.append(child)
        routers[name] = (port, child.pid)
    try:
        for port in (*engines, *(port for port, _ in routers.values())):
            await bench.wait_listening(port)
        for port, _ in routers.values():  # warm: connections, caches
            await bench.closed_loop([f"http://127.0.0.1:{port}"], clients, 1.0, False)
        totals = {name: [0, 0.0, 0.0] for name in routers}
        for i in range(rounds):
            order = list(routers.items()) if i % 2 == 0 else list(reversed(routers.items()))
            for name, (port, pid) in order:
                load = bench.closed_loop([f"http://127.0.0.1:{port}"], clients, seconds, False)
                r = await bench.measured([pid], load)
                totals[name][0] += r.done
                totals[name][1] += r.cpu
                totals[name][2] += r.seconds
                print(f"round {i} {name:4} {bench.rate(r):7.0f} req/s {r.cpu / max(r.done, 1) * 1e6:6.1f} us CPU/req "
                      f"errors {r.errors or 0}  load {os.getloadavg()[0]:.1f}", flush=True)
        for name, (done, cpu, secs) in totals.items():
            print(f"total   {name:4} {done / secs:7.0f} req/s {cpu / max(done, 1) * 1e6:6.1f} us CPU/req")
    finally:
        for child in children:
            child.terminate()
            child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=HERE.parent,
                        help="the old tree (its bench/router.py and operator/); default: this one (with --loops)")
    parser.add_argument("--loops", nargs=2, default=["asyncio", "asyncio"], choices=["asyncio", "uvloop"],
                        metavar=("OLD", "NEW"), help="each router's event loop (uvloop: the `uvloop` extra)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    bench.raise_open_file_limit()
    asyncio.run(compare({"old": args.base, "new": HERE.parent}, args.rounds, args.seconds, args.concurrency,
                        dict(zip(("old", "new"), args.loops))))


if __name__ == "__main__":
    main()
