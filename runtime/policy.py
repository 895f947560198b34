"""Build the policy model and its tokenizer from a `ModelConfig` (used by every role)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from meshrl.models import get_family
from meshrl.models.common.lora import add_lora, init_lora, resolve_targets
from meshrl.models.generic_hf import check_expert_parallel, check_generic_config, resolve_impl
from meshrl.models.hf import build_hf_skeleton, load_hf_model, load_hf_weights, read_hf_config
from meshrl.runtime.config import ModelConfig
from meshrl.runtime.tokenizer import build_char_tokenizer, load_tokenizer


def compute_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """bfloat16 on GPU and float32 on CPU unless the config names one."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def check_model_source(cfg: ModelConfig, ep: int = 1, cp: int = 1) -> None:
    """Fail early (before any process group) when the model folder is missing or incomplete, its
    model_type cannot be served by the chosen implementation (`cfg.impl`; a config the native
    family refuses is an error for "native" and falls back to the generic path for "auto"),
    expert parallelism `ep` (trainer.parallel.ep) asks for experts the implementation lacks,
    context parallelism `cp` for a native family whose plan refuses it (`no_cp`: linear attention),
    or `cfg.lora` targets a module the model does not have."""
    if cfg.path is not None:
        cfg.check_folder()
        config = read_hf_config(Path(cfg.path))
        impl = resolve_impl(config.get("model_type"), cfg.impl, config)
        if impl == "hf":
            check_generic_config(config)
        check_expert_parallel(config["model_type"], impl, ep)
        if impl == "native":
            _check_context_parallel(config["model_type"], cp)
    else:
        family = get_family(cfg.family)
        if cfg.flavor not in family.flavors:
            raise ValueError(f"model.flavor: unknown flavor {cfg.flavor!r} of {cfg.family} (known: {sorted(family.flavors)})")
        check_expert_parallel(cfg.family, "native", ep)
        _check_context_parallel(cfg.family, cp)
    if cfg.lora is not None:  # every target must name a linear module of this model
        model, adapter, _, _ = policy_skeleton(cfg)
        resolve_targets(model, adapter, cfg.lora.target_modules)


def _check_context_parallel(model_type: str, cp: int) -> None:
    reason = get_family(model_type).parallel_plan.get("no_cp")
    if cp > 1 and reason:
        raise ValueError(f"trainer.parallel.cp = {cp}: model_type {model_type!r} has no context parallelism "
                         f"({reason}); use cp = 1")


def load_tokenizer_for(cfg: ModelConfig):
    """The tokenizer of the model folder, or the one built in code for a fresh model."""
    if cfg.path is not None:
        return load_tokenizer(cfg.path)
    assert cfg.tokenizer == "char"
    return build_char_tokenizer()


def build_policy(cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32, tokenizer=None,
                 fp8_out: dict | None = None):
    """Return (model, args) on `device` in `dtype`: loaded from `cfg.path` or freshly initialised.
    `fp8_out`: for an FP8 checkpoint, filled with its raw e4m3 weights (models/hf.py `load_hf_weights`).

    Every rank that calls this with the same config gets the same weights (the fresh init is
    seeded), which the trainer relies on before FSDP2 shards the model.
    """
    if cfg.path is not None:
        return load_hf_model(cfg.path, device=device, dtype=dtype, impl=cfg.impl, fp8_out=fp8_out)
    family = get_family(cfg.family)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(cfg)
    args = dataclasses.replace(family.flavors[cfg.flavor], vocab_size=len(tokenizer))
    with torch.device("meta"):
        model: nn.Module = family.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.init_seed)
    return model.to(dtype), args


def policy_skeleton(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object, object, str | None]:
    """(the model on the meta device, its state-dict adapter, its args, its HF folder or None):
    the family and args `build_policy` would use, without reading or initialising weights."""
    if cfg.path is not None:
        model, args, adapter = build_hf_skeleton(cfg.path, cfg.impl, dtype)
        return model, adapter, args, cfg.path
    family = get_family(cfg.family)
    args = dataclasses.replace(family.flavors[cfg.flavor], vocab_size=len(load_tokenizer_for(cfg)))
    with torch.device("meta"):
        model = family.model_cls(args)
    return model.to(dtype), family.state_dict_adapter(args), args, None


def build_trainer_policy(cfg: ModelConfig, device: torch.device, shard: Callable[[nn.Module], nn.Module],
                         tokenizer=None):
    """The trainer's policy, already parallelized by `shard` (e.g. parallel.parallelize). Returns (model, args).

    From an HF folder: the model is built on the meta device, sharded there, materialised and
    then each rank reads only its own shards, tensor by tensor, so no rank ever holds the full
    model. A fresh flavor is initialised in full on every rank first (seeded, so every rank
    and the inference engines agree) and then sharded: flavors are for tests and demos.
    Parameters stay fp32 (FSDP2 computes in the compute dtype).

    With `cfg.lora`, adapters are added before `shard` (the base weights frozen) and initialised
    after it, the same on every rank (models/common/lora.py).
    """
    if cfg.path is None:
        model, args = build_policy(cfg, device, torch.float32, tokenizer=tokenizer)
        apply_lora(model, cfg, get_family(cfg.family).state_dict_adapter(args))
        model = shard(model)
    else:
        model, args, adapter = build_hf_skeleton(cfg.path, cfg.impl, torch.float32)
        apply_lora(model, cfg, adapter)
        model = shard(model)
        model.to_empty(device=device)
        load_hf_weights(model, cfg.path, adapter)  # the base weights; a base folder has no adapters
    if cfg.lora is not None:
        init_lora(model, cfg.init_seed)
    return model, args


def apply_lora(model: nn.Module, cfg: ModelConfig, adapter) -> dict[str, str]:
    """Add `cfg.lora`'s adapters to `model` and freeze the rest (models/common/lora.py); returns
    {our module path: HF name} of the adapted modules ({} without LoRA)."""
    if cfg.lora is None:
        return {}
    lo = cfg.lora
    return add_lora(model, adapter, lo.rank, lo.alpha, lo.dropout, lo.target_modules)
