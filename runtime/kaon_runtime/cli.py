"""`kaon` command line: `kaon generate` for a few prompts offline, `kaon serve` for the HTTP server,
`kaon fetch` to download an hf:// or s3:// model (the engine pod's init container), `kaon profile` to
measure the engine's performance model (the operator's profiling Job).

Over 300 lines for a stated reason: it is the one table of every flag and its help text, which
reads better whole than split across modules."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from kaon_runtime.config import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    PREFIX_CACHING_HASH_ALGOS,
    QUANTIZATION_METHODS,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from kaon_runtime.errors import KaonError, ModelDoesNotFitError, UnsupportedByModelError
from kaon_runtime.fetch.fetch import add_model_source_flags
from kaon_runtime.fetch.source import FETCHED_SCHEMES, FetchError
from kaon_runtime.server import limits
from kaon_runtime.structured.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from kaon_runtime.version import package_version

KV_DTYPE_HELP = ("the KV cache's dtype; auto: float16 with int8/int4 weights on CPU (half the memory attention "
                 "reads), else the model's dtype")
TP_HELP = "processes that each hold a shard of the model: one per GPU (on CPU, for testing)"
PP_HELP = ("stages of contiguous layers, each run by --tensor-parallel-size processes (on one host, or one "
           "stage per host of a LeaderWorkerSet group: docs/multinode.md)")
# Below this many uncached prompt tokens a decode engine prefills locally: a first guess, not tuned:
# bench/disagg.py found no length where a transfer paid off on a shared 2-core CPU (docs/disaggregation.md).
DISAGG_MIN_PROMPT_TOKENS = 256
DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about Kubernetes.",
    "Explain in one sentence what a KV cache is.",
    "Give me three tips for writing clean Python code.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaon", description="kaon: serve LLMs on Kubernetes")
    parser.add_argument("--version", action="version", version=f"kaon {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for a few prompts")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--prompt", action="append", help="repeatable; defaults to a few demo questions")
    gen.add_argument("--raw", action="store_true", help="send prompts as-is instead of through the chat template")
    gen.add_argument("--max-tokens", type=int, default=96)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none",
                     help="quantize the linear layers' weights at load time")
    gen.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_DTYPE_HELP)
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help=TP_HELP)
    gen.add_argument("--pipeline-parallel-size", type=int, default=1, help=PP_HELP)
    add_model_source_flags(gen)
    add_speculative_flags(gen)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--model", default=DEFAULT_MODEL)
    serve.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("KAON_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1 (default: $KAON_API_KEY)")
    serve.add_argument("--api-key-file", default=os.environ.get("KAON_API_KEY_FILE"),
                       help="require a key from this file (one per line) or directory (one per file: a mounted "
                       "Secret) on /v1; re-read when it changes, so keys rotate without a restart; missing or "
                       "empty refuses every request (default: $KAON_API_KEY_FILE)")
    # Checked here: 0 waiting places refused every request (429), a negative wait expired every one (503).
    serve.add_argument("--max-queue", type=positive_int, default=256, help="waiting requests beyond this get a 429")
    serve.add_argument("--max-queue-wait", type=non_negative_float, default=limits.MAX_QUEUE_WAIT_S, metavar="SECONDS",
                       help="the admission limit past capacity: a request that has waited this long for its turn "
                       "(no token yet) gets a 503 with Retry-After, and one that would wait longer, at the rate "
                       "requests finish, gets it at once; so the time to first token stays within it. 0: no limit "
                       "(requests wait as long as it takes)")
    serve.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="/health answers 503 when requests are pending and no engine step has completed for "
                       "this long (the first step after load gets 3x); 0 turns the check off")
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--tool-call-parser", choices=("auto", *TOOL_CALL_PARSERS), default="auto",
                       help="the format tool calls are read in (and forced in); auto: the chat template's "
                            "(Hermes for a template that knows no tools)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM")
    limits.add_flags(serve)  # what one request or connection may cost
    serve.add_argument("--task", choices=("auto", "generate", "embed"), default="auto",
                       help="generate: the completion routes (auto: a decoder's own task); embed: /v1/embeddings")
    serve.add_argument("--pooling", choices=("auto", "last", "mean"), default="auto",
                       help="--task embed: last token or mean of the final hidden states (auto: the checkpoint's "
                       "sentence-transformers config, else last token, as decoder embedding models are trained)")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences in the running batch; the rest wait, oldest first (default: 8 on a CPU, "
                            "where a larger batch adds no throughput, 64 on a GPU; engine/admission.py)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens one step computes at most: longer prompts are prefilled in chunks of it "
                            "(default 1024; 256 for --role decode, whose steps its streams wait on; "
                            "--disagg-chunk-tokens for --role prefill)")
    serve.add_argument("--prefill-group", type=positive_int, default=None, metavar="N",
                       help="past capacity, waiting prompts go in once N running slots are free, their prefills in "
                            "one step (default: half of --max-num-seqs on a CPU, 1 on a GPU; engine/admission.py)")
    serve.add_argument("--prefill-delay-ms", type=non_negative_float, default=0.0, metavar="MS",
                       help="while sequences decode, hold a new prompt's prefill up to MS for them to finish: "
                            "a steadier token pace for a longer time to first token (default 0: prefill at once)")
    serve.add_argument("--kv-cache-fraction", type=float, default=0.85,
                       help="GPU: share of the memory left after loading weights for the KV cache and the largest "
                            "step's activations (measured at start)")
    serve.add_argument("--kv-cache-bytes", type=positive_int, default=1 << 30,
                       help="CPU: bytes for the KV cache pool (default 1 GiB)")
    serve.add_argument("--num-kv-blocks", type=positive_int,
                       help="the KV cache pool in blocks of 16 tokens, on any device; overrides --kv-cache-bytes "
                            "and --kv-cache-fraction")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--prefix-caching-hash-algo", choices=PREFIX_CACHING_HASH_ALGOS, default="builtin",
                       help="the prefix cache's block hashes, as vLLM's flag: builtin (kaon's, fast) or sha256_cbor "
                            "(vLLM's, seeded by PYTHONHASHSEED: what llm-d's precise prefix-cache scorer computes)")
    add_kv_tier_flags(serve)
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help=TP_HELP)
    serve.add_argument("--pipeline-parallel-size", type=int, default=1, help=PP_HELP)
    serve.add_argument("--distributed-init-address", default=None, metavar="HOST:PORT",
                       help="the group leader's address across hosts (default: LWS_LEADER_ADDRESS:29500 under a "
                            "LeaderWorkerSet, else one host); a host with LWS_WORKER_INDEX > 0 serves its stage only")
    serve.add_argument("--cuda-graph-max-batch", type=int, default=256,
                       help="GPU: decode batches up to this size replay captured CUDA graphs; 0 runs them eagerly")
    serve.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none",
                       help="quantize the linear layers' weights at load time")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_DTYPE_HELP)
    add_model_source_flags(serve)
    add_speculative_flags(serve)
    add_lora_flags(serve)
    add_runtime_lora_flags(serve)
    add_disagg_flags(serve)
    serve.add_argument("--log-level", default="info")
    sub.add_parser("fetch", help="download an hf:// or s3:// model into the cache, or check a local one "
                   "(see `kaon fetch --help`)", add_help=False)
    sub.add_parser("profile", help="measure the engine's performance model (step time over batch sizes and "
                   "context lengths) for the predictive autoscaler (see `kaon profile --help`)", add_help=False)
    sub.add_parser("route", help="InferenceRoute tools: `kaon route train examples.jsonl` fits the learned "
                   "classifier (see `kaon route --help`)", add_help=False)
    sub.add_parser("operator", help="run the InferenceService operator: the same as `kaon-operator`", add_help=False)
    sub.add_parser("router", help="run the OpenAI gateway in front of every InferenceService: the same as "
                   "`kaon-router`", add_help=False)
    return parser


def non_negative_float(text: str) -> float:
    """An argparse type, like positive_int."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for a time limit: 0 is refused, since aiohttp reads a 0 s timeout as none at all."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def http_url(text: str) -> str:
    """An argparse type: an engine's base URL, http(s)://host[:port], checked at start rather than failing (and
    falling back) on every request."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a URL ({exc}): {text!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://host[:port], got {text!r}")
    return text


def positive_int(text: str) -> int:
    """An argparse type: argparse turns the ValueError into `argument --flag: ...` and exit 2."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_kv_tier_flags(parser: argparse.ArgumentParser) -> None:
    """The KV tiers below the pool and KV events (docs/kv_cache.md)."""
    parser.add_argument("--kv-offload-bytes", type=int, default=0, metavar="N",
                        help="host memory for KV blocks evicted from the pool, brought back on a prefix hit "
                             "(default 0: none)")
    parser.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                        help="a disk tier below host memory, kept across restarts of the same model and settings "
                             "(one written with others is cleared at start: kaon's own files only)")
    parser.add_argument("--kv-offload-dir-bytes", type=int, default=0, metavar="N", help="the disk tier's size")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="KV cache events in vLLM's format, e.g. '{\"enable_kv_cache_events\": true, "
                             "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}'; "
                             "kaon's key \"encoding\": \"array\" (default: vLLM before 0.24) or \"map\" (vLLM 0.24+)")


