"""Qwen3-MoE parity with transformers (logits, gradients, aux loss), HF folders both ways, MoE stats."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import Qwen2MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

from meshrl.models import get_family
from meshrl.models.common.moe import MoE, moe_aux_loss, pop_moe_stats, record_moe_stats
from meshrl.models.hf import load_hf_model, save_hf_model
from meshrl.models.qwen3 import FLAVORS as QWEN3_FLAVORS, Qwen3
from meshrl.models.qwen3_moe import FLAVORS, Qwen3Moe, Qwen3MoeArgs, Qwen3MoeStateDictAdapter

VOCAB = 96


def tiny_args(**overrides) -> Qwen3MoeArgs:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                moe_hidden_dim=32, num_experts=8, top_k=2, mlp_only_layers=(1,))
    return Qwen3MoeArgs(**{**base, **overrides})


def build(args: Qwen3MoeArgs, seed: int = 0) -> Qwen3Moe:
    with torch.device("meta"):
        model = Qwen3Moe(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms expose a swapped norm
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.weight"):
                # Decisive routing: with N(0, 0.02) routers the top-k of near-uniform
                # probabilities could flip on 1e-7 differences between the two implementations.
                p.normal_(0.0, 0.5, generator=gen)
    return model


def hf_twin(model: Qwen3Moe, args: Qwen3MoeArgs, tmp_path) -> Qwen3MoeForCausalLM:
    save_hf_model(model, args, tmp_path / "ours")
    return Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32, attn_implementation="eager")


def positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).expand(batch, seq)


def hf_per_expert(named: dict[str, torch.Tensor], moe_hidden_dim: int) -> dict[str, torch.Tensor]:
    """transformers 5's fused in-memory expert tensors -> the per-expert hub keys."""
    out = {}
    for key, value in named.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for j in range(value.shape[0]):
                out[f"{prefix}{j}.gate_proj.weight"] = value[j, :moe_hidden_dim]
                out[f"{prefix}{j}.up_proj.weight"] = value[j, moe_hidden_dim:]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for j in range(value.shape[0]):
                out[f"{prefix}{j}.down_proj.weight"] = value[j]
        else:
            out[key] = value
    return out


# Dense layers via mlp_only_layers and via decoder_sparse_step; norm_topk_prob both ways; tied and untied.
PARITY_CASES = [
    dict(norm_topk_prob=True, tie_embeddings=False),
    dict(norm_topk_prob=False, tie_embeddings=True, n_layers=4, mlp_only_layers=(), decoder_sparse_step=2),
]


@pytest.mark.parametrize("overrides", PARITY_CASES)
def test_logits_and_gradients_match_transformers(overrides, tmp_path):
    args = tiny_args(**overrides)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    kinds = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert kinds == [args.is_moe_layer(i) for i in range(args.n_layers)]
    assert any(kinds) and not all(kinds)

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 17), generator=gen)
    ours = model(tokens, positions(3, 17))
    theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5

    def loss_fn(logits):
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    loss_fn(ours).backward()
    loss_fn(theirs).backward()
    ours_grads = Qwen3MoeStateDictAdapter(args).to_hf({k: p.grad for k, p in model.named_parameters()})
    theirs_grads = hf_per_expert({k: p.grad for k, p in hf.named_parameters()}, args.moe_hidden_dim)
    assert ours_grads.keys() == theirs_grads.keys()
    for key in ours_grads:
        torch.testing.assert_close(ours_grads[key], theirs_grads[key], rtol=1e-4, atol=1e-6, msg=key)


def test_aux_loss_matches_transformers(tmp_path):
    # One MoE layer: transformers' aux loss (which pools all layers) is exactly ours.
    args = tiny_args(n_layers=2, mlp_only_layers=(0,))
    model = build(args)
    hf = hf_twin(model, args, tmp_path / "one")
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    model(tokens, positions(2, 13))
    out = hf(tokens, output_router_logits=True)
    ours = moe_aux_loss(model)
    torch.testing.assert_close(ours, out.aux_loss, rtol=1e-6, atol=1e-6)
    # Differentiable the same way: compare the router gradients of the aux loss alone.
    ours.backward()
    out.aux_loss.backward()
    torch.testing.assert_close(model.layers["1"].moe.router.weight.grad, hf.model.layers[1].mlp.gate.weight.grad,
                               rtol=1e-4, atol=1e-7)

    # Several MoE layers: ours is the sum of per-layer losses, each equal to transformers' formula.
    args = tiny_args(n_layers=3, mlp_only_layers=())
    model = build(args, seed=5)
    hf = hf_twin(model, args, tmp_path / "three")
    with torch.no_grad():
        model(tokens, positions(2, 13))
        out = hf(tokens, output_router_logits=True)
    per_layer = [load_balancing_loss_func((logits,), args.num_experts, args.top_k) for logits in out.router_logits]
    for i, expected in enumerate(per_layer):
        torch.testing.assert_close(model.layers[str(i)].moe.aux_loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe_aux_loss(model), torch.stack(per_layer).sum(), rtol=1e-6, atol=1e-6)


