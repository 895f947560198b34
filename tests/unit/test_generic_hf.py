"""Generic transformers path: parity with the plain HF model (logits, gradients, packed rows,
greedy generation through NativeEngine), HF folder I/O, impl selection, and clear refusals."""

from __future__ import annotations

import copy
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from meshrl.models import MODEL_FAMILIES
from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.generic_hf import (
    GenericArgs,
    GenericStateDictAdapter,
    HFCausalLM,
    build_generic,
    check_generic_config,
    resolve_impl,
)
from meshrl.models.hf import load_hf_model, save_hf_model
from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.runtime.config import ModelConfig
from meshrl.runtime.engine.api import Request, SamplingParams, generate
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.policy import build_policy, check_model_source

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, bos_token_id=1, eos_token_id=2)
FAMILIES = ["mistral", "olmo2", "granite"]


def hf_config(family: str, tie: bool = False) -> transformers.PretrainedConfig:
    """Tiny random configs of families meshrl does not implement natively (all full causal attention)."""
    if family == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=None, tie_word_embeddings=tie)
    if family == "olmo2":  # q/k RMSNorm over all heads, post-norm blocks
        return transformers.Olmo2Config(**SHAPE, tie_word_embeddings=tie)
    if family == "granite":  # non-default scales: the attention scaling and the logit scale are exercised
        return transformers.GraniteConfig(**SHAPE, tie_word_embeddings=tie, attention_multiplier=0.2,
                                          embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)
    raise AssertionError(family)


def wrapper(family: str, tie: bool = False, seed: int = 0, scale: float = 1.0) -> HFCausalLM:
    """A materialised fp32 wrapper; `scale` multiplies the weight matrices (a tiny model at init std
    mostly repeats one token, which would make greedy parity tests vacuous)."""
    model = build_generic(hf_config(family, tie).to_dict())
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model


def reference(model: HFCausalLM) -> transformers.PreTrainedModel:
    """The plain HF model (eager attention) with the wrapper's weights."""
    # A copy: from_config would switch the wrapper's own (shared) config to eager.
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(model.hf.config), attn_implementation="eager")
    ref.load_state_dict({k.removeprefix("hf."): v for k, v in model.state_dict().items()})
    return ref.float()


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_non_native_families_stay_non_native():
    # The tests below rely on these types having no native family.
    for family in FAMILIES:
        assert hf_config(family).model_type not in MODEL_FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_transformers(family):
    model = wrapper(family, scale=4.0)
    ref = reference(model)
    tokens = random_tokens(2, 9)
    positions = torch.arange(9)[None].expand(2, 9)
    logits = model(tokens, positions)
    ref_logits = ref(input_ids=tokens).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)

    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()
    (ref_logits * weights).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        ref_grad = ref_params[name.removeprefix("hf.")].grad
        # fp32 sums in a different order: tolerance relative to the gradient's scale
        torch.testing.assert_close(param.grad, ref_grad, rtol=1e-4, atol=1e-5 * ref_grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_equal_separate_runs(family):
    model = wrapper(family, scale=4.0).eval()
    lengths = [5, 3, 7]
    docs = [random_tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    tokens = torch.cat(docs)[None]  # (1, 15)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(tokens, positions, DocumentCausalAttention.from_positions(positions))[0]
        separate = torch.cat([model(d[None], torch.arange(len(d))[None])[0] for d in docs])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_transformers_generate(family):
    model = wrapper(family, scale=4.0)
    ref = reference(model).eval()
    prompts = [random_tokens(1, n, seed=10 + n)[0].tolist() for n in (3, 8, 1, 5)]
    max_tokens = [9, 4, 12, 7]
    requests = [Request(i, p, SamplingParams(temperature=0.0, max_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    engine = NativeEngine(model, max_num_seqs=2, max_model_len=64, device="cpu", dtype=torch.float32)
    completions = generate(engine, requests)
    generated = set()
    for prompt, n, completion in zip(prompts, max_tokens, completions):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        assert completion.token_ids == out[0, len(prompt):].tolist()
        generated.update(completion.token_ids)
    assert len(generated) > 3, "degenerate model: the parity check would be vacuous"


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_through_hf_folders(tie, tmp_path):
    model = wrapper("mistral", tie=tie, scale=4.0)
    save_hf_model(model, model.args, tmp_path / "m", eos_token_id=2)
    # transformers reads what we wrote ...
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    tokens = random_tokens(1, 6)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens, positions), rtol=1e-5, atol=1e-5)
    # ... and we read it back, bit for bit, with the tie intact.
    loaded, args = load_hf_model(tmp_path / "m")
    assert isinstance(loaded, HFCausalLM)
    assert args.config == {**model.args.config, "dtype": "float32"}  # the config records the saved dtype
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert (loaded.output_weight is loaded.hf.model.embed_tokens.weight) == tie
    # A sharded folder written by transformers loads too.
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    resharded, _ = load_hf_model(tmp_path / "sharded", dtype=torch.bfloat16)
    for key, value in model.state_dict().items():
        assert torch.equal(resharded.state_dict()[key], value.to(torch.bfloat16)), key
    # RoPE frequencies are derived state: exact and fp32 whatever the weights' dtype.
    inv_freq = dict(resharded.hf.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, dict(hf.named_buffers())["model.rotary_emb.inv_freq"])


def test_layers_view_shares_modules_and_names_stay_unique():
    model = wrapper("olmo2", tie=True)
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == ["0", "1"]
    assert all(model.layers[str(i)] is layer for i, layer in enumerate(model.hf.model.layers))
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) and all(n.startswith("hf.") and ".layers." not in n[:10] for n in names)
    assert not any(n.startswith("layers.") for n in model.state_dict())
    assert "hf.lm_head.weight" not in names  # tied: one parameter, named once
    assert model.output_weight is model.hf.model.embed_tokens.weight
    model.to(torch.bfloat16)
    assert model.output_weight is model.hf.model.embed_tokens.weight
    assert dict(model.hf.named_buffers())["model.rotary_emb.inv_freq"].dtype == torch.float32


def test_init_weights_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = wrapper("granite", seed=5).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    b = wrapper("granite", seed=5).state_dict()
    c = wrapper("granite", seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["hf.model.embed_tokens.weight"], c["hf.model.embed_tokens.weight"])
    assert torch.equal(a["hf.model.norm.weight"], torch.ones(64))
    std = a["hf.model.layers.0.self_attn.q_proj.weight"].std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02


def test_adapter_is_explicit():
    model = wrapper("mistral", tie=True)
    adapter = GenericStateDictAdapter(model.args)
    hf_state = adapter.to_hf(model.state_dict())
    assert "lm_head.weight" not in hf_state and "model.embed_tokens.weight" in hf_state
    back = adapter.from_hf(hf_state)
    assert back.keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match="unknown state-dict key 'layers.0.x'"):
        adapter.to_hf({"layers.0.x": torch.zeros(1)})
    with pytest.raises(ValueError, match="unknown HF state-dict key 'model.layers.9.mlp.up_proj.weight'"):
        adapter.from_hf({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})


def _native_folder(tmp_path):
    args = Qwen3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                     tie_embeddings=False)
    model = Qwen3(args)
    model.init_weights(seed=0)
    save_hf_model(model, args, tmp_path / "qwen3")
    return model, tmp_path / "qwen3"


