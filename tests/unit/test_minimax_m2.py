"""MiniMax-M2 (minimax_m2) against transformers in fp32: logits and gradients, packed documents,
hub folders both ways (Mixtral-style block_sparse_moe names), the engine, and the config."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open

from meshrl.models import get_family
from meshrl.models.minimax_m2 import FLAVORS, MiniMaxM2, MiniMaxM2Args, MiniMaxM2StateDictAdapter
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin)

VOCAB = 96


def tiny_args(**overrides) -> MiniMaxM2Args:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
                num_experts=8, top_k=2, rotary_dim=8)
    return MiniMaxM2Args(**{**base, **overrides})


@pytest.mark.parametrize("overrides", [dict(), dict(rotary_dim=16, tie_embeddings=True, n_layers=3, top_k=3)],
                         ids=["partial-rotary", "full-rotary-tied"])
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(MiniMaxM2, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    assert hf.model.layers[0].self_attn.q_norm.weight.shape == (args.n_heads * args.head_dim,)
    check_logits_and_grads(model, hf, MiniMaxM2StateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_hub_folders_load_and_round_trip(tmp_path):
    args = tiny_args()
    model = build_random(MiniMaxM2, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)
    for folder in ("ours", "hub"):  # what we write and what transformers writes: the hub's names
        with safe_open(str(tmp_path / folder / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        assert {"model.layers.1.block_sparse_moe.e_score_correction_bias", "model.layers.1.block_sparse_moe.gate.weight",
                "model.layers.1.block_sparse_moe.experts.7.w2.weight"} <= keys, folder
        assert not any(".mlp." in k for k in keys), folder


def test_unknown_keys_fail_naming_them():
    adapter = MiniMaxM2StateDictAdapter(tiny_args())
    for key in ("model.layers.0.block_sparse_moe.experts.8.w1.weight", "model.layers.0.mlp.shared_experts.w1.weight",
                "model.layers.2.self_attn.q_proj.weight"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.") + "|expert 8|layer 2"):
            adapter.from_hf({key: torch.zeros(1)})


def test_engine_matches_transformers_and_trainer(tmp_path):
    args = tiny_args()
    model = build_random(MiniMaxM2, args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_engine(model, hf, VOCAB)


def test_flavors_and_config_round_trip(tmp_path):
    for name, args in FLAVORS.items():
        assert MiniMaxM2Args.from_hf_config(args.to_hf_config()) == args, name
        hf_config = transformers.MiniMaxM2Config(**args.to_hf_config())
        assert hf_config.rope_parameters["partial_rotary_factor"] == args.rotary_dim / args.head_dim
    assert "ep" in get_family("minimax_m2").parallel_plan
    with torch.device("meta"):
        count = sum(p.numel() for p in MiniMaxM2(FLAVORS["230B-A10B"]).parameters())
    assert 228e9 < count < 231e9
    # The hub's config.json: rotary_dim beside head_dim, no rope_parameters.
    hub = {**FLAVORS["debug"].to_hf_config(), "rope_parameters": None}
    assert MiniMaxM2Args.from_hf_config(hub) == FLAVORS["debug"]
    for bad, match in [({"scoring_func": "softmax"}, "scoring_func"), ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"router_jitter_noise": 0.1}, "jitter"), ({"rope_parameters": {"rope_type": "yarn"}}, "RoPE")]:
        with pytest.raises(ValueError, match=match):
            MiniMaxM2Args.from_hf_config({**FLAVORS["debug"].to_hf_config(), **bad})
