"""Hugging Face folder I/O: the one on-disk model format of meshrl.

A folder written by `save_hf_model` loads with `transformers.AutoModelForCausalLM.from_pretrained`
(offline), and `load_hf_model` reads HF checkpoints (single-file or sharded safetensors) into our
model classes: a native family when meshrl has one for the config's model_type, else (or when
asked with impl="hf") the transformers wrapper of models/generic_hf.py. Keys are renamed by the
family's state-dict adapter; values are only cast/copied.

Block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-FP8, GLM FP8 releases) load dequantised;
`fp8_out` hands their raw e4m3 weights and scales to an FP8 engine (models/common/fp8.py).

Loading copies tensor by tensor from the safetensors files into a model that was built on the
meta device and materialised with `to_empty`, so peak host memory is one tensor, not one model.
Saving goes through `<path>.tmp` and `os.replace`, so a crash never leaves a half-written folder
at `path`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from meshrl.models import family_of_args
from meshrl.models.common.lora import is_lora_param
from meshrl.models.common.fp8 import BLOCK, FP8, dequantize_blocks, fp8_checkpoint_block
from meshrl.models.generic_hf import GENERIC_FAMILY, GenericArgs, Impl, family_for

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PEFT_DIR = "adapter"  # a LoRA policy's PEFT adapter folder inside an export
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Everything a tokenizer folder may hold that AutoTokenizer reads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of an HF model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist or is not a directory")
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"model folder {str(folder)!r} has no {CONFIG_FILE}")
    with open(config_file) as f:
        return json.load(f)


def _weight_files(folder: Path) -> list[Path]:
    index_file = folder / WEIGHTS_INDEX_FILE
    if index_file.is_file():
        with open(index_file) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / name for name in names]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index_file} names {file.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    return files


@torch.no_grad()
def load_hf_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    impl: Impl = "auto", fp8_out: dict[str, tuple[Tensor, Tensor]] | None = None,
) -> tuple[nn.Module, Any]:
    """Build the model an HF folder describes and load its weights. Returns (model, args).

    `impl` picks the implementation (see `generic_hf.resolve_impl`): "auto" is our native family
    when the model_type has one, else the generic transformers wrapper; "native" or "hf" force one.

    Every parameter ends up on `device` in `dtype` (checkpoint tensors are cast on copy).
    Missing, unexpected or mis-shaped weights raise ValueError naming the key. FP8 checkpoints:
    see `load_hf_weights` (`fp8_out`).
    """
    model, args, adapter = build_hf_skeleton(path, impl, dtype)
    model = model.to_empty(device=device)
    load_hf_weights(model, path, adapter, fp8_out=fp8_out)
    return model, args


def build_hf_skeleton(path: str | os.PathLike, impl: Impl = "auto", dtype: torch.dtype = torch.float32):
    """The model an HF folder describes, on the meta device: (model, args, state-dict adapter).

    Parallelize it while on meta (FSDP2, expert parallel), materialise with `to_empty`, then
    fill it with `load_hf_weights`: no rank ever holds more than one full tensor at a time.
    """
    config = read_hf_config(path)
    family = family_for(config.get("model_type"), impl, config)
    args = family.args_cls.from_hf_config(config)
    with torch.device("meta"):
        model = family.model_cls(args)
    return model.to(dtype=dtype), args, family.state_dict_adapter(args)


def _local_part(model: nn.Module, key: str, target: Tensor, tensor: Tensor) -> tuple[Tensor, Tensor]:
    """(destination, source) for one checkpoint tensor: this rank's piece of a sharded parameter.

    Handles expert-parallel shards (plain tensors holding experts [r*E/ep, (r+1)*E/ep) of the
    module's `num_global_experts`) and DTensors (FSDP2 / HSDP shards, via their placements).
    """
    module = model.get_submodule(key.rpartition(".")[0]) if "." in key else model
    group = getattr(module, "ep_group", None)
    if group is not None:
        local = tensor.shape[0] // torch.distributed.get_world_size(group)
        start = torch.distributed.get_rank(group) * local
        tensor = tensor[start:start + local]
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(target, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            if tuple(tensor.shape) != tuple(target.shape):
                return target, tensor  # the caller reports the shape mismatch
            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                  target.placements)
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            return target.to_local(), tensor[index]
    return target, tensor


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike, adapter: Any,
                    fp8_out: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
    """Copy an HF folder's weights into `model` (plain, FSDP2-sharded or expert-parallel), one
    tensor at a time; each rank copies only its own shard. Checkpoint tensors are cast on copy.

    Missing, unexpected or mis-shaped weights raise ValueError naming the key; LoRA adapters
    (`lora_a`, `lora_b`: models/common/lora.py) are not in a base folder and stay as they are.
    Block-scaled FP8 checkpoints (config.json quantization_config: quant_method "fp8" with a
    square weight_block_size; `*.weight` in e4m3 beside its `*.weight_scale_inv`) load dequantised
    (w8 x scale_inv per block, models/common/fp8.py) into the model's dtype; with `fp8_out` each
    such weight's raw (e4m3 tensor, scale_inv) is also recorded under our key, for an FP8 engine to
    take as it is.
    """
    folder = Path(path)
    block = fp8_checkpoint_block(read_hf_config(folder))
    if block is not None and block[0] != block[1]:
        raise ValueError(f"{folder / CONFIG_FILE}: FP8 weight_block_size {list(block)} is not square (supported: "
                         "[b, b], e.g. [128, 128])")
    files = _weight_files(folder)
    scales = _fp8_scales(files) if block is not None else {}
    # state_dict() tensors share storage with the parameters: copying into them loads the model.
    targets = model.state_dict()
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_key in f.keys():
                if block is not None and hf_key.endswith(("weight_scale_inv", "input_scale")):
                    continue  # read with their weight / dynamic activation scales need none
                tensor, raw = f.get_tensor(hf_key), None
                if block is not None and tensor.dtype == FP8:
                    if hf_key not in scales:
                        raise ValueError(f"{file.name}: FP8 weight {hf_key!r} has no {hf_key}_scale_inv")
                    raw = (tensor, scales[hf_key])
                    tensor = dequantize_blocks(tensor, scales[hf_key], torch.float32, block[0])
                mapped = adapter.from_hf({hf_key: tensor})
                if raw is not None and fp8_out is not None and len(mapped) == 1 and block[0] == BLOCK:
                    fp8_out[next(iter(mapped))] = raw
                for key, tensor in mapped.items():
                    if key not in targets:
                        raise ValueError(f"{file.name}: weight {hf_key!r} has no place in the model")
                    dest, src = _local_part(model, key, targets[key], tensor)
                    if src.shape != dest.shape:
                        raise ValueError(f"{file.name}: weight {hf_key!r} has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(targets[key].shape)}")
                    dest.copy_(src)
                    loaded.add(key)
    missing = sorted(k for k in targets.keys() - loaded if not is_lora_param(k))  # adapters: init_lora
    if missing:
        raise ValueError(f"model folder {str(folder)!r} lacks weights for {missing}")


def _fp8_scales(files: list[Path]) -> dict[str, Tensor]:
    """{weight key: its scale_inv} of an FP8 checkpoint (scales are small; they may sit in another shard)."""
    scales = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(".weight_scale_inv"):
                    scales[key.removesuffix("_scale_inv")] = f.get_tensor(key)
    return scales


def _cpu_state_dict(model_or_state_dict: nn.Module | dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    if isinstance(model_or_state_dict, nn.Module):
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    out = {}
    for key, value in state_dict.items():
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor

            if isinstance(value, DTensor):
                raise ValueError(f"{key!r} is a sharded DTensor: gather a full state dict first "
                                 "(torch.distributed.checkpoint.state_dict.get_model_state_dict with "
                                 "full_state_dict=True) and save that")
        value = value.detach().to("cpu")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.contiguous()  # safetensors stores contiguous tensors only
    return out


def _shard(state_dict: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Split a state dict, in key order, into files of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _write_folder(
    folder: Path,
    hf_state_dict: dict[str, Tensor],
    config: dict[str, Any],
    generation_config: dict[str, Any],
    tokenizer_dir: Path | None,
    max_shard_bytes: int,
) -> None:
    folder.mkdir(parents=True)
    shards = _shard(hf_state_dict, max_shard_bytes)
    if len(shards) == 1:
        # "format": "pt" is the metadata transformers expects in a PyTorch safetensors file.
        save_file(hf_state_dict, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    else:  # HF's sharded layout: model-0000i-of-0000n.safetensors + an index of key -> file
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            for key, tensor in shard.items():
                weight_map[key] = name
                total += tensor.numel() * tensor.element_size()
        with open(folder / WEIGHTS_INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(folder / CONFIG_FILE, "w") as f:
        json.dump(config, f, indent=2)
    with open(folder / GENERATION_CONFIG_FILE, "w") as f:
        json.dump(generation_config, f, indent=2)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, folder / name)


def _write_peft(folder: Path, state: dict[str, Tensor], adapter_config: dict[str, Any]) -> None:
    """A PEFT LoRA folder: adapter_model.safetensors + adapter_config.json."""
    folder.mkdir()
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(folder / "adapter_config.json", "w") as f:
        json.dump(adapter_config, f, indent=2)


def state_dict_adapter(args: Any):
    """The state-dict adapter (our keys <-> HF's) of the family `args` belongs to."""
    family = GENERIC_FAMILY if isinstance(args, GenericArgs) else family_of_args(args)
    return family.state_dict_adapter(args)


def save_hf_model(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    args: Any,
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    max_shard_gb: float = 5.0,
    peft_adapter: tuple[dict[str, Tensor], dict[str, Any]] | None = None,
) -> None:
    """Write an HF model folder: config.json, model.safetensors, generation_config.json, tokenizer.

    Weights above `max_shard_gb` GB are split into `model-0000i-of-0000n.safetensors` files with
    a `model.safetensors.index.json`, as transformers writes them.

    `model_or_state_dict` is a model or a state dict in *our* key layout with full (unsharded)
    tensors on any device. `dtype` casts floating tensors (default: keep their dtype); the
    config records the saved dtype. A tied LM head is stored once (as the embedding).
    Tokenizer files found in `tokenizer_dir` are copied alongside. An existing folder at `path`
    is replaced only once the new one is complete.

    `peft_adapter` (state, adapter_config dict: `lora.peft_adapter`) is written as a PEFT LoRA
    folder `adapter/` inside (adapter_config.json + adapter_model.safetensors), before the rename.
    """
    state_dict = _cpu_state_dict(model_or_state_dict, dtype)
    hf_state_dict = state_dict_adapter(args).to_hf(state_dict)
    float_dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(float_dtypes) > 1:
        raise ValueError(f"state dict mixes dtypes {sorted(map(str, float_dtypes))}; pass dtype= to save one")
    saved_dtype = float_dtypes.pop() if float_dtypes else torch.float32
    token_ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    config = args.to_hf_config(dtype=saved_dtype, **token_ids)
    generation_config = {k: v for k, v in token_ids.items() if v is not None}

    tok_dir = None
    if tokenizer_dir is not None:
        tok_dir = Path(tokenizer_dir)
        if not tok_dir.is_dir() or not any((tok_dir / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"tokenizer_dir {str(tok_dir)!r} holds none of {list(TOKENIZER_FILES)}")

    folder = Path(path)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from an earlier crash
    _write_folder(tmp, hf_state_dict, config, generation_config, tok_dir, int(max_shard_gb * 1e9))
    if peft_adapter is not None:
        _write_peft(tmp / PEFT_DIR, *peft_adapter)
    if folder.exists():
        # A directory cannot be os.replace'd onto a non-empty one: move the old one aside first.
        old = folder.with_name(folder.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
