"""Llama 3 parity with transformers (RoPE scaling, logits, gradients, greedy decoding), packed
documents, HF folder round trips, and config conversion."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from meshrl.models import get_family
from meshrl.models.common.attention import CausalAttention, DocumentCausalAttention
from meshrl.models.common.rope import Llama3RopeScaling, rope_inv_freq
from meshrl.models.hf import load_hf_model, read_hf_config, save_hf_model
from meshrl.models.llama3 import FLAVORS, Llama3, Llama3Args, Llama3StateDictAdapter
from meshrl.runtime.engine.api import Request, SamplingParams, generate
from meshrl.runtime.engine.native import NativeEngine

VOCAB = 96
# A 32-token "pretraining" context: with theta 1e4 and head_dim 16 the wavelengths are 6.3 (kept),
# 20 (interpolated) and 63+ (divided by 8), and the tests run to position 47.
TINY_SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=32)
SEQ = 48


def tiny_args(tie: bool, scaled: bool) -> Llama3Args:
    return Llama3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                      rope_theta=10_000.0, rope_scaling=TINY_SCALING if scaled else None, max_seq_len=256,
                      tie_embeddings=tie)


def build(args: Llama3Args, seed: int = 0) -> Llama3:
    with torch.device("meta"):
        model = Llama3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    # Non-trivial norm weights, so a swapped pre/post norm would show.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def hf_twin(model: Llama3, args: Llama3Args, tmp_path) -> LlamaForCausalLM:
    save_hf_model(model, args, tmp_path / "hf")
    return LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")


def arange_positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).expand(batch, seq)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [tiny_args(True, True), tiny_args(True, False), *FLAVORS.values()],
                         ids=["tiny-scaled", "tiny", *FLAVORS])
def test_inv_freq_is_bit_identical_to_transformers(args):
    config = LlamaConfig(**args.to_hf_config())
    theirs = LlamaRotaryEmbedding(config).inv_freq
    assert config.rope_parameters["rope_type"] == ("default" if args.rope_scaling is None else "llama3")
    assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), theirs)
    if args.rope_scaling is not None:
        llama3_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        assert attention_factor == 1.0
        assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), llama3_inv_freq)
        # The scaling is not a no-op: some frequencies are kept, some slowed down.
        plain = rope_inv_freq(args.head_dim, args.rope_theta)
        assert plain[0] == theirs[0] and (theirs < plain).any()


def test_llama3_scaling_rejects_degenerate_settings():
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        Llama3RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0, original_max_seq_len=8192)
    with pytest.raises(ValueError, match="factor"):
        Llama3RopeScaling(factor=0.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)


# --------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [False, True], ids=["default-rope", "llama3-rope"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers(tie, scaled, tmp_path):
    args = tiny_args(tie, scaled)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, arange_positions(3, SEQ))
        theirs = hf(tokens).logits
    assert ours.shape == (3, SEQ, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # hidden() + output_weight is the same computation the trainer will chunk.
    with torch.no_grad():
        h = model.hidden(tokens, arange_positions(3, SEQ))
    assert torch.equal(h @ model.output_weight.T, ours)


def test_rope_scaling_changes_the_logits():
    """Guards the parity test above against a scaling that silently does nothing."""
    scaled = build(tiny_args(tie=False, scaled=True))
    plain = Llama3(tiny_args(tie=False, scaled=False))
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (scaled(tokens, arange_positions(1, SEQ)) - plain(tokens, arange_positions(1, SEQ))).abs().max()
    assert diff.item() > 1e-3


@pytest.mark.parametrize("scaled", [False, True], ids=["default-rope", "llama3-rope"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gradients_match_transformers(tie, scaled, tmp_path):
    args = tiny_args(tie, scaled)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    loss_fn(model(tokens, arange_positions(2, SEQ))).backward()
    loss_fn(hf(tokens).logits).backward()

    ours = Llama3StateDictAdapter(args).to_hf({k: p.grad for k, p in model.named_parameters()})
    theirs = {k: p.grad for k, p in hf.named_parameters()}  # a tied lm_head is listed once
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def test_packed_documents_match_separate_runs():
    args = tiny_args(tie=False, scaled=True)
    model = build(args)
    gen = torch.Generator().manual_seed(2)
    # Document A runs past the original 32-token context, where the scaling matters.
    doc_a, doc_b, doc_c = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (40, 5, 9))
    pad = torch.zeros(36, dtype=torch.long)
    # Row 0: [A | B]; row 1: [C | 36 pad tokens], each pad its own one-token document.
    tokens = torch.stack([torch.cat([doc_a, doc_b]), torch.cat([doc_c, pad])])
    positions = torch.stack([torch.cat([torch.arange(40), torch.arange(5)]),
                             torch.cat([torch.arange(9), torch.zeros(36, dtype=torch.long)])])
    doc_ids = torch.stack([torch.tensor([0] * 40 + [1] * 5), torch.cat([torch.zeros(9), torch.arange(1, 37)]).long()])

    with torch.no_grad():
        packed = model(tokens, positions, DocumentCausalAttention(doc_ids))
        alone = [model(doc[None], torch.arange(len(doc))[None], CausalAttention())[0] for doc in (doc_a, doc_b, doc_c)]
    assert not packed.isnan().any()
    assert (packed[0, :40] - alone[0]).abs().max().item() <= 1e-5
    assert (packed[0, 40:] - alone[1]).abs().max().item() <= 1e-5
    assert (packed[1, :9] - alone[2]).abs().max().item() <= 1e-5


def test_engine_greedy_matches_transformers(tmp_path):
    """NativeEngine on the debug flavor decodes exactly what transformers' greedy generate does,
    including a prompt that runs past the flavor's 256-token original RoPE context."""
    args = FLAVORS["debug"]
    model = build(args)
    # Scaled-up weights: at std 0.02 with tied embeddings the model only echoes its last token,
    # which would make token-for-token parity vacuous.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    save_hf_model(model, args, tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    assert isinstance(hf, LlamaForCausalLM)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 270, 1)]
    max_tokens = [9, 12, 10, 7]
    requests = [Request(i, p, SamplingParams(temperature=0.0, max_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    engine = NativeEngine(model, max_num_seqs=2, max_model_len=320, device="cpu", dtype=torch.float32)
    completions = generate(engine, requests)

    generated = set()
    for prompt, n, completion in zip(prompts, max_tokens, completions):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        assert completion.token_ids == out[0, len(prompt):].tolist()
        generated.update(completion.token_ids)
    assert len(generated) > 4  # not a degenerate echo


# --------------------------------------------------------------------------------------------
# HF folders and configs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_save_load_round_trip(tie, tmp_path):
    args = tiny_args(tie, scaled=True)
    model = build(args)
    save_hf_model(model, args, tmp_path / "m", eos_token_id=2)
    loaded, loaded_args = load_hf_model(tmp_path / "m")
    assert loaded_args == args and isinstance(loaded, Llama3)
    assert_same_state(model, loaded)
    assert read_hf_config(tmp_path / "m")["eos_token_id"] == 2

    # A folder written by transformers itself (its own config spelling, sharded) loads too.
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert hf.config.tie_word_embeddings == tie
    hf.save_pretrained(tmp_path / "by_hf", max_shard_size="100KB")
    reloaded, reloaded_args = load_hf_model(tmp_path / "by_hf")
    assert reloaded_args == args
    assert_same_state(model, reloaded)


def test_registry_and_init():
    family = get_family("llama")
    assert family.args_cls is Llama3Args and family.model_cls is Llama3 and family.flavors is FLAVORS
    args = FLAVORS["debug"]
    a, b = build(args, seed=3), build(args, seed=3)
    assert_same_state(a, b)
    assert a.output is None and a.output_weight is a.tok_embeddings.weight
    fresh = Llama3(args)
    fresh.init_weights(seed=0)
    assert torch.equal(fresh.norm.weight, torch.ones(args.dim))
    assert fresh.layers["0"].attention.wo.weight.std().item() < 0.02 / 1.5  # depth-scaled
    assert not any("q_norm" in k or "k_norm" in k for k in fresh.state_dict())
    # policy.py swaps the vocabulary with dataclasses.replace: head_dim must survive it.
    assert dataclasses.replace(args, vocab_size=100).head_dim == args.head_dim


def test_flavors_round_trip_through_hf_config():
    for name, args in FLAVORS.items():
        config = args.to_hf_config(dtype=torch.bfloat16, eos_token_id=2)
        assert Llama3Args.from_hf_config(config) == args, name
        # transformers 5.x spelling (rope_parameters only), as LlamaConfig writes it.
        assert Llama3Args.from_hf_config(LlamaConfig(**config).to_dict()) == args, name
    assert FLAVORS["1B"].tie_embeddings and FLAVORS["3B"].tie_embeddings and not FLAVORS["8B"].tie_embeddings
    assert FLAVORS["8B"].rope_scaling.factor == 8.0 and FLAVORS["70B"].rope_theta == 500_000.0
    assert FLAVORS["1B"].head_dim == 64 and FLAVORS["3B"].head_dim == 128


def test_reads_transformers_4_config_spelling():
    """A Llama 3.1 config.json as the Hub serves it (transformers 4.x): rope_theta on top,
    rope_scaling without a theta, no head_dim."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "torch_dtype": "bfloat16",
    }
    assert Llama3Args.from_hf_config(config) == FLAVORS["8B"]
    plain = {**config, "rope_scaling": None}
    assert Llama3Args.from_hf_config(plain) == dataclasses.replace(FLAVORS["8B"], rope_scaling=None)


def test_from_hf_config_rejects_unsupported_features():
    config = FLAVORS["debug"].to_hf_config()
    llama3_rope = config["rope_scaling"]
    bad = [
        ({"model_type": "qwen3"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"rope_scaling": {**llama3_rope, "partial_rotary_factor": 0.5}}, "partial"),
        ({"rope_scaling": {k: v for k, v in llama3_rope.items() if k != "low_freq_factor"}}, "low_freq_factor"),
    ]
    for update, match in bad:
        with pytest.raises(ValueError, match=match):
            Llama3Args.from_hf_config({**config, **update})


def test_adapter_rejects_unknown_keys():
    args = tiny_args(tie=True, scaled=False)
    adapter = Llama3StateDictAdapter(args)
    with pytest.raises(ValueError, match="q_norm"):  # a Qwen3 key is not a Llama key
        adapter.from_hf({"model.layers.0.self_attn.q_norm.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.5.mlp.up_proj.weight"):  # beyond n_layers
        adapter.from_hf({"model.layers.5.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="layers.0.bogus"):
        adapter.to_hf({"layers.0.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="ties its embeddings"):
        adapter.to_hf({"output.weight": torch.zeros(1)})
    assert adapter.from_hf({"lm_head.weight": torch.zeros(1)}) == {}  # a stored copy of the tied head
