#!/usr/bin/env bash
# lm-evaluation-harness against a running `kaon serve`: a loglikelihood (multiple-choice) task
# through /v1/completions (echo + logprobs + max_tokens 0) and a generative one through
# /v1/chat/completions. Ten items each: a smoke test that the harness works unchanged, not a benchmark.
#
#   kaon serve --model builtin://smollm2-135m-instruct --port 8000 &
#   pip install "lm-eval[api]" transformers     # in a separate virtualenv is fine
#   bench/lm_eval/run.sh http://127.0.0.1:8000 builtin://smollm2-135m-instruct /path/to/hf-tokenizer-dir
#
# The tokenizer directory is the model's Hugging Face tokenizer (local-completions counts the
# context's tokens with it); for a GGUF model: AutoTokenizer.from_pretrained(dir, gguf_file=...).save_pretrained(...).
set -euo pipefail
url=${1:?base url}; model=${2:?model}; tokenizer=${3:?tokenizer dir}
cd "$(dirname "$0")"
lm_eval --model local-completions --tasks kaon_tiny_mc --include_path . \
  --model_args "model=$model,base_url=$url/v1/completions,tokenizer=$tokenizer,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
lm_eval --model local-chat-completions --apply_chat_template --tasks kaon_tiny_gen --include_path . \
  --model_args "model=$model,base_url=$url/v1/chat/completions,num_concurrent=1,max_retries=1"
