"""Fused inference kernels (models/common/fused.py) against the eager modules they replace (CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrl.models.common.ffn import FeedForward
from meshrl.models.common.norm import RMSNorm
from meshrl.models.common.rope import RotaryEmbedding, apply_rope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in bf16 spacings (2**-7 relative) of the larger of the two values, with a
    floor of one spacing at 1/64 of b's typical size (a sum that cancels to ~0 may round either way)."""
    a, b = a.float(), b.float()
    spacing = 2.0**-7 * torch.maximum(torch.maximum(a.abs(), b.abs()), b.abs().mean() / 64)
    return ((a - b).abs() / spacing).max().item()


@pytest.mark.parametrize("shape", [(256, 1, 1024), (256, 1, 16, 128), (3, 17, 8, 128), (5, 96)])
def test_rms_norm_matches_eager(shape):
    pytest.importorskip("triton")
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1]).cuda().to(torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    eager = norm(x)
    with torch.inference_mode():
        fused = norm(x)
    assert fused.shape == eager.shape and fused.dtype == eager.dtype
    assert _ulps(fused, eager) <= 1.0  # the fp32 sum's order may move the rsqrt by an ulp


def test_rope_and_silu_mul_match_eager():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    rope = RotaryEmbedding(128, 1e6)
    positions = torch.randint(0, 30000, (64, 3), device="cuda")
    cos, sin = rope(positions, torch.bfloat16)
    q = torch.randn(64, 3, 16, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(64, 3, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    eager = apply_rope(q, k, cos, sin)
    with torch.inference_mode():
        fused = apply_rope(q, k, cos, sin)
    for x, e, f in zip((q, k), eager, fused):
        assert f.shape == e.shape
        # The compiler may fuse a product into the sum (one rounding instead of eager's two):
        # agreement to within a bf16 spacing of the products, which a cancelling sum exposes.
        c, s = cos[:, None], sin[:, None]
        products = (x.float() * c.float()).abs() + (x.float() * s.float()).abs().roll(64, dims=-1)
        assert ((f.float() - e.float()).abs() <= 2.0**-7 * products + 1e-6).all()
        assert (f != e).float().mean().item() < 0.5
    ffn = FeedForward(256, 768).cuda().to(torch.bfloat16)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    a, b = ffn.w1(x), ffn.w3(x)
    with torch.inference_mode():
        from meshrl.models.common.fused import silu_mul
        assert _ulps(silu_mul(a, b), F.silu(a) * b) <= 1.0
        assert _ulps(ffn(x), ffn.w2(F.silu(a) * b)) <= 2.0


def test_model_logits_with_fused_kernels_match_eager():
    pytest.importorskip("triton")
    from meshrl.models import get_family

    fam = get_family("qwen3")
    torch.manual_seed(0)
    model = fam.model_cls(fam.flavors["debug"]).cuda()
    model.init_weights(seed=0)
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, model.output_weight.shape[0], (4, 33), device="cuda")
    positions = torch.arange(33, device="cuda").expand(4, -1)
    with torch.no_grad():
        eager = model(tokens, positions).float()
    with torch.inference_mode():
        fused = model(tokens, positions).float()
    assert (fused - eager).abs().max().item() <= 0.05 * eager.abs().max().item()
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.95
