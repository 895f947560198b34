"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (models/qwen3_next.py) against transformers in fp32:
logits and gradients, packed documents (the recurrences restart per document), rows longer than
one delta-rule chunk, the chunked delta rule against the token-by-token recurrence, hub folders
both ways (Qwen3.5's vision-language layout included), the engine, and the configs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.common.linear_attention import (causal_conv, chunk_gated_delta_rule, l2norm,
                                                   recurrent_gated_delta_rule)
from meshrl.models.hf import load_hf_model
from meshrl.models.qwen3_next import (NEXT_FLAVORS, QWEN3_5_FLAVORS, QWEN3_5_MOE_FLAVORS, Qwen3_5Args,
                                      Qwen3_5MoeArgs, Qwen3Next, Qwen3NextArgs, Qwen3NextStateDictAdapter)
from tests.family_checks import (build_random, check_engine, check_hub_folders, check_logits_and_grads,
                                 check_packed_documents, hf_twin, positions)

VOCAB = 96
CASES = {
    "next": NEXT_FLAVORS["debug"],
    # Qwen3-Next with one value head per key head, a sparse step of 2, half rotary, tied head.
    "next-plain": replace(NEXT_FLAVORS["debug"], linear_v_heads=2, decoder_sparse_step=2,
                          mlp_only_layers=(), tie_embeddings=True, partial_rotary_factor=0.5),
    "3.5": QWEN3_5_FLAVORS["debug"],
    "3.5-moe": replace(QWEN3_5_MOE_FLAVORS["debug"], layer_types=("linear_attention", "full_attention") * 2),
}


def tiny(name: str):
    return replace(CASES[name], vocab_size=VOCAB)


def build(args, seed: int = 0, scale: float = 1.0) -> Qwen3Next:
    """`build_random`, plus random decay parameters (the init's constants would hide a mix-up)."""
    model = build_random(Qwen3Next, args, seed=seed, scale=scale)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0, generator=gen)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_gradients_match_transformers(name, tmp_path):
    args = tiny(name)
    model = build(args)
    hf = hf_twin(model, args, tmp_path / "ours")
    kinds = [layer.layer_type if hasattr(layer, "layer_type") else layer.block_type for layer in hf.model.layers]
    assert kinds == list(args.layer_types)
    check_logits_and_grads(model, hf, Qwen3NextStateDictAdapter, args)
    check_packed_documents(model, VOCAB)


def test_rows_longer_than_a_chunk_and_packed_documents(tmp_path):
    """150 tokens (three delta-rule chunks) match transformers; a packed row of three documents that
    cross chunk borders equals each document run alone by transformers."""
    args = tiny("next")
    model = build(args)
    hf = hf_twin(model, args, tmp_path / "ours")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 150), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions(2, 150)), hf(tokens).logits, rtol=1e-5, atol=2e-5)
        lengths = [70, 5, 75]
        docs = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
        doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], 1)
        packed = model(torch.cat(docs, 1), torch.cat([positions(1, n) for n in lengths], 1),
                       DocumentCausalAttention(doc_ids))
        alone = torch.cat([hf(d).logits for d in docs], 1)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=2e-5)


