"""NativeEngine: parity with transformers greedy decoding and with the trainer's logprobs (paged or
not, shared prefixes or not), stopping rules, n samples, seeds, abort, in-flight weight swaps,
multi-turn continuation, preemption and scheduler invariants under random traffic."""

from __future__ import annotations

import random

import pytest
import torch

from meshrl.models.qwen3 import Qwen3, Qwen3Args
from meshrl.runtime.engine.api import Completion, InferenceEngine, Request, SamplingParams, continuation_ids, generate
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.engine.sampling import StaticSamplingBatch
from tests.random_models import scaled_random_model

VOCAB = 96


def tiny_args() -> Qwen3Args:
    return Qwen3Args(
        vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
        tie_embeddings=False,
    )


def tiny_model(seed: int = 0) -> Qwen3:
    """A random fp32 2-layer Qwen3 with GQA (4 query heads on 2 kv heads), matrices scaled 8x."""
    return scaled_random_model(Qwen3, tiny_args(), seed)


def make_engine(model: Qwen3, max_num_seqs: int = 2, max_model_len: int = 64, **kwargs) -> NativeEngine:
    kwargs.setdefault("block_size", 4)
    return NativeEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cpu",
                        dtype=torch.float32, **kwargs)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def requests_for(prompts: list[list[int]], **sampling) -> list[Request]:
    return [Request(i, p, SamplingParams(**sampling)) for i, p in enumerate(prompts)]


def drain(engine: NativeEngine) -> list[Completion]:
    done = []
    while engine.has_work():
        done += engine.step()
        engine.check()
    return done


def assert_no_leak(engine: NativeEngine) -> None:
    engine.blocks.check()
    assert all(r == 0 for r in engine.blocks.ref), "a block is still referenced"
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    assert sorted(engine.scheduler.free_rows) == list(range(engine.max_num_seqs)) and not engine.scheduler.running


@torch.no_grad()
def trainer_logprobs(model: Qwen3, completion: Completion, temperature: float, device: str = "cpu") -> torch.Tensor:
    """log_softmax(logits / temperature) of the completion tokens from one full forward."""
    ids = completion.prompt_ids + completion.token_ids
    tokens = torch.tensor([ids], device=device)
    logits = model(tokens, torch.arange(len(ids), device=device)[None])  # (1, T, V)
    num_prompt = len(completion.prompt_ids)
    logp = torch.log_softmax(logits[0, num_prompt - 1 : -1].float() / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion.token_ids, device=device)[:, None]).squeeze(-1)


