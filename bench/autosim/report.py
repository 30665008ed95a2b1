"""What a run prints: the tables, kaon against the HPA frontier, the plots, the policy's version."""
from __future__ import annotations

import math
from pathlib import Path

from kaon_operator.autoscaling import autoscaler

from .run import percentile


def policy_version() -> str:
    """The git blob hash of the autoscaler.py this run imported (its owner edits it): say which policy was judged."""
    import hashlib
    data = Path(autoscaler.__file__).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:10]


def iso_slo(rows: list[dict], policy: str = "kaon-predictive") -> list[dict]:
    """Per trace: `policy` against the cheapest HPA setting (the frontier's and the default
    target) whose SLO attainment is at least as good; None where no HPA setting reaches it."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        ours = next(r for r in rows if r["trace"] == trace and r["policy"] == policy)
        hpas = [r for r in rows if r["trace"] == trace and (r["policy"] == "hpa" or r["policy"].startswith("hpa-x"))]
        good = [r for r in hpas if r["slo_attainment"] >= ours["slo_attainment"]]
        best = min(good, key=lambda r: r["replica_hours"], default=None)
        out.append({"trace": trace, "policy": policy, "slo_attainment": ours["slo_attainment"],
                    "replica_hours": ours["replica_hours"], "hpa_setting": best and best["policy"],
                    "hpa_slo_attainment": best and best["slo_attainment"],
                    "hpa_replica_hours": best and best["replica_hours"],
                    "below_hpa": best is None or ours["replica_hours"] < best["replica_hours"]})
    return out


def iso_table(rows: list[dict]) -> str:
    head = f"{'trace':11} {'SLO att.':>9} {'repl-h':>7}   {'cheapest HPA at that SLO or better':36} {'below':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        hpa = "none reaches it" if r["hpa_setting"] is None else \
            f"{r['hpa_setting']}: {100 * r['hpa_slo_attainment']:.2f}%, {r['hpa_replica_hours']:.2f} h"
        lines.append(f"{r['trace']:11} {100 * r['slo_attainment']:8.2f}% {r['replica_hours']:7.2f}   {hpa:36} "
                     f"{'yes' if r['below_hpa'] else 'no':>5}")
    return "\n".join(lines)


def table(rows: list[dict], target: float) -> str:
    head = (f"{'trace':11} {'policy':16} {'SLO att.':>9} {'repl-h':>7} {'vs oracle':>9} {'vs dwell':>8} {'chg/h':>6} "
            f"{'cut':>5} {'503':>4} {'P99 TTFT':>9} {'requests':>8}")
    lines = [f"TTFT target {target:g} s", head, "-" * len(head)]
    for r in rows:
        vs = "-" if r["replica_hours_vs_oracle"] is None else f"{r['replica_hours_vs_oracle']:.2f}x"
        dwell = "-" if r["replica_hours_vs_dwell_oracle"] is None else f"{r['replica_hours_vs_dwell_oracle']:.2f}x"
        lines.append(f"{r['trace']:11} {r['policy']:16} {100 * r['slo_attainment']:8.2f}% {r['replica_hours']:7.2f} "
                     f"{vs:>9} {dwell:>8} {r['changes_per_hour']:6.1f} {r['cut_requests']:5d} {r['failed_held']:4d} "
                     f"{r['p99_ttft_s']:8.2f}s {r['requests']:8d}")
    return "\n".join(lines)


def plot(series: dict, target: float, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace, arrivals, runs = series["trace"], series["arrivals"], series["runs"]
    minutes = math.ceil(trace.duration / 60)
    fig, (ax_load, ax_rep, ax_p99) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    per_minute = [0] * minutes
    for t, _, _ in arrivals:
        per_minute[min(int(t // 60), minutes - 1)] += 1
    ax_load.plot(range(minutes), [n / 60 for n in per_minute], color="black", drawstyle="steps-post")
    ax_load.set_ylabel("arrivals (req/s)")
    ax_load.set_title(f"{trace.name}: load, replicas, P99 TTFT per minute")
    for name, run in runs.items():
        if name.startswith("hpa-x"):  # the HPA frontier is a table, not eight more lines
            continue
        log = run.replica_log + [(trace.duration, run.replica_log[-1][1])]
        ax_rep.plot([t / 60 for t, _ in log], [n for _, n in log], drawstyle="steps-post", label=name,
                    linestyle="--" if name.startswith("oracle") else "-")
        p99 = []
        for m in range(minutes):
            ttfts = [r.ttft() for r in run.requests if m * 60 <= r.arrival < (m + 1) * 60 and r.ttft() is not None]
            p99.append(percentile(ttfts, 0.99) if ttfts else float("nan"))
        ax_p99.plot(range(minutes), p99, label=name, linestyle="--" if name.startswith("oracle") else "-")
    ax_rep.set_ylabel("replicas")
    ax_rep.legend(loc="upper left", fontsize=8)
    ax_p99.axhline(target, color="red", linewidth=1, label="target")
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("P99 TTFT (s)")
    ax_p99.set_xlabel("minute")
    ax_p99.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"autoscale_{trace.name}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