def kv_tier_options(args) -> dict:
    return {"kv_offload_bytes": args.kv_offload_bytes, "kv_offload_dir": args.kv_offload_dir,
            "kv_offload_dir_bytes": args.kv_offload_dir_bytes, "kv_events_config": args.kv_events_config}


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default="none",
                        help="speculative decoding: 'ngram' drafts by prompt lookup, 'draft' with a smaller model")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts verified per step")
    parser.add_argument("--speculative-draft-model", help="the draft model (same tokenizer) for 'draft'")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram prompt lookup matches")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram prompt lookup matches")


def add_disagg_flags(parser: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation (docs/disaggregation.md; server/disagg.py)."""
    parser.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                        help="both: prefill and decode here; prefill: also compute prompts' K/V for decode engines; "
                        "decode: have --prefill-url engines prefill long prompts and receive their K/V")
    parser.add_argument("--prefill-url", action="append", default=[], metavar="URL", type=http_url,
                        help="a prefill engine (repeatable), for --role decode")
    parser.add_argument("--disagg-min-prompt-tokens", type=positive_int, default=DISAGG_MIN_PROMPT_TOKENS, metavar="N",
                        help="a decode engine prefills prompts with fewer uncached tokens itself (bench/disagg.py)")
    parser.add_argument("--kv-transport", choices=("auto", "nixl", "tcp"), default="auto",
                        help="how a decode engine receives K/V: auto: NIXL where it runs (pip install kaon[nixl]), "
                        "else TCP")
    parser.add_argument("--disagg-max-in-flight", type=positive_int, default=2, metavar="N",
                        help="transfers a decode engine keeps in flight per prefill engine; past it, it prefills "
                        "the prompt itself at once (in chunks) instead of queueing it there")
    parser.add_argument("--disagg-chunk-tokens", type=positive_int, default=None, metavar="N",
                        help="--role prefill: tokens per prefill step, each step's K/V sent to the decode engine as "
                        "soon as the step is done, so moving one chunk overlaps computing the next (default 1024: "
                        "smaller steps cost more on a CPU than the move they hide, bench/disagg_chunks.py; "
                        "--max-num-batched-tokens, when set, wins)")
    parser.add_argument("--disagg-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                        help="a transfer not complete by then is given up: the decode engine prefills the prompt")


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, metavar="NAME=DIR", default=[],
                        help="LoRA adapters (PEFT directories) served from the start; requests name them as model")
    parser.add_argument("--max-loras", type=int, default=0,
                        help="adapter slots: distinct adapters running at once (default: one per --lora-modules; "
                        "set it to load adapters at run time through /v1/load_lora_adapter)")
    parser.add_argument("--max-lora-rank", type=positive_int, default=16, help="the highest adapter rank served")


def add_runtime_lora_flags(parser: argparse.ArgumentParser) -> None:
    """Who may change the adapters at run time, and what one change may cost (server/lora_routes.py); who may
    put the engine to sleep (server/sleep.py)."""
    allowed = os.environ.get("KAON_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true", "yes")
    parser.add_argument("--enable-runtime-lora", action="store_true", default=allowed,
                        help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter, for the holder of "
                        "--admin-key only (default: off, a 404; $KAON_ALLOW_RUNTIME_LORA_UPDATING=true)")
    parser.add_argument("--admin-key", default=os.environ.get("KAON_ADMIN_KEY"),
                        help="the key (Authorization: Bearer) that changes adapters and puts the engine to sleep; the "
                        "serving keys do not (default: $KAON_ADMIN_KEY; needed by --enable-runtime-lora and "
                        "--enable-sleep-mode)")
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        default=os.environ.get("KAON_ENABLE_SLEEP_MODE", "").lower() in ("1", "true", "yes"),
                        help="answer POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's), for the "
                        "holder of --admin-key only (default: off, a 404; $KAON_ENABLE_SLEEP_MODE=true)")
    parser.add_argument("--sleep-grace-period", type=non_negative_float, default=30.0, metavar="SECONDS",
                        help="how long a sleep waits for the requests in flight before it aborts them")
    parser.add_argument("--max-cpu-loras", type=positive_int, default=16,
                        help="adapters registered at once (at start and at run time); a load past it is refused "
                        "before its download")
    parser.add_argument("--max-lora-bytes", type=positive_int, default=1 << 30,
                        help="the largest adapter (its files' bytes), refused before it is read")
    parser.add_argument("--lora-load-timeout", type=non_negative_float, default=600.0, metavar="SECONDS",
                        help="how long a load (its download included) is waited for before a 400")


def lora_module(text: str) -> tuple[str, str]:
    """An argparse type: NAME=DIR."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, path


def lora_options(args) -> dict:
    return dict(lora_modules=dict(args.lora_modules) or None, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank)


def speculative_options(args) -> dict:
    return dict(speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                speculative_draft_model=args.speculative_draft_model, prompt_lookup_max=args.prompt_lookup_max,
                prompt_lookup_min=args.prompt_lookup_min)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["operator"], ["router"]):
        return _hand_over(argv[0], argv[1:])
    if argv[:1] == ["fetch"]:  # nor here: it runs as the init container and must start at once
        from kaon_runtime.fetch.fetch import run_cli

        return run_cli(argv[1:])
    if argv[:1] == ["profile"]:  # runs its own `kaon serve` and talks to it over HTTP
        from kaon_runtime.server.perf_profile import run_cli as profile_cli

        return profile_cli(argv[1:])
    if argv[:1] == ["route"]:  # InferenceRoute tools: `kaon route train examples.jsonl`
        from kaon_runtime.server.route_train import run_cli as route_cli

        return route_cli(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        _fetch_first(args)
        return _serve(args) if args.command == "serve" else _generate(args)
    except FetchError as exc:
        _fatal(exc.line())
        return exc.exit_code
    except ModelDoesNotFitError as exc:
        # The line the operator looks for in the container's termination message (ModelDoesNotFit).
        _fatal(f"model does not fit: {exc}")
        return 2
    except UnsupportedByModelError as exc:
        _fatal(f"unsupported by the model: {exc}")  # the words the operator looks for (UnsupportedByModel)
        return 2
    except KaonError as exc:
        _fatal(str(exc))
        return 2


# `kaon operator` and `kaon router` are kept for people used to them. Their own commands are
# `kaon-operator` and `kaon-router`: the runtime never imports kaon_operator (the operator image
# has no kaon_runtime, the engine needs no operator), so these replace this process with that one.
HANDOVER = {"operator": "kaon_operator", "router": "kaon_operator.router"}


def _hand_over(command: str, args: list[str]) -> int:
    module = HANDOVER[command]
    if importlib.util.find_spec("kaon_operator") is None:  # finds the package without importing it
        print(f"kaon: error: `kaon {command}` needs kaon_operator installed; its command is "
              f"kaon-{command}", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


TERMINATION_LOG = Path("/dev/termination-log")


def _fatal(cause: str) -> None:
    """The one line that says why the engine could not start: last on stderr, and in the kubelet's
    termination log when there is one, so the pod's status (and the InferenceService's Degraded
    condition) carries it whatever the log holds."""
    line = f"kaon: error: {cause}"
    print(line, file=sys.stderr)
    try:
        if TERMINATION_LOG.is_file():
            TERMINATION_LOG.write_text(line.splitlines()[0] + "\n")
    except OSError:
        pass  # not writable here (no kubelet, a read-only file): stderr has it


def _fetch_first(args) -> None:
    """hf:// and s3:// models are downloaded into --model-cache first (nothing to do when a fetch, e.g.
    the init container, completed them there), then served from that directory under their URI."""
    if args.model.startswith(FETCHED_SCHEMES):
        from kaon_runtime.engine import startup
        from kaon_runtime.fetch.fetch import fetch

        uri = args.model
        with startup.phase("fetch"):
            args.model = str(fetch(uri, args.model_cache, revision=args.revision, gguf_file=args.gguf_file,
                                   tensor_parallel_size=args.tensor_parallel_size, hold=True))
        if getattr(args, "served_model_name", "unset") is None:
            args.served_model_name = uri
    elif args.model.startswith("pvc://"):
        raise FetchError("invalid model", f"{args.model}: pvc:// is for InferenceServices (the operator mounts "
                                          "the claim); give the path instead")


def _generate(args) -> int:
    from kaon_runtime.llm import LLM
    from kaon_runtime.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              **speculative_options(args))
    prompts = args.prompt or DEMO_PROMPTS
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"\n>>> {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}]")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)")
    return 0


