"""kaon runtime: the inference engine."""
import os

# Before torch loads OpenMP: its idle workers sleep instead of spinning. libgomp's default
# spin suits a machine with a core per thread; a serving process has more busy threads than
# that (the engine loop, the event loop, the OpenMP workers), and on a shared or small CPU a
# spinning worker holds the core the others need, so every parallel op can wait a whole
# scheduler slice (bench/RESULTS.md, "CPU decode"). The user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kaon_runtime.errors import InvalidRequestError, KaonError, ModelLoadError, ModelNotFoundError
from kaon_runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "KaonError", "InvalidRequestError", "ModelLoadError", "ModelNotFoundError"]


def __getattr__(name):
    # LLM pulls in torch and the model code; keep `import kaon_runtime` light.
    if name == "LLM":
        from kaon_runtime.llm import LLM
        return LLM
    raise AttributeError(name)
