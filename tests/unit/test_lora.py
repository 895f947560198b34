"""LoRA (models/common/lora.py): forward = merged forward, frozen base, config refusals, a hub folder
with adapters, the PEFT folder round trip through `peft` on the transformers model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from meshrl.models import get_family
from meshrl.models.common.attention import DocumentCausalAttention
from meshrl.models.common.lora import (LoRALinear, add_lora, copy_full, init_lora, merge_weight, policy_parameters,
                                       resolve_targets)
from meshrl.models.hf import save_hf_model
from meshrl.parallel import full_adapters, full_tensors
from meshrl.runtime.config import ConfigError, LoRAConfig, ModelConfig, RLConfig, load_config
from meshrl.runtime.policy import build_trainer_policy, check_model_source

FAMILY = get_family("qwen3")
ARGS = FAMILY.flavors["debug"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(seed: int = 0, args=ARGS):
    with torch.device("meta"):
        model = FAMILY.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def randomize_b(model, seed: int = 1) -> None:
    """Non-zero B everywhere (a fresh adapter has B = 0 and would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                copy_full(m.lora_b, 0.05 * torch.randn(m.lora_b.shape, generator=gen))


def lora_model(targets=TARGETS, rank: int = 4, alpha: float = 8.0, args=ARGS):
    model = base_model(args=args)
    add_lora(model, FAMILY.state_dict_adapter(args), rank, alpha, 0.0, targets)
    init_lora(model, seed=0)
    randomize_b(model)
    return model


def inputs():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ARGS.vocab_size, (1, 48), generator=gen)
    positions = torch.cat([torch.arange(30), torch.arange(18)])[None]
    doc_ids = torch.cat([torch.zeros(30), torch.ones(18)]).long()[None]
    return ids, positions, DocumentCausalAttention(doc_ids)


