"""FP8 (e4m3) weights with 128x128 block scales, as the FP8 releases of DeepSeek-V3, Qwen3 and GLM.

Format. A linear weight W (N, K) is cut into 128x128 blocks; block (i, j) stores
`scale_inv[i, j] = amax(|W_block|) / 448` (fp32) and `W8 = round_e4m3(W_block / scale_inv)`, so
that `W ~= W8 * scale_inv` (HF checkpoints call the tensors `*.weight` (e4m3) and
`*.weight_scale_inv`). Edge blocks of a dimension that is not a multiple of 128 are partial.
Error bound: e4m3 keeps 3 mantissa bits, so for every element
`|W - dequant(W8)| <= 2^-4 |W| + 2^-10 scale_inv` (round-to-nearest on a normal value loses at
most half a spacing, 2^-4 of the value; below 2^-6 x scale_inv the spacing is 2^-9 x scale_inv);
`tests/unit/test_fp8.py` checks it per block against a block-by-block reference.

Activations are quantised on the fly per token and 128 input features (1x128 groups, the same
formula), and a matmul sums each 128-wide slice of K in fp32 times the product of its two scales:

    y[m, n] = sum_j  scale_x[m, j] * scale_w[n // 128, j] * (x8[m, j-th 128] . W8[n, j-th 128])

`Fp8Linear` holds W8 as its `weight` parameter (same name and shape as the bf16 nn.Linear it
replaces, so weight sync plans are unchanged) and the scales as the buffer `weight_scale_inv`;
`load_weight(w)` quantises a bf16 tensor into them in place (CUDA graphs keep reading the same
storages). Matmul backends:

- "scaled_mm" (sm90 default, chosen by measurement: models/common/fp8_kernels.py): a Triton
  activation-quantisation kernel, then `torch._scaled_mm` with BlockWise1x128 x BlockWise128x128
  scales (cuBLAS, CUDA >= 12.9);
- "triton" (sm89, and shapes cuBLAS refuses or, probed once per shape, computes wrong: on an
  H200 every N whose count of 128-blocks is neither 1 nor a multiple of 4): one Triton kernel per linear that quantises the
  activation tile in registers and runs e4m3 x e4m3 tensor-core products, fp32 per-K-block promotion;
- "emulate": CPU and GPUs without FP8 tensor cores (one log line says so): the same quantised
  operands, dequantised to fp32 and multiplied (slow; for tests and correctness, not speed).

Only plain nn.Linear modules inside the decoder blocks are converted (`quantize_model`): the
embedding, the LM head, norms, MoE routers and gates, grouped expert tensors and MLA's wkv_b
(whose weight the latent attention reads directly) stay in the model dtype.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_TINY = 1e-12  # an all-zero block gets this amax: scale > 0, values 0

# nn.Linear children that stay in the model dtype (see the module docstring).
KEEP_UNQUANTIZED = frozenset({"router", "shared_expert_gate", "weights_proj", "wkv_b", "output"})

Backend = Literal["triton", "scaled_mm", "emulate"]
log = logging.getLogger("meshrl.fp8")


# ---------------------------------------------------------------------------- numerics (torch)


def _pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    return x if x.shape == (rows, cols) else F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quantize_blocks(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """w (N, K) float -> (w8 (N, K) e4m3, scale_inv (ceil(N/block), ceil(K/block)) fp32) with
    w ~= w8 * scale_inv block by block (module docstring)."""
    N, K = w.shape
    nb, kb = math.ceil(N / block), math.ceil(K / block)
    x = _pad_to(w.float(), nb * block, kb * block).view(nb, block, kb, block)
    amax = x.abs().amax(dim=(1, 3)).clamp(min=_TINY)  # (nb, kb)
    scale = amax / FP8_MAX
    q = (x / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * block, kb * block)[:N, :K].contiguous(), scale


def dequantize_blocks(w8: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32,
                      block: int = BLOCK) -> Tensor:
    """(w8 (N, K) e4m3, scale_inv (ceil(N/block), ceil(K/block))) -> w8 * scale_inv in `dtype`."""
    N, K = w8.shape
    if scale_inv.shape != (math.ceil(N / block), math.ceil(K / block)):
        raise ValueError(f"an FP8 weight of shape {tuple(w8.shape)} with {block}x{block} blocks needs scales of "
                         f"shape {(math.ceil(N / block), math.ceil(K / block))}, got {tuple(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return (w8.float() * s).to(dtype)


def quantize_groups(x: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Activations x (M, K) -> (x8 (M, K) e4m3, scale (M, ceil(K/group)) fp32): one scale per row
    and `group` features (the 1x128 recipe). The last group of a K that is not a multiple is partial."""
    M, K = x.shape
    kb = math.ceil(K / group)
    xf = _pad_to(x.float(), M, kb * group).view(M, kb, group)
    scale = xf.abs().amax(dim=2).clamp(min=_TINY) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, kb * group)[:, :K].contiguous(), scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., D) -> (x8 (..., D) e4m3, scale (...) fp32), one scale per vector (the FP8 KV cache:
    one per token and head)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=_TINY) / FP8_MAX
    return (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def emulated_linear(x: Tensor, w8: Tensor, scale_inv: Tensor, bias: Tensor | None = None) -> Tensor:
    """The FP8 matmul's numerics without FP8 hardware: x (..., K) quantised per 1x128 group, both
    operands dequantised to fp32, one fp32 matmul -> (..., N) in x's dtype."""
    shape = x.shape
    x8, xs = quantize_groups(x.reshape(-1, shape[-1]))
    xd = (x8.float().view(x8.shape[0], -1) * xs.repeat_interleave(BLOCK, 1)[:, :shape[-1]])
    out = xd @ dequantize_blocks(w8, scale_inv).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], w8.shape[0])


