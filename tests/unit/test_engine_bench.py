"""The benchmark entry points for every native family, on CPU with debug flavors (so that a typo
cannot waste a GPU run): `meshrl bench engine --family F`, `meshrl bench trainer --family F`,
the matrix's native side and its vLLM side (the fake vLLM of test_vllm_engine.py) over the folder
exported for vLLM, which must load in transformers with our logits. Also the benchmark shapes
of docs/models.md (GLM-4.5-Air-, DeepSeek-V3- and Qwen3.5-like) against the releases' layers.
No timings are asserted."""

from __future__ import annotations

import json
import socket
from dataclasses import fields, replace

import pytest
import torch
import transformers

from meshrl.models import get_family
from meshrl.runtime.engine import bench as engine_bench
from meshrl.runtime.engine import bench_matrix as bm
from meshrl.runtime.engine.bench_export import VLLM_ARCHITECTURES, check_vllm_config, export_for_vllm, mrope_sections
from meshrl.runtime.train import bench as trainer_bench
from tests.family_checks import build_random, positions
from tests.unit.test_vllm_engine import FakeLLMEngine, fake_vllm  # noqa: F401 (fixture)

FAMILIES = ["glm4_moe", "deepseek_v3", "qwen3_5"]
# The benchmark shapes of benchmarks/gpu/families.sh: (family, flavor, released flavor, fields that differ).
SHAPES = [("glm4_moe", "air-like-3L", "air-106B-A12B", {"n_layers", "num_mtp_layers"}),
          ("deepseek_v3", "v3-like-3L", "671B-A37B", {"n_layers", "num_experts", "first_dense", "num_mtp_layers"}),
          ("qwen3_5", "like-2B-24L", "27B", {"dim", "n_layers", "n_heads", "n_kv_heads", "linear_v_heads",
                                             "hidden_dim", "tie_embeddings", "layer_types"})]