def test_moe_stats_and_dense_models():
    args = tiny_args()
    model = build(args)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, VOCAB, (2, 9), generator=gen) for _ in range(2)]
    counts = {i: torch.zeros(args.num_experts) for i in ("0", "2")}
    aux_sums = []
    with torch.no_grad():
        for tokens in batches:
            # Recompute each MoE layer's routing from its input, captured with a forward pre-hook.
            seen = {}
            hooks = [model.layers[i].moe.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0]))
                     for i in counts]
            model(tokens, positions(2, 9))
            record_moe_stats(model)  # the trainer does this after every forward
            for h in hooks:
                h.remove()
            for i in counts:
                _, top_i, _ = model.layers[i].moe.route(seen[i].reshape(-1, args.dim))
                counts[i] += torch.bincount(top_i.flatten(), minlength=args.num_experts)
            aux_sums.append(moe_aux_loss(model).item())
    stats = pop_moe_stats(model)
    loads = [c / c.sum() * args.num_experts for c in counts.values()]
    assert stats["moe/aux_loss"] == pytest.approx(sum(aux_sums) / 2, rel=1e-6)
    assert stats["moe/load_max"] == pytest.approx(sum(l.max().item() for l in loads) / 2, rel=1e-6)
    assert stats["moe/load_min"] == pytest.approx(sum(l.min().item() for l in loads) / 2, rel=1e-6)
    assert stats["moe/load_min"] <= 1.0 <= stats["moe/load_max"]
    assert pop_moe_stats(model) == {}  # reset

    dense = Qwen3(QWEN3_FLAVORS["debug"])
    dense.init_weights(seed=0)
    dense(torch.zeros(1, 4, dtype=torch.long), positions(1, 4))
    assert moe_aux_loss(dense) is None and pop_moe_stats(dense) == {}
    with pytest.raises(ValueError, match="forward"):
        moe_aux_loss(build(args))


def test_shared_expert_matches_qwen2_moe_block():
    """The optional Qwen2-MoE shared expert (sigmoid-gated), checked against transformers' block."""
    config = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=48,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    torch.manual_seed(0)
    theirs = Qwen2MoeSparseMoeBlock(config)
    ours = MoE(32, 16, 6, 2, norm_topk_prob=False, shared_hidden_dim=48)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
        ours.router.weight.copy_(theirs.gate.weight)
        ours.experts.w1.copy_(theirs.experts.gate_up_proj[:, :16])
        ours.experts.w3.copy_(theirs.experts.gate_up_proj[:, 16:])
        ours.experts.w2.copy_(theirs.experts.down_proj)
        ours.shared_expert.w1.weight.copy_(theirs.shared_expert.gate_proj.weight)
        ours.shared_expert.w3.weight.copy_(theirs.shared_expert.up_proj.weight)
        ours.shared_expert.w2.weight.copy_(theirs.shared_expert.down_proj.weight)
        ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
        x = torch.randn(2, 7, 32)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_our_folder_round_trips_and_is_hub_layout(tmp_path):
    args = tiny_args()
    model = build(args)
    save_hf_model(model, args, tmp_path / "m", eos_token_id=2)
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys and "model.layers.0.mlp.gate.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys and not any("gate_up_proj" in k for k in keys)
    loaded, loaded_args = load_hf_model(tmp_path / "m")
    assert loaded_args == args and isinstance(loaded, Qwen3Moe)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


@pytest.mark.parametrize("original_format", [True, False])
def test_folders_saved_by_transformers_load(original_format, tmp_path):
    """transformers 5 writes per-expert keys by default and fused ones without save_original_format."""
    args = tiny_args(tie_embeddings=True)
    model = build(args)
    hf = hf_twin(model, args, tmp_path)
    hf.save_pretrained(tmp_path / "theirs", save_original_format=original_format, max_shard_size="100KB")
    loaded, loaded_args = load_hf_model(tmp_path / "theirs")
    assert loaded_args == args
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


