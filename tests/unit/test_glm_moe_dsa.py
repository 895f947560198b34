"""GLM-5 (glm_moe_dsa: MLA + DeepSeek sparse attention) against transformers in fp32: logits and
gradients with rows longer than index_topk (so queries attend sparsely, and a "shared" layer
reuses the selection), packed documents, hub folders both ways, the engine, and the config."""

from __future__ import annotations

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.models.common.rope import YarnRopeScaling
from meshrl.models.glm_moe_dsa import FLAVORS, GlmMoeDsa, GlmMoeDsaArgs, GlmMoeDsaStateDictAdapter
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin)

VOCAB = 96


def tiny_args(**overrides) -> GlmMoeDsaArgs:
    base = dict(vocab_size=VOCAB, num_mtp_layers=1)
    return GlmMoeDsaArgs(**{**base, **overrides})


YARN = YarnRopeScaling(factor=40.0, original_max_seq_len=8, mscale=1.0, mscale_all_dim=1.0)
CASES = [dict(), dict(n_layers=4, indexer_types=("full", "full", "shared", "shared"), index_topk=6, first_dense=0,
                      n_group=2, topk_group=1, rope_scaling=YARN, tie_embeddings=True)]


@pytest.mark.parametrize("overrides", CASES, ids=["full-shared-full", "yarn-groups-tied"])
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build_random(GlmMoeDsa, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    assert [layer.self_attn.skip_topk for layer in hf.model.layers] == [t == "shared" for t in args.indexer_types]
    assert not any(p.requires_grad for p in model.layers["0"].attention.indexer.parameters())
    check_logits_and_grads(model, hf, GlmMoeDsaStateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_the_selection_matters():
    """With index_topk below the row length the output differs from dense MLA: the test above
    would not notice a context that ignored the selection otherwise."""
    args = tiny_args()
    model = build_random(GlmMoeDsa, args)
    dense = build_random(GlmMoeDsa, tiny_args(index_topk=64))
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(17).expand(2, 17)
    with torch.no_grad():
        sparse_out, dense_out = model(tokens, pos), dense(tokens, pos)
        assert (sparse_out - dense_out).abs().max() > 1e-2
        torch.testing.assert_close(sparse_out[:, :4], dense_out[:, :4])  # <= topk keys: nothing dropped yet


def test_hub_folders_load_and_round_trip(tmp_path):
    args = tiny_args()
    model = build_random(GlmMoeDsa, args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)
    # A "shared" layer has no indexer: a checkpoint key for one fails the load, naming it.
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "hub" / "model.safetensors")
    weights["model.layers.1.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)
    save_file(weights, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.indexer\.wk\.weight.*no place"):
        from meshrl.models.hf import load_hf_model

        load_hf_model(tmp_path / "hub")


def test_engine_matches_transformers_and_trainer(tmp_path):
    from tests.family_checks import make_engine

    args = tiny_args()
    model = build_random(GlmMoeDsa, args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    kv = make_engine(model).kv
    assert kv.latent and kv.head_dim == args.kv_lora_rank + args.qk_rope_head_dim + args.index_head_dim
    check_engine(model, hf, VOCAB)


def test_flavors_and_config_round_trip():
    for name, args in FLAVORS.items():
        assert GlmMoeDsaArgs.from_hf_config(args.to_hf_config()) == args, name
        hf_config = transformers.GlmMoeDsaConfig(**args.to_hf_config())
        assert list(hf_config.indexer_types) == list(args.indexer_types)
    assert "ep" in get_family("glm_moe_dsa").parallel_plan
    with torch.device("meta"):
        count = sum(p.numel() for p in GlmMoeDsa(FLAVORS["744B-A40B"]).parameters())
    assert 743e9 < count < 745e9
    for bad, match in [({"indexer_types": ["shared", "full", "full"]}, "first layer"),
                       ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "dense layers after"),
                       ({"num_key_value_heads": 2}, "num_key_value_heads")]:
        with pytest.raises(ValueError, match=match):
            GlmMoeDsaArgs.from_hf_config({**FLAVORS["debug"].to_hf_config(), **bad})
