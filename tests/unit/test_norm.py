"""RMSNorm's CPU inference path (torch.rms_norm, one op) is bit-identical to the eager formula in fp32."""

from __future__ import annotations

import pytest
import torch

from meshrl.models.common.norm import RMSNorm


@pytest.mark.parametrize("shape", [(64, 1, 128), (64, 1, 4, 32), (3, 17, 96), (5, 1)])
def test_rms_norm_inference_path_is_bit_identical_in_fp32(shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-6)
    norm.weight.data.normal_()
    x = torch.randn(*shape) * 3
    eager = norm(x)  # grad mode: the eager formula
    with torch.inference_mode():
        fast = norm(x)
    assert torch.equal(fast, eager)
