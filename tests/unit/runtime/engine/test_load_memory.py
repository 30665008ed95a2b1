"""Loading fits the memory it claims (issue 49 §3): a quantized model's load peaks within 15% of the
memory the engine then settles at, because its weights go from the file to their kernel layout one
tensor at a time (no float copy of the model, nor of the file, ever exists), and the engine refuses a
load whose peak would not fit its container's memory limit with ModelDoesNotFit.

Peak and settled resident memory are measured in a fresh process each (tests/support/load_memory.py:
a high-water mark never goes down, so the test process itself could not show a load's peak); the three loads
run one after the other. Before this, the bundled Q4_1 file peaked at 1.66x
its settled memory (a float copy of the whole model, the dequantized vocabulary table and the file's
pages all at once), and `--quantization int8` of it (kaon quantizing a float model) at 1.57x until 2026-11-30."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kaon_runtime import LLM
from kaon_runtime.engine import memory_fit
from kaon_runtime.engine.model_loader import _released_once_copied
from kaon_runtime.errors import ModelDoesNotFitError
from kaon_runtime.loader.mapped_safetensors import mapped_tensors
from support import MODEL
from support.gguf_files import write_tiny_gguf
from support.resident import mapping_resident_bytes

ROOT = Path(__file__).resolve().parents[4]
PEAK_OVER_SETTLED = 1.15  # the bound
ESTIMATE_SLACK = 0.04  # (the estimate against the measured peak: below)


def _start(model: str, *options: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "tests"),
                                                           os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "load_memory.py"), model, *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=900)  # generous: a shared CI machine
    assert process.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_quantized_loads_peak_within_15_percent_of_their_settled_memory_and_hold_each_weight_once(tmp_path, gguf_path):
    k_quant = write_tiny_gguf(tmp_path / "q4_k_m.gguf", gguf_path, "Q4_K_M")  # Q4_K with Q6_K, f16 table
    # One after the other: side by side, each load's memory pressure made the kernel reclaim the other's clean
    # pages (torch's libraries) after its peak, and its settled figure read 10-15% low.
    # And kaon's own quantization of a float model (--quantization int8 from the bundled file, dequantized as it
    # streams): 1.8x until 2026-11-30, when the whole float model was built first and quantized afterwards; now each
    # linear is quantized as its weights arrive (quant/on_load.py).
    loads = (("bundled Q4_1", (MODEL,)), ("Q4_K_M", (str(k_quant),)), ("int8 from float", (MODEL, "quantization=int8")))
    results = {name: _result(_start(*model)) for name, model in loads}
    for name, found in results.items():
        ratio = found["peak"] / found["settled"]
        # Both to the 1.15x (the K-quant was held to 1.25x until 2026-11-29: it measured 1.21x inside this
        # test once; now 1.05x for llama.cpp's full-size Q4_K_M / Q5_K_M, bench/load_memory.py).
        assert ratio <= PEAK_OVER_SETTLED, (name, f"peak {found['peak'] >> 20} MiB, settled "
                                                  f"{found['settled'] >> 20} MiB: {ratio:.2f}x")
    # The engine's memory check (ModelDoesNotFit) counts that peak: its estimate of the int8 load, made before any
    # weight is read, is not below what the load reached. Measured (2026-11-30 21:12, load ~7): estimate 878 MiB,
    # peak 871 (1,008 until the tied table, which comes as the file's int8 blocks, was no longer counted at float32
    # twice: a margin of 7 MiB now, the peak 871-872 MiB in every run that day).
    # The estimate leaves out what no header tells (the allocator's free chunks, the mapped file's resident pages),
    # so it may fall short of the peak by ESTIMATE_SLACK of it; what it guards against is larger: the linears
    # counted at their float size, or the float transient left out, is 100 MiB or more on this model.
    quantizing = results["int8 from float"]
    assert quantizing["estimate"] >= quantizing["peak"] * (1 - ESTIMATE_SLACK), \
        (quantizing["estimate"] >> 20, quantizing["peak"] >> 20)
    # What the settled engine held is its model's tensors and its KV pool, each once: closing it gives back no more
    # than those. Until 2026-11-30 the fused CPU step read its own interleaved copy of every int4 / int8 projection
    # (the bundled model's 53 MiB, over half its 97 MiB of quantized tensors) beside the module's, which no count
    # saw (quant/kernel_layout.py). Measured (2026-11-30, load ~6): 22-24 MiB under (not every freed page goes back);
    # with the copy back, 30 MiB over; an eighth of the quantized bytes (12 MiB) allowed here.
    bundled = results["bundled Q4_1"]  # (the tiny K-quant's few MiB of weights are within the allocator's noise)
    unseen = bundled["released"] - bundled["weights"] - bundled["kv"]
    assert unseen < bundled["quantized"] / 8, f"{unseen >> 20} MiB held beyond the model's " \
                                              f"{bundled['weights'] >> 20} MiB and the pool's"


def test_a_load_whose_peak_exceeds_the_memory_limit_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(memory_fit, "memory_limit", lambda: 600 << 20)  # a container of 600 MiB
    with pytest.raises(ModelDoesNotFitError, match="at its peak") as raised:
        LLM(MODEL, show_progress=False, device="cpu", num_kv_blocks=64)
    assert "600 MiB" in str(raised.value)


def test_a_host_kv_tier_the_container_cannot_hold_is_refused_at_start(monkeypatch):
    """--kv-offload-bytes fills while serving: one past the container's limit was taken, and the engine was
    OOM-killed once the tier filled, hours into serving (found by hand: 4 GiB of tier in a 2 GiB container)."""
    monkeypatch.setattr(memory_fit, "memory_limit", lambda: 2 << 30)  # room for the model and its pool
    with pytest.raises(ModelDoesNotFitError, match="kv-offload-bytes") as raised:
        LLM(MODEL, show_progress=False, device="cpu", num_kv_blocks=64, kv_offload_bytes=4 << 30)
    assert "host KV tier (--kv-offload-bytes) 4096 MiB" in str(raised.value)


@pytest.mark.parametrize("own, files, limit", [
    # a systemd scope on a cgroup v2 host (`systemd-run -p MemoryMax=1G kaon serve`): the root has no memory.max
    ("0::/system.slice/run-1.scope\n", {"/sys/fs/cgroup/system.slice/run-1.scope/memory.max": "1073741824"}, 1 << 30),
    # a v1 host: the process's own cgroup unlimited, its parent's 2 GiB binds it, the root unlimited
    ("4:memory:/jobs/x\n0::/\n", {"/sys/fs/cgroup/memory/memory.limit_in_bytes": str(1 << 62),
                                    "/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": "2147483648",
                                    "/sys/fs/cgroup/memory/jobs/x/memory.limit_in_bytes": str(1 << 62)}, 2 << 30),
    # a container with its own cgroup namespace: its path is "/", the mount's root is its cgroup
    ("0::/\n", {"/sys/fs/cgroup/memory.max": "629145600"}, 600 << 20),
    # a v1 container sharing the host's namespace: the host's path is not under its mount; the root is its own
    ("5:cpuacct,memory:/docker/abc\n", {"/sys/fs/cgroup/memory/memory.limit_in_bytes": "536870912"}, 512 << 20),
    ("0::/user.slice\n", {"/sys/fs/cgroup/user.slice/memory.max": "max"}, None),
])
def test_the_memory_limit_is_the_tightest_on_the_process_own_cgroup_path(own, files, limit):
    """Only the mount's root was read: a limit given to a systemd scope or a host's cgroup went unseen, so a
    load that could not fit was OOM-killed half-way instead of refused."""
    assert memory_fit.limit_from(own, lambda path: files.get(str(path))) == limit


def test_the_peak_estimate_counts_the_kernel_layout_and_the_float_copies():
    quantized = memory_fit.LoadPeak(resident=500 << 20, weights=100 << 20, float_transient=30 << 20,
                                    kv_cache=20 << 20)
    assert quantized.total == 650 << 20
    assert memory_fit.check_fits(quantized, limit=None) is None  # no limit: nothing to refuse
    assert memory_fit.check_fits(quantized, limit=700 << 20) is None
    message = memory_fit.check_fits(quantized, limit=640 << 20)
    assert message is not None and "650 MiB" in message and "640 MiB" in message


def test_the_weight_stream_releases_each_safetensors_tensor_once_the_next_is_asked_for(tmp_path):
    """FP8-dynamic and W8A8 checkpoints peaked 1.17x: every tensor's file pages stayed resident beside the copy
    load_weights made of it until the load ended. Now the stream drops each one's pages when it moves on."""
    file = tmp_path / "model.safetensors"
    save_file({f"layer{i}.weight": torch.randn(512, 512) for i in range(4)}, file)  # 1 MiB each
    held, copies = [], []
    for _, tensor in _released_once_copied(mapped_tensors(file)):
        copies.append(tensor.clone())  # as load_weights copies it: every page read
        held.append(tensor)  # the views keep the mapping alive to be measured
    assert mapping_resident_bytes(held[0]) < 1 << 20  # of 4 MiB read (pressure could only lower it)
    assert all(torch.equal(view, copy) for view, copy in zip(held, copies))


