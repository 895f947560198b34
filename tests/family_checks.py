"""The checks every native family passes, against transformers' modeling code in fp32.

A family test builds a tiny random model of ours (`build_random`), gets its transformers twin by
saving our folder and loading it with `from_pretrained` (so the config and key maps are exercised
too), and runs:

- `check_logits_and_grads`: logits and every parameter's gradient of a cross-entropy loss;
- `check_packed_documents`: two packed documents equal two separate rows;
- `check_hub_folders`: folders transformers writes (per-expert hub layout, sharded, and the fused
  in-memory layout) load into our model, our folder loads into transformers with equal logits;
- `check_engine`: the native engine's greedy tokens equal transformers' `generate`, and its
  sampled logprobs equal the trainer's full forward (mismatch_kl, the k3 estimator, <= 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.hf import load_hf_model, save_hf_model
from meshrl.runtime.engine.api import Request, SamplingParams, generate
from meshrl.runtime.engine.native import NativeEngine


@torch.no_grad()
def build_init(model_cls: type[nn.Module], args, seed: int = 0) -> nn.Module:
    """model_cls(args) with its own init_weights(seed), fp32 on the CPU (built on meta, no double init)."""
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


@torch.no_grad()
def build_random(model_cls: type[nn.Module], args, seed: int = 0, scale: float = 1.0) -> nn.Module:
    """model_cls(args) initialised with `seed` in fp32 on the CPU, then made harder to match by
    accident: norms and biases away from 1 / 0, decisive routers and sparse-attention indexers
    (N(0, 0.5): near-uniform top-k could flip on 1e-7 differences), a random expert bias (it must steer the choice), and weight
    matrices times `scale` (a tiny model at init std echoes its last token, which would make
    greedy parity vacuous)."""
    model = build_init(model_cls, args, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("router.weight") or (".indexer." in name and p.dim() > 1):
            # Decisive top-k choices (experts, GLM-5's selected keys): different parallel layouts
            # sum in different orders, and near-tied scores must not flip on that round-off.
            p.normal_(0.0, 0.5, generator=gen)
        elif name.endswith("expert_bias"):
            p.uniform_(-0.3, 0.3, generator=gen)
        elif name.endswith(".bias") or name.endswith("sinks"):
            p.normal_(0.0, 0.1, generator=gen)
        elif p.dim() > 1 and scale != 1.0:
            p.mul_(scale)
    return model


def hf_twin(model: nn.Module, args, path) -> transformers.PreTrainedModel:
    """Our model saved as an HF folder and loaded by transformers (fp32, eager attention)."""
    save_hf_model(model, args, path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).expand(batch, seq)


def ours_from_hf_named(adapter_cls, args, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors (fused experts) by our names, through the family's adapter."""
    return adapter_cls(args).from_hf(named)


def check_logits_and_grads(model: nn.Module, hf: transformers.PreTrainedModel, adapter_cls, args,
                           logits_atol: float = 1e-5, grad_rtol: float = 1e-4, grad_atol: float = 1e-6) -> float:
    """Logits and gradients of ours vs transformers on one random batch; returns the max logit difference."""
    vocab = args.vocab_size
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 17), generator=gen)
    targets = torch.randint(0, vocab, (3, 17), generator=gen)
    ours = model(tokens, positions(3, 17))
    theirs = hf(tokens).logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= logits_atol, diff

    def loss_fn(logits):
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    loss_fn(ours).backward()
    loss_fn(theirs).backward()
    ours_grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    theirs_grads = ours_from_hf_named(adapter_cls, args, {k: p.grad for k, p in hf.named_parameters()
                                                          if p.grad is not None})
    assert ours_grads.keys() == theirs_grads.keys(), ours_grads.keys() ^ theirs_grads.keys()
    for key, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[key], rtol=grad_rtol, atol=grad_atol, msg=key)
    return diff


@torch.no_grad()
def check_packed_documents(model: nn.Module, vocab: int) -> None:
    """A row of two documents (positions restart, document mask) equals the two run alone."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, vocab, (1, 9), generator=gen), torch.randint(0, vocab, (1, 6), generator=gen)
    packed = model(torch.cat([a, b], 1), torch.cat([positions(1, 9), positions(1, 6)], 1),
                   DocumentCausalAttention(torch.cat([torch.zeros(1, 9), torch.ones(1, 6)], 1).long()))
    alone = torch.cat([model(a, positions(1, 9)), model(b, positions(1, 6))], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def assert_same_state(model: nn.Module, loaded: nn.Module) -> None:
    theirs = loaded.state_dict()
    assert model.state_dict().keys() == theirs.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key


@torch.no_grad()
def check_hub_folders(model: nn.Module, args, hf: transformers.PreTrainedModel, tmp_path) -> None:
    """transformers' folders (hub per-expert layout, sharded, fused) load into ours; ours round-trips."""
    layouts = {"hub": dict(save_original_format=True), "sharded": dict(max_shard_size="60KB"),
               "fused": dict(save_original_format=False)}
    for name, kwargs in layouts.items():
        hf.save_pretrained(tmp_path / name, **kwargs)
        if name == "sharded":
            assert (tmp_path / name / "model.safetensors.index.json").is_file()
        loaded, loaded_args = load_hf_model(tmp_path / name)
        assert type(loaded) is type(model) and loaded_args == args, name
        assert_same_state(model, loaded)
    # Back: load the hub folder, save it with meshrl, transformers loads that with equal logits.
    loaded, loaded_args = load_hf_model(tmp_path / "hub")
    save_hf_model(loaded, loaded_args, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=0, atol=0)


def mismatch_kl(trainer_lp: torch.Tensor, engine_lp: torch.Tensor) -> float:
    """Mean k3 estimate exp(d) - d - 1, d = trainer - engine logprob (the RL metric)."""
    d = trainer_lp - engine_lp
    return (torch.exp(d) - d - 1).mean().item()


@torch.no_grad()
def trainer_logprobs(model: nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = prompt + completion
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def make_engine(model: nn.Module, **kwargs) -> NativeEngine:
    kwargs.setdefault("block_size", 4)
    return NativeEngine(model, max_num_seqs=kwargs.pop("max_num_seqs", 3), max_model_len=64, device="cpu",
                        dtype=torch.float32, **kwargs)


def check_engine(model: nn.Module, hf: transformers.PreTrainedModel, vocab: int) -> float:
    """Engine greedy == transformers generate (paged, shared prefixes, more requests than rows);
    sampled logprobs == the trainer's full forward. Returns the largest mismatch_kl seen."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 3, 5, 9)]
    prompts = base + [base[0] + [7, 8, 9], list(base[0])]  # a shared prefix and an exact duplicate
    max_tokens = [9, 4, 12, 7, 6, 8]
    requests = [Request(i, p, SamplingParams(temperature=0.0, max_tokens=n))
                for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    completions = generate(make_engine(model), requests)
    expected = []
    for prompt, n in zip(prompts, max_tokens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    assert [c.token_ids for c in completions] == expected
    assert len({tuple(t) for t in expected}) > 3  # not a degenerate echo

    sampled = generate(make_engine(model, max_num_seqs=4),
                       [Request(i, p, SamplingParams(temperature=1.0, max_tokens=10, seed=i))
                        for i, p in enumerate(prompts)])
    worst = 0.0
    for c in sampled:
        ref = trainer_logprobs(model, c.prompt_ids, c.token_ids)
        engine_lp = torch.tensor(c.logprobs)
        assert (engine_lp - ref).abs().max().item() <= 1e-5
        worst = max(worst, mismatch_kl(ref, engine_lp))
    assert worst <= 1e-6, worst
    return worst
