"""`meshrl bench engine --compare vllm`'s workload matrix on CPU: the native side for real (debug
flavor, tiny sizes), the vLLM side against the fake vLLM of test_vllm_engine.py. No timings are
asserted; what is checked is that every row does the work its workload defines."""

from __future__ import annotations

import json

import pytest
import torch

from meshrl.runtime.engine import bench_matrix as bm
from meshrl.runtime.engine.vllm_engine import WORKER_EXTENSION
from tests.unit.test_vllm_engine import FakeLLMEngine, fake_vllm  # noqa: F401 (fixture)

SIZES = ["--scale", "0.01", "--batch-scale", "0.04"]




def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_workloads_define_their_shapes():
    grpo = bm.make_workload("grpo", 1000)
    assert (len(grpo.prompts), grpo.n, set(map(len, grpo.prompts)), set(grpo.max_tokens)) == (32, 16, {256}, {256})
    long = bm.make_workload("long_4k", 1000)
    assert long.num_samples == 32 and set(long.max_tokens) == {4096}
    turns = bm.make_workload("multiturn", 1000)
    assert turns.turns == 4 and turns.max_context() == 512 + 4 * 128 + 3 * 32
    refill = bm.make_workload("refill", 1000)
    assert refill.concurrency == 128 and len(refill.prompts) == 512 and len(set(refill.max_tokens)) > 100
    # the same prompts in every process (the vLLM child rebuilds them)
    assert bm.make_workload("refill", 1000).prompts == refill.prompts


def test_floor_counts_weights_once_per_step_and_every_samples_context():
    w = bm.Workload("x", [[1] * 10, [2] * 10], [4, 4])
    floor = bm.decode_floor(w, weight_bytes=1000, kv_bytes_per_token=10, gbps=1e-9)  # 1 byte per s
    # 3 decode steps; each sample reads contexts 11, 12, 13
    assert floor["floor_steps"] == 3
    assert floor["floor_step_ms"] == pytest.approx(1e3 * (3 * 1000 + 2 * (11 + 12 + 13) * 10) / 3)
    assert bm.decode_floor(w, 1000, 10, None) == {}


def test_native_matrix_runs_every_workload_on_cpu(capsys, tmp_path):
    out = tmp_path / "rows.jsonl"
    bm.main(["--device", "cpu", "--flavors", "debug", *SIZES, "--hbm-gbps", "50", "--out", str(out)])
    rows = _rows(capsys)
    assert [r["workload"] for r in rows] == list(bm.WORKLOADS)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    for row in rows:
        w = bm.make_workload(row["workload"], 128, 0.01, 0, 0.04)
        expected = sum(w.n * g for g in w.max_tokens) * w.turns
        assert row["engine"] == "native" and row["tokens"] == expected, row
        assert row["samples"] == w.num_samples and row["step_vs_floor"] > 0 and row["settings"]["prefix_sharing"]


def test_multiturn_continuations_hit_the_prefix_cache():
    from meshrl.runtime.engine.bench import build_model
    from meshrl.runtime.engine.native import NativeEngine

    model, _ = build_model("qwen3", "debug", torch.device("cpu"), torch.float32, 0)
    engine = NativeEngine(model, max_num_seqs=16, max_model_len=128, device="cpu", dtype=torch.float32)
    w = bm.Workload("multiturn", [[i + 1] * 40 for i in range(4)], [8] * 4, turns=3,
                    turn_tokens=[[5] * 4 for _ in range(4)])
    bm.drive(bm.NativeDriver(engine), w)
    # every turn after the first computes only what its cached blocks do not hold
    total_prompt = sum(40 + t * 12 for t in range(3)) * 4
    assert engine.num_prefill_tokens < total_prompt - 2 * 4 * 32


def test_vllm_side_against_the_fake(fake_vllm, monkeypatch, capsys):  # noqa: F811
    class MatrixFake(FakeLLMEngine):
        resets = 0

        def __init__(self, engine_args):
            engine_args.kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
            super().__init__(engine_args)

        def reset_prefix_cache(self):
            MatrixFake.resets += 1

    monkeypatch.setattr(fake_vllm, "LLMEngine", MatrixFake)
    spec = {"family": "qwen3", "flavor": "debug", "dtype": "float32", "device": "cpu", "seed": 0, "scale": 0.01,
            "batch_scale": 0.04, "workloads": ["plain_8", "grpo", "multiturn", "refill"], "max_model_len": 96,
            "max_num_seqs": 512}
    rows = []
    bm.run_vllm(spec, rows.append)
    assert [r["workload"] for r in rows] == spec["workloads"]
    assert MatrixFake.resets == len(rows) + 1  # the warm-up and every row start from an empty cache
    for row in rows:
        w = bm.make_workload(row["workload"], 128, 0.01, 0, 0.04)
        assert row["tokens"] == sum(w.n * g for g in w.max_tokens) * w.turns
        s = row["settings"]
        assert s["enable_prefix_caching"] and s["async_scheduling"] and not s["enforce_eager"]
        assert s["load_format"] == "dummy" and s["seeded_requests"] is False