@torch.no_grad()
def greedy_reference(model: Qwen3, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_satisfies_protocol():
    assert isinstance(make_engine(tiny_model()), InferenceEngine)


# Mixed lengths, a prompt that extends another (shared full blocks) and an exact duplicate (fork).
_BASE = random_prompts([13, 3, 5, 1, 9], seed=0)
PARITY_PROMPTS = _BASE + [_BASE[0] + [7, 8, 9], list(_BASE[0])]
PARITY_MAX_TOKENS = [9, 4, 12, 7, 6, 8, 10]


@pytest.fixture(scope="module")
def hf_greedy(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from meshrl.models.hf import save_hf_model

    path = tmp_path_factory.mktemp("hf") / "model"
    save_hf_model(tiny_model(), tiny_args(), path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt, n in zip(PARITY_PROMPTS, PARITY_MAX_TOKENS):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("block_size,prefix_sharing", [(4, True), (4, False), (64, True)],
                         ids=["paged-shared", "paged-unshared", "one-block-per-seq"])
def test_greedy_matches_transformers(hf_greedy, block_size, prefix_sharing):
    requests = [Request(i, p, SamplingParams(temperature=0.0, max_tokens=n))
                for i, (p, n) in enumerate(zip(PARITY_PROMPTS, PARITY_MAX_TOKENS))]
    # Fewer rows than requests: later requests are admitted as earlier ones finish.
    engine = make_engine(tiny_model(), max_num_seqs=3, block_size=block_size, prefix_sharing=prefix_sharing)
    completions = generate(engine, requests)

    assert [c.token_ids for c in completions] == hf_greedy
    assert all(c.finish_reason == "length" and c.versions == [0] * n for c, n in zip(completions, PARITY_MAX_TOKENS))
    assert len({tuple(t) for t in hf_greedy}) > 3  # not a degenerate echo
    num_prompt_tokens = sum(len(p) for p in PARITY_PROMPTS)
    if prefix_sharing and block_size == 4:
        assert engine.num_prefill_tokens < num_prompt_tokens  # shared blocks were not recomputed
    else:
        assert engine.num_prefill_tokens >= num_prompt_tokens - len(PARITY_PROMPTS[-1])
    assert_no_leak(engine)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_full_forward(temperature):
    model = tiny_model()
    prompts = random_prompts([4, 9, 2, 13, 6, 7], seed=1)
    truncations = [{}, dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(top_k=20, top_p=0.8), {}]
    requests = [
        # Truncation filters what is sampled, never the reported logprobs.
        Request(i, p, SamplingParams(temperature=temperature, max_tokens=10 + i, **truncations[i]))
        for i, p in enumerate(prompts)
    ]
    completions = generate(make_engine(model, max_num_seqs=4), requests)

    for completion in completions:
        engine_lp = torch.tensor(completion.logprobs)
        ref_lp = trainer_logprobs(model, completion, temperature)
        assert (engine_lp - ref_lp).abs().max().item() <= 1e-5
        log_ratio = ref_lp - engine_lp  # tokens were drawn from the engine's distribution
        assert (log_ratio.exp() - 1 - log_ratio).mean().item() <= 1e-6


def test_greedy_logprobs_are_temperature_one():
    model = tiny_model()
    (completion,) = generate(make_engine(model), requests_for(random_prompts([5]), temperature=0.0, max_tokens=8))
    assert completion.token_ids == greedy_reference(model, completion.prompt_ids, 8)
    ref_lp = trainer_logprobs(model, completion, 1.0)
    assert torch.allclose(torch.tensor(completion.logprobs), ref_lp, atol=1e-5)


def test_stop_token_ends_completion_and_is_included():
    model = tiny_model()
    prompt = random_prompts([6])
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


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string_ends_after_the_token_that_completes_it():
    model = tiny_model()
    prompt = random_prompts([6], seed=2)
    sampling = dict(temperature=1.0, max_tokens=24, seed=5)
    (ref,) = generate(make_engine(model, detokenize=letters), requests_for(prompt, **sampling))
    text = letters(ref.token_ids)
    # A two-letter string first seen ending at token k (and nowhere earlier).
    k = next(i for i in range(2, len(text)) if text[i - 1:i + 1] not in text[:i])
    stop = text[k - 1:k + 1]

    engine = make_engine(model, detokenize=letters)
    (out,) = generate(engine, requests_for(prompt, **sampling, stop=(stop, "zzzzzz")))
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[:k + 1]
    with pytest.raises(ValueError, match="detokenize"):
        make_engine(model).add(Request(1, [1, 2], SamplingParams(stop=("x",))))


def test_max_tokens_and_max_model_len_end_with_length():
    model = tiny_model()
    engine = make_engine(model, max_model_len=16)
    short, long, longest = random_prompts([3, 10, 15])
    out = generate(
        engine,
        [
            Request(0, short, SamplingParams(max_tokens=5)),
            Request(1, long, SamplingParams(max_tokens=64)),  # 16 tokens in all: 6 fit
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


def test_duplicate_live_request_id_rejected():
    engine = make_engine(tiny_model())
    engine.add(Request(7, [1, 2, 3]))
    with pytest.raises(ValueError, match="already live"):
        engine.add(Request(7, [4, 5]))


def test_kv_cache_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 16"):
        make_engine(tiny_model(), max_model_len=64, num_blocks=10)


def test_seed_gives_same_tokens_whatever_the_batch():
    model = tiny_model()
    prompt = random_prompts([5], seed=3)[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=123)
    (alone,) = generate(make_engine(model), [Request(0, prompt, seeded)])
    (again,) = generate(make_engine(model), [Request(0, prompt, seeded)])
    assert again.token_ids == alone.token_ids

    others = random_prompts([2, 9, 4], seed=4)
    batch = [Request(10 + i, p, SamplingParams(temperature=1.0, max_tokens=5 + 4 * i)) for i, p in enumerate(others)]
    batch.insert(1, Request(0, prompt, seeded))
    batch.append(Request(20, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=7)))
    together = generate(make_engine(model, max_num_seqs=3), batch)

    assert together[1].token_ids == alone.token_ids
    assert together[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert together[-1].token_ids != alone.token_ids  # another seed, another sample


@pytest.mark.parametrize("as_n", [True, False], ids=["sampling.n", "identical-requests"])
def test_samples_of_one_prompt_prefill_once_and_copy_on_write(as_n):
    model = tiny_model()
    prompt = random_prompts([10], seed=8)[0]  # 2 full blocks of 4 + a shared partial block
    singles = [generate(make_engine(model), [Request(0, prompt, SamplingParams(max_tokens=12, seed=40 + i))])[0]
               for i in range(4)]

    engine = make_engine(model, max_num_seqs=4)
    if as_n:
        out = generate(engine, [Request(3, prompt, SamplingParams(max_tokens=12, n=4, seed=40))])
        assert [c.index for c in out] == [0, 1, 2, 3] and {c.request_id for c in out} == {3}
    else:
        out = generate(engine, [Request(i, prompt, SamplingParams(max_tokens=12, seed=40 + i)) for i in range(4)])
    assert engine.num_prefill_tokens == len(prompt)
    for c, single in zip(out, singles):  # each sample equals its own unshared run: no sample wrote another's keys
        assert c.token_ids == single.token_ids
        assert c.logprobs == pytest.approx(single.logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in out}) == 4
    assert_no_leak(engine)


def test_abort_frees_blocks_and_returns_partial_completion():
    model = tiny_model()
    prompts = random_prompts([4, 7, 5], seed=5)
    engine = make_engine(model, max_num_seqs=1, prefix_sharing=False)
    for r in requests_for(prompts, temperature=0.0, max_tokens=30):
        engine.add(r)

    engine.step()
    engine.step()
    in_use = engine.blocks.num_blocks - 1 - engine.blocks.num_free
    assert in_use == 2  # 4 prompt tokens + 1 decoded, blocks of 4
    aborted = engine.abort(0)
    assert aborted is not None and aborted.finish_reason == "abort"
    # The prefill's token, and not the in-flight one of the decode launched in step 2: an abort
    # returns what has come back to the host and drops the launch's result.
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.versions) == 1
    assert aborted.token_ids == greedy_reference(model, prompts[0], 1)
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1  # freed at once
    assert engine.abort(0) is None  # no longer live
    waiting = engine.abort(2)  # never admitted
    assert waiting is not None and waiting.finish_reason == "abort" and waiting.token_ids == []

    done = drain(engine)
    assert [c.request_id for c in done] == [1]
    assert done[0].token_ids == greedy_reference(model, prompts[1], 30)  # freed blocks' stale keys did not leak in
    assert_no_leak(engine)


def test_abort_of_n_samples_reports_every_sample():
    engine = make_engine(tiny_model(), max_num_seqs=4)
    engine.add(Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=30, n=3, seed=1)))
    engine.step()
    engine.step()
    first = engine.abort(0)
    assert first is not None and first.index == 0
    rest = engine.step()
    assert sorted(c.index for c in rest) == [1, 2] and all(c.finish_reason == "abort" for c in rest)
    assert not engine.has_work()
    assert_no_leak(engine)


def perturb_(model: Qwen3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def test_weight_swap_between_steps_keeps_requests_and_records_versions():
    prompts = random_prompts([5, 8], seed=6)
    sampling = dict(temperature=0.0, max_tokens=12)
    ref = generate(make_engine(tiny_model()), requests_for(prompts, **sampling))

    model = tiny_model()
    engine = make_engine(model)
    assert engine.model is model  # weight sync writes into this module's parameters
    for r in requests_for(prompts, **sampling):
        engine.add(r)
    done = engine.step() + engine.step() + engine.step()  # prefill (1 token), then 1 token per decode step
    assert done == []

    perturb_(engine.model)
    engine.set_version(1)
    done = sorted(drain(engine), key=lambda c: c.request_id)

    for new, old in zip(done, ref):
        assert new.finish_reason == "length" and len(new.token_ids) == 12
        assert new.versions == [0] * 3 + [1] * 9
        assert new.token_ids[:3] == old.token_ids[:3]
    assert any(new.token_ids[3:] != old.token_ids[3:] for new, old in zip(done, ref))


@pytest.mark.parametrize("bump_version", [True, False])
def test_new_version_drops_the_prefix_cache(bump_version):
    model = tiny_model()
    engine = make_engine(model)
    prompt = random_prompts([14], seed=9)[0]
    generate(engine, [Request(0, prompt, SamplingParams(temperature=0.0, max_tokens=3))])
    hits = engine.blocks.hits
    perturb_(model)
    if bump_version:
        engine.set_version(1)
    (out,) = generate(engine, [Request(1, prompt, SamplingParams(temperature=0.0, max_tokens=6))])
    if bump_version:
        assert engine.blocks.hits == hits  # nothing computed by the old weights was reused
        assert out.token_ids == greedy_reference(model, prompt, 6)
    else:
        assert engine.blocks.hits > hits  # the control: same version, the cached prefix is reused


def test_multi_turn_continuation_reuses_earlier_turns():
    model = tiny_model()
    engine = make_engine(model, max_model_len=96)
    prompt = random_prompts([9], seed=10)[0]
    (turn1,) = generate(engine, [Request(0, prompt, SamplingParams(temperature=0.0, max_tokens=14))])
    env_tokens = [5, 6, 7]
    prompt2 = continuation_ids(turn1, env_tokens)
    assert prompt2 == prompt + turn1.token_ids + env_tokens

    computed = engine.num_prefill_tokens
    (turn2,) = generate(engine, [Request(1, prompt2, SamplingParams(temperature=0.0, max_tokens=10))])
    # Only the blocks the first turn never completed are computed: at most one partial block + new tokens.
    assert engine.num_prefill_tokens - computed <= len(env_tokens) + 1 + 2 * engine.block_size
    assert engine.num_prefill_tokens - computed < len(prompt2) // 2
    assert turn2.token_ids == greedy_reference(model, prompt2, 10)


def test_preemption_when_blocks_run_out_gives_the_same_tokens():
    model = tiny_model()
    prompts = random_prompts([6, 9, 3, 7], seed=11)
    requests = [Request(i, p, SamplingParams(temperature=0.9, max_tokens=40, seed=i)) for i, p in enumerate(prompts)]
    roomy = generate(make_engine(model, max_num_seqs=4), requests)
    # 4 sequences of up to 49 tokens need ~52 blocks of 4; 20 force preemptions.
    tight = make_engine(model, max_num_seqs=4, num_blocks=20)
    out = generate(tight, [Request(r.request_id, r.prompt_ids, r.sampling) for r in requests])
    assert tight.num_preemptions > 0
    assert [c.token_ids for c in out] == [c.token_ids for c in roomy]
    assert_no_leak(tight)


def test_chunked_prefill_matches_whole_prefill():
    model = tiny_model()
    prompts = random_prompts([30, 4, 21], seed=12)
    requests = requests_for(prompts, temperature=0.0, max_tokens=8)
    engine = make_engine(model, max_num_seqs=3, max_num_batched_tokens=8)
    out = generate(engine, requests)
    assert [c.token_ids for c in out] == [greedy_reference(model, p, 8) for p in prompts]


@pytest.mark.parametrize("budget", [8, 9, 2])
def test_chunked_prefill_of_a_prompt_with_samples_forks_them(budget):
    """A chunk boundary one token before the prompt's end must not send the leader to decode
    alone: its n samples fork and all finish (this hung before), with the greedy tokens."""
    model = tiny_model()
    engine = make_engine(model, max_num_batched_tokens=budget, max_num_seqs=3)
    prompt = list(range(1, 10))  # 9 tokens: a budget of 8 left exactly one
    engine.add(Request(0, prompt, SamplingParams(temperature=0.0, max_tokens=4, n=3)))
    out = []
    for _ in range(200):
        out += engine.step()
        engine.check()
        if not engine.has_work():
            break
    assert not engine.has_work() and sorted(c.index for c in out) == [0, 1, 2]
    assert all(c.token_ids == greedy_reference(model, prompt, 4) for c in out)
    assert_no_leak(engine)


def test_samples_of_a_chunked_prompt_fork_beside_another_request():
    """Two prompts sharing a small prefill budget on a tight cache; the second one's chunks end
    one token before its end (this hung before the fix) and its 3 samples must fork."""
    model = tiny_model()
    engine = make_engine(model, max_num_seqs=4, max_model_len=40, num_blocks=12, max_num_batched_tokens=6)
    prompts = random_prompts([13, 13], seed=1)
    engine.add(Request(0, prompts[0], SamplingParams(temperature=0.0, max_tokens=12)))
    engine.add(Request(1, prompts[1], SamplingParams(temperature=0.0, max_tokens=8, n=3)))
    out = []
    for _ in range(400):
        out += engine.step()
        engine.check()
        if not engine.has_work():
            break
    assert sorted((c.request_id, c.index) for c in out) == [(0, 0), (1, 0), (1, 1), (1, 2)]
    for c in out:
        assert c.token_ids == greedy_reference(model, prompts[c.request_id], 12 if c.request_id == 0 else 8)
    assert_no_leak(engine)


@pytest.mark.parametrize("graphs", [False, True])
def test_scheduler_invariants_under_random_traffic(graphs):
    """Random arrivals, lengths, stop ids, n and aborts on a tight cache: every sample comes back
    exactly once (finished or aborted), nothing is duplicated, no block or row leaks, and every
    decoding row's inputs and block table match its sequence after every step (also on the
    CUDA-graph path, emulated on CPU: bucketed batches with pad rows)."""
    rng = random.Random(0)
    engine = make_engine(tiny_model(), max_num_seqs=5, max_model_len=40, num_blocks=24, max_num_batched_tokens=24)
    if graphs:
        emulate_cuda_graphs(engine)
    expected: dict[tuple[int, int], None] = {}
    seen: list[tuple[int, int]] = []
    live: list[int] = []
    next_id = 0
    for step in range(300):
        if step < 220 and rng.random() < 0.5:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
            if rng.random() < 0.2 and live:  # same prompt as an earlier request: fork / prefix hits
                samples = engine.scheduler.live.get(live[-1])
                prompt = list(samples[0].request.prompt_ids) if samples else prompt
            n = rng.choice([1, 1, 1, 2, 3])
            sampling = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 20), n=n,
                                      stop_token_ids=(rng.randrange(VOCAB),))
            engine.add(Request(next_id, prompt, sampling))
            expected.update({(next_id, i): None for i in range(n)})
            live.append(next_id)
            next_id += 1
        if live and rng.random() < 0.1:
            rid = live.pop(rng.randrange(len(live)))
            aborted = engine.abort(rid)
            if aborted is not None:
                seen.append((aborted.request_id, aborted.index))
        for c in engine.step():
            seen.append((c.request_id, c.index))
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions)
        engine.check()
    seen += [(c.request_id, c.index) for c in drain(engine)]
    assert len(seen) == len(set(seen)), "a sample completed twice"
    assert set(seen) == set(expected), "a sample was lost"
    assert_no_leak(engine)


