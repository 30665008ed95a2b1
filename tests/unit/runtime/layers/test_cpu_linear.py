"""oneDNN float32 linears on CPU: same results as nn.Linear up to float32 rounding, and on by default."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kaon_runtime.layers.cpu_linear import (
    OneDnnLinear,
    onednn_linears_apply,
    use_onednn_linears,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_onednn_linear_matches_nn_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias)
    x = torch.randn(2, rows, 96)  # leading dims are flattened and restored
    with torch.inference_mode():
        expected = linear(x)
        out = OneDnnLinear(linear)(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(OneDnnLinear(linear).weight, linear.weight)  # readable as a plain weight still


def test_every_linear_is_swapped_and_the_switch_turns_it_off(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert use_onednn_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert onednn_linears_apply(torch.device("cpu"), torch.float32)
    assert not onednn_linears_apply(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("KAON_CPU_LINEAR", "torch")
    assert not onednn_linears_apply(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("KAON_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KAON_CPU_LINEAR"):
        onednn_linears_apply(torch.device("cpu"), torch.float32)
