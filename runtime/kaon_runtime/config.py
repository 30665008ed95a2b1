"""Model and engine configuration, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass

from kaon_runtime.errors import InvalidRequestError, ModelLoadError

DEFAULT_MODEL = "builtin://smollm2-135m-instruct"
QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
PREFIX_CACHING_HASH_ALGOS = ("builtin", "sha256_cbor")  # engine/block_hash.py
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # of the MLP (layers.activation has one function each)


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-descended decoder, read from GGUF metadata or config.json.

    The fields after attention_bias are the per-family options of the shared decoder
    (models/decoder.py); their defaults are Llama's.
    """

    architecture: str  # a key of models.registry: "llama", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict ("llama3", "linear", "longrope")
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    rotary_dim: int | None = None  # rotated dims of each head (Phi-3's partial_rotary_factor); None: all
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    sliding_window: int | None = None  # a query sees itself and the window - 1 keys before it
    sliding_layers: tuple[bool, ...] | None = None  # which layers use the window; None: all of them
    # Gemma 2
    hidden_act: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # extra norms after attention and around the MLP
    embedding_scale: float | None = None  # the token embeddings are multiplied by this (sqrt(hidden) for Gemma)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # the same on the logits
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # width of one expert's MLP
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a plain MLP (Qwen3-MoE's mlp_only_layers)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise ModelLoadError(f"unsupported MLP activation {self.hidden_act!r}; supported: {GATED_ACTIVATIONS}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ModelLoadError(f"{len(self.sliding_layers)} layer types for {self.num_layers} layers")

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer's attention, None for full attention."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


@dataclass(slots=True)
class EngineConfig:
    """Knobs of the engine. Memory: a byte budget on CPU, a fraction of free memory on GPU."""

    model: str = DEFAULT_MODEL
    device: str = "auto"  # "auto", "cpu", "cuda"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16", "float16", "float64"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # While sequences decode, a new prompt's prefill waits up to this long for them to finish
    # (0: it joins the next step). Prefill chunks lengthen the step every decoding stream waits
    # on; waiting trades time to first token for a steadier token pace (docs/serving.md).
    prefill_delay_ms: float = 0.0
    # past capacity, waiting prompts go in once this many slots are free (scheduler.gather_prefills)
    prefill_group: int = 1
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_fraction: float = 0.85  # GPU: share of the memory left after loading weights
    kv_cache_bytes: int = 1 << 30  # CPU: bytes for the KV pool
    num_kv_blocks: int | None = None  # overrides both budgets (tests use it to force preemption)
    enable_prefix_caching: bool = True
    # vLLM's --prefix-caching-hash-algo: "builtin" (kaon's, fast) or "sha256_cbor" (vLLM's, seeded by
    # PYTHONHASHSEED: what llm-d's precise prefix-cache scorer recomputes); engine/block_hash.py
    prefix_caching_hash_algo: str = "builtin"  # one of PREFIX_CACHING_HASH_ALGOS
    quantization: str = "none"  # weights of the linear layers: "none", "int8", "int4" or "fp8"
    # "auto": float16 for int8/int4 weights on CPU (attention there is bound by reading the cache;
    # the narrow formats already trade exact float output for speed), else the model's dtype
    kv_cache_dtype: str = "auto"
    cuda_graph_max_batch: int = 256  # GPU decode batches up to this size replay CUDA graphs; 0: always eager
    tensor_parallel_size: int = 1  # processes holding a shard each: one per GPU (on CPU, for tests)
    # Stages of contiguous layers, each run by its own tensor_parallel_size ranks (docs/multinode.md).
    pipeline_parallel_size: int = 1
    distributed_init_address: str | None = None  # the leader's HOST:PORT across hosts; else LWS_* or one host
    # Speculative decoding: "ngram" drafts by prompt lookup, "draft" with a smaller model of the same tokenizer.
    speculative_method: str = "none"
    num_speculative_tokens: int = 4  # drafts verified per step and sequence
    speculative_draft_model: str | None = None  # model id of the draft model ("draft" only)
    prompt_lookup_max: int = 4  # longest n-gram prompt lookup matches ("ngram" only)
    prompt_lookup_min: int = 2  # shortest; shorter matches guess too often to pay for their verification
    # LoRA adapters (PEFT directories) served from the start, by name; more can be loaded at run time.
    lora_modules: dict[str, str] | None = None
    max_loras: int = 0  # adapter slots (adapters running at once); 0: one per lora_modules entry (none: LoRA off)
    max_lora_rank: int = 16  # the highest adapter rank the slots hold
    # KV tiers below the pool and KV events (engine/kv_observer.py checks and builds them; docs/kv_cache.md):
    kv_offload_bytes: int = 0  # host memory for blocks evicted from the pool; 0: none
    kv_offload_dir: str | None = None  # a directory for a disk tier below host memory (kept across restarts)
    kv_offload_dir_bytes: int = 0  # the disk tier's size
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON

    @property
    def lora_enabled(self) -> bool:
        return self.max_loras > 0 or bool(self.lora_modules)

    @property
    def lora_slots(self) -> int:
        return self.max_loras or len(self.lora_modules or ())

    def __post_init__(self):
        checks = [
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (0 < self.kv_cache_fraction <= 1, f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}"),
            (self.prefill_delay_ms >= 0, f"prefill_delay_ms must be >= 0, got {self.prefill_delay_ms}"),
            (1 <= self.prefill_group <= self.max_num_seqs,
             f"prefill_group must be between 1 and max_num_seqs ({self.max_num_seqs}), got {self.prefill_group}"),
            (self.kv_cache_bytes > 0, f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be >= 1, got {self.max_model_len}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda, got {self.device!r}"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16", "float64"),
             f"unknown dtype {self.dtype!r}"),
            (self.cuda_graph_max_batch >= 0,
             f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}"),
            (self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (self.pipeline_parallel_size >= 1,
             f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"),
            (not (self.lora_enabled and self.pipeline_parallel_size > 1),
             "LoRA adapters are not supported with pipeline_parallel_size > 1 yet"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"),
            (self.quantization in QUANTIZATION_METHODS,
             f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}"),
            (self.speculative_method in SPECULATIVE_METHODS,
             f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative_method!r}"),
            (self.num_speculative_tokens >= 1,
             f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"),
            ((self.speculative_method == "draft") == (self.speculative_draft_model is not None),
             "speculative_draft_model is needed by, and only by, speculative_method 'draft'"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
             f"{self.prompt_lookup_max}"),
            (self.max_loras >= 0 and self.max_lora_rank >= 1,
             f"need max_loras >= 0 and max_lora_rank >= 1, got {self.max_loras} and {self.max_lora_rank}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
