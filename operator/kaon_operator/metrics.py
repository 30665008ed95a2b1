"""The operator's own Prometheus metrics (docs/metrics.md lists them)."""
from __future__ import annotations

from prometheus_client import Histogram

RECONCILE_SECONDS = Histogram("kaon_operator_reconcile_seconds", "Time to apply one InferenceService's children",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
STATUS_SECONDS = Histogram("kaon_operator_status_update_seconds", "Time to recompute and write one status",
                           buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
