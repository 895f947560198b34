"""Shared-prompt packing (runtime/train/packing.py, runtime/train/shared_prompt.py): the samples of a
group trained on one copy of their prompt give the logprobs, the loss and the gradients of the
unshared packing, on every CPU attention path, with LoRA, multi-turn masks and mixed groups."""

from __future__ import annotations

import random

import pytest
import torch

from meshrl.models.qwen3 import FLAVORS, Qwen3
from meshrl.runtime.config import LossConfig, OptimConfig
from meshrl.runtime.train import shared_prompt
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack, shared_fraction
from meshrl.runtime.train.shared_prompt import SharedPromptAttention, shared_prompt_mask
from meshrl.runtime.train.trainer import Trainer, policy_loss
from tests.family_checks import build_init

ARGS = FLAVORS["debug"]
TOL = 1e-6  # the model runs in float64; the logprob head and the loss in fp32, summed in another order


def make_samples(seed: int = 0) -> list[Sample]:
    """Three groups with different prompts (4, 3 and 1 samples, interleaved), one of them with a
    multi-turn sample (environment tokens in its completion), one truncated at the length limit, and
    a one-token prompt (never shared)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, ARGS.vocab_size) for _ in range(n)]  # noqa: E731
    prompts = [tok(9), tok(5), tok(7), tok(1)]
    samples = []
    for g, count in [(0, 4), (1, 3), (2, 1), (3, 2), (0, 0)]:
        for _ in range(count):
            n = rng.randint(1, 12)
            mask = None
            if g == 1 and not any(s.completion_mask for s in samples):
                mask = [True] * 3 + [False] * 4 + [True] * (n - 7) if n > 8 else None
            samples.append(Sample(list(prompts[g]), tok(n), [rng.uniform(-3, -0.1) for _ in range(n)],
                                  advantage=rng.uniform(-1, 1), completion_mask=mask))
    samples.append(Sample(list(prompts[0]), tok(16), [-1.0] * 16, advantage=0.5))  # the longest (truncated) one
    rng.shuffle(samples)
    return samples


def model(lora: bool = False) -> Qwen3:
    m = build_init(Qwen3, ARGS, seed=0)
    if lora:
        from meshrl.models.common.lora import add_lora, init_lora
        from meshrl.models.qwen3 import Qwen3StateDictAdapter

        add_lora(m, Qwen3StateDictAdapter(ARGS), 4, 8.0, 0.0, ["q_proj", "v_proj", "down_proj"])
        init_lora(m, seed=0)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return m.double()


def run(trainer: Trainer, batches, loss: LossConfig) -> tuple[dict, float, list[torch.Tensor]]:
    """Logprobs at the loss positions keyed (sample, i-th loss token), the summed loss, the gradients."""
    trainer.model.zero_grad()
    n = count_loss_tokens(batches)
    logprobs, total = {}, 0.0
    for mb in batches[0]:
        mb, lp, _ = trainer._forward(mb, temperature=0.7)
        value, _ = policy_loss(mb, lp, loss, n)
        value.backward()
        total += float(value.detach())
        seen: dict[int, int] = {}
        for sid, v, m in zip(mb["sample_ids"][0].tolist(), lp[0].tolist(), mb["loss_mask"][0].tolist()):
            if m:
                logprobs[(sid, seen.get(sid, 0))] = v
                seen[sid] = seen.get(sid, 0) + 1
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
    return logprobs, total, grads


@pytest.mark.parametrize("attention", ["split", "sdpa"])
@pytest.mark.parametrize("loss", [LossConfig(kl_coef=0.1), LossConfig(type="gspo", correction="tis",
                                                                        correction_level="sequence")],
                         ids=["default", "gspo-seq"])
def test_shared_packing_equals_unshared(attention, loss):
    samples = make_samples()
    trainer = Trainer(model(), OptimConfig(), torch.device("cpu"), None, attention=attention)
    ref = run(trainer, pack(samples, 64, 1), loss)
    shared = pack(samples, 64, 1, share_prompts=True)
    assert any(shared_prompt.is_shared(mb) for mb in shared[0])
    assert count_loss_tokens(shared) == count_loss_tokens(pack(samples, 64, 1))
    assert shared_fraction(samples, pack(samples, 64, 1)) == 0.0
    unshared_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    shared_tokens = sum(mb["input_ids"].shape[1] for mb in shared[0] if mb["sample_ids"].max() >= 0)
    assert shared_fraction(samples, shared) == pytest.approx(1 - shared_tokens / unshared_tokens)
    assert shared_fraction(samples, shared) > 0.2
    got = run(trainer, shared, loss)
    assert got[0].keys() == ref[0].keys()
    assert max(abs(got[0][k] - ref[0][k]) for k in ref[0]) < TOL
    assert abs(got[1] - ref[1]) < TOL
    for g, r in zip(got[2], ref[2]):
        assert (g - r).abs().max() <= TOL * max(1.0, r.abs().max())


def test_shared_packing_with_lora():
    samples = make_samples(seed=1)
    trainer = Trainer(model(lora=True), OptimConfig(), torch.device("cpu"), None, attention="split")
    ref = run(trainer, pack(samples, 64, 1), LossConfig())
    got = run(trainer, pack(samples, 64, 1, share_prompts=True), LossConfig())
    assert len(got[2]) == len(ref[2]) and len(ref[2]) < len(list(trainer.model.parameters()))
    assert abs(got[1] - ref[1]) < TOL
    for g, r in zip(got[2], ref[2]):
        assert (g - r).abs().max() <= TOL * max(1.0, r.abs().max())


def test_shared_layout_by_hand():
    a = Sample([5, 6, 7], [8, 9], [-0.1, -0.2], 1.0)
    b = Sample([5, 6, 7], [10], [-0.3], -1.0)
    c = Sample([4, 6], [11, 12], [-0.5, -0.6], 0.5)
    (row,), = pack([a, b, c], 64, 1, share_prompts=True)
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9, 7, 10, 4, 6, 11, 12]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3]]
    assert row["doc_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]]
    assert row["prompt_doc"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert row["targets"].tolist() == [[6, 7, 8, 9, 0, 10, 0, 6, 11, 12, 0]]
    assert row["loss_mask"].tolist() == [[False, False, True, True, False, True, False, False, True, True, False]]
    mask = shared_prompt_mask(row["doc_ids"], row["prompt_doc"], row["position_ids"])[0]
    assert mask[5].nonzero().squeeze(1).tolist() == [0, 1, 5]  # b's branch: the prompt and itself
    assert mask[4].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]
    assert mask[1].nonzero().squeeze(1).tolist() == [0, 1]
    assert mask[8].nonzero().squeeze(1).tolist() == [7, 8]


def test_groups_are_cut_for_rows_and_ranks():
    """A group is cut only where a row is full, each piece with its prompt; a piece never straddles a
    row or a rank; every loss token is packed exactly once."""
    prompt = list(range(3, 23))
    samples = [Sample(prompt, [30 + i] * 10, [-1.0] * 10, 1.0) for i in range(12)]
    one = pack(samples, 512, 1, share_prompts=True)
    assert len(one[0]) == 1 and one[0][0]["input_ids"].shape[1] == 19 + 12 * 11
    two = pack(samples, 64, 2, share_prompts=True)  # 19 + 4 * 11 = 63 per unit and row
    assert sorted(mb["input_ids"].shape[1] for r in two for mb in r) == [1, 63, 63, 63]
    for mb in (mb for r in two for mb in r if mb["input_ids"].shape[1] > 1):
        assert mb["input_ids"][0, :19].tolist() == prompt[:-1] and mb["prompt_doc"][0, 19:].eq(1).all()
    small = pack(samples, 64, 1, share_prompts=True)
    assert [mb["input_ids"].shape[1] for mb in small[0]] == [63, 63, 63]
    for batches in (one, two, small):
        assert count_loss_tokens(batches) == 12 * 10
        ids = sorted(int(s) for r in batches for mb in r for s, m in zip(mb["sample_ids"][0], mb["loss_mask"][0]) if m)
        assert ids == sorted([i for i in range(12)] * 10)


def test_split_windows_and_sinks_use_the_position_mask():
    """Sliding windows are measured in positions (a branch's distance to its prompt is not the row's)."""
    samples = make_samples()
    (row, *_), = pack(samples, 512, 1, share_prompts=True)
    (ref_row, *_), = pack(samples, 512, 1)
    T = row["input_ids"].shape[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, T, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    attn = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "split")
    dense = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "sdpa")
    assert (attn.attend(0, q, k, v) - dense.attend(0, q, k, v)).abs().max() < 1e-12
    mask = shared_prompt_mask(row["doc_ids"], row["prompt_doc"], row["position_ids"], window=4)[0]
    for i in range(T):  # every allowed key is within the window in positions, and all of them are there
        pos = row["position_ids"][0]
        same = (mask[i] != 0).nonzero().squeeze(1)
        assert bool(((pos[i] - pos[same]) < 4).all()) and len(same) == min(int(pos[i]) + 1, 4)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    assert attn.attend(0, q, k, v, window=4, sinks=sinks).shape == q.shape
    assert ref_row is not None


def _reference_varlen(bottom_right: bool):
    """A varlen attention kernel in torch: per document, SDPA of its queries over its keys with a
    causal mask aligned bottom-right (the flash kernels' convention) or top-left."""
    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        outs = []
        for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            qd, kd, vd = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))
            mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a) if bottom_right else 0)
            outs.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask,
                                                                         enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)
    return kernel


