"""Architecture name -> model class."""
from kaon_runtime.config import ModelConfig
from kaon_runtime.models.llama import LlamaForCausalLM

_MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def build_model(config: ModelConfig):
    return _MODELS[config.architecture](config)
