"""DeepSeek-V3 (deepseek_v3, multi-head latent attention) against transformers in fp32: logits and
gradients, packed documents, hub folders both ways, the engine (greedy and logprobs over its
cache), and the config."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.models.common.rope import YarnRopeScaling
from meshrl.models.deepseek_v3 import FLAVORS, DeepseekV3, DeepseekV3Args, DeepseekV3StateDictAdapter
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin)

VOCAB = 96


def tiny_args(**overrides) -> DeepseekV3Args:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, hidden_dim=128, moe_hidden_dim=32, num_experts=8, top_k=2,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, first_dense=1, num_mtp_layers=1)
    return DeepseekV3Args(**{**base, **overrides})


# DeepSeek-V3 itself (q LoRA, interleaved RoPE, YaRN with its softmax mscale: factor 40 over an
# original context of 8 tokens, so the test positions fall in every band); DeepSeek-V2-Lite-like
# (no q LoRA, HF's half layout RoPE, two shared experts, tied head, biases, one group, plain RoPE).
YARN = YarnRopeScaling(factor=40.0, original_max_seq_len=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                       mscale_all_dim=1.0)
CASES = [dict(rope_scaling=YARN),
         dict(q_lora_rank=None, rope_interleave=False, num_shared_experts=2, tie_embeddings=True,
              attention_bias=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, v_head_dim=16)]


@pytest.mark.parametrize("overrides", CASES, ids=["v3", "lite-like"])
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(DeepseekV3, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_logits_and_grads(model, hf, DeepseekV3StateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_hub_folders_load_and_round_trip(tmp_path):
    args = tiny_args()
    model = build_random(DeepseekV3, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)


@pytest.mark.parametrize("overrides", CASES, ids=["v3", "lite-like"])
def test_engine_matches_transformers_and_trainer(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(DeepseekV3, args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_engine(model, hf, VOCAB)


def test_flavors_and_config_round_trip():
    for name, args in FLAVORS.items():
        assert DeepseekV3Args.from_hf_config(args.to_hf_config()) == args, name
        hf_config = transformers.DeepseekV3Config(**args.to_hf_config())
        assert (hf_config.qk_head_dim, hf_config.head_dim) == (args.qk_head_dim, args.qk_rope_head_dim)
    assert "ep" in get_family("deepseek_v3").parallel_plan
    with torch.device("meta"):
        count = sum(p.numel() for p in DeepseekV3(FLAVORS["671B-A37B"]).parameters())
    assert 670e9 < count < 672e9
    adapter = DeepseekV3StateDictAdapter(FLAVORS["debug"])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_b_proj.bias"):
        adapter.from_hf({"model.layers.0.self_attn.q_b_proj.bias": torch.zeros(1)})
    # The hub's config.json spells YaRN as a 4.x rope_scaling with "type".
    hub = {**FLAVORS["671B-A37B"].to_hf_config(), "rope_parameters": None, "rope_theta": 10000.0,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
    assert DeepseekV3Args.from_hf_config(hub) == FLAVORS["671B-A37B"]
    assert FLAVORS["671B-A37B"].rope_scaling.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    for bad, match in [({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear"),
                       ({"topk_method": "greedy"}, "topk_method"),
                       ({"num_key_value_heads": 2}, "num_key_value_heads"), ({"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(ValueError, match=match):
            DeepseekV3Args.from_hf_config({**FLAVORS["debug"].to_hf_config(), **bad})


def test_engine_caches_the_compressed_latent():
    """The engine keeps kv_lora_rank + qk_rope_head_dim numbers per token and layer (one shared
    "head", no values), not H * (q/k + v head dims): 24 instead of 4 * (24 + 12) here, 576 instead
    of 40,960 for DeepSeek-V3."""
    from tests.family_checks import make_engine

    args = tiny_args()
    engine = make_engine(build_random(DeepseekV3, args))
    kv = engine.kv
    assert kv.latent and (kv.num_kv_heads, kv.head_dim, kv.v_head_dim) == (1, args.kv_lora_rank + args.qk_rope_head_dim, 0)
    assert kv.bytes_per_block(args.n_layers, 4, 1, kv.head_dim, torch.float32, 0) == args.n_layers * 4 * 24 * 4