def _prefill_chunk(args) -> tuple[int, ...]:
    """--disagg-chunk-tokens when given (parsers without the disaggregation flags: the default)."""
    chunk = getattr(args, "disagg_chunk_tokens", None)
    return () if chunk is None else (chunk,)


def engine_config(args) -> EngineConfig:
    """`kaon serve`'s flags as the engine's configuration, which the server takes finished."""
    from kaon_runtime.engine.remote_prefill import step_token_budget  # here: the CLI starts without torch

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=_max_num_seqs(args), prefill_group=_prefill_group(args),
                        max_num_batched_tokens=step_token_budget(args.max_num_batched_tokens,
                                                                 getattr(args, "role", "both"),
                                                                 *_prefill_chunk(args)),
                        prefill_delay_ms=args.prefill_delay_ms, kv_cache_fraction=args.kv_cache_fraction,
                        kv_cache_bytes=args.kv_cache_bytes,
                        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        distributed_init_address=args.distributed_init_address,
                        cuda_graph_max_batch=args.cuda_graph_max_batch,
                        **speculative_options(args), **lora_options(args), **kv_tier_options(args))


def _max_num_seqs(args) -> int:
    """--max-num-seqs, else the measured default for the device the engine will run on."""
    from kaon_runtime.engine.admission import serving_max_num_seqs

    return serving_max_num_seqs(args.max_num_seqs, args.device)