def emulate_cuda_graphs(engine: NativeEngine) -> NativeEngine:
    """Run the engine's CUDA-graph path on CPU: buckets, pads, static sampling buffers, one
    'graph' per (batch, blocks, sampling mode), replays writing into the captured outputs."""
    engine.cuda_graphs = True
    engine.runner.static_sampling = StaticSamplingBatch(engine.max_num_seqs, engine.device)
    return engine


def test_graph_path_gives_the_same_completions_as_eager():
    """Mixed greedy / seeded / top-k requests arriving over time, finishing at different steps:
    the graph path (emulated on CPU) returns exactly what the plain path returns."""
    def run(engine: NativeEngine) -> list:
        rng = random.Random(3)
        out = []
        for step in range(60):
            if step < 30 and step % 3 == 0:
                for _ in range(rng.randint(1, 3)):
                    rid = len(out) + 1000 * step + rng.randrange(100)
                    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
                    sampling = rng.choice([SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12)),
                                           SamplingParams(temperature=1.0, seed=rid, max_tokens=rng.randint(1, 12)),
                                           SamplingParams(temperature=0.8, top_k=3, seed=rid, n=2, max_tokens=6)])
                    engine.add(Request(rid, prompt, sampling))
            out += [(c.request_id, c.index, c.token_ids, c.logprobs) for c in engine.step()]
        return sorted(out + [(c.request_id, c.index, c.token_ids, c.logprobs) for c in drain(engine)])

    model = tiny_model()
    plain = run(make_engine(model, max_num_seqs=7, max_model_len=40))
    graphed_engine = emulate_cuda_graphs(make_engine(model, max_num_seqs=7, max_model_len=40))
    graphed = run(graphed_engine)
    assert len(graphed_engine.runner.graphs) >= 3  # several batch buckets and sampling modes were captured
    assert [x[:3] for x in graphed] == [x[:3] for x in plain]
    for a, b in zip(graphed, plain):
        assert max(abs(x - y) for x, y in zip(a[3], b[3])) <= 1e-5  # padded batches round differently