def test_varlen_gather_layout(monkeypatch):
    """The varlen path's gathered keys and cu_seqlens, through a reference bottom-right causal kernel
    (the flash kernels' convention), equal the dense rule (the real kernels are checked on CUDA)."""
    samples = make_samples()
    (row, *_), = pack(samples, 512, 1, share_prompts=True)
    T = row["input_ids"].shape[1]

    kernel = _reference_varlen(bottom_right=True)
    from meshrl.models.common import attention

    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: kernel)
    monkeypatch.setattr(attention, "_torch_varlen_params", lambda: frozenset({"window_size", "enable_gqa"}))
    shared_prompt._ALIGNS.clear()
    assert shared_prompt._varlen_aligns("varlen", torch.device("cpu"), torch.float16)  # the probe passes
    shared_prompt._ALIGNS.clear()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 8, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(1, 2, T, 8, generator=gen, dtype=torch.float16) for _ in range(2))
    got = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "varlen").attend(0, q, k, v)
    ref = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "sdpa").attend(
        0, q.double(), k.double(), v.double())
    assert (got.double() - ref).abs().max() < 1e-2
    shared_prompt._ALIGNS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["varlen", "flex", "split", "sdpa"])
def test_shared_prompt_backends_on_cuda(backend):
    """Each GPU path in bf16 (forward and q/k/v gradients) against the dense rule in fp32; varlen's
    gathered keys rely on the flash kernels' bottom-right causal alignment, checked here."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    samples = make_samples()
    (row, *_), = pack(samples, 512, 1, share_prompts=True)
    row = row.to("cuda")
    T = row["input_ids"].shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(1, h, T, 64, generator=gen, device="cuda") for h in (8, 2, 2)]
    upstream = torch.randn(1, 8, T, 64, generator=gen, device="cuda")

    def grads(backend_, dtype):
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in base)  # leaves, also when dtype is base's
        attn = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], backend_)
        out = attn.attend(0, q, k, v)
        out.backward(upstream.to(dtype))
        return [t.float() for t in (out, q.grad, k.grad, v.grad)]

    if backend == "varlen":  # else shared rows would quietly take the split path
        assert shared_prompt._varlen_aligns("varlen", torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    ref = grads("sdpa", torch.float32)
    for got, want in zip(grads(backend, torch.bfloat16), ref):
        assert (got - want).norm() / want.norm() < 2e-2


def test_unsupported_runs_pack_unshared():
    """Context parallelism and linear-attention families get unshared rows (the controller asks this);
    a linear-attention layer handed a shared row anyway refuses it instead of restarting at branches."""
    from meshrl.models.common.linear_attention import document_starts
    from meshrl.runtime.config import ModelConfig, ParallelConfig, TrainerConfig

    plain = ModelConfig(flavor="tiny", tokenizer="char")
    assert shared_prompt.unsupported(plain, TrainerConfig()) is None
    assert "cp = 2" in shared_prompt.unsupported(plain, TrainerConfig(parallel=ParallelConfig(cp=2)))
    hybrid = ModelConfig(flavor="debug", family="qwen3_next", tokenizer="char")
    assert "linear-attention" in shared_prompt.unsupported(hybrid, TrainerConfig())
    assert shared_prompt.enabled(plain, TrainerConfig()) and not shared_prompt.enabled(hybrid, TrainerConfig())
    assert not shared_prompt.enabled(plain, TrainerConfig(share_prompts=False))
    (row, *_), = pack(make_samples(), 512, 1, share_prompts=True)
    attn = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "split")
    with pytest.raises(ValueError, match="no doc_ids"):
        document_starts(attn, 1, row["input_ids"].shape[1], torch.device("cpu"))


def test_varlen_probe_falls_back_to_split_when_the_kernel_aligns_top_left(monkeypatch):
    """A varlen kernel whose causal mask is aligned top-left (queries fewer than keys) would give
    wrong branches; the once-per-process probe catches it and shared rows go through 'split'."""
    from meshrl.models.common import attention

    top_left = _reference_varlen(bottom_right=False)
    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: top_left)
    monkeypatch.setattr(attention, "_torch_varlen_params", lambda: frozenset({"window_size", "enable_gqa"}))
    shared_prompt._ALIGNS.clear()
    try:
        assert not shared_prompt._varlen_aligns("varlen", torch.device("cpu"), torch.float16)
        (row, *_), = pack(make_samples(), 512, 1, share_prompts=True)
        T = row["input_ids"].shape[1]
        q, k, v = (torch.randn(1, h, T, 8, dtype=torch.float16) for h in (4, 2, 2))
        got = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "varlen").attend(0, q, k, v)
        ref = SharedPromptAttention(row["doc_ids"], row["prompt_doc"], row["position_ids"], "sdpa").attend(
            0, q.double(), k.double(), v.double())
        assert (got.double() - ref).abs().max() < 1e-2
    finally:
        shared_prompt._ALIGNS.clear()