def test_impl_selection_and_errors(tmp_path):
    native, qwen3_dir = _native_folder(tmp_path)
    mistral = wrapper("mistral")
    save_hf_model(mistral, mistral.args, tmp_path / "mistral")

    assert resolve_impl("qwen3", "auto") == "native" and resolve_impl("qwen3", "hf") == "hf"
    assert resolve_impl("mistral", "auto") == "hf"
    with pytest.raises(ValueError, match="no native implementation of model_type 'mistral'"):
        resolve_impl("mistral", "native")

    # auto / native load our Qwen3; hf loads the wrapper, and both compute the same logits.
    assert isinstance(load_hf_model(qwen3_dir)[0], Qwen3)
    assert isinstance(load_hf_model(qwen3_dir, impl="native")[0], Qwen3)
    wrapped, _ = load_hf_model(qwen3_dir, impl="hf")
    assert isinstance(wrapped, HFCausalLM)
    tokens, positions = random_tokens(2, 7), torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(tokens, positions), native(tokens, positions), rtol=1e-5, atol=1e-5)

    # The same choice through ModelConfig / build_policy / check_model_source.
    cpu = torch.device("cpu")
    assert isinstance(build_policy(ModelConfig(path=str(tmp_path / "mistral")), cpu)[0], HFCausalLM)
    assert isinstance(build_policy(ModelConfig(path=str(qwen3_dir), impl="hf"), cpu)[0], HFCausalLM)
    assert isinstance(build_policy(ModelConfig(path=str(qwen3_dir)), cpu)[0], Qwen3)
    check_model_source(ModelConfig(path=str(tmp_path / "mistral"), impl="hf"))
    with pytest.raises(ValueError, match="no native implementation"):
        check_model_source(ModelConfig(path=str(tmp_path / "mistral"), impl="native"))
    with pytest.raises(ValueError, match="no native implementation"):
        load_hf_model(tmp_path / "mistral", impl="native")
    with pytest.raises(ValueError, match="fresh flavor models are always native"):
        ModelConfig(flavor="debug", tokenizer="char", impl="hf")
    assert ModelConfig(flavor="debug", tokenizer="char").impl == "auto"


@pytest.mark.parametrize("config, match", [
    (transformers.MistralConfig(**SHAPE, sliding_window=16), "sliding_window=16"),
    (transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=0),
     "sliding_attention"),
    (transformers.Gemma2Config(**SHAPE, layer_types=["full_attention"] * 2, sliding_window=None),
     "soft-capping"),
    (transformers.MistralConfig(**SHAPE, sliding_window=None, attention_dropout=0.1), "dropout"),
    (transformers.BartConfig(vocab_size=VOCAB), "encoder-decoder"),
])
def test_unsupported_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        check_generic_config(config.to_dict())
    with pytest.raises(ValueError, match=match):
        build_generic(config.to_dict())


def test_models_without_decoder_layers_are_refused():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="no `model.layers`"):
        build_generic(config.to_dict())


def test_unknown_model_type_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_model"):
        check_generic_config({"model_type": "no_such_model"})


def test_dropout_modules_are_refused():
    config = transformers.Phi3Config(**SHAPE, resid_pdrop=0.1)
    with pytest.raises(ValueError, match="resid_attn_dropout has dropout p=0.1"):
        build_generic(config.to_dict())


def test_calling_the_hf_model_without_a_context_is_a_clear_error():
    model = wrapper("mistral")
    with pytest.raises(ValueError, match="without an AttentionContext"):
        model.hf(input_ids=random_tokens(1, 4))


def test_generic_args_round_trip():
    config = hf_config("granite").to_dict()
    args = GenericArgs.from_hf_config(config)
    assert args == GenericArgs.from_hf_config(dict(reversed(list(config.items()))))
    saved = args.to_hf_config(torch.bfloat16, eos_token_id=7)
    assert saved["dtype"] == "bfloat16" and saved["eos_token_id"] == 7 and saved["bos_token_id"] == 1
    assert saved["model_type"] == "granite" and saved["logits_scaling"] == 4.0
