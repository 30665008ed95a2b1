#!/usr/bin/env bash
# tests/integration and tests/e2e, `make test`'s second stage: two pytest processes side by side
# (CLUSTER_TESTS=side-by-side, the default) or one after the other (CLUSTER_TESTS=serial).
#
# Why side by side: in one process the two took 1,317 s in CI, much of it in waits (engines loading,
# autoscaling windows and holds, probes, drains) that a second process can overlap. Each process gets its own control
# plane (free loopback ports, its own temp dir), its own MinIO and stand-in hub, and the e2e local
# cluster its own pod range (e2e/pod_range.py), so neither sees the other's objects or engines.
# The two are about even in CI: of the last serial run's 1,317 s, the e2e tests in its slowest list
# alone took ~550 s (a run beside other work here, load 10-90, is no guide: there the load-sensitive
# integration tests took several times their CI time). tests/e2e prints as it runs;
# tests/integration's output goes to $LOG and is printed when both are done. Exit status: the first
# failing stage's (integration's, then e2e's), so any failure fails it.
#
# Balance: run side by side in CI (2026-11-29, a quiet 2-core machine), tests/e2e took 839 s and
# tests/integration 1,155 s. The integration modules below need no control plane (engine processes
# only: pipeline parallel ~81 s, engine lifecycle ~31 s run alone there), so they run in the e2e
# process, after the e2e tests, to even the two out. The cold CI of 2026-11-30 (a 2-vCPU AMD Zen 2,
# helpers' work beside it): tests/e2e 857 s, tests/integration 1,226 s, of which the slow-reader test
# 112 s (its small send buffer did not apply under uvloop: 4 s now); tensor parallelism (engine
# processes only) moved over too.
#
# usage: PY=.venv/bin/python tests/run_cluster_tests.sh [pytest options...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOG=${LOG:-.venv/integration.log}

if [[ ${CLUSTER_TESTS:-side-by-side} == serial ]]; then
  exec "$PY" -m pytest "$@" tests/integration tests/e2e
fi

IN_E2E_PROCESS=(tests/integration/test_pipeline_parallel.py tests/integration/test_engine_lifecycle.py
                tests/integration/test_tensor_parallel.py)
start=$SECONDS ticks=$(tests/cpu_busy.sh)
( "$PY" -m pytest "$@" tests/integration "${IN_E2E_PROCESS[@]/#/--ignore=}" > "$LOG" 2>&1 & pytest_pid=$!
  trap 'kill "$pytest_pid" 2>/dev/null' INT TERM
  wait "$pytest_pid"; rc=$?
  echo "[tests] tests/integration took $((SECONDS - start)) s" >> "$LOG"; exit $rc ) &
integration_pid=$!
trap 'kill "$integration_pid" 2>/dev/null' INT TERM
"$PY" -m pytest "$@" tests/e2e "${IN_E2E_PROCESS[@]}"
e2e=$?
echo "[tests] tests/e2e (and ${IN_E2E_PROCESS[*]##*/}) took $((SECONDS - start)) s"
wait "$integration_pid"
integration=$?
echo
echo "==================== tests/integration (ran beside tests/e2e; also in $LOG) ===================="
cat "$LOG"
echo "[tests] tests/integration exit $integration, tests/e2e exit $e2e; the CPUs were $(tests/cpu_busy.sh "$ticks")% busy"
((integration == 0)) || exit "$integration"
exit "$e2e"