@pytest.mark.parametrize("graphs", [False, True])
def test_a_sparse_tail_of_rows_is_moved_down_without_changing_completions(graphs):
    """20 requests take rows 0-19; the low rows finish within a few tokens and 3 long ones on
    rows 17-19 remain, with their next tokens in flight. The scheduler moves them down
    (`compact_rows`: host inputs, whole block tables, the in-flight token on the device), so later
    launches span at most 8 rows (it leaves spans of 8 or fewer alone), not 20; completions (tokens and logprobs, greedy and seeded) equal those of
    the same engine with the moves off, and the bookkeeping invariants hold after every step
    (eager and emulated-graph paths)."""
    def run(compact: bool) -> tuple[list, list[int]]:
        engine = make_engine(model, max_num_seqs=24, max_model_len=64)
        if graphs:
            emulate_cuda_graphs(engine)
        engine.scheduler.compact_rows = compact
        spans, reserve = [], engine.scheduler.reserve_decode
        engine.scheduler.reserve_decode = lambda: (lambda out: (spans.append(out[1]), out)[1])(reserve())
        rows, push = engine.runner.rows, engine.runner.rows.push
        rows.push = lambda B: (moved_tokens.append(len(rows.moves) // 2), push(B))
        rng = random.Random(11)
        for rid in range(20):
            long = rid >= 17
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
            sampling = (SamplingParams(temperature=1.0, seed=rid, max_tokens=30) if long and rid % 2
                        else SamplingParams(temperature=0.0, max_tokens=30 if long else 2 + rid % 3))
            engine.add(Request(rid, prompt, sampling))
        out = []
        while engine.has_work():
            out += [(c.request_id, c.token_ids, c.logprobs) for c in engine.step()]
            engine.check()
        assert_no_leak(engine)
        return sorted(out), spans

    model, moved_tokens = tiny_model(), []
    kept, kept_spans = run(compact=False)
    assert not any(moved_tokens)
    moved, moved_spans = run(compact=True)
    assert max(kept_spans[-5:]) == 20  # without moves the tail still spans rows 0-19
    assert max(moved_spans[-5:]) <= 8
    assert sum(moved_tokens) >= 3  # the long ones moved with a token in flight
    assert [x[:2] for x in moved] == [x[:2] for x in kept]
    for a, b in zip(moved, kept):
        assert max(abs(x - y) for x, y in zip(a[2], b[2])) <= 1e-5
    assert [len(x[1]) for x in moved if x[0] >= 17] == [30, 30, 30]


def test_prefill_graphs_give_the_same_completions_as_eager():
    """Small prefills replay a graph per padded (rows, tokens[, blocks]) bucket (emulated on CPU):
    pad rows, pad tokens, cut or padded block tables and one persistent input buffer per bucket. With
    requests arriving over time (one to three new ones a step, some n=2, a prompt longer than the
    largest bucket's share, chunked by the prefill budget), a continuation over its cached prefix
    and graphs dropped by sleep halfway, the completions are those of the eager prefill."""
    def run(engine: NativeEngine, graphs: bool) -> list:
        engine.runner.graph_prefill = graphs
        rng = random.Random(5)
        out, prompts = [], {}
        for step in range(50):
            if step == 25:
                out += [(c.request_id, c.index, c.token_ids, c.logprobs) for c in drain(engine)]
                engine.sleep()
                engine.wake()
            if step < 40 and step % 2 == 0:
                for _ in range(rng.randint(1, 3)):
                    rid = 1000 * step + rng.randrange(1000)
                    prompt = prompts[rid] = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 17, 33, 70]))]
                    sampling = rng.choice([SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8)),
                                           SamplingParams(temperature=1.0, seed=rid, n=2, max_tokens=5)])
                    engine.add(Request(rid, prompt, sampling))
            out += [(c.request_id, c.index, c.token_ids, c.logprobs) for c in engine.step()]
        out += [(c.request_id, c.index, c.token_ids, c.logprobs) for c in drain(engine)]
        # a continuation of a finished request's prompt + completion: its prefix is cached (not fresh)
        first = max(out, key=lambda c: len(prompts[c[0]]))
        engine.add(Request(99_999, prompts[first[0]] + first[2] + [1, 2], SamplingParams(max_tokens=4)))
        return sorted(out + [(c.request_id, c.index, c.token_ids, c.logprobs) for c in drain(engine)])

    model = tiny_model()
    plain = run(emulate_cuda_graphs(make_engine(model, max_num_seqs=7, max_model_len=128, max_num_batched_tokens=64)),
                graphs=False)
    engine = emulate_cuda_graphs(make_engine(model, max_num_seqs=7, max_model_len=128, max_num_batched_tokens=64))
    captured = []
    capture = engine.runner._capture_prefill
    engine.runner._capture_prefill = lambda *key: (captured.append(key), capture(*key))
    graphed = run(engine, graphs=True)
    assert len(set(captured)) >= 3 and len(captured) > len(set(captured))  # several buckets, again after sleep
    assert all(B in (1, 2, 4, 8) and T in (16, 32, 48, 64, 96, 128) for B, T, _, _ in captured)
    assert any(not fresh for *_, fresh in captured)  # the continuation over its cached prefix
    assert [x[:3] for x in graphed] == [x[:3] for x in plain]
    for a, b in zip(graphed, plain):
        assert max(abs(x - y) for x, y in zip(a[3], b[3])) <= 1e-5  # padded rows round differently


