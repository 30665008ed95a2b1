"""The engine's performance profile, measured on a real `kaon serve` here: the autoscaling
simulator's engine model and the predictive autoscaler's performance model (one JSON, the
`perf_model.PerfModel` the operator reads from a ConfigMap).

    python bench/autoscale_calibrate.py [--out FILE] [--quantization Q] [--profile-out FILE]
    python bench/autoscale_sim.py --calibrate

The measurement and the fit are `kaon profile`'s (kaon_runtime/server/perf_profile.py: cold
start, decode step time over batch sizes and context lengths, prefill cost per token;
perf_fit.py: the least-squares fit step = a + b * batch + c * prefill tokens + d * context tokens seconds);
this script runs it on the bundled model with the full grid and keeps, beside the model, the
record the simulator reads (step_ms, cold_start_s, the measured points). One server at a
time (the machine is shared), a few minutes of wall time.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "runtime"))

import serve  # noqa: E402  (MODEL)

from kaon_runtime.server import perf_profile  # noqa: E402

LONG_CONTEXT_TOKENS = 16 * 384  # the 384-token decode points up to batch 16: prefilling more first takes minutes


def calibrate(out: Path, quantization: str = "none") -> dict:
    """Profile the bundled model (serve.MODEL) with `quantization`; write the whole record to `out`."""
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    args = perf_profile.build_parser().parse_args(["--max-context-tokens", str(LONG_CONTEXT_TOKENS), "--",
                                                   "--model", serve.MODEL, "--quantization", quantization])
    with open(logs / "autoscale_calibrate.log", "w") as log:
        profile = perf_profile.profile(args, log=log)
    profile["key"]["model"] = serve.MODEL
    grid = profile["grid"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores; load average {load_before:.1f} when calibration started",
        "model": serve.MODEL, "max_num_seqs": profile["max_num_seqs"],
        "max_num_batched_tokens": profile["max_num_batched_tokens"],
        "step_ms": [round(profile[t] * 1e3, 8) for t in "abcd"],
        "cold_start_s": profile["cold_start_seconds"],
        # decode points as "<batch>x<context tokens per sequence>"
        "measured": {"decode_step_ms": {f"{p['batch']}x{p['context_tokens'] / p['batch']:.0f}":
                                        round(p["seconds"] * 1e3, 2) for p in grid if p["batch"]},
                     "prefill_latency_ms": {str(p["prefill_tokens"]): round(p["seconds"] * 1e3, 1)
                                            for p in grid if not p["batch"]}},
        "wall_s": round(time.perf_counter() - started, 1),
        "perf_model": profile,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "autoscale_calibration.json")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--profile-out", type=Path, help="also write the bare performance model (a ConfigMap's data)")
    args = parser.parse_args(argv)
    result = calibrate(args.out, args.quantization)
    if args.profile_out:
        args.profile_out.write_text(json.dumps(result["perf_model"], indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
