#!/usr/bin/env bash
# The GPU checks and benchmarks in one call (bench/gpu/README.md):
#   bash bench/gpu/run.sh [all|kernels|engine|gemv|roofline|throughput] [--dry-run]
# `all` runs the stages in order, each under its own timeout, going on when one fails; each writes
# its figures under $OUT (the device tool brings back at most 8 files: run.log, the output of every
# stage, and one JSON, XML or text file each). gemv (bench/gpu/gemv_sweep.py: decode's quantized
# matrix-vector kernels per tile shape) chooses the tiles roofline then runs the engine with.
# Carried wheels (.whl/, from bench/gpu/pack.sh) are installed first, if present.
# --dry-run (or KAON_GPU_DRY=1): the same stages on the CPU with tiny shapes, to prove the script
# before a lease (tests/integration/test_gpu_script.py runs it).
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=${KAON_GPU_DRY:-0}
stages=()
for arg in "$@"; do
    case $arg in
    --dry-run) dry=1 ;;
    all) stages+=(kernels gemv roofline throughput engine) ;;
    kernels | engine | gemv | roofline | throughput) stages+=("$arg") ;;
    *) echo "usage: bash bench/gpu/run.sh [all|kernels|engine|gemv|roofline|throughput] [--dry-run]" >&2; exit 2 ;;
    esac