def test_adapter_collects_experts_across_calls_and_rejects_bad_keys():
    args = tiny_args()
    adapter = Qwen3MoeStateDictAdapter(args)
    hf_state = adapter.to_hf(build(args).state_dict())
    out = {}
    for key, value in hf_state.items():  # one key per call, as models/hf.py loads
        out.update(adapter.from_hf({key: value}))
    assert adapter.pending() == []
    assert out.keys() == build(args).state_dict().keys()

    adapter.from_hf({"model.layers.0.mlp.experts.3.up_proj.weight": torch.zeros(32, 64)})
    assert adapter.pending() == ["layers.0.moe.experts.w3"]
    with pytest.raises(ValueError, match="twice"):
        adapter.from_hf({"model.layers.0.mlp.experts.3.up_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match="expert 8"):
        adapter.from_hf({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match="dense layer"):
        adapter.from_hf({"model.layers.1.mlp.gate.weight": torch.zeros(8, 64)})
    with pytest.raises(ValueError, match="MoE layer"):
        adapter.from_hf({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match="layer 5"):
        adapter.from_hf({"model.layers.5.self_attn.q_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unknown"):
        adapter.to_hf({"layers.0.moe.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="gather"):
        adapter.to_hf({"layers.0.moe.experts.w1": torch.zeros(4, 32, 64)})  # an expert-parallel shard


def test_flavors_and_config_round_trip():
    for name, args in FLAVORS.items():
        assert Qwen3MoeArgs.from_hf_config(args.to_hf_config(dtype=torch.bfloat16, eos_token_id=2)) == args, name
    # transformers 5 writes num_local_experts instead of num_experts.
    config = FLAVORS["debug"].to_hf_config()
    config["num_local_experts"] = config.pop("num_experts")
    assert Qwen3MoeArgs.from_hf_config(config) == FLAVORS["debug"]
    assert get_family("qwen3_moe").model_cls is Qwen3Moe
    # The real shapes: 30.5B / 3.3B active and 235B / 22B active.
    for name, total, active in (("30B-A3B", 30.53e9, 3.35e9), ("235B-A22B", 235.09e9, 22.19e9)):
        args = FLAVORS[name]
        with torch.device("meta"):
            n = sum(p.numel() for p in Qwen3Moe(args).parameters())
        unused = args.n_layers * (args.num_experts - args.top_k) * 3 * args.moe_hidden_dim * args.dim
        assert n == pytest.approx(total, rel=1e-3) and n - unused == pytest.approx(active, rel=1e-2), name


def test_init_weights_is_seeded():
    args = FLAVORS["debug"]
    a, b = Qwen3Moe(args), Qwen3Moe(args)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    experts = a.layers["0"].moe.experts
    assert experts.w2.std().item() < 0.02 / 1.5 < experts.w1.std().item()  # depth-scaled residual projection


def test_unsupported_configs_raise():
    config = FLAVORS["debug"].to_hf_config()
    cases = [
        ({"model_type": "qwen3"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "sliding"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "RoPE"),
        ({"shared_expert_intermediate_size": 64}, "shared expert"),
        ({"num_experts_per_tok": 9}, "top_k"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            Qwen3MoeArgs.from_hf_config({**config, **change})
    without = {k: v for k, v in config.items() if k != "num_experts"}
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3MoeArgs.from_hf_config(without)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_mm_matches_expert_loop():
    """bf16 on CUDA: the grouped GEMM path gives the loop's outputs and gradients (zero-row experts too)."""
    torch.manual_seed(0)
    moe = MoE(256, 128, 16, 4, norm_topk_prob=True).cuda().to(torch.bfloat16)
    with torch.no_grad():
        moe.init_weights(0.05, 0.05)
        moe.router.weight.normal_(0.0, 0.5)
        moe.router.weight[3:5] = -1.0  # with positive inputs experts 3 and 4 are never chosen: empty groups
    x = torch.randn(3, 37, 256, device="cuda").abs().to(torch.bfloat16).requires_grad_()
    results = []
    for grouped in (True, False):
        moe.experts.use_grouped_mm = grouped
        moe.zero_grad()
        x.grad = None
        y = moe(x)
        y.float().square().sum().backward()
        results.append((y.float(), x.grad.float(), moe.experts.w1.grad.float(), moe.experts.w2.grad.float()))
    for a, b in zip(*results):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item() + 1e-3
    for w1_grad in (results[0][2], results[1][2]):  # empty groups get exact zeros, not stale memory
        assert w1_grad[3:5].abs().max().item() == 0 and w1_grad.abs().max().item() > 0