def _prefill_group(args) -> int:
    from kaon_runtime.engine.admission import serving_prefill_group

    return serving_prefill_group(args.prefill_group, _max_num_seqs(args), args.device)


def admin_key_serves(args) -> bool:
    """Whether the admin key is one of the serving keys at start (a key file changed later is not watched for it)."""
    from kaon_runtime.server.keys import ApiKeys

    serving = ApiKeys(args.api_key, args.api_key_file).keys()  # (a tuple of bytes, not a dict's keys)
    return bool(args.admin_key) and args.admin_key.encode() in serving


def _serve(args) -> int:
    from kaon_runtime.engine import pipeline_group
    from kaon_runtime.fetch.fetch import adapter_fetcher
    from kaon_runtime.server.run import serve

    if args.role == "decode" and not args.prefill_url:
        raise SystemExit("kaon serve: --role decode needs at least one --prefill-url")
    if args.prefill_url and args.role != "decode":
        raise SystemExit("kaon serve: --prefill-url is for --role decode")
    if args.role != "both" and (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1
                                or args.speculative_method == "draft"):
        raise SystemExit("kaon serve: --role prefill/decode runs one process per engine, without a draft model "
                         "(the transfer moves one pool's K/V)")
    if args.enable_runtime_lora and not args.admin_key:  # on for no one would read as on for everyone
        raise SystemExit("kaon serve: --enable-runtime-lora needs --admin-key (or $KAON_ADMIN_KEY): only its "
                         "holder may change adapters")
    if args.enable_sleep_mode and not args.admin_key:
        raise SystemExit("kaon serve: --enable-sleep-mode needs --admin-key (or $KAON_ADMIN_KEY): only its "
                         "holder may put the engine to sleep")
    if (args.enable_runtime_lora or args.enable_sleep_mode) and admin_key_serves(args):
        raise SystemExit("kaon serve: the --admin-key is also a serving key (--api-key, --api-key-file): every "
                         "client holding it could change adapters or put the engine to sleep; give it its own value")
    if args.task in ("embed", "auto"):  # a sentence encoder (BERT family) has its own small server
        from kaon_runtime.server.encoder_run import encoder_checkpoint, serve_encoder

        encoder = encoder_checkpoint(args.model)
        if encoder is not None:
            return serve_encoder(encoder, args)
    config = engine_config(args)
    rdv = pipeline_group.world_rendezvous(config)
    if not rdv.is_leader:  # a LeaderWorkerSet worker: its stage's ranks, no API (only /health)
        return pipeline_group.serve_stage(config, rdv, (args.host, args.port))
    pipeline_group.exit_on_peer_loss = pipeline_group.uses_pipeline(config, rdv)
    fetch_adapter = adapter_fetcher(args.model_cache)
    args.lora_modules = [(name, fetch_adapter(path)) for name, path in args.lora_modules]
    return serve(engine_config(args), args, fetch_adapter=fetch_adapter)


if __name__ == "__main__":
    sys.exit(main())