def test_a_prefill_graph_the_device_refuses_runs_eagerly(caplog):
    """A capture that raises (a device refusing an operation inside a graph) turns the engine's
    prefill graphs off, with one warning, and the completions are those of eager prefills."""
    model = tiny_model()
    prompts = random_prompts([5, 17, 33], seed=2)

    def run(engine: NativeEngine) -> list:
        requests = [Request(i, p, SamplingParams(temperature=1.0, seed=i, max_tokens=5)) for i, p in enumerate(prompts)]
        return [(c.request_id, c.token_ids, c.logprobs) for c in generate(engine, requests)]

    plain = run(emulate_cuda_graphs(make_engine(model, max_num_seqs=4, max_model_len=64)))
    engine = emulate_cuda_graphs(make_engine(model, max_num_seqs=4, max_model_len=64))
    engine.runner.graph_prefill = True
    tried = []

    def refuse(*key):
        tried.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    engine.runner._capture_prefill = refuse
    with caplog.at_level("WARNING", logger="meshrl.runtime.engine.runner"):
        assert run(engine) == plain
    assert len(tried) == 1 and not engine.runner.graph_prefill and not engine.runner.prefill_graphs
    assert len([r for r in caplog.records if "not captured" in r.getMessage()]) == 1


# ------------------------------------------------------------------------------- GPU


