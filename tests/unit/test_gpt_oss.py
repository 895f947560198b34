"""gpt-oss (gpt_oss) against transformers in fp32: logits and gradients (sliding windows shorter
than the rows, sinks, yarn RoPE, expert biases, clamped SwiGLU), packed documents, hub folders
both ways (packed expert tensors), the engine, and the config."""

from __future__ import annotations

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.models.gpt_oss import FLAVORS, GptOss, GptOssArgs, GptOssStateDictAdapter
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin)

VOCAB = 96


def tiny_args(**overrides) -> GptOssArgs:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
                num_experts=8, top_k=2, sliding_window=4)
    return GptOssArgs(**{**base, **overrides})


def clamping(model: GptOss) -> None:
    """Expert weights large enough that the SwiGLU clamp (limit 7) is active."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.w1", "experts.w3")):
                p.mul_(40.0)


CASES = [dict(), dict(n_layers=3, layer_types=("full_attention", "sliding_attention", "sliding_attention"),
                      rope_scaling=None, tie_embeddings=True, top_k=3, sliding_window=6)]


@pytest.mark.parametrize("overrides", CASES, ids=["yarn-alternating", "plain-rope-tied"])
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(GptOss, args)
    clamping(model)
    hf = hf_twin(model, args, tmp_path / "ours")
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [args.window(i) for i in range(args.n_layers)]
    check_logits_and_grads(model, hf, GptOssStateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_hub_folders_load_and_round_trip(tmp_path):
    args = tiny_args()
    model = build_random(GptOss, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)


def test_engine_matches_transformers_and_trainer(tmp_path):
    args = tiny_args()
    model = build_random(GptOss, args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_engine(model, hf, VOCAB)


def test_flavors_and_config_round_trip():
    for name, args in FLAVORS.items():
        assert GptOssArgs.from_hf_config(args.to_hf_config()) == args, name
        hf_config = transformers.GptOssConfig(**args.to_hf_config())
        assert list(hf_config.layer_types) == list(args.layer_types)
    assert "ep" in get_family("gpt_oss").parallel_plan
    with torch.device("meta"):
        counts = {n: sum(p.numel() for p in GptOss(FLAVORS[n]).parameters()) for n in ("20b", "120b")}
    assert 20.5e9 < counts["20b"] < 21.5e9 and 116e9 < counts["120b"] < 118e9
    # transformers' defaults: alternating layer types and yarn when the config leaves them out.
    hub = {k: v for k, v in FLAVORS["20b"].to_hf_config().items() if k not in ("layer_types", "rope_parameters")}
    hub["rope_scaling"] = FLAVORS["20b"].rope_scaling.to_hf(150_000.0)
    assert GptOssArgs.from_hf_config(hub) == FLAVORS["20b"]
    for bad, match in [({"quantization_config": {"quant_method": "mxfp4"}}, "dequantize"),
                       ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear"),
                       ({"layer_types": ["chunked_attention"] * 2}, "layer_types")]:
        with pytest.raises(ValueError, match=match):
            GptOssArgs.from_hf_config({**FLAVORS["debug"].to_hf_config(), **bad})
    with pytest.raises(ValueError, match="gate_up_proj_blocks"):
        GptOssStateDictAdapter(FLAVORS["debug"]).from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)})


@pytest.mark.parametrize("bias", [False, True], ids=["swiglu", "biases-clamped"])
def test_grouped_gemm_path_equals_the_expert_loop(bias, monkeypatch):
    """The path CUDA takes in bf16 (torch._grouped_mm, which also runs on CPU), biases gathered per
    row, equals the per-expert loop; an expert with no rows included."""
    from meshrl.models.common import moe
    from meshrl.models.common.moe import ClampedSwiGLU, GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(16, 8, 4, bias=bias, activation=ClampedSwiGLU() if bias else None)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 1.0)
    x, counts = torch.randn(11, 16), torch.tensor([3, 0, 5, 3])
    loop = experts(x, counts)
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda x, w: True)
    torch.testing.assert_close(experts(x, counts), loop, rtol=1e-5, atol=1e-5)