def test_a_quantized_checkpoints_tensors_leave_resident_memory_once_their_module_is_built(tmp_path):
    """The other half of the FP8-dynamic / W8A8 peak: the quantized tensors set aside for install() were read
    by their conversion and stayed resident beside the converted copy until the load ended."""
    import numpy as np

    from kaon_runtime.config import ModelConfig
    from kaon_runtime.distributed.parallel import TensorParallel
    from kaon_runtime.engine.prequantized import Prequantized
    from kaon_runtime.quant.checkpoint_formats import scheme_from_config
    from support.gptq_awq import np_pack_columns, np_pack_rows, np_quantize

    n = k = 2048  # a 4-bit GPTQ o_proj: 2 MiB of packed weights
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=n, intermediate_size=4096, num_layers=1,
                         num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=64)
    name = "model.layers.0.self_attn.o_proj"
    q, zeros, scales, _ = np_quantize(np.random.default_rng(0).normal(size=(n, k)), 4, 32, False)
    packed = {"qweight": np_pack_rows(q.T, 4), "qzeros": np_pack_columns((zeros - 1).T, 4), "scales": scales.T}
    file = tmp_path / "model.safetensors"
    save_file({f"{name}.{key}": torch.from_numpy(np.ascontiguousarray(v)) for key, v in packed.items()}, file)
    mapped = {key.rpartition(".")[2]: tensor for key, tensor in mapped_tensors(file)}
    plan = Prequantized(scheme_from_config(dict(quant_method="gptq", bits=4, group_size=32, sym=False)), config, {})
    plan.held[name] = dict(mapped)
    module = plan._module(name, [name], (n, k), None, torch.device("cpu"), TensorParallel())
    assert mapping_resident_bytes(mapped["qweight"]) < 512 << 10  # of 2 MiB read (pressure could only lower it)
    plan.held[name] = {key: tensor.clone() for key, tensor in mapped.items()}  # the same, never mapped
    from_copies = plan._module(name, [name], (n, k), None, torch.device("cpu"), TensorParallel())
    x = torch.randn(2, k)
    assert torch.equal(module(x), from_copies(x))  # released pages read back as they were


