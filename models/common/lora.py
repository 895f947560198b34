"""LoRA: a trainable low-rank update beside frozen linear weights, for any native family.

    y = x W^T (+ b) + (dropout(x) A^T B^T) * alpha / r          A (r, in), B (out, r)

`add_lora` turns the chosen `nn.Linear` modules into `LoRALinear` in place (the class is swapped and
two parameters, `lora_a` and `lora_b`, are registered after the module's own), so module names,
state-dict keys of the base weights, FSDP units and HF key maps stay what they were. Every other
parameter is frozen (`requires_grad = False`); the optimizer gets only the adapters.

Targets are named by HF's module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj, ...: the last component of the HF key of the module's weight, found through the
family's state-dict adapter) or by ours (wq, wk, ...). The same names go into PEFT's
`adapter_config.json`.

Merged weights W + (B @ A) * alpha / r are what the policy *is* to everyone outside the trainer:
`parallel.full_tensors` yields them under the base weight's name (and no adapter parameters), so
weight sync, the HF export and the SFT evaluator see a plain model of the base architecture.
`merge_weight` is the one formula, so every path (and a single process) merges bit for bit alike.

Init (PEFT's default): A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0, so a
fresh adapter changes nothing. `init_lora` draws every A in full from one seeded CPU generator in
module order and each rank keeps its own shard, so FSDP2 ranks agree with a single process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LORA_PARAMS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update (module docstring). Made by `add_lora`, never built."""

    lora_a: nn.Parameter  # (r, in_features)
    lora_b: nn.Parameter  # (out_features, r)
    lora_alpha: float
    lora_scale: float  # alpha / r
    lora_dropout: float

    def forward(self, x: Tensor) -> Tensor:
        # x: (..., in) -> (..., out)
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.lora_scale


def merge_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """W + (B @ A) * scale: the merged weight (PEFT's formula). Full tensors, same dtype."""
    return weight + (lora_b @ lora_a) * scale


def is_lora_param(name: str) -> bool:
    return name.rpartition(".")[2] in LORA_PARAMS


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def policy_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """`named_parameters` without the adapters: the parameters of the base architecture, whose
    (merged) values are the policy. The engine's model has exactly these."""
    return ((n, p) for n, p in model.named_parameters() if not is_lora_param(n))


def linear_names(model: nn.Module, adapter) -> dict[str, str]:
    """{our module path: HF module name (last component)} of every `nn.Linear` whose weight the
    family's state-dict adapter maps to a single HF key."""
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not path:
            continue
        hf = adapter.to_hf({f"{path}.weight": torch.empty(0)})
        if len(hf) != 1:  # a tied LM head is stored as the embedding: not a linear of its own
            continue
        (hf_key,) = hf
        out[path] = hf_key.removesuffix(".weight").rpartition(".")[2]
    return out


def resolve_targets(model: nn.Module, adapter, targets: list[str]) -> dict[str, str]:
    """{our module path: HF name} of the linear modules `targets` names (HF or our short names).
    ValueError naming the target that matches nothing and the linear modules there are."""
    names = linear_names(model, adapter)
    chosen = {}
    for target in targets:
        hits = {p: hf for p, hf in names.items() if target in (hf, p.rpartition(".")[2])}
        if not hits:
            known = sorted({f"{hf} ({p.rpartition('.')[2]})" for p, hf in names.items()})
            raise ValueError(f"model.lora.target_modules: {target!r} names no linear module of this model; "
                             f"its linear modules are {', '.join(known)}")
        chosen.update(hits)
    return chosen


def add_lora(model: nn.Module, adapter, rank: int, alpha: float, dropout: float, targets: list[str]) -> dict[str, str]:
    """Give the targeted linear modules LoRA adapters (on their weight's device and dtype; B = 0,
    A = 0 until `init_lora`) and freeze everything else. Returns {our path: HF name} of them."""
    chosen = resolve_targets(model, adapter, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for path in chosen:
        module = model.get_submodule(path)
        w = module.weight
        module.__class__ = LoRALinear
        module.lora_a = nn.Parameter(torch.zeros(rank, module.in_features, device=w.device, dtype=w.dtype))
        module.lora_b = nn.Parameter(torch.zeros(module.out_features, rank, device=w.device, dtype=w.dtype))
        module.lora_alpha = alpha
        module.lora_scale = alpha / rank
        module.lora_dropout = dropout
    return chosen


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Initialise every adapter (module docstring), sharded (DTensor) or not, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            rank, fan_in = module.lora_a.shape
            bound = 1.0 / math.sqrt(fan_in)
            full_a = torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * (2 * bound) - bound
            copy_full(module.lora_a, full_a)
            copy_full(module.lora_b, torch.zeros(module.lora_b.shape, dtype=torch.float64))


def copy_full(param: Tensor, full: Tensor) -> None:
    """Copy a full tensor into a parameter: all of it, or this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        param.to_local().copy_(full[index])
    else:
        param.copy_(full)


def peft_adapter(model: nn.Module, adapter, adapters: dict[str, tuple[Tensor, Tensor]],
                 base_model: str | None) -> tuple[dict[str, Tensor], dict]:
    """(adapter_model.safetensors state, adapter_config.json dict) of a PEFT LoRA folder that
    `peft.PeftModel.from_pretrained` loads onto the transformers model of the base.

    `adapters` maps our module path to its full (A, B); keys become HF's module names:
    `base_model.model.<HF module>.lora_A.weight` (A) and `.lora_B.weight` (B)."""
    modules = {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapters.keys() == modules.keys(), "every LoRA module's adapters are needed"
    specs = {(m.lora_a.shape[0], m.lora_alpha, m.lora_dropout) for m in modules.values()}
    assert len(specs) == 1, f"one rank, alpha and dropout for all adapters, got {specs}"
    (rank, alpha, dropout), = specs
    state, targets = {}, set()
    for path, (a, b) in adapters.items():
        (hf_key,) = adapter.to_hf({f"{path}.weight": torch.empty(0)})
        module = hf_key.removesuffix(".weight")
        targets.add(module.rpartition(".")[2])
        state[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        state[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    return state, config