# ---------------------------------------------------------------------------- hardware


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def hardware_backend(device: torch.device) -> tuple[Backend, str]:
    """The matmul backend FP8 weights get on `device` and, for "emulate", why (for the one log line).
    MESHRL_FP8_GEMM=triton|scaled_mm|emulate overrides the choice on a capable GPU."""
    if device.type != "cuda":
        return "emulate", f"{device.type} has no FP8 tensor cores"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return "emulate", f"{torch.cuda.get_device_name(device)} (sm{cap[0]}{cap[1]}) has no FP8 tensor cores (needs sm89+)"
    if not triton_available():
        return "emulate", "triton is not installed"
    # scaled_mm (cuBLAS blockwise) measured faster than our Triton kernel on an H200 (fp8_kernels)
    wanted = os.environ.get("MESHRL_FP8_GEMM", "scaled_mm" if cap >= (9, 0) else "triton")
    if wanted not in ("triton", "scaled_mm", "emulate"):
        raise ValueError(f"MESHRL_FP8_GEMM must be triton, scaled_mm or emulate, got {wanted!r}")
    if wanted == "scaled_mm" and cap < (9, 0):
        return "triton", ""
    return wanted, "MESHRL_FP8_GEMM=emulate" if wanted == "emulate" else ""


# ---------------------------------------------------------------------------- module