def test_the_peak_estimate_under_quantization_counts_the_linears_quantized_and_one_in_float():
    """--quantization on a float checkpoint (quant/on_load.py): the linears' float bytes leave the estimate for their
    quantized bytes, and one linear's float weight and quantization temporaries join the transient."""
    from kaon_runtime.quant.on_load import quantized_bytes, transient_bytes

    assert quantized_bytes("int8", 1024, 512) == 1024 * 512 + 1024 * 8  # int8 values, float32 scales and their copy
    assert quantized_bytes("fp8", 1024, 512) == 1024 * 512 + 1024 * 4
    assert quantized_bytes("int4", 1024, 512) == 1024 * 256 + 4 * 1024 * 512 // 32  # nibbles, float16 scale + min
    assert transient_bytes(1024, 512, dtype_bytes=2) == 1024 * 512 * (2 + 12)
    linears = 32  # (a model's worth: one linear's transient against all of their float bytes)
    float_model = memory_fit.estimate([(1024 * 512, 1024 * 512 * 2, False)] * linears, 4, False, kv_cache=0,
                                      resident=0)
    assert float_model.weights == linears * 1024 * 512 * 4
    quantizing = memory_fit.quantized_on_load(float_model, float_bytes=linears * 1024 * 512 * 4,
                                              quantized=linears * quantized_bytes("int8", 1024, 512),
                                              transient=transient_bytes(1024, 512, 4))
    assert quantizing.weights == linears * quantized_bytes("int8", 1024, 512)
    assert quantizing.float_transient == float_model.float_transient + transient_bytes(1024, 512, 4)
    assert quantizing.total < float_model.total / 2


