"""NativeEngine: parity with transformers greedy decoding and with the trainer's logprobs,
stopping rules, seeded sampling, abort, and in-place weight swaps between steps."""

from __future__ import annotations

import pytest
import torch

from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.runtime.engine import (
    Completion,
    InferenceEngine,
    NativeEngine,
    Request,
    SamplingParams,
    generate,
    sample_tokens,
    top_p_filter,
)

VOCAB = 96


def tiny_args() -> Qwen3Args:
    return Qwen3Args(
        vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
        tie_embeddings=False,
    )


def tiny_model(seed: int = 0) -> Qwen3:
    """A random fp32 2-layer Qwen3 with GQA (4 query heads on 2 kv heads).

    Weight matrices are scaled up 8x from init_weights(): at std 0.02 (and tied embeddings) the
    model just echoes its last token, which would make greedy parity tests vacuous.
    """
    with torch.device("meta"):
        model = Qwen3(tiny_args())
    model.to_empty(device="cpu")
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def make_engine(model: Qwen3, max_num_seqs: int = 2, max_model_len: int = 64) -> NativeEngine:
    return NativeEngine(
        model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cpu", dtype=torch.float32
    )


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def requests_for(prompts: list[list[int]], **sampling) -> list[Request]:
    return [Request(i, p, SamplingParams(**sampling)) for i, p in enumerate(prompts)]


@torch.no_grad()
def trainer_logprobs(model: Qwen3, completion: Completion, temperature: float, device: str = "cpu") -> torch.Tensor:
    """log_softmax(logits / temperature) of the completion tokens from one full forward."""
    ids = completion.prompt_ids + completion.token_ids
    tokens = torch.tensor([ids], device=device)
    logits = model(tokens, torch.arange(len(ids), device=device)[None])  # (1, T, V)
    num_prompt = len(completion.prompt_ids)
    logp = torch.log_softmax(logits[0, num_prompt - 1 : -1].float() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion.token_ids, device=device)[:, None]).squeeze(-1)


def test_engine_satisfies_protocol():
    engine = make_engine(tiny_model())
    assert isinstance(engine, InferenceEngine)


def test_greedy_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from meshrl.models.hf import save_hf_model

    model = tiny_model()
    save_hf_model(model, tiny_args(), tmp_path / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()

    prompts = random_prompts([3, 11, 5, 1, 8])
    max_tokens = [9, 4, 12, 7, 6]
    requests = [
        Request(i, p, SamplingParams(temperature=0.0, max_tokens=n))
        for i, (p, n) in enumerate(zip(prompts, max_tokens))
    ]
    # Fewer slots than requests: later requests are admitted as earlier ones finish.
    completions = generate(make_engine(model, max_num_seqs=2), requests)

    for prompt, n, completion in zip(prompts, max_tokens, completions):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert completion.token_ids == out[0, len(prompt) :].tolist()
        assert completion.finish_reason == "length"
        assert completion.versions == [0] * n


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_full_forward(temperature):
    torch.manual_seed(0)
    model = tiny_model()
    prompts = random_prompts([4, 9, 2, 13, 6, 7], seed=1)
    requests = [
        # top_p filters what is sampled, never the reported logprobs.
        Request(i, p, SamplingParams(temperature=temperature, top_p=0.9 if i % 2 else 1.0, max_tokens=10 + i))
        for i, p in enumerate(prompts)
    ]
    completions = generate(make_engine(model, max_num_seqs=4), requests)

    for completion in completions:
        engine_lp = torch.tensor(completion.logprobs)
        ref_lp = trainer_logprobs(model, completion, temperature)
        assert (engine_lp - ref_lp).abs().max().item() <= 1e-5
        log_ratio = ref_lp - engine_lp  # tokens were drawn from the engine's distribution
        k3 = (log_ratio.exp() - 1 - log_ratio).mean().item()
        assert k3 <= 1e-6


def test_greedy_logprobs_are_temperature_one():
    model = tiny_model()
    (completion,) = generate(make_engine(model), requests_for(random_prompts([5]), temperature=0.0, max_tokens=8))
    ref_lp = trainer_logprobs(model, completion, 1.0)
    assert torch.allclose(torch.tensor(completion.logprobs), ref_lp, atol=1e-5)


def test_stop_token_ends_completion_and_is_included():
    model = tiny_model()
    prompt = random_prompts([6])
    # Seeded sampling: both runs draw the same tokens up to the stop (greedy on a random tiny model
    # tends to repeat one token).
    sampling = dict(temperature=1.0, max_tokens=20, seed=11)
    (ref,) = generate(make_engine(model), requests_for(prompt, **sampling))
    # First token that does not occur before its position: the run must stop right there.
    stop_at = next(i for i in range(1, len(ref.token_ids)) if ref.token_ids[i] not in ref.token_ids[:i])
    stop_id = ref.token_ids[stop_at]
    other_id = next(t for t in range(VOCAB) if t not in ref.token_ids)

    (out,) = generate(make_engine(model), requests_for(prompt, **sampling, stop_token_ids=(other_id, stop_id)))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: stop_at + 1]
    assert out.logprobs == pytest.approx(ref.logprobs[: stop_at + 1], abs=1e-6)