def test_compare_without_vllm_says_so_and_runs_native(capsys, monkeypatch):
    monkeypatch.setattr(bm, "vllm_installed", lambda: False)
    bm.main(["--compare", "vllm", "--device", "cpu", "--flavors", "debug", "--workloads", "plain_8", *SIZES])
    captured = capsys.readouterr()
    assert "vLLM is not installed here" in captured.err and captured.err.count("\n") == 1
    assert [json.loads(line)["engine"] for line in captured.out.splitlines()] == ["native"]


FAKE_PACKAGE = {
    "__init__.py": ("from tests.unit.test_vllm_engine import FakeEngineArgs as EngineArgs, FakeLLMEngine\n"
                    "from tests.unit.test_vllm_engine import FakeSamplingParams as SamplingParams\n"
                    "from meshrl.runtime.engine.vllm_engine import WORKER_EXTENSION\n"
                    "class LLMEngine(FakeLLMEngine):\n"
                    "    def __init__(self, engine_args):\n"
                    "        engine_args.kwargs.setdefault('worker_extension_cls', WORKER_EXTENSION)\n"
                    "        super().__init__(engine_args)\n"
                    "print('a vLLM log line on stdout')\n"),
    "inputs.py": "TokensPrompt = lambda **kwargs: dict(kwargs)\n",
    "sampling_params.py": "from tests.unit.test_vllm_engine import FakeRequestOutputKind as RequestOutputKind\n",
}


@pytest.mark.slow  # two child processes, each importing torch
def test_vllm_rows_come_back_from_the_child_process(tmp_path, monkeypatch, capsys):
    """The parent -> child path: the child imports (fake) vllm, prints log lines and marked rows;
    the parent forwards the rows with the floor added, and turns a crash into an error row."""
    import pathlib

    package = tmp_path / "vllm"
    package.mkdir()
    for name, text in FAKE_PACKAGE.items():
        (package / name).write_text(text)
    root = pathlib.Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{root}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(str(tmp_path))  # so that this process finds vllm installed
    bm.main(["--compare", "vllm", "--device", "cpu", "--flavors", "debug", "--workloads", "plain_8,grpo", *SIZES,
             "--hbm-gbps", "50"])
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [(r["engine"], r["workload"]) for r in rows] == [("native", "plain_8"), ("native", "grpo"),
                                                             ("vllm", "plain_8"), ("vllm", "grpo")]
    assert rows[2]["tokens"] == rows[0]["tokens"] and rows[3]["floor_step_ms"] == rows[1]["floor_step_ms"]
    (package / "inputs.py").write_text("raise RuntimeError('broken vllm')\n")
    bm.main(["--compare", "vllm", "--device", "cpu", "--flavors", "debug", "--workloads", "plain_8", *SIZES])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[-1]["engine"] == "vllm" and "exited with 1" in rows[-1]["error"]


def test_fp8_reaches_both_engines_and_the_floor():
    """--quantization fp8 / --kv-cache-dtype fp8: vLLM gets quantization="fp8" and an FP8 cache, the
    native engine FP8 linears, and the floor counts the FP8 weights' bytes (e4m3 + block scales)."""
    from meshrl.models import get_family

    opts = bm._parser().parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--device", "cpu"])
    spec = bm._spec(opts, "debug", ["plain_8"], torch.float32, 128)
    args = bm.vllm_engine_args(spec, get_family("qwen3").flavors["debug"])
    assert args["quantization"] == "fp8" and args["kv_cache_dtype"] == "fp8"
    plain = bm.vllm_engine_args(dict(spec, quantization="none", kv_cache_dtype="auto"), get_family("qwen3").flavors["debug"])
    assert "quantization" not in plain and "kv_cache_dtype" not in plain

    rows, sizes = [], {"weight_bytes": bm.weight_bytes("qwen3", "debug", torch.float32)}
    bm.run_native(dict(spec, workloads=["plain_8"], scale=0.01, batch_scale=0.04), rows.append, sizes)
    assert rows[0]["settings"]["quantization"] == "fp8" and rows[0]["settings"]["kv_cache_dtype"] == "fp8"
    fam = get_family("qwen3")
    with torch.device("meta"):
        model = fam.model_cls(fam.flavors["debug"])
    linears = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.startswith("layers."))
    fp32 = bm.weight_bytes("qwen3", "debug", torch.float32)
    # every decoder linear went from 4 bytes a weight to 1 (+ its scales): the floor's bytes shrank by ~3/4 of them
    assert fp32 - 3 * linears <= sizes["weight_bytes"] < fp32 - 3 * linears + linears // 16
