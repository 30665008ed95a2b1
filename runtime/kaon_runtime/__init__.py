"""kaon runtime: the inference engine."""
import os

# Before torch loads OpenMP: its idle workers go to sleep at once instead of spinning.
# libgomp's default spin suits a machine with a core per busy thread; a serving process has more
# busy threads than that (the engine loop, the event loop, the OpenMP workers, the fused CPU
# decode step's own workers), and on a small or shared CPU a spinning worker holds the core the
# others need (measurements: bench/history/cpu_decode.md). The user's settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "0")

from kaon_runtime.errors import InvalidRequestError, KaonError, ModelLoadError, ModelNotFoundError
from kaon_runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "KaonError", "InvalidRequestError", "ModelLoadError", "ModelNotFoundError"]


def __getattr__(name):
    # LLM pulls in torch and the model code; keep `import kaon_runtime` light.
    if name == "LLM":
        from kaon_runtime.llm import LLM
        return LLM
    raise AttributeError(name)
