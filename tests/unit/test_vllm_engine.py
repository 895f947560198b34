"""The vLLM adapter's own logic, against a fake `vllm` module (real vLLM is not installable here).

The fake mimics the surface runtime/engine/vllm_engine.py uses: EngineArgs, LLMEngine.from_engine_args,
add_request / step / abort_request / collective_rpc, SamplingParams, TokensPrompt,
RequestOutputKind, and RequestOutput / CompletionOutput / Logprob with DELTA outputs (only the new
tokens of each step). Its "model" samples a token that is a pure function of the prompt, the sample
index, the position and how many weight loads happened, so tests can tell which weights made a
token. Its worker is built from the worker_extension_cls qualified name, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from meshrl.models import qwen3
from meshrl.runtime import weight_sync
from meshrl.runtime.config import InferenceConfig, ModelConfig, RLConfig
from meshrl.runtime.engine.api import Request, SamplingParams
from meshrl.runtime.engine.vllm_engine import (
    WORKER_EXTENSION,
    VLLMEngine,
    build_vllm_engine,
    pack_tensors,
)
from meshrl.runtime.policy import policy_skeleton

VOCAB = 128

# ----------------------------------------------------------------------------- the fake vllm


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]
    finish_reason: str | None


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: list[FakeCompletionOutput]
    finished: bool


class FakeRequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeEngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.n = kwargs.get("n", 1)


def fake_token(prompt: list[int], index: int, position: int, num_loads: int) -> int:
    return (sum(prompt) + 3 * index + position + 5 * num_loads) % VOCAB


def fake_logprob(token: int, num_loads: int) -> float:
    return -0.01 * (token + 1) - 0.5 * num_loads


class FakeVLLMModel:
    """vLLM's model inside the worker: records what load_weights received."""

    def __init__(self):
        self.loads: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights):
        self.loads.append([(name, t.clone()) for name, t in weights])


@dataclass
class FakeChild:
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class FakeLLMEngine:
    tokens_per_step = 1

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    def __init__(self, engine_args):
        self.args = engine_args.kwargs
        self.env = {var: os.environ.get(var) for var in
                    ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "RANK", "MASTER_PORT",
                     "TORCHELASTIC_USE_AGENT_STORE")}
        module, name = self.args["worker_extension_cls"].rsplit(".", 1)
        extension = getattr(importlib.import_module(module), name)
        self.worker = type("FakeWorker", (extension,), {})()
        self.worker.device = torch.device("cpu")
        self.worker.model_runner = SimpleNamespace(model=FakeVLLMModel())
        self.requests: dict[str, tuple[list[int], FakeSamplingParams, list[FakeChild]]] = {}
        self.aborted: list[str] = []

    @property
    def num_loads(self) -> int:
        return len(self.worker.model_runner.model.loads)

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and request_id not in self.requests
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params, [FakeChild() for _ in range(params.n)])

    def step(self):
        outputs = []
        for rid, (prompt, params, children) in list(self.requests.items()):
            assert params.kwargs["output_kind"] is FakeRequestOutputKind.DELTA
            completions = []
            for index, child in enumerate(children):
                if child.done:
                    continue
                new, reason = [], None
                for _ in range(self.tokens_per_step):
                    token = fake_token(prompt, index, len(child.tokens), self.num_loads)
                    child.tokens.append(token)
                    new.append(token)
                    if token in params.kwargs["stop_token_ids"]:
                        reason = "stop"
                    elif len(child.tokens) >= params.kwargs["max_tokens"]:
                        reason = "length"
                    if reason is not None:
                        child.done = True
                        break
                completions.append(FakeCompletionOutput(
                    index, new, [{t: FakeLogprob(fake_logprob(t, self.num_loads))} for t in new], reason))
            finished = all(c.done for c in children)
            if finished:
                del self.requests[rid]
            outputs.append(FakeRequestOutput(rid, completions, finished))
        return outputs

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for rid in request_ids:
            self.requests.pop(rid, None)

    def sleep(self, level=1, mode="abort"):
        assert self.args["enable_sleep_mode"] and not self.requests
        self.sleeps = getattr(self, "sleeps", 0) + 1

    def wake_up(self, tags=None):
        self.wakes = getattr(self, "wakes", 0) + 1

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.EngineArgs = FakeEngineArgs
    vllm.LLMEngine = FakeLLMEngine
    vllm.SamplingParams = FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kwargs: dict(kwargs)  # a TypedDict in vLLM
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = FakeRequestOutputKind
    vllm.inputs, vllm.sampling_params = inputs, sampling_params
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    monkeypatch.setattr(FakeLLMEngine, "tokens_per_step", 1)
    return vllm