def test_lora_forward_equals_the_merged_models_forward():
    model = lora_model()
    merged = base_model(seed=7)  # other values until loaded
    state = dict(full_tensors(model))
    assert list(state) == [n for n, _ in merged.named_parameters()]  # the base architecture's names, in order
    merged.load_state_dict(state, strict=True)
    ids, pos, attn = inputs()
    with torch.no_grad():
        got, want = model(ids, pos, attn), merged(ids, pos, attn)
        plain = base_model()(ids, pos, attn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3, "the adapters must change the output"


def test_only_adapters_train_and_a_fresh_adapter_is_the_base_model():
    model = base_model()
    chosen = add_lora(model, FAMILY.state_dict_adapter(ARGS), 4, 8.0, 0.0, ["q_proj", "wv"])
    init_lora(model, seed=0)
    assert sorted(chosen) == sorted(f"layers.{i}.attention.w{x}" for i in range(ARGS.n_layers) for x in "qv")
    assert set(chosen.values()) == {"q_proj", "v_proj"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{p}.lora_{x}" for p in chosen for x in "ab"}
    assert [n for n, _ in policy_parameters(model)] == [n for n, _ in base_model().named_parameters()]
    for (name, t), (_, ref) in zip(full_tensors(model), base_model().named_parameters()):
        assert torch.equal(t, ref), f"{name}: B = 0 merges to the base weight"
    a = model.get_submodule("layers.0.attention.wq").lora_a
    assert 0 < a.abs().max() <= 1 / ARGS.dim ** 0.5


def test_merge_is_peft_formula():
    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    assert torch.equal(merge_weight(w, a, b, 4.0), w + (b @ a) * 4.0)


def test_unknown_target_names_the_modules_that_exist():
    with pytest.raises(ValueError, match=r"model.lora.target_modules: 'qkv_proj' names no linear module.*"
                                         r"down_proj \(w2\).*q_proj \(wq\)"):
        resolve_targets(base_model(), FAMILY.state_dict_adapter(ARGS), ["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="'qkv_proj' names no linear module"):
        check_model_source(ModelConfig(flavor="debug", tokenizer="char", lora={"target_modules": ["qkv_proj"]}))


@pytest.mark.parametrize("override, expected", [
    (["--model.lora.rank", "0"], "model.lora.rank: Input should be greater than or equal to 1"),
    (["--model.lora.dropout", "1.0"], "model.lora.dropout: Input should be less than 1"),
    (["--model.lora.target-modules", "[]"], "model.lora.target_modules: name at least one module"),
    (["--model.lora.target-modules", '["q_proj", "q_proj"]'], "names a module twice"),
    (["--model.lora.ranks", "4"], "model.lora.ranks: unknown key"),
])
def test_bad_lora_config_is_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["--model.flavor", "debug", "--model.tokenizer", "char", *override])
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_lora_from_the_cli_and_the_bad_target_exit_2(tmp_path):
    cfg, _ = load_config(RLConfig, ["--model.flavor", "debug", "--model.tokenizer", "char", "--model.lora.rank", "8"])
    assert cfg.model.lora == LoRAConfig(rank=8)
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", "rl", "--model.flavor", "debug",
                        "--model.tokenizer", "char", "--model.lora.target-modules", '["nope"]',
                        "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "'nope' names no linear module" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_an_hf_folder_loads_under_lora_and_the_adapters_are_initialised(tmp_path):
    save_hf_model(base_model(), ARGS, tmp_path / "base")
    cfg = ModelConfig(path=str(tmp_path / "base"), lora={"rank": 4, "target_modules": ["q_proj", "down_proj"]})
    model, _ = build_trainer_policy(cfg, torch.device("cpu"), lambda m: m)
    ref = base_model()
    for (name, t), (_, r) in zip(full_tensors(model), ref.named_parameters(), strict=True):
        assert torch.equal(t, r), name  # B = 0: the merged policy is the folder's model
    a = model.get_submodule("layers.1.feed_forward.w2").lora_a
    assert a.abs().max() > 0 and a.requires_grad and not model.get_submodule("layers.1.feed_forward.w2").weight.requires_grad


def _hf_logits(folder, ids, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("tie", [True, False])
def test_peft_round_trip_loads_our_adapter_on_the_transformers_model(tmp_path, tie):
    """Our export's adapter/ folder, loaded by peft onto the base folder's transformers model,
    gives our LoRA model's logits; the export itself holds the merged policy."""
    pytest.importorskip("peft")
    from meshrl.runtime.checkpoint import export_hf
    from meshrl.runtime.tokenizer import build_char_tokenizer

    args = ARGS if tie else type(ARGS)(**{**ARGS.__dict__, "tie_embeddings": False})
    tokenizer = build_char_tokenizer()
    args = type(args)(**{**args.__dict__, "vocab_size": len(tokenizer)})
    save_hf_model(base_model(args=args), args, tmp_path / "base")
    model = lora_model(targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], rank=4, alpha=16.0, args=args)
    export_hf(model, args, tokenizer, tmp_path / "final", leader=True, base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "final" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ids = torch.randint(3, args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(20).expand(2, 20))
    peft_logits = _hf_logits(tmp_path / "base", ids, tmp_path / "final" / "adapter")
    torch.testing.assert_close(peft_logits, ours, rtol=1e-5, atol=1e-5)
    merged_logits = _hf_logits(tmp_path / "final", ids)
    torch.testing.assert_close(merged_logits, ours, rtol=1e-5, atol=1e-5)
    assert (peft_logits - _hf_logits(tmp_path / "base", ids)).abs().max() > 1e-3  # the adapter matters
    adapters = full_adapters(model)
    assert set(adapters) == {p for p, m in model.named_modules() if isinstance(m, LoRALinear)}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_compiled_lora_blocks_match_eager(monkeypatch):
    """torch.compile of every block (FSDP2 over a world of one, selective checkpointing) with LoRA:
    no graph break, the same logprobs and adapter gradients as eager."""
    import os

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from meshrl.parallel import parallelize
    from meshrl.parallel.dims import ParallelDims, build_meshes
    from meshrl.runtime.train.logprob_head import LogprobHead
    from tests.dist.multirank import free_port

    def run(compile: bool):
        model = lora_model()
        meshes = build_meshes(ParallelDims.resolve(1), [0], 0, "cpu")
        parallelize(model, meshes, torch.float32, ac="selective", compile=compile)
        ids, positions, attn = inputs()
        out = []
        for _ in range(2):  # the second call reuses the compiled graphs
            lp, _ = model(ids, positions, attn, head=LogprobHead(torch.roll(ids, -1, 1), 0.7))
            lp.sum().backward()
            out.append(lp.detach())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        return out, grads

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)  # not left behind for later tests (the CLI reads WORLD_SIZE)
    dist.init_process_group("gloo")
    try:
        counters.clear()
        eager, eager_grads = run(compile=False)
        compiled, compiled_grads = run(compile=True)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"].get("fxgraph_cache_hit", 0) > 0
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert eager_grads.keys() == compiled_grads.keys() and eager_grads
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()


def test_the_colocated_memory_plan_counts_a_frozen_base():
    """With LoRA the trainer holds fp32 base weights plus gradients and AdamW moments of the
    adapters only: the 8B shape on one 139 GiB GPU is refused without LoRA and planned with it."""
    from meshrl.runtime import memory
    from meshrl.runtime.config import validate

    raw = {"model": {"flavor": "8B", "tokenizer": "char"}, "layout": {"colocate": True},
           "trainer": {"micro_batch_tokens": 4096, "parallel": {"activation_checkpointing": "full"}}}
    full = memory.plan(validate(RLConfig, raw), 139 * memory.GIB)
    lora = memory.plan(validate(RLConfig, {**raw, "model": {**raw["model"], "lora": {"rank": 16}}}), 139 * memory.GIB)
    params = full.engine_weights // 2
    fam = FAMILY.flavors["8B"]
    per_layer = 16 * (2 * (fam.dim + fam.n_heads * fam.head_dim) + 2 * (fam.dim + fam.n_kv_heads * fam.head_dim)
                      + 3 * (fam.dim + fam.hidden_dim))  # r * (in + out) of q and o, k and v, gate, up, down
    assert full.trainer_state == 16 * params
    assert lora.trainer_state == 4 * params + 16 * fam.n_layers * per_layer
    assert full.peak > 139 * memory.GIB > lora.peak