class Fp8Linear(nn.Module):
    """An inference-only nn.Linear whose weight is e4m3 with 128x128 block scales (module docstring).

    weight: (out, in) e4m3 Parameter (no grad); weight_scale_inv: (ceil(out/128), ceil(in/128)) fp32
    buffer; bias: the model dtype, or None. `backend` picks the matmul ("triton", "scaled_mm", "emulate").
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device,
                 dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        if backend == "scaled_mm" and (in_features % BLOCK or out_features % BLOCK):
            backend = "triton"  # cuBLAS blockwise scaling takes whole 128-blocks only
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.weight = nn.Parameter(torch.zeros((out_features, in_features), dtype=FP8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.ones((math.ceil(out_features / BLOCK),
                                                             math.ceil(in_features / BLOCK)),
                                                            dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: Backend) -> "Fp8Linear":
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, w.device, w.dtype, backend)
        out.load_weight(w)
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach())
        return out

    @torch.no_grad()
    def load_weight(self, w: Tensor) -> None:
        """Quantise a full-precision (out, in) weight into this module's storages, in place."""
        w8, scale = quantize_blocks(w)
        self.weight.copy_(w8)
        self.weight_scale_inv.copy_(scale)

    @torch.no_grad()
    def load_fp8(self, w8: Tensor, scale_inv: Tensor) -> None:
        """Take an already quantised weight (an FP8 checkpoint's tensors) as it is."""
        if w8.shape != self.weight.shape or scale_inv.shape != self.weight_scale_inv.shape:
            raise ValueError(f"FP8 weight {tuple(w8.shape)} / scales {tuple(scale_inv.shape)} do not fit a "
                             f"{tuple(self.weight.shape)} layer with {BLOCK}x{BLOCK} blocks")
        self.weight.copy_(w8.view(FP8) if w8.dtype != FP8 else w8)
        self.weight_scale_inv.copy_(scale_inv)

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "emulate" or not x.is_cuda:
            return emulated_linear(x, self.weight, self.weight_scale_inv, self.bias)
        from meshrl.models.common import fp8_kernels

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.backend == "scaled_mm":
            out = fp8_kernels.scaled_mm_linear(x2, self.weight, self.weight_scale_inv, self.bias)
        else:
            out = fp8_kernels.block_fp8_linear(x2, self.weight, self.weight_scale_inv, self.bias)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128, {self.backend}"


def quantizable(name: str, module: nn.Module) -> bool:
    """Whether `quantize_model` converts this module (module docstring)."""
    return (type(module) is nn.Linear and name.rpartition(".")[2] not in KEEP_UNQUANTIZED
            and (name.startswith("layers.") or ".layers." in name)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def quantize_model(model: nn.Module, device: torch.device) -> int:
    """Replace every quantizable nn.Linear of `model` by an Fp8Linear holding its quantised weight;
    returns how many. Logs once when the device has no FP8 matmul (the emulated fallback)."""
    backend, why = hardware_backend(device)
    if backend == "emulate":
        _warn_emulated(why)
    names = [name for name, module in model.named_modules() if quantizable(name, module)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), backend))
    return len(names)


@functools.cache
def _warn_emulated(why: str) -> None:
    log.warning("inference.quantization = fp8: %s; the engine keeps its weights in FP8 but every matmul "
                "dequantises them (emulated FP8, slower than bf16: for tests and correctness only)", why)


def quantized_params(model: nn.Module) -> dict[int, Fp8Linear]:
    """{index in model.named_parameters(): its Fp8Linear} for the FP8 weights of `model` (weight sync
    quantises what it receives for these instead of copying it)."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    return {i: owners[id(p)] for i, (_, p) in enumerate(model.named_parameters()) if id(p) in owners}


def fp8_checkpoint_block(config: dict) -> tuple[int, int] | None:
    """(block rows, block cols) if an HF config.json describes block-scaled FP8 weights, else None;
    ValueError for an FP8 config of another kind (per-tensor, dynamic activation-only, ...)."""
    q = config.get("quantization_config")
    if not q or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError("config.json quantization_config: quant_method 'fp8' without a 2-entry weight_block_size "
                         "(per-tensor FP8 checkpoints are not supported; block-scaled ones, e.g. [128, 128], are)")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("config.json quantization_config: only fmt 'e4m3' with activation_scheme 'dynamic' is "
                         f"supported, got fmt {q.get('fmt')!r}, activation_scheme {q.get('activation_scheme')!r}")
    return int(block[0]), int(block[1])


def load_checkpoint_weights(model: nn.Module, raw: dict[str, tuple[Tensor, Tensor]]) -> int:
    """Give each Fp8Linear of `model` the e4m3 weight and scales an FP8 checkpoint stores for it
    ({"layers.0.attention.wq.weight": (w8, scale_inv)}, models/hf.py `load_hf_weights(fp8_out=)`),
    when its blocks are 128x128 (the shapes say so); returns how many were taken as they are."""
    taken = 0
    for name, module in model.named_modules():
        entry = raw.get(f"{name}.weight")
        if isinstance(module, Fp8Linear) and entry is not None and entry[1].shape == module.weight_scale_inv.shape:
            module.load_fp8(*entry)
            taken += 1
    return taken