def test_chunked_delta_rule_equals_the_recurrence():
    """The chunked form equals the token-by-token recurrence (document starts anywhere, an initial
    state, Hv value heads), and so does its final state; the conv restarts at document starts."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, Dk, Dv = 2, 150, 3, 8, 5
    q, k = (l2norm(torch.randn(B, T, H, Dk, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=gen)
    g, beta = -torch.rand(B, T, H, generator=gen) * 2, torch.rand(B, T, H, generator=gen)
    starts = torch.rand(B, T, generator=gen) < 0.05
    starts[0, 63] = starts[1, 64] = True  # on and right after a chunk border
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    for s0, first in [(None, True), (state, False)]:
        st = starts.clone()
        st[:, 0] = first
        o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, st, s0)
        for chunk in (16, 64):
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, st, s0, chunk=chunk)
            torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    # Conv: a row of two documents equals the two alone; a state continues a row exactly.
    x, w = torch.randn(1, 12, 6, generator=gen), torch.randn(6, 1, 4, generator=gen)
    st = torch.zeros(1, 12, dtype=torch.bool)
    st[0, [0, 7]] = True
    y, _ = causal_conv(x, w, st)
    one = torch.zeros(1, 7, dtype=torch.bool)
    one[0, 0] = True
    torch.testing.assert_close(y[:, :7], causal_conv(x[:, :7], w, one)[0])
    torch.testing.assert_close(y[:, 7:], causal_conv(x[:, 7:], w, one[:, :5])[0])
    head, conv_state = causal_conv(x[:, :9], w, one.new_zeros(1, 9) | (torch.arange(9) == 0))
    tail, _ = causal_conv(x[:, 9:], w, torch.zeros(1, 3, dtype=torch.bool), conv_state)
    whole, _ = causal_conv(x, w, torch.arange(12)[None] == 0)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole)


@pytest.mark.parametrize("name", ["next", "3.5-moe"])
def test_hub_folders_load_and_round_trip(name, tmp_path):
    args = tiny(name)
    model = build(args)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_hub_folders(model, args, hf, tmp_path)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_vision_language_folders_load_the_text_decoder(model_type, tmp_path):
    """A hub Qwen3.5 folder is the vision-language model: text_config, model.language_model.*,
    model.visual.*; the decoder loads (vision tower dropped) with the VLM's text-only logits."""
    args = tiny("3.5" if model_type == "qwen3_5" else "3.5-moe")
    text = args.to_hf_config()
    config = transformers.AutoConfig.for_model(
        model_type, text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type")},
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=args.dim),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    vlm = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in vlm.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    vlm.save_pretrained(tmp_path / "vlm")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "vlm" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    loaded, loaded_args = load_hf_model(tmp_path / "vlm")
    assert loaded_args == args and get_family(model_type).args_cls is type(args)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, positions(2, 11)), vlm(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["next", "3.5"])
def test_engine_matches_transformers_and_trainer(name, tmp_path):
    args = tiny(name)
    model = build(args, scale=4.0)
    hf = hf_twin(model, args, tmp_path / "ours")
    check_engine(model, hf, VOCAB)


def test_engine_states_survive_chunked_prefill_preemption_and_pad_rows(tmp_path):
    """Prompts prefilled in chunks, sequences preempted and recomputed (a tiny KV cache), decode
    launches with pad rows (emulated CUDA graphs round the batch up): the greedy tokens equal
    transformers' and every sampled logprob equals the trainer's full forward."""
    from meshrl.runtime.engine.api import Request, SamplingParams, generate
    from tests.family_checks import make_engine, trainer_logprobs
    from tests.unit.test_engine import emulate_cuda_graphs

    args = tiny("next")
    model = build(args, scale=4.0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 6, 9)]
    engine = emulate_cuda_graphs(make_engine(model, num_blocks=17, max_num_batched_tokens=5))
    assert engine.states is not None and not engine.prefix_sharing
    done = generate(engine, [Request(i, p, SamplingParams(temperature=1.0, max_tokens=16, seed=i))
                             for i, p in enumerate(prompts)])
    assert engine.num_preemptions > 0
    for c in done:
        ref = trainer_logprobs(model, c.prompt_ids, c.token_ids)
        assert (torch.tensor(c.logprobs) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["3.5", "next"])