def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _debug(family: str):
    # Qwen3.5's multimodal RoPE needs 3 sections: 6 rotary dims ([1, 1, 1]) instead of debug's 4
    return replace(get_family(family).flavors["debug"], vocab_size=96, **({"head_dim": 24} if family == "qwen3_5" else {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_folder_for_vllm_loads_in_transformers_with_our_logits(family, tmp_path):
    args = _debug(family)
    model = build_random(get_family(family).model_cls, args, scale=2.0)
    config = export_for_vllm(model, args, tmp_path / "m", torch.float32)
    on_disk = json.loads((tmp_path / "m" / "config.json").read_text())
    assert on_disk == config and "quantization_config" not in config and config["dtype"] == "float32"
    vlm = family == "qwen3_5"
    assert config["architectures"] == [VLLM_ARCHITECTURES["qwen3_5" if vlm else family]]
    if vlm:  # vLLM 0.26 serves Qwen3.5 as the vision-language model only
        assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == "qwen3_5_text"
        assert config["text_config"]["rope_parameters"]["mrope_section"] == [1, 1, 1]
    cls = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    hf = cls.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions(2, 9)), hf(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)


def test_vllm_config_checks_refuse_what_vllm_026_does_not_serve():
    args = get_family("qwen3_5").flavors["debug"]
    with pytest.raises(ValueError, match="no model_type 'qwen3_5_text'"):
        check_vllm_config(args.to_hf_config(), torch.float32)  # the text-only export: rewritten first
    glm = get_family("glm4_moe").flavors["debug"].to_hf_config(dtype=torch.bfloat16)
    check_vllm_config(glm, torch.bfloat16)
    with pytest.raises(ValueError, match="quantization_config present"):
        check_vllm_config({**glm, "quantization_config": {"quant_method": "fp8"}}, torch.bfloat16)
    with pytest.raises(ValueError, match=r"architectures \['Glm4MoeModel'\]"):
        check_vllm_config({**glm, "architectures": ["Glm4MoeModel"]}, torch.bfloat16)
    with pytest.raises(ValueError, match="saved in float32"):
        check_vllm_config(glm, torch.float32)
    assert mrope_sections(64) == [11, 11, 10]  # Qwen3.5's releases (head_dim 256, quarter rotary)


@pytest.mark.parametrize("family, flavor, release, differ", SHAPES)
def test_benchmark_shapes_keep_the_release_layer(family, flavor, release, differ):
    fam = get_family(family)
    ours, real = fam.flavors[flavor], fam.flavors[release]
    assert {f.name for f in fields(ours) if getattr(ours, f.name) != getattr(real, f.name)} == differ
    with torch.device("meta"):
        count = sum(p.numel() for p in fam.model_cls(ours).parameters())
    # what fits one H200 for training (16 bytes a parameter: fp32 weights, gradients, AdamW)
    assert {"air-like-3L": 6.17e9, "v3-like-3L": 5.72e9, "like-2B-24L": 1.88e9}[flavor] == pytest.approx(count, rel=1e-3)
    if family == "qwen3_5":
        assert list(ours.layer_types).count("full_attention") == 6 and ours.layer_types[3] == "full_attention"


@pytest.mark.parametrize("family", FAMILIES)
def test_bench_engine_runs_every_family_on_cpu(family, capsys):
    engine_bench.main(["--family", family, "--device", "cpu", "--num-seqs", "3", "--prompt-tokens", "5",
                       "--gen-tokens", "4", "--no-hf"])
    (row,) = _json_lines(capsys.readouterr().out)
    assert (row["family"], row["flavor"], row["num_seqs"]) == (family, "debug", 3) and row["tokens_per_s"] > 0


def test_bench_engine_refuses_an_unknown_family_or_flavor_in_one_line(capsys):
    for argv, message in ((["--family", "llama4"], "--family 'llama4' is not a native model family"),
                          (["--family", "glm4_moe", "--flavor", "air"], "unknown flavor 'air' of glm4_moe"),
                          (["--family", "glm4_moe", "--device", "cpu", "--flavors", "x", "--workloads", "plain_8"],
                           "unknown flavor 'x' of glm4_moe")):
        with pytest.raises(SystemExit) as exit_:
            engine_bench.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_bench_trainer_runs_every_family_on_cpu(family, capsys, monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=_free_port()).items():
        monkeypatch.setenv(key, value)
    trainer_bench.main(["--family", family, "--flavor", "debug", "--device", "cpu", "--seq-len", "64", "--docs", "2",
                        "--steps", "1", "--warmup", "1"])
    (row,) = _json_lines(capsys.readouterr().out)
    assert row["family"] == family and row["tokens_per_step"] == 64 and row["tokens_per_s"] > 0
    assert row["mfu"] is None and row["tflops_per_device"] >= 0
    assert row["compiled_graphs"] is None and row["graph_breaks"] is None  # not compiled


def test_attention_flops_count_each_layer_kind():
    pairs = trainer_bench.attention_pairs(64, 2)
    assert pairs == 2 * 32 * 33 // 2 and trainer_bench.attention_pairs(64, 2, window=4) == 2 * (10 + 28 * 4)
    v3 = get_family("deepseek_v3").flavors["debug"]  # 4 heads, q/k 16 + 8, v 12
    assert trainer_bench.attention_flops(v3, 64, 2, 1) == 3 * 6 * 4 * (24 + 12) * pairs
    q35 = get_family("qwen3_5").flavors["debug"]  # 3 DeltaNet layers (4 value heads of 16 x 16) + 1 full (4 x 16)
    assert trainer_bench.attention_flops(q35, 64, 2, 3) == 3 * (3 * 18 * 4 * 16 * 16 * 64 + 6 * 4 * 32 * pairs)


class _Event:  # the part of a profiler's raw event that `timeline` reads
    def __init__(self, start, length, stream, name, device=torch.autograd.DeviceType.CUDA, kind="kernel"):
        self._v = (start, length, stream, name, device, kind)

    def start_ns(self): return self._v[0]  # noqa: E704
    def duration_ns(self): return self._v[1]  # noqa: E704
    def device_resource_id(self): return self._v[2]  # noqa: E704
    def name(self): return self._v[3]  # noqa: E704
    def device_type(self): return self._v[4]  # noqa: E704
    def is_user_annotation(self): return self._v[5] == "user_annotation"  # noqa: E704


def test_trainer_profile_timeline_takes_the_union_of_overlapping_streams():
    ms = 1_000_000
    events = [_Event(0, 4 * ms, 7, "nvjet_tst_128x256_h_bz_coopA"), _Event(1 * ms, 2 * ms, 20, "ncclDevKernel_AllGather"),
              _Event(3 * ms, 3 * ms, 20, "void at::native::direct_copy_kernel_cuda"),  # overlaps the matmul by 1 ms
              _Event(8 * ms, 1 * ms, 7, "triton_poi_fused_add_mul_0"),
              _Event(10 * ms, 1 * ms, 7, "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor>"),
              _Event(11 * ms, 1 * ms, 7, "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>"),
              _Event(9 * ms, 1 * ms, 7, "void flash_fwd_kernel"), _Event(0, 5 * ms, 0, "aten::mm", torch.autograd.DeviceType.CPU),
              _Event(5 * ms, 1 * ms, 0, "Optimizer.step#AdamW.step", torch.autograd.DeviceType.CPU, "user_annotation"),
              _Event(5 * ms, 7 * ms, 7, "Optimizer.step#AdamW.step", kind="gpu_user_annotation")]  # its GPU mirror
    row = trainer_bench.timeline(events, wall_s=0.014)
    assert row["device_busy_ms"] == 10.0 and row["device_idle_ms"] == 4.0 and row["kernels"] == 7  # [0, 6) + [8, 12)
    assert row["streams_busy_ms"] == {"7": 8.0, "20": 5.0}
    assert row["by_category_ms"] == {"matmul": 4.0, "copy": 4.0, "nccl": 2.0, "compiled": 1.0, "attention": 1.0,
                                     "optimizer": 1.0}


def test_matrix_runs_the_hybrid_family_and_counts_its_states(capsys):
    bm.main(["--family", "qwen3_5", "--device", "cpu", "--workloads", "plain_8,grpo", "--scale", "0.01",
             "--batch-scale", "0.04", "--hbm-gbps", "50", "--max-num-seqs", "64"])
    rows = _json_lines(capsys.readouterr().out)
    assert [r["workload"] for r in rows] == ["plain_8", "grpo"]
    s = rows[0]["settings"]
    args = get_family("qwen3_5").flavors["debug"]  # 3 DeltaNet layers: conv (C, 3) + fp32 (4, 16, 16) each
    conv = 2 * args.linear_k_heads * args.linear_k_dim + args.linear_v_heads * args.linear_v_dim
    assert s["state_bytes_per_seq"] == 3 * (conv * 3 * 4 + 4 * 16 * 16 * 4) and s["max_num_seqs"] == 64
    assert s["kv_bytes_per_token"] == 1 * 2 * 16 * 2 * 4  # one full layer: 2 kv heads, k and v of 16, fp32
    assert not s["prefix_sharing"]  # off for linear-attention models, whatever was asked


def test_vllm_side_loads_the_exported_folder(fake_vllm, monkeypatch, tmp_path):  # noqa: F811
    """The parent writes the native model's folder (Qwen3.5: the vision-language layout); the child's
    vLLM gets that folder with load_format safetensors and, for Qwen3.5, language_model_only."""
    from meshrl.runtime.engine.vllm_engine import WORKER_EXTENSION

    seen = {}

    class MatrixFake(FakeLLMEngine):
        def __init__(self, engine_args):
            engine_args.kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
            seen.update(engine_args.kwargs)
            super().__init__(engine_args)

    monkeypatch.setattr(fake_vllm, "LLMEngine", MatrixFake)
    spec = {"family": "qwen3_5", "flavor": "debug", "dtype": "float32", "device": "cpu", "seed": 0, "scale": 0.01,
            "batch_scale": 0.04, "workloads": ["plain_8"], "max_model_len": 32, "max_num_seqs": 8,
            "num_blocks": 64, "model_dir": str(tmp_path / "model")}
    native, vllm_rows, sizes = [], [], {}
    bm.run_native(spec, native.append, sizes)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and sizes["state_bytes_per_seq"] > 0
    bm.run_vllm(spec, vllm_rows.append)
    assert seen["model"] == spec["model_dir"] and seen["load_format"] == "safetensors"
    assert seen["language_model_only"] is True and seen["max_num_seqs"] == 8
    assert vllm_rows[0]["settings"]["language_model_only"] is True
    assert vllm_rows[0]["tokens"] == native[0]["tokens"]
