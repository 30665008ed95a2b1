"""Architecture name -> model class. Every supported family is one shared decoder with options."""
from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.layers.kernel_backend import KernelBackend
from kaon_runtime.models.decoder import DecoderForCausalLM

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe")


def build_model(config: ModelConfig, tp: TensorParallel = TensorParallel(),
                kernels: KernelBackend | None = None) -> DecoderForCausalLM:
    """The model for `config`, this rank's shard of it, built with `kernels` (torch's own when None)."""
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"no model for architecture {config.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return DecoderForCausalLM(config, tp, kernels)
