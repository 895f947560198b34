"""Which implementation serves a model folder, and refusals that must come before launch.

- Qwen3 with attention_bias=true (a valid config our qwen3.py does not implement): `auto` falls
  back to the generic transformers path (same logits as transformers), `native` is refused by
  `check_model_source`, i.e. before torchrun starts a rank, and `meshrl eval` / `meshrl rl` exit
  with one line instead of a traceback.
- Qwen3.5 keeps `layer_types` in `text_config`: on the generic path (`model.impl = "hf"`) its
  linear-attention layers are refused early (the native family serves it otherwise).
- Expert parallelism on the generic path (or on a dense family) is refused before start, naming
  the model type and the families that have native EP.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from meshrl.models.generic_hf import HFCausalLM, native_ep_families, resolve_impl
from meshrl.models.hf import load_hf_model
from meshrl.runtime import cli
from meshrl.runtime.config import ModelConfig
from meshrl.runtime.policy import check_model_source

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def save_hf(config: transformers.PretrainedConfig, path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def biased_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_bias") / "m"
    hf = save_hf(transformers.Qwen3Config(**SHAPE, attention_bias=True), path)
    return path, hf


def test_qwen3_with_attention_bias_falls_back_to_generic_under_auto(biased_qwen3):
    path, hf = biased_qwen3
    config = hf.config.to_dict()
    assert resolve_impl("qwen3", "auto", config) == "hf" and resolve_impl("qwen3", "hf", config) == "hf"
    check_model_source(ModelConfig(path=str(path)))  # auto: accepted
    model, _ = load_hf_model(path)
    assert isinstance(model, HFCausalLM)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(9).expand(2, 9))
        torch.testing.assert_close(ours, hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_native_refusal_comes_before_launch(biased_qwen3, tmp_path, capsys):
    path, _ = biased_qwen3
    capsys.readouterr()
    with pytest.raises(ValueError, match="attention_bias"):
        check_model_source(ModelConfig(path=str(path), impl="native"))
    with pytest.raises(ValueError, match="attention_bias"):
        resolve_impl("qwen3", "native", transformers.Qwen3Config(**SHAPE, attention_bias=True).to_dict())
    # The command lines: one line on stderr and exit 2, no traceback and no torchrun.
    for command in (["eval", "@", "configs/alphabet_sort/eval.toml"], ["rl", "@", "configs/reverse_text/rl.toml"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*command, "--model.path", str(path), "--model.impl", "native", "--output-dir",
                      str(tmp_path / command[0])])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "attention_bias" in err and "Traceback" not in err, err


def test_qwen3_5_layer_types_are_read_from_text_config(tmp_path):
    config = transformers.AutoConfig.for_model(
        "qwen3_5", text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    layer_types=["linear_attention", "full_attention"]))
    assert "layer_types" not in config.to_dict() or not config.to_dict()["layer_types"]
    (tmp_path / "m").mkdir()
    config.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")  # the check reads config.json only
    # Native (models/qwen3_next.py) serves it; the generic path still refuses its linear-attention layers.
    with pytest.raises(ValueError, match="linear_attention"):
        check_model_source(ModelConfig(path=str(tmp_path / "m"), impl="hf"))


def test_expert_parallel_on_the_generic_path_is_refused_before_start(tmp_path):
    save_hf(transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
            tmp_path / "mixtral")
    families = native_ep_families()
    assert "qwen3_moe" in families and "qwen3" not in families
    check_model_source(ModelConfig(path=str(tmp_path / "mixtral")), ep=1)
    with pytest.raises(ValueError, match=r"'mixtral' runs on the generic transformers path.*qwen3_moe"):
        check_model_source(ModelConfig(path=str(tmp_path / "mixtral")), ep=2)
    with pytest.raises(ValueError, match="'qwen3' has no experts"):
        check_model_source(ModelConfig(flavor="debug", family="qwen3", tokenizer="char"), ep=2)
    check_model_source(ModelConfig(flavor="debug", family="qwen3_moe", tokenizer="char"), ep=2)


def test_meshrl_rl_refuses_generic_ep_with_one_line(tmp_path, capsys):
    save_hf(transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
            tmp_path / "mixtral")
    capsys.readouterr()  # transformers' progress bars
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["rl", "@", "configs/reverse_text/rl.toml", "--model.path", str(tmp_path / "mixtral"),
                  "--layout.num-trainer-ranks", "2", "--trainer.parallel.ep", "2", "--output-dir", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'mixtral'" in err and "qwen3_moe" in err, err
