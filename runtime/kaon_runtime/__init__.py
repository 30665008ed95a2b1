"""kaon runtime: the inference engine."""
from kaon_runtime.errors import InvalidRequestError, KaonError, ModelLoadError, ModelNotFoundError
from kaon_runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "KaonError", "InvalidRequestError", "ModelLoadError", "ModelNotFoundError"]


def __getattr__(name):
    # LLM pulls in torch and the model code; keep `import kaon_runtime` light.
    if name == "LLM":
        from kaon_runtime.llm import LLM
        return LLM
    raise AttributeError(name)
