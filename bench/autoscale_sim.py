"""A calibrated discrete-event simulator that judges kaon's autoscaling policy.

    python bench/autoscale_sim.py [--json] [--plot DIR] [--traces steady-60 step ...]
    python bench/autoscale_sim.py --calibrate          # measure the engine here first
    python bench/autoscale_sim.py --step-ms 12,0.3,0.02 --cold-start-s 180   # GPU figures

The simulator is the package bench/autosim/ (its docstring maps the modules: engine, wake, cluster,
simulation, traces, measure, oracle, policies, run, report, cli); this file is its command line, and
re-exports the names scripts and tests import from it (`import autoscale_sim as sim`).
"""
from __future__ import annotations

import sys

from autosim import ROOT
from autosim.cli import CALIBRATION, load_model, main, wake_of
from autosim.cluster import MAX_REPLICAS, Cluster, Scrape
from autosim.engine import BOUNDS, BUCKETS, EngineModel, Replica, Request, Workload
from autosim.measure import capacity, slo_concurrency
from autosim.oracle import cached_oracle_schedule, dwell_schedule, oracle_key, oracle_schedule
from autosim.policies import HPA, KPA, Kaon
from autosim.report import iso_slo, iso_table, plot, policy_version, table
from autosim.run import HPA_FRONTIER, Config, kaon_spec, percentile, policies, pooled, run_trace
from autosim.simulation import Poke, Policy, Run, Schedule, _hours, make_requests, simulate
from autosim.traces import LONG_PROMPTS, Trace, arrivals_for, traces
from autosim.wake import ENGINE_WAKE_S, PROFILED, READY_TO_ROUTER_S, Wake

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import perf_model

__all__ = [
    "BOUNDS", "BUCKETS", "CALIBRATION", "ENGINE_WAKE_S", "HPA", "HPA_FRONTIER", "KPA", "LONG_PROMPTS", "MAX_REPLICAS",
    "PROFILED", "READY_TO_ROUTER_S", "ROOT", "AutoscalingSpec", "Cluster", "Config", "EngineModel", "Kaon", "Poke",
    "Policy", "Replica", "Request", "Run", "Schedule", "Scrape", "Trace", "Wake", "Workload", "_hours",
    "arrivals_for", "cached_oracle_schedule", "capacity", "dwell_schedule", "iso_slo", "iso_table", "kaon_spec",
    "load_model", "main", "make_requests", "oracle_key", "oracle_schedule", "percentile", "perf_model", "plot",
    "policies", "policy_version", "pooled", "run_trace", "simulate", "slo_concurrency", "table", "traces", "wake_of",
]

if __name__ == "__main__":
    sys.exit(main())
