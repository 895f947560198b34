"""Qwen3 parity with transformers (logits, gradients) and packed-document attention."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from meshrl.models.common.attention import CausalAttention, DocumentCausalAttention, document_ids_from_positions
from meshrl.models.hf import save_hf_model
from meshrl.models.qwen3 import FLAVORS, Qwen3, Qwen3Args, Qwen3StateDictAdapter

VOCAB = 96


def tiny_args(tie: bool) -> Qwen3Args:
    return Qwen3Args(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                     tie_embeddings=tie)


def build(args: Qwen3Args, seed: int = 0) -> Qwen3:
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    # Non-trivial norm weights, so a swapped q_norm/k_norm or pre/post norm would show.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def hf_twin(model: Qwen3, args: Qwen3Args, tmp_path) -> Qwen3ForCausalLM:
    save_hf_model(model, args, tmp_path / "hf")
    return Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")


def arange_positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).expand(batch, seq)


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tie, tmp_path):
    args = tiny_args(tie)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, arange_positions(3, 17))
        theirs = hf(tokens).logits
    assert ours.shape == (3, 17, VOCAB)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # hidden() + output_weight is the same computation the trainer will chunk.
    with torch.no_grad():
        h = model.hidden(tokens, arange_positions(3, 17))
    assert torch.equal(h @ model.output_weight.T, ours)


@pytest.mark.parametrize("tie", [True, False])
def test_gradients_match_transformers(tie, tmp_path):
    args = tiny_args(tie)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 13), generator=gen)
    targets = torch.randint(0, VOCAB, (2, 13), generator=gen)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    loss_fn(model(tokens, arange_positions(2, 13))).backward()
    loss_fn(hf(tokens).logits).backward()

    ours = Qwen3StateDictAdapter(args).to_hf({k: p.grad for k, p in model.named_parameters()})
    theirs = {k: p.grad for k, p in hf.named_parameters()}  # a tied lm_head is listed once
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def test_packed_documents_match_separate_runs():
    args = tiny_args(tie=False)
    model = build(args)
    gen = torch.Generator().manual_seed(2)
    doc_a, doc_b, doc_c = (torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 5, 9))
    pad = torch.zeros(3, dtype=torch.long)
    # Row 0: [A | B]; row 1: [C | 3 pad tokens], each pad its own one-token document.
    tokens = torch.stack([torch.cat([doc_a, doc_b]), torch.cat([doc_c, pad])])
    positions = torch.stack([torch.cat([torch.arange(7), torch.arange(5)]),
                             torch.cat([torch.arange(9), torch.zeros(3, dtype=torch.long)])])
    doc_ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 9 + [1, 2, 3]])
    assert torch.equal(document_ids_from_positions(positions), doc_ids)

    with torch.no_grad():
        packed = model(tokens, positions, DocumentCausalAttention(doc_ids))
        alone = [model(doc[None], torch.arange(len(doc))[None], CausalAttention())[0] for doc in (doc_a, doc_b, doc_c)]
    assert not packed.isnan().any()
    assert (packed[0, :7] - alone[0]).abs().max().item() <= 1e-5
    assert (packed[0, 7:] - alone[1]).abs().max().item() <= 1e-5
    assert (packed[1, :9] - alone[2]).abs().max().item() <= 1e-5


def test_document_attention_is_causal_attention_for_one_document():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    ctx = DocumentCausalAttention(torch.zeros(2, 6, dtype=torch.long))
    torch.testing.assert_close(ctx.attend(0, q, k, v), CausalAttention().attend(0, q, k, v))
    assert ctx.mask(q.device) is ctx.mask(q.device)  # built once, shared by all layers


def test_init_weights_is_seeded_and_leaves_nothing_on_meta():
    args = FLAVORS["debug"]
    a, b = build(args, seed=3), build(args, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert all(p.device.type == "cpu" for p in a.parameters())
    fresh = Qwen3(args)
    fresh.init_weights(seed=0)
    assert torch.equal(fresh.norm.weight, torch.ones(args.dim))
    wo_std = fresh.layers["0"].attention.wo.weight.std().item()
    assert wo_std < 0.02 / 1.5  # depth-scaled residual projection


def test_flavors_round_trip_through_hf_config():
    for name, args in FLAVORS.items():
        config = args.to_hf_config(dtype=torch.bfloat16, eos_token_id=2)
        assert Qwen3Args.from_hf_config(config) == args, name
    assert FLAVORS["0.6B"].tie_embeddings and not FLAVORS["8B"].tie_embeddings


def test_from_hf_config_rejects_unsupported_features():
    config = FLAVORS["debug"].to_hf_config()
    with pytest.raises(ValueError, match="model_type"):
        Qwen3Args.from_hf_config({**config, "model_type": "llama"})
    with pytest.raises(ValueError, match="RoPE"):
        Qwen3Args.from_hf_config({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match="sliding"):
        Qwen3Args.from_hf_config({**config, "use_sliding_window": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tie", [True, False])
def test_cuda_bf16_error_is_no_worse_than_transformers(tie, tmp_path):
    """On GPU in bf16 neither side is exact: our error against the fp32 reference must be on
    the order of transformers' own (same kernels family, same rounding points)."""
    args = tiny_args(tie)
    model = build(args)
    save_hf_model(model, args, tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    positions = arange_positions(4, 64).cuda()
    with torch.no_grad():
        reference = model.cuda()(tokens, positions).float()
        ours = model.to(torch.bfloat16)(tokens, positions).float()
        hf_sdpa = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16, attn_implementation="sdpa")
        theirs = hf_sdpa.cuda()(tokens).logits.float()
    our_err = (ours - reference).abs().max().item()
    their_err = (theirs - reference).abs().max().item()
    assert our_err <= 2 * their_err + 1e-3, (our_err, their_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_documents_and_backward():
    args = tiny_args(tie=True)
    model = build(args).cuda()
    gen = torch.Generator().manual_seed(2)
    doc_a, doc_b = (torch.randint(0, VOCAB, (n,), generator=gen).cuda() for n in (40, 24))
    tokens = torch.cat([doc_a, doc_b])[None]
    positions = torch.cat([torch.arange(40), torch.arange(24)])[None].cuda()
    ctx = DocumentCausalAttention.from_positions(positions)
    packed = model(tokens, positions, ctx)
    with torch.no_grad():
        alone_a = model(doc_a[None], positions[:, :40])[0]
        alone_b = model(doc_b[None], positions[:, :24])[0]
    assert (packed[0, :40] - alone_a).abs().max().item() <= 1e-4
    assert (packed[0, 40:] - alone_b).abs().max().item() <= 1e-4
    packed.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
