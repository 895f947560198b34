"""Packed projections (models/common/packed_projections.py): q/k/v and gate/up as one matmul in the
engine, with the parameters unchanged, in-place weight loads seen, the colocated flat buffer
re-bound, and nothing packed where it would be wrong (training, FP8, hooks)."""

from __future__ import annotations

import torch

from meshrl.models.common import packed_projections
from meshrl.models.common.fp8 import quantize_model
from meshrl.models.glm4_moe import FLAVORS as GLM_FLAVORS, Glm4Moe
from meshrl.models.qwen3 import Qwen3
from meshrl.runtime.engine.api import generate
from meshrl.runtime.weight_sync import ColocatedReceiver, flat_plan
from tests.random_models import scaled_random_model
from tests.unit.test_engine import make_engine, random_prompts, requests_for, tiny_args, tiny_model


def _logits(model, tokens):
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))


def test_pack_keeps_parameters_and_outputs():
    model, reference = tiny_model(), tiny_model()
    model.requires_grad_(False)
    before = {name: p for name, p in model.named_parameters()}
    assert packed_projections.pack(model) == 2 * tiny_args().n_layers  # qkv and gate_up per layer
    assert {name: p for name, p in model.named_parameters()} == before  # same names, same objects
    attn, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    weight, bias, sizes = attn.packed["qkv"]
    assert bias is None and sizes == (64, 32, 32) and weight.shape == (128, 64)
    assert weight.untyped_storage().data_ptr() == attn.wv.weight.untyped_storage().data_ptr()
    assert "gate_up" in ffn.packed
    tokens = torch.randint(0, tiny_args().vocab_size, (2, 9))
    torch.testing.assert_close(_logits(model, tokens), _logits(reference, tokens), rtol=1e-5, atol=1e-5)
    # an in-place load (what weight sync does) reaches the packed matmul
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(dict(tiny_model(seed=3).named_parameters())[name])
    torch.testing.assert_close(_logits(model, tokens), _logits(tiny_model(seed=3), tokens), rtol=1e-5, atol=1e-5)


def test_a_trainable_model_never_takes_the_packed_path():
    model = tiny_model()
    packed_projections.pack(model)  # requires_grad still on: e.g. a test that trains the engine's model
    model(torch.randint(0, 96, (1, 5)), torch.arange(5)[None]).sum().backward()
    assert model.layers["0"].attention.wk.weight.grad is not None
    assert model.layers["1"].feed_forward.w3.weight.grad is not None


def test_packing_is_on_for_cuda_and_off_for_cpu_unless_forced(monkeypatch):
    monkeypatch.delenv("MESHRL_PACKED_PROJECTIONS", raising=False)
    assert packed_projections.enabled(torch.device("cuda")) and not packed_projections.enabled(torch.device("cpu"))
    assert "qkv" not in make_engine(tiny_model()).model.layers["0"].attention.packed
    monkeypatch.setenv("MESHRL_PACKED_PROJECTIONS", "0")
    assert not packed_projections.enabled(torch.device("cuda"))
    monkeypatch.setenv("MESHRL_PACKED_PROJECTIONS", "1")
    assert packed_projections.enabled(torch.device("cpu"))


def test_engine_packs_and_decodes_as_the_unpacked_model(monkeypatch):
    monkeypatch.setenv("MESHRL_PACKED_PROJECTIONS", "1")  # the CUDA engine's path, on the CPU
    prompts = random_prompts([5, 11, 3])
    engine = make_engine(tiny_model(), max_num_seqs=3)
    assert "qkv" in engine.model.layers["1"].attention.packed
    out = generate(engine, requests_for(prompts, temperature=0.0, max_tokens=8))
    plain = make_engine(tiny_model(), max_num_seqs=3)
    for module in plain.model.modules():  # the same engine with one matmul per projection
        if hasattr(module, "packed"):
            module.packed = {}
    ref = generate(plain, requests_for(prompts, temperature=0.0, max_tokens=8))
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for a, b in zip(out, ref):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_colocated_flat_buffer_is_rebound(monkeypatch):
    """The colocated receiver makes every parameter a view of one flat buffer: q/k/v and w1/w3 are
    consecutive parameters there, so they stay packed, now over the flat buffer."""
    monkeypatch.setenv("MESHRL_PACKED_PROJECTIONS", "1")
    engine = make_engine(tiny_model())
    receiver = ColocatedReceiver(engine.model, torch.float32, torch.device("cpu"), peer=0, to_peer=None,
                                 from_peer=None)
    flat = receiver.flat.untyped_storage().data_ptr()
    for block in engine.model.layers.values():
        assert block.attention.packed["qkv"][0].untyped_storage().data_ptr() == flat
        assert block.feed_forward.packed["gate_up"][0].untyped_storage().data_ptr() == flat
    entries, _ = flat_plan(engine.model)
    tokens = torch.randint(0, 96, (1, 7))
    expected = _logits(tiny_model(seed=5), tokens)
    with torch.no_grad():  # a new version lands in the flat buffer (as the receiver's copy does)
        for (offset, _), (_, p) in zip(entries, tiny_model(seed=5).named_parameters()):
            receiver.flat[offset:offset + p.numel()].copy_(p.reshape(-1))
    torch.testing.assert_close(_logits(engine.model, tokens), expected, rtol=1e-5, atol=1e-5)


def test_biases_are_packed_too():
    args = GLM_FLAVORS["debug"]
    model, reference = (scaled_random_model(Glm4Moe, args, 0) for _ in range(2))
    model.requires_grad_(False)
    assert packed_projections.pack(model) > 0
    attn = model.layers["0"].attention
    if attn.wq.bias is not None:
        assert attn.packed["qkv"][1] is not None
    tokens = torch.randint(0, args.vocab_size, (2, 6))
    torch.testing.assert_close(_logits(model, tokens), _logits(reference, tokens), rtol=1e-4, atol=1e-4)


def test_nothing_is_packed_where_the_members_have_their_own_forward():
    model = tiny_model().requires_grad_(False)
    quantize_model(model, torch.device("cpu"))  # FP8 linears
    assert packed_projections.pack(model) == 0
    hooked = tiny_model().requires_grad_(False)
    hooked.layers["0"].attention.wk.register_forward_hook(lambda *a: None)
    assert packed_projections.pack(hooked) == 2 * tiny_args().n_layers - 1
    assert "qkv" not in hooked.layers["0"].attention.packed
    assert isinstance(hooked, Qwen3)
