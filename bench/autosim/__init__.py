"""A calibrated discrete-event simulator that judges kaon's autoscaling policy (bench/autoscale_sim.py runs it).

Policies, on the same trace and seed: kaon (`kaon_operator.autoscaling.autoscaler.decide` fed the very
`Sample`s the operator builds, every 5 s), an HPA-style policy, Knative's KPA and an oracle
(see `oracle.oracle_schedule`); kaon-standby is the predictive policy with standby replicas (issue 53):
`--standby` of them loaded and asleep, a scale-up waking one (the profiled wake, `wake.Wake`: the engine's,
the readiness probe's phase, the routers' watch, the standby loop's round; or a constant `--wake-s`) and
starting another behind it, each costing `--standby-cost` of an awake replica in its replica-hours.
The yardstick: SLO attainment (TTFT <= target), replica-hours
relative to the oracle, replica changes per hour, requests cut by scale-down.

The modules, each one job (imports run down this list, never up):
- engine: the engine model (EngineModel's step time), the workload, a request, a replica's scheduler;
- wake: a standby's wake, part by part (the profiled one, or a constant);
- cluster: the replicas, the router, the standbys, the event queue, the scrape and the routers' pressure;
- simulation: one policy over one trace (simulate), the Run it returns, the Policy base and Schedule;
- traces: the ten traces and their arrivals;
- measure: one replica's capacity and the per-replica target at the SLO, measured in the model;
- oracle: the oracle's schedule, its cache (keyed by the text of the modules above only) and the dwell oracle;
- policies: kaon (reactive, predictive, with standbys), the HPA, Knative's KPA;
- run: a whole trace's run (Config, every policy against the oracles), its rows, pooling over seeds;
- report: the tables, the iso-SLO comparison with the HPA, the plots;
- cli: the command line (bench/autoscale_sim.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))
