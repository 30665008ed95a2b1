"""Architecture name -> model class."""
from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.models.llama import LlamaForCausalLM

_MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def build_model(config: ModelConfig, tp: TensorParallel = TensorParallel()):
    return _MODELS[config.architecture](config, tp)