def cuda_engine(model: Qwen3, dtype: torch.dtype, **kwargs) -> NativeEngine:
    return NativeEngine(model, max_num_seqs=6, max_model_len=64, device="cuda", dtype=dtype, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_logprobs_match_full_forward(dtype):
    """On CUDA (graphs, default attention) the logprobs match a full forward in the same dtype."""
    model = tiny_model()
    engine = cuda_engine(model, dtype)
    prompts = random_prompts([4, 9, 2, 13, 6], seed=1)
    requests = [Request(i, p, SamplingParams(temperature=0.7, max_tokens=12, seed=i)) for i, p in enumerate(prompts)]
    completions = generate(engine, requests)

    max_diff, k3_max = (1e-4, 1e-6) if dtype == torch.float32 else (0.1, 1e-3)
    for completion in completions:
        engine_lp = torch.tensor(completion.logprobs)
        ref_lp = trainer_logprobs(engine.model, completion, 0.7, device="cuda").cpu()
        assert (engine_lp - ref_lp).abs().max().item() <= max_diff
        log_ratio = ref_lp - engine_lp
        assert (log_ratio.exp() - 1 - log_ratio).mean().item() <= k3_max


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cuda_graph_decode_equals_eager_decode(attention):
    """Graph replays (bucketed batch, padded rows) decode what eager forwards decode, in fp32."""
    if attention == "triton":
        pytest.importorskip("triton")
    prompts = random_prompts([4, 9, 2, 13, 6, 30, 1], seed=3)
    requests = [Request(i, p, SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=20 + i, seed=i))
                for i, p in enumerate(prompts)]
    eager = generate(cuda_engine(tiny_model(), torch.float32, cuda_graphs=False, attention="torch"), requests)
    engine = cuda_engine(tiny_model(), torch.float32, cuda_graphs=True, attention=attention)
    graphed = generate(engine, [Request(r.request_id, r.prompt_ids, r.sampling) for r in requests])
    assert engine.runner.graphs, "no graph was captured"
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_graphs_equal_eager_prefill():
    """Small prefills replaying captured graphs (padded rows and tokens) give what eager prefills
    give, in fp32: prompts of 1-70 tokens arriving one to three at a time, then a continuation over
    a cached prefix (a graph per block count). The first GPU run of this test found no cached-prefix
    graph: it continued an early prompt whose blocks the later requests had evicted."""
    def run(graphs: bool) -> tuple[list, NativeEngine]:
        engine = NativeEngine(tiny_model(), max_num_seqs=6, max_model_len=128, device="cuda", dtype=torch.float32,
                              cuda_graphs=True)
        engine.runner.graph_prefill = graphs
        rng, out, prompts = random.Random(7), [], {}
        for step in range(40):
            if step < 30 and step % 2 == 0:
                for _ in range(rng.randint(1, 3)):
                    rid = 1000 * step + rng.randrange(1000)
                    prompt = prompts[rid] = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 5, 17, 33, 70]))]
                    engine.add(Request(rid, prompt, SamplingParams(temperature=1.0, seed=rid, max_tokens=6)))
            out += [(c.request_id, c.token_ids, c.logprobs) for c in engine.step()]
        out += [(c.request_id, c.token_ids, c.logprobs) for c in drain(engine)]
        # A continuation over a cached prefix: a 40-token request, then its prompt + completion + 2
        # tokens at once, while its blocks are still in the prefix cache (the requests above cycle
        # through the cache, so an early prompt's blocks may be gone).
        prompt = [rng.randrange(VOCAB) for _ in range(40)]
        engine.add(Request(2, prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=6)))
        (first,) = drain(engine)
        engine.add(Request(1, prompt + first.token_ids + [3, 4], SamplingParams(temperature=1.0, seed=1, max_tokens=6)))
        out += [(first.request_id, first.token_ids, first.logprobs)]
        return sorted(out + [(c.request_id, c.token_ids, c.logprobs) for c in drain(engine)]), engine

    eager, _ = run(False)
    graphed, engine = run(True)
    assert engine.runner.prefill_graphs, "no prefill graph was captured"
    assert engine.runner.graph_prefill, "a capture was refused"
    assert any(not fresh for *_, fresh in engine.runner.prefill_graphs), "no graph over a cached prefix"
    assert [x[:2] for x in graphed] == [x[:2] for x in eager]
    for a, b in zip(graphed, eager):
        assert a[2] == pytest.approx(b[2], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_greedy_matches_full_forward_up_to_ties():
    """bf16 engine (graphs, triton when available) vs a bf16 full forward over the engine's own
    tokens: every greedy token is the full forward's argmax up to bf16 rounding. (A random tiny
    model has near-tied logits, so comparing free-running argmax sequences flips on ties: the
    first GPU run of the older form of this test failed exactly so.)"""
    model = tiny_model()
    engine = cuda_engine(model, torch.bfloat16)
    prompts = random_prompts([5, 12, 3], seed=4)
    out = generate(engine, requests_for(prompts, temperature=0.0, max_tokens=12))
    for prompt, c in zip(prompts, out):
        ids = list(prompt) + c.token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda")[None])
        logits = logits[0, len(prompt) - 1:-1].float()  # (12, V): the logits each token was chosen from
        chosen = logits.gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None]).squeeze(-1)
        gap = logits.max(dim=-1).values - chosen  # 0 when the engine took the argmax
        scale = logits.abs().max(dim=-1).values
        assert (gap <= 0.02 * scale + 1e-3).all(), (gap.tolist(), scale.tolist())