def test_max_tokens_and_full_slot_end_with_length():
    model = tiny_model()
    engine = make_engine(model, max_model_len=16)
    short, long, longest = random_prompts([3, 10, 15])
    out = generate(
        engine,
        [
            Request(0, short, SamplingParams(max_tokens=5)),
            Request(1, long, SamplingParams(max_tokens=64)),  # slot holds 16 tokens: 6 fit
            Request(2, longest, SamplingParams(max_tokens=64)),  # one token, never cached
        ],
    )
    assert [len(c.token_ids) for c in out] == [5, 6, 1]
    assert [c.finish_reason for c in out] == ["length"] * 3
    assert all(len(c.logprobs) == len(c.versions) == len(c.token_ids) for c in out)

    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(Request(3, random_prompts([16])[0]))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add(Request(4, []))
    with pytest.raises(ValueError, match="token ids"):
        engine.add(Request(5, [1, VOCAB]))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(stop_token_ids=(-1,))]
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_duplicate_live_request_id_rejected():
    engine = make_engine(tiny_model())
    engine.add(Request(7, [1, 2, 3]))
    with pytest.raises(ValueError, match="already live"):
        engine.add(Request(7, [4, 5]))


def test_seed_gives_same_tokens_whatever_the_batch():
    model = tiny_model()
    prompt = random_prompts([5], seed=3)[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=123)
    (alone,) = generate(make_engine(model), [Request(0, prompt, seeded)])

    torch.manual_seed(1)
    others = random_prompts([2, 9, 4], seed=4)
    batch = [Request(10 + i, p, SamplingParams(temperature=1.0, max_tokens=5 + 4 * i)) for i, p in enumerate(others)]
    batch.insert(1, Request(0, prompt, seeded))
    batch.append(Request(20, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=7)))
    together = generate(make_engine(model, max_num_seqs=3), batch)

    assert together[1].token_ids == alone.token_ids
    assert together[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert together[-1].token_ids != alone.token_ids  # another seed, another sample


def test_abort_frees_slot_and_returns_partial_completion():
    model = tiny_model()
    prompts = random_prompts([4, 7, 5], seed=5)
    engine = make_engine(model, max_num_seqs=1)
    for r in requests_for(prompts, temperature=0.0, max_tokens=30):
        engine.add(r)

    engine.step()
    engine.step()
    aborted = engine.abort(0)
    assert aborted is not None and aborted.finish_reason == "abort"
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.versions) > 0
    assert engine.abort(0) is None  # no longer live
    waiting = engine.abort(2)  # never admitted
    assert waiting is not None and waiting.finish_reason == "abort" and waiting.token_ids == []

    done = []
    while engine.has_work():
        done += engine.step()
    assert [c.request_id for c in done] == [1]
    (alone,) = generate(make_engine(model), [Request(1, prompts[1], SamplingParams(temperature=0.0, max_tokens=30))])
    assert done[0].token_ids == alone.token_ids  # the freed slot's stale cache did not leak in


def test_weight_swap_between_steps_keeps_requests_and_records_versions():
    prompts = random_prompts([5, 8], seed=6)
    sampling = dict(temperature=0.0, max_tokens=12)
    ref = generate(make_engine(tiny_model()), requests_for(prompts, **sampling))

    model = tiny_model()
    engine = make_engine(model)
    assert engine.model is model  # weight sync writes into this module's parameters
    for r in requests_for(prompts, **sampling):
        engine.add(r)
    done = engine.step() + engine.step() + engine.step()  # 4 tokens each (prefill + 3 decodes)
    assert done == []

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    engine.set_version(1)
    while engine.has_work():
        done += engine.step()
    done.sort(key=lambda c: c.request_id)

    for new, old in zip(done, ref):
        assert new.finish_reason == "length" and len(new.token_ids) == 12
        assert new.versions == [0] * 4 + [1] * 8
        assert new.token_ids[:4] == old.token_ids[:4]
    assert any(new.token_ids[4:] != old.token_ids[4:] for new, old in zip(done, ref))


def test_top_p_filter_keeps_nucleus():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3], [0.2, 0.5, 0.3]])
    out = top_p_filter(probs, torch.tensor([0.6, 0.5, 1.0]))
    expected = torch.tensor([[0.0, 0.5, 0.3], [0.0, 0.5, 0.0], [0.2, 0.5, 0.3]])
    assert torch.equal(out, expected)


def test_sample_tokens_greedy_and_tiny_top_p_pick_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_p=0.01)]
    tokens, logprobs = sample_tokens(logits, params, [None, torch.Generator().manual_seed(0)])
    assert tokens.tolist() == [1, 0]
    expected = torch.stack([torch.log_softmax(logits[0], -1)[1], torch.log_softmax(logits[1] / 2.0, -1)[0]])
    assert torch.allclose(logprobs, expected)
    assert logprobs.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_logprobs_match_full_forward(dtype):
    """On CUDA the engine's logprobs match a full forward of the same model in the same dtype."""
    model = tiny_model()
    engine = NativeEngine(model, max_num_seqs=3, max_model_len=64, device="cuda", dtype=dtype)
    prompts = random_prompts([4, 9, 2, 13, 6], seed=1)
    requests = [Request(i, p, SamplingParams(temperature=0.7, max_tokens=12, seed=i)) for i, p in enumerate(prompts)]
    completions = generate(engine, requests)

    max_diff, k3_max = (1e-5, 1e-6) if dtype == torch.float32 else (0.1, 1e-3)
    for completion in completions:
        engine_lp = torch.tensor(completion.logprobs)
        ref_lp = trainer_logprobs(model, completion, 0.7, device="cuda").cpu()
        assert (engine_lp - ref_lp).abs().max().item() <= max_diff
        log_ratio = ref_lp - engine_lp
        assert (log_ratio.exp() - 1 - log_ratio).mean().item() <= k3_max
