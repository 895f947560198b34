"""GLM-4.5 (glm4_moe) against transformers in fp32: logits and gradients, packed documents, hub
folders both ways, the engine (greedy and logprobs), routing details and the config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.models.glm4_moe import FLAVORS, Glm4Moe, Glm4MoeArgs, Glm4MoeStateDictAdapter
from meshrl.models.hf import load_hf_model
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin)

VOCAB = 96


def tiny_args(**overrides) -> Glm4MoeArgs:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                moe_hidden_dim=32, num_experts=8, num_shared_experts=1, top_k=2, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, first_dense=1, use_qk_norm=True, num_mtp_layers=1)
    return Glm4MoeArgs(**{**base, **overrides})


# GLM-4.5 (qk norm, grouped routing, scaling), GLM-4.5-Air-like (no qk norm, one group, two
# shared experts, tied head, quarter rotary), no attention bias with 4 groups of which 2 eligible.
CASES = [
    dict(),
    dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, num_shared_experts=2,
         tie_embeddings=True, partial_rotary_factor=0.25, n_layers=2),
    dict(attention_bias=False, norm_topk_prob=False, first_dense=2, n_group=4, topk_group=2, top_k=3),
]


@pytest.mark.parametrize("overrides", CASES, ids=["glm4.5", "air-like", "no-bias-4-groups"])
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(Glm4Moe, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert kinds == ["Glm4MoeMLP" if i < args.first_dense else "Glm4MoeMoE" for i in range(args.n_layers)]
    check_logits_and_grads(model, hf, Glm4MoeStateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_hub_folders_load_and_round_trip(tmp_path):
    args = tiny_args()
    model = build_random(Glm4Moe, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)


def test_mtp_layers_are_dropped_and_unknown_keys_fail(tmp_path):
    """A GLM-4.5 checkpoint stores its MTP module as layer n_layers: it loads without it; any
    other stray key is an error that names it."""
    from safetensors.torch import load_file, save_file

    args = tiny_args()
    model = build_random(Glm4Moe, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    hf.save_pretrained(tmp_path / "mtp")
    weights = load_file(tmp_path / "mtp" / "model.safetensors")
    weights["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    loaded, _ = load_hf_model(tmp_path / "mtp")
    assert torch.equal(loaded.layers["2"].moe.experts.w1, model.layers["2"].moe.experts.w1)
    adapter = Glm4MoeStateDictAdapter(args)
    with pytest.raises(ValueError, match="model.layers.4.self_attn.q_proj.weight"):
        adapter.from_hf({"model.layers.4.self_attn.q_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.1.mlp.bogus"):
        adapter.from_hf({"model.layers.1.mlp.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="dense layer"):
        adapter.from_hf({"model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(8)})


def test_engine_matches_transformers_and_trainer(tmp_path):
    args = tiny_args()
    model = build_random(Glm4Moe, args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_engine(model, hf, VOCAB)


def test_expert_bias_steers_the_choice_not_the_weights():
    """The score-correction bias only picks experts: with a huge bias on experts 0 and 5 every
    token goes there, weighted by its unbiased sigmoid scores (renormalised, scaled)."""
    args = tiny_args(n_group=1, topk_group=1, routed_scaling_factor=2.0)
    model = build_random(Glm4Moe, args)
    moe = model.layers["1"].moe
    assert not moe.expert_bias.requires_grad
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[[0, 5]] = 100.0
    x = torch.randn(7, args.dim)
    top_w, top_i, _ = moe.route(x)
    assert sorted(top_i[0].tolist()) == [0, 5] and all(sorted(row) == [0, 5] for row in top_i.tolist())
    scores = torch.sigmoid(x @ moe.router.weight.T).gather(1, top_i)
    torch.testing.assert_close(top_w, 2.0 * scores / scores.sum(-1, keepdim=True))


def test_flavors_and_config_round_trip():
    for name, args in FLAVORS.items():
        assert Glm4MoeArgs.from_hf_config(args.to_hf_config()) == args, name
        hf_config = transformers.Glm4MoeConfig(**args.to_hf_config())
        assert hf_config.rope_parameters["partial_rotary_factor"] == args.partial_rotary_factor
        assert hf_config.num_mtp_layers == args.num_mtp_layers
    assert get_family("glm4_moe").args_cls is Glm4MoeArgs and "ep" in get_family("glm4_moe").parallel_plan
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in Glm4Moe(FLAVORS[name]).parameters())
                  for name in ("air-106B-A12B", "355B-A32B")}
    assert 105e9 < counts["air-106B-A12B"] < 108e9 and 350e9 < counts["355B-A32B"] < 356e9
    # A hub config: partial_rotary_factor and rope_theta at the top, MTP count as num_nextn_predict_layers.
    hub = {**FLAVORS["debug"].to_hf_config(), "rope_parameters": None, "partial_rotary_factor": 0.5,
           "rope_theta": 1e6, "num_nextn_predict_layers": 1}
    assert Glm4MoeArgs.from_hf_config(hub) == replace(FLAVORS["debug"], num_mtp_layers=1)
    for bad, match in [({"hidden_act": "gelu"}, "hidden_act"), ({"rope_parameters": {"rope_type": "yarn"}}, "RoPE"),
                       ({"n_group": 3}, "groups"), ({"model_type": "glm4"}, "model_type"),
                       ({"n_shared_experts": 0}, "n_shared_experts")]:
        with pytest.raises(ValueError, match=match):
            Glm4MoeArgs.from_hf_config({**FLAVORS["debug"].to_hf_config(), **bad})
