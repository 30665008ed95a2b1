"""Architecture name -> model class. Every supported family is one shared decoder with options."""
from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.models.decoder import DecoderForCausalLM

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe")


def build_model(config: ModelConfig, tp: TensorParallel = TensorParallel()):
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"no model for architecture {config.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return DecoderForCausalLM(config, tp)
