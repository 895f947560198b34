"""Colocation settings: one-line errors before any process starts, the "auto" decision, the memory
plan, and the engine's sleep / wake on the CPU."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from meshrl.runtime import layout, memory
from meshrl.runtime.config import ConfigError, RLConfig, validate
from meshrl.runtime.engine.api import Request, SamplingParams, generate
from meshrl.runtime.engine.native import NativeEngine
from meshrl.models.qwen3 import FLAVORS, Qwen3
from tests.random_models import scaled_random_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"flavor": "debug", "tokenizer": "char"}


@pytest.mark.parametrize("raw, message", [
    ({"layout": {"colocate": True, "num_trainer_ranks": 2}},
     "layout.num_inference_ranks (1) must equal layout.num_trainer_ranks (2) with layout.colocate = true"),
    ({"layout": {"colocate": True, "num_inference_ranks": 2}, "inference": {"tensor_parallel": 2}},
     "layout.num_inference_ranks (2) must equal layout.num_trainer_ranks (1)"),
    ({"layout": {"colocate": True, "num_trainer_ranks": 2, "num_inference_ranks": 2},
      "inference": {"tensor_parallel": 2}}, "inference.tensor_parallel (2) must be 1 with layout.colocate = true"),
    ({"inference": {"sleep_while_training": True}}, "inference.sleep_while_training needs max_off_policy_steps = 0"),
    ({"inference": {"sleep_while_training": True}, "max_off_policy_steps": 0, "layout": {"colocate": False}},
     "inference.sleep_while_training needs a colocated layout"),
    ({"layout": {"gpu_memory_gib": 24, "colocate": False}}, "layout.gpu_memory_gib applies to a colocated layout"),
])
def test_bad_colocation_settings_fail_with_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        validate(RLConfig, {"model": MODEL, **raw})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_reports_a_bad_colocation_before_starting_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", "rl", "@", str(ROOT / "configs/reverse_text/rl.toml"),
                        "--layout.colocate", "true", "--layout.num-trainer-ranks", "2", "--output-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "layout.num_inference_ranks (1) must equal layout.num_trainer_ranks (2)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_auto_colocates_only_a_one_node_gpu_job_short_of_gpus(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert layout.resolve_colocation("auto", 1, 1, 1, cuda=True) is True  # 2 GPUs needed, 1 there
    assert layout.resolve_colocation("auto", 1, 1, 1, cuda=False) is False  # CPU: split unless asked
    assert layout.resolve_colocation(True, 1, 1, 1, cuda=False) is True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert layout.resolve_colocation("auto", 1, 1, 1, cuda=True) is False  # enough GPUs: split
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="need 3 GPUs, this node has 1; sharing them"):
        layout.resolve_colocation("auto", 1, 2, 1, cuda=True)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # two nodes: "auto" never colocates
    assert layout.resolve_colocation("auto", 1, 1, 1, cuda=True) is False


def test_colocated_pairs_share_one_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    got = []
    for local_rank in range(5):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        got.append(str(layout.pick_device(True, colocated_pairs=2)))
    assert got == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cpu"]  # trainers 0, 1; engines 0, 1; controller
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="colocated layout of 3 trainer ranks needs 3 GPUs, this node has 2"):
        layout.pick_device(True, colocated_pairs=3)
    roles = layout.assign_roles(5, 2, 2, controller=4, colocated=True)
    assert [roles.peer_of(r) for r in range(4)] == [2, 3, 0, 1]


def test_the_memory_plan_refuses_a_gpu_too_small_with_the_numbers():
    model = {"flavor": "0.6B", "tokenizer": "char"}
    cfg = validate(RLConfig, {"model": model, "layout": {"colocate": True}, "trainer": {"micro_batch_tokens": 4096}})
    plan = memory.plan(cfg, 24 * memory.GIB)
    params = plan.engine_weights // 2  # engine weights are bf16: 2 bytes a parameter
    assert plan.trainer_state == 16 * params and plan.staging == 2 * params
    assert plan.kv_cache == int(0.3 * 24 * memory.GIB)
    assert plan.peak == plan.engine + plan.trainer < 24 * memory.GIB  # 0.6B, char vocabulary, 4k tokens: fits
    long = {"model": model, "trainer": {"micro_batch_tokens": 16384}, "max_off_policy_steps": 0}
    big = memory.plan(validate(RLConfig, {**long, "layout": {"colocate": True}}), 24 * memory.GIB)
    assert big.peak > 24 * memory.GIB  # 16k tokens without activation checkpointing: too much
    asleep = memory.plan(validate(RLConfig, {**long, "layout": {"colocate": True},
                                             "inference": {"sleep_while_training": True}}), 24 * memory.GIB)
    assert asleep.peak == big.peak - min(big.kv_cache, big.step_memory)
    # colocated, blocks are resharded after forward by default; kept gathered, every layer's bf16 weights count
    kept = memory.plan(validate(RLConfig, {"model": model, "layout": {"colocate": True}, "trainer": {
        "micro_batch_tokens": 4096, "parallel": {"reshard_after_forward": False}}}), 24 * memory.GIB)
    layer = plan.gathered // 4  # one layer's bf16 weights and gradients
    assert kept.gathered == 2 * layer * 28 + 2 * layer and kept.peak == plan.peak + kept.gathered - plan.gathered
    small = validate(RLConfig, {"model": {"flavor": "0.6B", "tokenizer": "char"},
                                "layout": {"colocate": True, "gpu_memory_gib": 4}})
    with pytest.raises(ValueError, match=r"one GPU cannot hold the trainer and its engine: engine .* GiB .* of 4.00 GiB"):
        memory.check(small)


def test_the_memory_plan_counts_the_recurrent_states_a_native_engine_allocates():
    """A hybrid linear-attention model (Qwen3.5) keeps a state slot per row beside its KV cache:
    the plan holds exactly what a native engine of that config allocates (0 for Qwen3)."""
    from meshrl.models import get_family

    raw = {"model": {"family": "qwen3_5", "flavor": "debug", "tokenizer": "char"}, "layout": {"colocate": True},
           "inference": {"max_num_seqs": 6, "max_model_len": 96}}
    plan = memory.plan(validate(RLConfig, raw), 24 * memory.GIB)
    fam = get_family("qwen3_5")
    args = replace(fam.flavors["debug"], vocab_size=plan_vocab(raw))
    engine = NativeEngine(fam.model_cls(args), max_num_seqs=6, max_model_len=96, device="cpu", dtype=torch.bfloat16,
                          num_blocks=8)
    assert plan.recurrent_states == engine.states.nbytes() > 0
    assert plan.engine == plan.engine_weights + plan.kv_cache + plan.recurrent_states + plan.engine_reserve + memory.CONTEXT
    assert f"recurrent states {plan.recurrent_states / memory.GIB:.2f}" in plan.describe()
    asleep = memory.plan(validate(RLConfig, {**raw, "max_off_policy_steps": 0,
                                             "inference": {**raw["inference"], "sleep_while_training": True}}),
                         24 * memory.GIB)
    assert asleep.peak == plan.peak - min(plan.kv_cache + plan.recurrent_states, plan.step_memory)  # freed asleep
    qwen3 = memory.plan(validate(RLConfig, {**raw, "model": {"flavor": "debug", "tokenizer": "char"}}), 24 * memory.GIB)
    assert qwen3.recurrent_states == 0
    moe = memory.plan(validate(RLConfig, {**raw, "model": {"family": "qwen3_moe", "flavor": "debug", "tokenizer": "char"}}),
                      24 * memory.GIB)  # a meta skeleton whose MoE dispatch cannot run: no probe forward
    assert moe.recurrent_states == 0


def plan_vocab(raw: dict) -> int:
    from meshrl.runtime.config import ModelConfig
    from meshrl.runtime.policy import load_tokenizer_for

    return len(load_tokenizer_for(validate(ModelConfig, raw["model"])))


def test_a_sleeping_engine_frees_its_cache_and_serves_the_same_after_waking():
    model = scaled_random_model(Qwen3, FLAVORS["debug"], seed=0)
    engine = NativeEngine(model, max_num_seqs=4, max_model_len=48, device="cpu", dtype=torch.float32)
    requests = lambda base: [Request(base + i, [3 + i, 5, 7], SamplingParams(temperature=0.0, max_tokens=8))  # noqa: E731
                             for i in range(3)]
    before = [c.token_ids for c in generate(engine, requests(0))]
    freed = engine.sleep()
    assert freed > 0 and engine.asleep and engine.kv.data.numel() == 0
    engine.wake()
    assert not engine.asleep
    after = [c.token_ids for c in generate(engine, requests(10))]
    assert after == before
    engine.add(requests(20)[0])
    with pytest.raises(RuntimeError, match="cannot sleep while requests are live"):
        engine.sleep()


@pytest.mark.gpu
def test_a_sleeping_engine_gives_back_its_gpu_memory_and_recaptures_its_graphs():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = scaled_random_model(Qwen3, FLAVORS["debug"], seed=0)
    engine = NativeEngine(model, max_num_seqs=8, max_model_len=64, device="cuda", dtype=torch.bfloat16,
                          kv_cache_bytes=64 * 2**20)
    assert engine.cuda_graphs and engine.kv.num_blocks - 1 >= engine.max_blocks
    requests = lambda base: [Request(base + i, [3 + i, 5, 7], SamplingParams(temperature=0.0, max_tokens=12))  # noqa: E731
                             for i in range(4)]
    before = [c.token_ids for c in generate(engine, requests(0))]
    assert engine.runner.graphs
    reserved = torch.cuda.memory_reserved()
    freed = engine.sleep()
    assert freed > 0 and not engine.runner.graphs
    assert torch.cuda.memory_reserved() <= reserved - freed  # back to the driver, not kept by the allocator
    engine.wake()
    assert [c.token_ids for c in generate(engine, requests(10))] == before
    assert engine.runner.graphs  # captured again on the new cache


def test_blocks_stay_gathered_by_default_only_on_a_one_rank_trainer_that_has_its_gpu_alone():
    from meshrl.runtime.config import ParallelConfig

    auto = ParallelConfig()
    assert not auto.reshards(1, colocated=False)
    assert auto.reshards(2, colocated=False) and auto.reshards(1, colocated=True)
    assert auto.reshards(1, colocated=False, lora=True)
    assert ParallelConfig(reshard_after_forward=True).reshards(1, colocated=False)
    assert not ParallelConfig(reshard_after_forward=False).reshards(4, colocated=True)
