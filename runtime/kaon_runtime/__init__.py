"""kaon runtime: the inference engine."""
import os

# Before torch loads OpenMP: its idle workers go to sleep at once instead of spinning.
# libgomp's default spin (300,000 turns) suits a machine with a core per busy thread; a serving
# process has more busy threads than that (the engine loop, the event loop, the OpenMP workers,
# the fused CPU decode step's own workers), and on a small or shared CPU a spinning worker holds
# the core the others need. Measured on 2 vCPUs (bench/RESULTS.md, "CPU decode"): a torch decode
# forward took 46 ms idle and 180 ms beside two busy processes with the default spin, 48 and 84 ms
# with 2,000 turns, 54 and 75 ms with none; and with the fused decode step, torch's workers
# spinning 2,000 turns after the sampler's ops slowed the step's own workers from 5.2 to ~9 ms a
# token. The user's settings win.
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