def tiny_args(tie: bool = True) -> qwen3.Qwen3Args:
    return dataclasses.replace(qwen3.FLAVORS["debug"], vocab_size=VOCAB, tie_embeddings=tie)


def make_engine(tmp_path, tie: bool = True, tokenizer=None, **kwargs) -> VLLMEngine:
    args = tiny_args(tie)
    with torch.device("meta"):
        skeleton = qwen3.Qwen3(args)
    return VLLMEngine(skeleton, qwen3.Qwen3StateDictAdapter(args), tmp_path, device="cpu", dtype=torch.float32,
                      max_num_seqs=8, max_model_len=32, tokenizer=tokenizer, **kwargs)


def run_all(engine: VLLMEngine) -> list:
    done = []
    while engine.has_work():
        done += engine.step()
    return done


# ----------------------------------------------------------------------------- construction and mapping


def test_engine_args_and_environment(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # torchrun sets it; left in place, the worker's store would wait for a server nobody starts
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    engine = make_engine(tmp_path, seed=7, gpu_memory_utilization=0.6, enforce_eager=True)
    args = engine._engine.args
    assert args["model"] == str(tmp_path)
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["distributed_executor_backend"] == "mp" and args["tensor_parallel_size"] == 1
    assert args["worker_extension_cls"] == WORKER_EXTENSION
    assert args["load_format"] == "dummy"
    assert args["enable_prefix_caching"] is False and args["async_scheduling"] is False
    assert args["skip_tokenizer_init"] is True and args["tokenizer"] is None
    assert args["generation_config"] == "vllm"
    assert (args["dtype"], args["seed"], args["max_model_len"], args["max_num_seqs"]) == ("float32", 7, 32, 8)
    assert (args["gpu_memory_utilization"], args["enforce_eager"]) == (0.6, True)
    # while vLLM builds: in-process EngineCore, spawned worker, no torchrun variables
    assert engine._engine.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                                  "RANK": None, "MASTER_PORT": None, "TORCHELASTIC_USE_AGENT_STORE": None}
    # and restored afterwards
    assert os.environ["RANK"] == "3" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_sampling_params_mapping(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    engine.add(Request(4, [1, 2, 3], SamplingParams(temperature=0.7, max_tokens=5, stop_token_ids=(9, 10), seed=11)))
    prompt, params, _ = engine._engine.requests["4"]
    assert prompt == [1, 2, 3]
    assert params.kwargs == dict(n=1, temperature=0.7, top_p=1.0, max_tokens=5, stop_token_ids=[9, 10], seed=11,
                                 logprobs=0, ignore_eos=True, output_kind=FakeRequestOutputKind.DELTA,
                                 detokenize=False)


def test_sampling_fields_beyond_the_native_ones(fake_vllm, tmp_path):
    # n, top_k (off as 0, -1 or None), min_p and stop strings, which the native SamplingParams may gain
    base = dict(temperature=1.0, top_p=1.0, max_tokens=4, stop_token_ids=(), seed=None)
    engine = make_engine(tmp_path, tokenizer=tmp_path)
    assert engine._engine.args["skip_tokenizer_init"] is False
    engine.add(Request(1, [5], SimpleNamespace(**base, n=2, top_k=-1, min_p=0.0, stop=("END",))))
    params = engine._engine.requests["1"][1]
    assert params.kwargs["n"] == 2 and params.kwargs["stop"] == ["END"] and params.kwargs["detokenize"] is True
    assert "top_k" not in params.kwargs and "min_p" not in params.kwargs

    engine = make_engine(tmp_path)  # no tokenizer
    with pytest.raises(ValueError, match="stop strings"):
        engine.add(Request(1, [5], SimpleNamespace(**base, stop=("END",))))
    for extra in (dict(top_k=5), dict(min_p=0.1)):
        with pytest.raises(ValueError, match="truncate"):
            engine.add(Request(2, [5], SimpleNamespace(**base, **extra)))
    with pytest.raises(ValueError, match="truncate"):
        engine.add(Request(3, [5], SamplingParams(top_p=0.9)))
    assert not engine.has_work() and not engine._engine.requests


def test_add_rejects_requests_it_cannot_serve(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    with pytest.raises(ValueError, match="prompt has 0 tokens"):
        engine.add(Request(1, []))
    with pytest.raises(ValueError, match="prompt has 32 tokens"):
        engine.add(Request(1, [1] * 32))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add(Request(1, [1, VOCAB]))
    engine.add(Request(1, [1]))
    with pytest.raises(ValueError, match="already live"):
        engine.add(Request(1, [2]))


# ----------------------------------------------------------------------------- generation


def test_tokens_logprobs_and_finish(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    prompt = [3, 4]
    stop = fake_token(prompt, 0, 2, 0)  # the third token is the stop token
    engine.add(Request(7, prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop,))))
    engine.add(Request(8, [1], SamplingParams(max_tokens=2)))
    done = {c.request_id: c for c in run_all(engine)}
    expected = [fake_token(prompt, 0, i, 0) for i in range(3)]
    assert done[7].token_ids == expected and done[7].finish_reason == "stop"
    assert done[7].logprobs == [fake_logprob(t, 0) for t in expected]
    assert all(isinstance(x, float) for x in done[7].logprobs)
    assert done[7].prompt_ids == prompt and done[7].versions == [0, 0, 0]
    assert len(done[8].token_ids) == 2 and done[8].finish_reason == "length"


def test_several_tokens_in_one_step_keep_their_logprobs(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeLLMEngine, "tokens_per_step", 2)
    engine = make_engine(tmp_path)
    engine.add(Request(1, [2], SamplingParams(max_tokens=5)))
    assert len(engine.step()) == 0
    (done,) = run_all(engine)
    expected = [fake_token([2], 0, i, 0) for i in range(5)]
    assert done.token_ids == expected and done.logprobs == [fake_logprob(t, 0) for t in expected]


def test_versions_per_token_across_a_weight_update(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    prompt = [1, 2]
    engine.add(Request(1, prompt, SamplingParams(max_tokens=5)))
    assert engine.step() == [] and engine.step() == []
    # between two steps: new weights, then the new version (what run_inference does)
    model = qwen3.Qwen3(tiny_args())
    engine.load_weights(model.named_parameters())
    engine.set_version(1)
    (done,) = run_all(engine)
    assert done.versions == [0, 0, 1, 1, 1]
    loads = [0, 0, 1, 1, 1]
    expected = [fake_token(prompt, 0, i, n) for i, n in enumerate(loads)]
    assert done.token_ids == expected  # tokens 3..5 come from the new weights
    assert done.logprobs == [fake_logprob(t, n) for t, n in zip(expected, loads)]


def test_n_samples_come_back_together(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    prompt = [6]
    stop = fake_token(prompt, 0, 1, 0)  # sample 0 stops at its second token, the others run to max_tokens
    assert all(stop != fake_token(prompt, i, j, 0) for i in (1, 2) for j in range(4))
    engine.add(Request(5, prompt, SimpleNamespace(temperature=1.0, top_p=1.0, max_tokens=4, stop_token_ids=(stop,),
                                                  seed=3, n=3)))
    for _ in range(3):
        assert engine.step() == []  # sample 0 has finished, samples 1 and 2 have not
    done = engine.step()
    assert [c.request_id for c in done] == [5, 5, 5]
    assert [c.finish_reason for c in done] == ["stop", "length", "length"]
    for index, c in enumerate(done):
        assert c.token_ids == [fake_token(prompt, index, j, 0) for j in range(len(c.token_ids))]
        assert c.logprobs == [fake_logprob(t, 0) for t in c.token_ids]
    assert [len(c.token_ids) for c in done] == [2, 4, 4]
    assert not engine.has_work()


def test_abort(fake_vllm, tmp_path):
    engine = make_engine(tmp_path)
    engine.add(Request(1, [1], SamplingParams(max_tokens=10)))
    engine.add(Request(2, [2], SamplingParams(max_tokens=10)))
    engine.step()
    engine.step()
    aborted = engine.abort(1)
    assert aborted.finish_reason == "abort" and aborted.request_id == 1
    assert aborted.token_ids == [fake_token([1], 0, i, 0) for i in range(2)] and aborted.versions == [0, 0]
    assert engine._engine.aborted == ["1"]
    assert engine.abort(1) is None and engine.abort(99) is None
    engine.add(Request(3, [3]))  # never stepped: nothing generated yet
    assert engine.abort(3).token_ids == []
    (done,) = run_all(engine)
    assert done.request_id == 2 and done.finish_reason == "length"


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("tie", [True, False])
def test_weights_reach_vllm_under_hf_names(fake_vllm, tmp_path, tie):
    engine = make_engine(tmp_path, tie=tie)
    model = qwen3.Qwen3(tiny_args(tie))
    model.init_weights(seed=0)
    engine.load_weights(model.named_parameters())
    (load,) = engine._engine.worker.model_runner.model.loads
    got = dict(load)
    want = qwen3.Qwen3StateDictAdapter(tiny_args(tie)).to_hf(dict(model.named_parameters()))
    assert list(got) == list(want)
    assert "model.embed_tokens.weight" in got and "model.layers.1.self_attn.q_proj.weight" in got
    assert ("lm_head.weight" in got) == (not tie)  # vLLM ties the head to the embedding itself
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_receive_weights_follows_the_trainer_bucket_plan(fake_vllm, tmp_path, monkeypatch, tie):
    """send_weights (trainer) -> broadcast -> receive_weights (vLLM engine): same buckets, HF names."""
    model = qwen3.Qwen3(tiny_args(tie))
    model.init_weights(seed=1)
    wire: list[torch.Tensor] = []

    def record(tensor, src, group=None):
        wire.append(tensor.clone())

    monkeypatch.setattr(dist, "broadcast", record)
    bucket_mb = 0.02  # ~20 KiB: several buckets for the debug flavor
    weight_sync.send_weights(model, object(), 0, torch.float32, bucket_mb, torch.device("cpu"))
    assert len(wire) > 2

    def replay(tensor, src, group=None):
        tensor.copy_(wire.pop(0))

    monkeypatch.setattr(dist, "broadcast", replay)
    engine = make_engine(tmp_path, tie=tie)
    engine.receive_weights(object(), 0, torch.float32, bucket_mb, torch.device("cpu"))
    assert not wire
    loads = engine._engine.worker.model_runner.model.loads
    assert len(loads) > 2  # one load per bucket
    got = {name: t for load in loads for name, t in load}
    want = qwen3.Qwen3StateDictAdapter(tiny_args(tie)).to_hf(dict(model.named_parameters()))
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_colocated_weights_reach_vllm_from_the_trainers_buffer(fake_vllm, tmp_path, monkeypatch, tie):
    """Colocated layout: the engine rank hands views of the trainer's shared buffer to vLLM's
    load_weights (HF names, the values the trainer wrote), then signals "copied"."""
    model = qwen3.Qwen3(tiny_args(tie))
    model.init_weights(seed=2)
    entries, numel = weight_sync.flat_plan(model)
    trainer_buffer = torch.empty(numel)
    for (offset, shape), (_, p) in zip(entries, model.named_parameters()):
        trainer_buffer[offset:offset + p.numel()].view(shape).copy_(p.detach())
    signals = []
    monkeypatch.setattr(dist, "isend", lambda t, dst, group=None: signals.append((int(t), dst)) or SimpleNamespace(
        wait=lambda: None))
    engine = make_engine(tmp_path, tie=tie)
    receiver = weight_sync.ColocatedReceiver(engine.model, torch.float32, torch.device("cpu"), 0, None, None,
                                             load=engine.load_weights)
    assert receiver.flat is None  # vLLM's weights live in its worker, not in this process
    receiver.buffer = trainer_buffer
    receiver._copy(3)
    (load,) = engine._engine.worker.model_runner.model.loads
    want = qwen3.Qwen3StateDictAdapter(tiny_args(tie)).to_hf(dict(model.named_parameters()))
    assert list(dict(load)) == list(want)
    for name, tensor in load:
        torch.testing.assert_close(tensor, want[name].detach(), rtol=0, atol=0)
    assert signals == [(3, 0)]


def test_colocated_engine_args_and_sleep(fake_vllm, tmp_path):
    engine = make_engine(tmp_path, kv_cache_bytes=123 << 20, sleep_mode=True)
    args = engine._engine.args
    assert args["kv_cache_memory_bytes"] == 123 << 20 and args["enable_sleep_mode"] is True
    engine.add(Request(1, [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="cannot sleep while requests are live"):
        engine.sleep()
    run_all(engine)
    assert not engine.asleep
    engine.sleep()
    assert engine.asleep and engine._engine.sleeps == 1
    engine.sleep()  # already asleep: nothing more
    engine.wake()
    assert not engine.asleep and (engine._engine.sleeps, engine._engine.wakes) == (1, 1)
    assert make_engine(tmp_path)._engine.args["kv_cache_memory_bytes"] is None


def test_pack_tensors():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0])
    flat, entries = pack_tensors({"a": a, "b": b})
    assert entries == [("a", 0, [2, 3]), ("b", 6, [1])]
    torch.testing.assert_close(flat, torch.tensor([0.0, 1, 2, 3, 4, 5, 7]))


def test_policy_skeleton_matches_the_built_policy():
    from meshrl.runtime.policy import build_policy

    cfg = ModelConfig(flavor="debug", tokenizer="char")
    skeleton, adapter, args, path = policy_skeleton(cfg, torch.bfloat16)
    model, built_args = build_policy(cfg, torch.device("cpu"))
    assert path is None and args == built_args
    assert [(n, p.shape) for n, p in skeleton.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in skeleton.parameters())
    assert set(adapter.to_hf(dict(skeleton.named_parameters()))) == set(adapter.to_hf(dict(model.named_parameters())))


# ----------------------------------------------------------------------------- errors and config


def test_vllm_not_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match="docs/inference.md"):
        make_engine(tmp_path)


def test_build_on_cpu_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="CUDA only"):
        build_vllm_engine(InferenceConfig(backend="vllm"), ModelConfig(flavor="debug", tokenizer="char"),
                          torch.device("cpu"), torch.float32, seed=0)


def test_importing_meshrl_does_not_import_vllm():
    code = ("import sys, meshrl.runtime.engine.vllm_engine, meshrl.runtime.engine.loop, meshrl.runtime.config; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def rl_config(**overrides) -> RLConfig:
    return RLConfig(model=ModelConfig(flavor="debug", tokenizer="char"), **overrides)


def test_config_backend_and_vllm_section():
    assert rl_config().inference.backend == "native"
    cfg = rl_config(inference={"backend": "vllm", "vllm": {"gpu_memory_utilization": 0.5, "enforce_eager": True}})
    assert cfg.inference.vllm.gpu_memory_utilization == 0.5 and cfg.inference.vllm.enforce_eager
    assert rl_config(inference={"backend": "vllm"}, dist={"device": "auto"}).inference.backend == "vllm"
    with pytest.raises(ValidationError, match="needs CUDA"):
        rl_config(inference={"backend": "vllm"}, dist={"device": "cpu"})
    with pytest.raises(ValidationError, match="top_p"):
        rl_config(inference={"backend": "vllm", "sampling": {"top_p": 0.9}})
    assert rl_config(inference={"sampling": {"top_p": 0.9}}).inference.sampling.top_p == 0.9  # native: fine
    with pytest.raises(ValidationError):
        rl_config(inference={"backend": "vllm", "vllm": {"gpu_memory_utilization": 1.5}})
    with pytest.raises(ValidationError):
        rl_config(inference={"backend": "sglang"})
