"""The HF folder an engine benchmark hands to vLLM: the native engine's own random weights.

`meshrl bench engine --compare vllm` (bench_matrix.py) runs both engines on the same model, so
vLLM loads the weights the native engine serves, written by models/hf.py's exporter, rather
than vLLM's "dummy" weights (which would route MoE tokens differently). `export_for_vllm` writes
the folder and checks its config.json against what vLLM 0.26 serves:

- `architectures` names a class vLLM 0.26's model registry has for that model_type
  (`VLLM_ARCHITECTURES`, read from the vllm-0.26.0 wheel's registry.py); no
  `quantization_config` (the weights are plain bf16/fp32); the dtype the weights were saved in.
- Qwen3.5: meshrl exports the text-only model types (qwen3_5_text / qwen3_5_moe_text), which vLLM
  0.26 has no causal-LM class for: it serves Qwen3.5 only as the vision-language model. The folder
  is rewritten in the hub's vision-language layout (model_type qwen3_5 / qwen3_5_moe, the decoder's
  config in `text_config` with the release's interleaved multimodal RoPE sections, a small
  `vision_config`, weights under model.language_model.) and vLLM runs it with
  `language_model_only=True`, so its vision tower is never built. For text, multimodal RoPE with
  equal position streams is plain RoPE (tests/unit/test_engine_bench.py checks the folder's logits
  in transformers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from meshrl.models.hf import CONFIG_FILE, WEIGHTS_INDEX_FILE, read_hf_config, save_hf_model

# model_type of a meshrl export -> the architecture vLLM 0.26 serves it with.
VLLM_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# Text-only export -> the vision-language model_type vLLM 0.26 serves.
_VISION_LANGUAGE = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
_DECODER_PREFIX, _VLM_DECODER_PREFIX = "model.", "model.language_model."


def export_for_vllm(model: nn.Module, args: Any, path: str | os.PathLike, dtype: torch.dtype) -> dict[str, Any]:
    """Write `model` as an HF folder at `path` in `dtype` that vLLM 0.26 loads -> its config.json dict."""
    save_hf_model(model, args, path, dtype=dtype)
    config = read_hf_config(path)
    if config["model_type"] in _VISION_LANGUAGE:
        config = _to_vision_language(Path(path), config)
    check_vllm_config(config, dtype)
    return config


def check_vllm_config(config: dict[str, Any], dtype: torch.dtype) -> None:
    """ValueError unless config.json is what vLLM 0.26 serves for its model_type (module docstring)."""
    model_type = config.get("model_type")
    want = VLLM_ARCHITECTURES.get(model_type)
    if want is None:
        raise ValueError(f"config.json: vLLM 0.26 serves no model_type {model_type!r} from a meshrl export "
                         f"(known: {sorted(VLLM_ARCHITECTURES)})")
    if config.get("architectures") != [want]:
        raise ValueError(f"config.json: architectures {config.get('architectures')!r}, vLLM 0.26 needs [{want!r}] "
                         f"for model_type {model_type!r}")
    if "quantization_config" in config:
        raise ValueError("config.json: quantization_config present, but the exported weights are not quantized")
    name = str(dtype).removeprefix("torch.")
    if config.get("dtype") != name and config.get("torch_dtype") != name:
        raise ValueError(f"config.json: dtype {config.get('dtype')!r}, the weights were saved in {name}")


def mrope_sections(rotary_dim: int) -> list[int]:
    """Qwen3.5's three multimodal RoPE sections (temporal, height, width) over rotary_dim / 2
    frequencies, as the releases split them (64 rotary dims: [11, 11, 10])."""
    half = rotary_dim // 2
    base, rest = divmod(half, 3)
    return [base + (rest > 0), base + (rest > 1), base]


def _to_vision_language(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a text-only Qwen3.5 export in place as the hub's vision-language layout -> the config."""
    text = {k: v for k, v in config.items() if k != "architectures"}
    rope = dict(text["rope_parameters"])
    rotary = int(text["head_dim"] * rope.get("partial_rotary_factor", 0.25))
    rope.update(mrope_section=mrope_sections(rotary), mrope_interleaved=True)
    text["rope_parameters"] = rope
    model_type = _VISION_LANGUAGE[config["model_type"]]
    vlm = {"architectures": [VLLM_ARCHITECTURES[model_type]], "model_type": model_type, "text_config": text,
           # never built (language_model_only); small, and its output width is the decoder's
           "vision_config": {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
                             "out_hidden_size": text["hidden_size"]},
           "tie_word_embeddings": text["tie_word_embeddings"], "dtype": text["dtype"]}
    for file in _weight_files(folder):
        with safe_open(str(file), "pt") as f:
            tensors = {_vlm_key(k): f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {_vlm_key(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    (folder / CONFIG_FILE).write_text(json.dumps(vlm, indent=2))
    return vlm


def _vlm_key(key: str) -> str:
    return _VLM_DECODER_PREFIX + key.removeprefix(_DECODER_PREFIX) if key.startswith(_DECODER_PREFIX) else key


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))
