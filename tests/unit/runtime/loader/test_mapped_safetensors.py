"""safetensors files memory-mapped, not read (issue 53 §2): every tensor is a view of one copy-on-write
mapping of the file, equal to what the safetensors package reads, and a write never reaches the file."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader.mapped_safetensors import header, mapped_tensors, release_pages
from support.resident import mapping_resident_bytes

TENSORS = {"a.weight": torch.randn(64, 32), "b.qweight": torch.randint(-128, 127, (16, 48), dtype=torch.int8),
           "c.scales": torch.randn(16).to(torch.bfloat16), "d.fp8": torch.randn(8, 16).to(torch.float8_e4m3fn),
           "e.empty": torch.zeros(0, 4)}


def test_tensors_are_views_of_one_mapping_equal_to_the_file(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file(TENSORS, file)
    expected = load_file(file)
    found = dict(mapped_tensors(file))
    assert found.keys() == expected.keys()
    for name, tensor in found.items():
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape
        assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), name
    _, entries = header(file)
    a, b = (found[n] for n in ("a.weight", "b.qweight"))
    # Views of one mapping: their addresses are as far apart as their data in the file (a read would not be).
    distance = entries["b.qweight"]["data_offsets"][0] - entries["a.weight"]["data_offsets"][0]
    assert b.data_ptr() - a.data_ptr() == distance


def test_a_write_stays_in_the_process(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file(TENSORS, file)
    before = file.read_bytes()
    found = dict(mapped_tensors(file))
    found["a.weight"].add_(1.0)  # copy-on-write: a private page
    assert file.read_bytes() == before
    assert torch.equal(found["a.weight"], TENSORS["a.weight"] + 1)


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file(TENSORS, file)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        list(mapped_tensors(file))


def test_a_directory_with_a_truncated_file_fails_at_load_in_one_line(tmp_path):
    from kaon_runtime.loader.hf_dir import load_hf_dir

    file = tmp_path / "model.safetensors"
    save_file(TENSORS, file)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, '
                                          '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 1}')
    file.write_bytes(file.read_bytes()[:-100])
    try:
        checkpoint = load_hf_dir(tmp_path)
    except ModelLoadError:
        return  # refused at open: as good
    with pytest.raises(ModelLoadError, match=r"corrupt safetensors file model\.safetensors"):
        list(checkpoint.weights())


def test_released_pages_leave_resident_memory_and_read_back_the_same(tmp_path):
    """Issue 49 §3: a converted tensor's pages must not stay resident beside its copy until the load ends."""
    file = tmp_path / "model.safetensors"
    big = torch.randn(1024, 1024)  # 4 MiB: many pages
    save_file({"small": torch.randn(4), "big": big}, file)
    found = dict(mapped_tensors(file))
    copy = found["big"].clone()  # read: every page of it faulted in; and a copy, which release must not touch
    assert mapping_resident_bytes(found["big"]) >= 2 << 20 or pytest.skip("the kernel reclaimed the pages at once")
    release_pages(found["big"])
    release_pages(copy)  # not a mapping's: left alone (MADV_DONTNEED on it would zero it)
    # Memory pressure can only lower what stays resident: this cannot fail on a loaded machine.
    assert mapping_resident_bytes(found["big"]) < 1 << 20
    assert torch.equal(copy, big)
    assert torch.equal(found["big"], big)  # faulted back in from the file