def test_the_peak_estimate_counts_a_table_held_as_its_q8_0_blocks_once_and_narrow():
    """--quantization from a GGUF whose tied table is Q8_0 (the bundled file): the table comes as its int8 blocks,
    never float (engine/gguf_weights.table_held). Until 2026-11-30 the estimate counted it at the model's float
    dtype as a weight and again as the largest float transient (1,009 MiB estimated against an 871 MiB peak)."""
    vocab, hidden = 49152, 576
    table = (vocab * hidden, vocab * hidden // 32 * 34, True)  # Q8_0: 34 bytes a block of 32
    layer = (hidden * 1536, hidden * 1536 // 32 * 20, True)  # Q4_1 linears, dequantized as they stream
    sizes = [table, *[layer] * 10]
    counted_float = memory_fit.estimate(sizes, 4, False, kv_cache=0, resident=0)
    held = memory_fit.estimate(sizes, 4, False, kv_cache=0, resident=0, held_table=table[:2])
    assert held.weights == memory_fit.held_q8_0_bytes(vocab * hidden) + 10 * hidden * 1536 * 4
    assert memory_fit.held_q8_0_bytes(vocab * hidden) == vocab * hidden * 9 // 8  # int8 values, float32 scales
    assert held.float_transient == table[1] + table[0]  # its blocks and repack's int8 values, not a float table
    assert counted_float.weights - held.weights == vocab * hidden * (4 - 9 / 8)
    assert counted_float.float_transient == vocab * hidden * 4
    # Only the held table leaves the float count: another Q8_0 tensor of another size stays float.
    other = memory_fit.estimate([(1024, 1088, True)], 4, False, kv_cache=0, resident=0, held_table=table[:2])
    assert other.weights == 1024 * 4


def test_the_memory_check_of_the_bundled_file_under_int8_counts_its_q8_0_table_as_held(monkeypatch):
    """The loader tells the estimate which table it holds: the bundled file's tied Q8_0 table (49152 x 576) is
    counted at its int8 size and its float32 copy is in neither the weights nor the transient (refused before
    loading, under a 1 MiB limit, so nothing is read)."""
    peaks: list[memory_fit.LoadPeak] = []
    check_fits = memory_fit.check_fits

    def recorded(peak, limit):
        peaks.append(peak)
        return check_fits(peak, limit)

    monkeypatch.setattr(memory_fit, "memory_limit", lambda: 1 << 20)
    monkeypatch.setattr(memory_fit, "check_fits", recorded)
    with pytest.raises(ModelDoesNotFitError):
        LLM(MODEL, show_progress=False, device="cpu", num_kv_blocks=64, quantization="int8")
    (peak,) = peaks
    table_float = 49152 * 576 * 4
    # Its blocks and int8 values (56 MiB) and one fused linear's quantization (27 MiB); counted as float it was
    # the table's float32 (108 MiB) and that linear.
    assert peak.float_transient < table_float, peak.float_transient >> 20