def test_a_sleeping_engine_frees_the_recurrent_states_and_serves_the_same_after_waking(name):
    """sleep() releases the KV cache and every linear layer's conv and delta-rule slots (storage
    of 0 bytes while asleep); wake() re-creates them and generation after it equals an engine that
    never slept (sampled, seeded, with emulated CUDA graphs, which sleep drops)."""
    from meshrl.runtime.engine.api import Request, SamplingParams, generate
    from tests.family_checks import make_engine
    from tests.unit.test_engine import emulate_cuda_graphs

    model = build(tiny(name), scale=4.0)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 4, 6)]

    def batch(base: int) -> list:
        return [Request(base + i, p, SamplingParams(temperature=1.0, max_tokens=10, seed=base + i))
                for i, p in enumerate(prompts)]

    def run(engine, sleep: bool) -> list:
        out = [(c.token_ids, c.logprobs) for c in generate(engine, batch(0))]
        if sleep:
            held = engine.states.nbytes()
            assert held > 0 and not engine.states.released
            freed = engine.sleep()
            assert engine.asleep and engine.states.released and engine.states.nbytes() == 0
            assert all(t.numel() == 0 for t in (*engine.states.conv.values(), *engine.states.state.values()))
            assert freed >= held + 1 and not engine.runner.graphs
            engine.wake()
            assert not engine.asleep and engine.states.nbytes() == held
        return out + [(c.token_ids, c.logprobs) for c in generate(engine, batch(10))]

    slept = emulate_cuda_graphs(make_engine(model))
    awake = emulate_cuda_graphs(make_engine(model))
    assert slept.states is not None
    assert run(slept, sleep=True) == run(awake, sleep=False)


def test_context_parallel_is_refused(tmp_path):
    """Before launch (`check_model_source`, one line naming trainer.parallel.cp), and by the layer
    itself under a context-parallel attention context; so is a context without documents."""
    from meshrl.parallel.context_parallel import ContextParallelAttention
    from meshrl.runtime.config import ModelConfig
    from meshrl.runtime.policy import check_model_source

    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        check_model_source(ModelConfig(flavor="debug", family=family, tokenizer="char"), cp=1)
        with pytest.raises(ValueError, match=r"trainer.parallel.cp = 2: model_type .*linear-attention"):
            check_model_source(ModelConfig(flavor="debug", family=family, tokenizer="char"), cp=2)
    model = build(tiny("3.5"))
    cp = ContextParallelAttention(torch.zeros(1, 8, dtype=torch.long), torch.arange(4))
    with pytest.raises(ValueError, match="context parallelism"):
        model(torch.zeros(1, 4, dtype=torch.long), positions(1, 4), cp)

    class NoDocuments:  # a context that does not say where its rows' documents start
        def attend(self, *args, **kwargs):
            raise AssertionError("not reached: the first layer is a linear one")

    with pytest.raises(ValueError, match="NoDocuments has no doc_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), positions(1, 4), NoDocuments())


def test_flavors_and_config_round_trip():
    for flavors, cls in [(NEXT_FLAVORS, Qwen3NextArgs), (QWEN3_5_FLAVORS, Qwen3_5Args),
                         (QWEN3_5_MOE_FLAVORS, Qwen3_5MoeArgs)]:
        for name, args in flavors.items():
            assert type(args) is cls and cls.from_hf_config(args.to_hf_config()) == args, name
            transformers.AutoConfig.for_model(**args.to_hf_config())  # transformers accepts every field
    assert "ep" in get_family("qwen3_next").parallel_plan and "ep" not in get_family("qwen3_5").parallel_plan
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in Qwen3Next(flavors[name]).parameters())
                  for flavors, name in [(NEXT_FLAVORS, "80B-A3B"), (QWEN3_5_FLAVORS, "27B"),
                                        (QWEN3_5_MOE_FLAVORS, "35B-A3B")]}
    assert 79e9 < counts["80B-A3B"] < 82e9, counts
    assert 26e9 < counts["27B"] < 28e9, counts
    assert 34e9 < counts["35B-A3B"] < 36e9, counts
    base = NEXT_FLAVORS["debug"].to_hf_config()
    for bad, match in [({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
                       ({"rope_parameters": {"rope_type": "yarn"}}, "RoPE"), ({"model_type": "qwen3"}, "model_type"),
                       ({"layer_types": ["linear_attention"]}, "layer_types"),
                       ({"linear_num_value_heads": 3}, "linear_num_value_heads")]:
        with pytest.raises(ValueError, match=match):
            Qwen3NextArgs.from_hf_config({**base, **bad})
    # HF's default layer pattern when a config has none: every 4th layer full.
    no_types = {k: v for k, v in base.items() if k != "layer_types"}
    assert Qwen3NextArgs.from_hf_config(no_types).layer_types == NEXT_FLAVORS["debug"].layer_types