done
[[ ${#stages[@]} -eq 0 ]] && stages=(kernels gemv roofline throughput engine)
export KAON_GPU_DRY=$dry PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}

if compgen -G ".whl/*.whl" > /dev/null; then
    site=${TMPDIR:-/tmp}/kaon-gpu-site
    target=(--target "$site")
    # The dry run proves the wheels install for the GPU machine's Python 3.12, into a folder it does not use.
    [[ $dry == 1 ]] && target=(--target "$site-dry" --python-version 3.12 --only-binary=:all:
        --platform manylinux_2_17_x86_64 --implementation cp)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${target[@]}" .whl/*.whl \
        || { echo "installing the carried wheels failed" >&2; exit 1; }
    [[ $dry == 1 ]] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/runtime:$PWD/operator:$PWD/bench/gpu:$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2> /dev/null
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

# Per stage: its time limit on a GPU, and its command (the dry run's shapes where they differ).
kernels() {
    # Kernel tests in 8 processes; the tests that build engines (each sizes its KV pool to 85% of the
    # free device memory) after them in one process: in 8 at once they ran out of memory (2026-11-30).
    # The bf16 engine tests run a spread copy of tiny_llama, not the bundled model (not carried).
    local select="not engine_on_the_triton_kernels" engines=() workers=(-n 8)
    if [[ $dry == 1 ]]; then  # the interpreter is slow: a few tests prove the stage
        select="write_kv_cache_matches or rms_norm or w8a16_kernel_matches or int8_matches_the_reference"
        select+=" or rotary_write_kv or split_decode_merges"  # the fused decode kernels (2026-11-30)
        select+=" or attention_row_does_not_depend"  # KAON_GPU_BATCH_INVARIANT's attention (2026-11-30)
        engines=(-k "static_decode_path_gives_the_eager_tokens and all-decodes-torch")
        workers=()
    fi
    # --noconftest: tests/conftest.py brings the control plane, MinIO and the bundled model, which
    # do not travel; bench/gpu/gpu_fixtures.py stands in for the part these tests use.
    local pytest=($PY -m pytest -q -p no:cacheprovider --noconftest -p gpu_fixtures -rfE)
    "${pytest[@]}" "${workers[@]}" --junitxml "$OUT/kernels.xml" -k "$select" \
        tests/unit/runtime/kernels/test_kernels.py tests/unit/runtime/kernels/test_paged_attention.py \
        tests/unit/runtime/kernels/test_lora_kernels.py tests/unit/runtime/kernels/test_quant_gemv.py \
        tests/unit/runtime/kernels/test_batch_invariant_kernels.py tests/unit/runtime/quant/test_quant.py
    local kernels_rc=$?
    "${pytest[@]}" --junitxml "$OUT/engine-tests.xml" "${engines[@]}" tests/unit/runtime/engine/test_cuda_graphs.py \
        tests/unit/runtime/engine/test_triton_engine.py \
        tests/unit/runtime/quant/test_quant.py::test_engine_on_the_triton_kernels_generates_the_torch_tokens
    local engines_rc=$?
    return $((kernels_rc || engines_rc))
}
engine() { $PY bench/gpu/engine_check.py --json "$OUT/engine.json"; }
roofline() {
    local shape=()
    [[ $dry == 1 ]] && shape=(--device cpu --model random://smollm2-135m --dtype float32 --tokens 8 --repeats 1
        --copy-mib 64)
    # Each quantized format with quant_gemv's kernels (tiles from the gemv stage, if it ran) and without.
    local tiles=()
    [[ -f $OUT/gemv.json ]] && tiles=(--gemv-tiles "$OUT/gemv.json")
    $PY bench/decode_roofline.py --quantization none int4 int4:before int8 int8:before fp8 fp8:before --profile \
        "${tiles[@]}" "${shape[@]}" --json "$OUT/roofline.json"
}
throughput() {
    # kaon, its profile (host/device split), then HF's side in the same run: the whole set as one static batch
    # of 256 (in batches of 64 it took ~100 s on 2026-11-26; one batch of all is HF's best case, ~30-40 s).
    local shape=(--model random://llama-3.2-1b --device cuda --dtype bfloat16 --requests 256 --input-len 100 1024
        --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --decode-tokens 64 --hf-batch 256)
    [[ $dry == 1 ]] && shape=(--model random://smollm2-135m --device cpu --dtype float32 --requests 4
        --input-len 8 16 --output-len 4 8 --max-num-seqs 4 --decode-tokens 8)
    $PY bench/throughput.py "${shape[@]}" --profile "$OUT/throughput-profile.txt" --json "$OUT/throughput.json"
}
gemv() {
    $PY bench/gpu/gemv_sweep.py --json "$OUT/gemv.json"
    local rc=$?
    # Then the batch-invariant GEMMs against the default kernels (KAON_GPU_BATCH_INVARIANT=1; not yet run on a
    # GPU), into gemv.json's "invariant_gemm": new shapes stop starting after 60 s of the time the sweep leaves.
    $PY bench/gpu/invariant_gemm.py --budget 60 --json "$OUT/gemv.json" || rc=1
    return $rc
}
# On the 2026-11-30 lease gemv, roofline (seven formats) and throughput (kaon's side) took 28, 62 and 71 s;
# the engine tests, run alone, more than 170 s (five passed by then). engine took 85 s on 2026-11-26.
# gemv + roofline + throughput (HF's side included) stay under one call's 600 s with the wheels' install.
# kernels and engine in a second call (420 + 170 s): the engine tests, one process, take minutes; engine's
# batch-invariance check (2026-11-30, not yet run on a GPU) builds eight tiny engines (family x dtype x
# KAON_GPU_BATCH_INVARIANT), then two Llama-3.2-1B engines for the switch's cost, last (engine.json has each
# check's seconds; the dry run took 142 s, the invariance 18 and the cost 30 of them, on the CPU at load ~5).
# gemv also runs bench/gpu/invariant_gemm.py (2026-11-30): 30 s moved to it from roofline, which took 62 of its 150.
declare -A LIMIT=([kernels]=420 [engine]=170 [gemv]=150 [roofline]=120 [throughput]=280)
if [[ $dry == 1 ]]; then  # a CPU shared with other work is slower than any GPU: the dry run proves the script, not speed
    for stage in "${!LIMIT[@]}"; do LIMIT[$stage]=600; done
fi

failed=0
for stage in "${stages[@]}"; do
    start=$SECONDS
    echo "== $stage (limit ${LIMIT[$stage]}s)"
    # A stage in a function under `timeout`: the function runs in a child bash that timeout can kill.
    export -f "$stage"
    export dry OUT PY
    log=$(mktemp)
    timeout --kill-after=10 "${LIMIT[$stage]}" bash -c "$stage" > "$log" 2>&1
    rc=$?
    { echo "== $stage"; cat "$log"; } >> "$OUT/run.log"
    tail -n 25 "$log"
    rm -f "$log"
    echo "== $stage: rc $rc in $((SECONDS - start))s$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    [[ $rc == 0 ]] || failed=1
done
exit $failed
