"""Build and drop ten LLMs of mixed settings in one process (run as a script by
tests/integration/test_engine_lifecycle.py), printing one JSON line per engine of what the process
holds once it is gone: its child processes (but multiprocessing's resource tracker, which lives as long
as the process), its TCP sockets (the stores' ports, the groups' connections), kaon's threads still running,
whether torch.distributed's default group is set, whether the engine's model was freed, and the greedy tokens it gave.

Each engine leaves in one of the three ways a user's does: close(), a with block, or garbage collection
once its name is bound to the next one (as a notebook cell run twice does): a "rebind" engine is still
alive, workers and all, while the next one starts, and gone once that one is bound.
"""
from __future__ import annotations

import gc
import json
import multiprocessing.resource_tracker as resource_tracker
import sys
import threading
import weakref

import psutil
import torch.distributed as dist

from kaon_runtime import LLM, SamplingParams

PROMPT = [[5, 6, 7, 8, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def settings(model: str) -> list[tuple[str, dict]]:
    """(how it leaves, engine options): tensor and pipeline parallel, LoRA slots, both kinds of speculation.
    Four of the ten start workers (each a spawned Python importing torch: seconds apiece on two cores)."""
    return [
        ("rebind", dict(pipeline_parallel_size=2)),
        ("rebind", dict(pipeline_parallel_size=3)),
        ("close", dict(tensor_parallel_size=2, max_loras=2)),
        ("with", dict(speculative_method="ngram", num_speculative_tokens=3)),
        ("close", dict(speculative_method="draft", speculative_draft_model=model)),
        ("rebind", dict(max_loras=1)),
        ("rebind", dict(dtype="float64")),
        ("with", dict(num_kv_blocks=8)),
        ("close", dict(max_num_seqs=1)),
        ("with", dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
    ]


def held(tracker_pid: int | None) -> dict:
    me = psutil.Process()
    return {"children": sorted(p.pid for p in me.children(recursive=True) if p.pid != tracker_pid),
            "sockets": len(me.net_connections(kind="inet")),
            "default_group": dist.is_initialized(),
            # kaon's own threads still running (a pipeline group's accept loop outlived its engine)
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kaon-"))}


def main(model: str) -> None:
    base = dict(show_progress=False, device="cpu", dtype="float32", num_kv_blocks=16)
    models: dict[int, weakref.ref] = {}  # every engine's model, to see which are still in memory
    llm = None
    for index, (leaving, options) in enumerate(settings(model)):
        options = {**base, **options}
        if leaving == "with":
            llm = None  # the one bound before goes with its name
            with LLM(model, **options) as used:
                tokens = used.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
                models[index] = weakref.ref(used.engine.runner.model)
        else:
            llm = LLM(model, **options)  # the engine bound before is still bound while this one starts
            tokens = llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            models[index] = weakref.ref(llm.engine.runner.model)
            if leaving == "close":
                llm.close()
                llm.close()  # twice: harmless
        gc.collect()
        state = held(getattr(resource_tracker._resource_tracker, "_pid", None))
        in_memory = [i for i, ref in models.items() if ref() is not None]
        print(json.dumps({"index": index, "leaving": leaving, "workers": workers(options), "tokens": tokens,
                          "in_memory": in_memory, **state}), flush=True)
    llm = None
    gc.collect()
    print(json.dumps({"index": "end", "in_memory": [i for i, ref in models.items() if ref() is not None],
                      **held(getattr(resource_tracker._resource_tracker, "_pid", None))}), flush=True)


def workers(options: dict) -> int:
    return options.get("pipeline_parallel_size", 1) * options.get("tensor_parallel_size", 1) - 1


if __name__ == "__main__":
    main(sys.argv[1])
