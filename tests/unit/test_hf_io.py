"""HF folder I/O: round trips, sharded and tied checkpoints, tokenizer files, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.models import get_family
from meshrl.models.hf import load_hf_model, read_hf_config, save_hf_model
from meshrl.models.qwen3 import Qwen3, Qwen3Args, Qwen3StateDictAdapter


def tiny(tie: bool, seed: int = 0) -> tuple[Qwen3, Qwen3Args]:
    args = Qwen3Args(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                     tie_embeddings=tie)
    model = Qwen3(args)
    model.init_weights(seed=seed)
    return model, args


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_is_bit_identical(tie, tmp_path):
    model, args = tiny(tie)
    save_hf_model(model, args, tmp_path / "m", eos_token_id=2)
    loaded, loaded_args = load_hf_model(tmp_path / "m")
    assert loaded_args == args
    assert_same_state(model, loaded)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    assert read_hf_config(tmp_path / "m")["eos_token_id"] == 2


def test_bf16_save_and_load(tmp_path):
    model, args = tiny(tie=True)
    save_hf_model(model.state_dict(), args, tmp_path / "m", dtype=torch.bfloat16)
    assert read_hf_config(tmp_path / "m")["dtype"] == "bfloat16"
    loaded, _ = load_hf_model(tmp_path / "m", dtype=torch.bfloat16)
    assert_same_state(model.to(torch.bfloat16), loaded)
    tokens = torch.randint(0, args.vocab_size, (1, 5))
    assert loaded(tokens, torch.arange(5)[None]).dtype == torch.bfloat16


def test_load_sharded_checkpoint_written_by_transformers(tmp_path):
    model, args = tiny(tie=False)
    save_hf_model(model, args, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded, _ = load_hf_model(tmp_path / "sharded")
    assert_same_state(model, loaded)


def test_tied_model_accepts_a_stored_lm_head(tmp_path):
    model, args = tiny(tie=True)
    save_hf_model(model, args, tmp_path / "m")
    hf_state = Qwen3StateDictAdapter(args).to_hf(model.state_dict())
    hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"].clone()
    save_file(hf_state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = load_hf_model(tmp_path / "m")
    assert_same_state(model, loaded)


def test_missing_folder_or_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        read_hf_config(tmp_path / "empty")


def test_missing_or_misshaped_weights_are_clear_errors(tmp_path):
    model, args = tiny(tie=True)
    save_hf_model(model, args, tmp_path / "m")
    hf_state = Qwen3StateDictAdapter(args).to_hf(model.state_dict())
    del hf_state["model.norm.weight"]
    save_file(hf_state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        load_hf_model(tmp_path / "m")
    hf_state["model.norm.weight"] = torch.ones(3)
    save_file(hf_state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        load_hf_model(tmp_path / "m")


def test_unknown_keys_raise():
    _, args = tiny(tie=False)
    adapter = Qwen3StateDictAdapter(args)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        adapter.from_hf({"model.layers.0.self_attn.bogus.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):  # beyond n_layers
        adapter.from_hf({"model.layers.7.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="layers.0.bogus"):
        adapter.to_hf({"layers.0.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="mamba"):
        get_family("mamba")
    with pytest.raises(ValueError, match="qwen3"):  # the message lists the known types
        get_family("mamba")


def test_save_replaces_an_existing_folder_and_copies_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
                            ).save_pretrained(tmp_path / "tok")

    model, args = tiny(tie=True)
    save_hf_model(model, args, tmp_path / "m")
    model2, _ = tiny(tie=True, seed=1)
    save_hf_model(model2, args, tmp_path / "m", tokenizer_dir=tmp_path / "tok", bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "tok"]  # no .tmp / .old left behind
    loaded, _ = load_hf_model(tmp_path / "m")
    assert_same_state(model2, loaded)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tokenizer("abc")["input_ids"] == [3, 4, 5]
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"] == 2
    with pytest.raises(ValueError, match="tokenizer_dir"):
        save_hf_model(model, args, tmp_path / "m2", tokenizer_dir=tmp_path / "m2-missing")


def test_large_state_dicts_are_saved_as_shards_with_an_index(tmp_path):
    """Above max_shard_gb the folder has HF's sharded layout; transformers and our loader read it."""
    from meshrl.models.qwen3 import FLAVORS

    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    save_hf_model(model, args, tmp_path / "hf", max_shard_gb=40e3 / 1e9)  # ~40 kB per file
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    loaded, _ = load_hf_model(tmp_path / "hf")
    for (name, a), b in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(hf.model.embed_tokens.weight, model.tok_embeddings.weight)
