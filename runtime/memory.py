"""How a colocated trainer and engine split one GPU's memory (layout.colocate).

The engine takes what is fixed: its weights in the inference dtype, its KV cache (a budget, not
whatever happens to be free: both processes start at once), the recurrent states of a model with
linear-attention layers (Qwen3.5, Qwen3-Next: one slot per max_num_seqs row) and a reserve for CUDA
graphs, workspaces and the sampler's (max_num_seqs, vocab) fp32 buffers. The trainer takes the rest,
which must hold its share of the fp32 parameters, their gradients and AdamW's two moments (with
LoRA: the frozen fp32 base, and those three for the adapters only), the shared weight buffer of the
colocated path, one layer's gathered bf16 weights (every layer's when
trainer.parallel.reshard_after_forward is false) and the activations of one micro-batch. `plan` adds
these up from the model shape (an estimate for the activations, stated as such), and `check` refuses
a budget that cannot hold them before any process starts, with the numbers. With
inference.sleep_while_training the engine frees its KV cache while the trainer steps, so the cache
and the step's memory (activations, the gathered weights, the logprob head) only have to fit one at a
time.

    KV budget = inference.kv_cache_gib, else inference.gpu_memory_fraction x the GPU's memory
    GPU memory = layout.gpu_memory_gib if set (each process is then capped, `cap_process`), else
                 the device's total memory
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.models.common.lora import resolve_targets
from meshrl.models.common.probe import recurrent_state_bytes
from meshrl.runtime.config import RLConfig
from meshrl.runtime.policy import policy_skeleton

GIB = 2**30
ENGINE_RESERVE = 1 * GIB  # CUDA graphs' pools, cuBLAS workspaces, prefill temporaries
SAMPLER_BYTES = 16  # per row and vocabulary entry: the fp32 logits of a decode step and their temporaries
CONTEXT = GIB // 2  # the CUDA context and allocator slack of each process
# Activation bytes per token and layer in bf16, per model dim, by activation checkpointing: about
# 34 x dim without it (Korthikanti et al., 2022), the block inputs alone with full AC.
_ACTIVATION_BYTES_PER_DIM = {"none": 34, "selective": 20, "full": 2}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one GPU shared by one trainer rank and its engine."""

    device: int
    engine_weights: int
    kv_cache: int
    engine_reserve: int  # ENGINE_RESERVE + the sampler's (max_num_seqs, vocab) fp32 buffers
    trainer_state: int  # fp32 parameters + gradients + two AdamW moments, this rank's share
    staging: int  # the shared weight buffer (inference dtype)
    gathered: int  # one layer's full bf16 weights and gradients in FSDP2's forward / backward (with
    # trainer.parallel.reshard_after_forward = false: every layer's bf16 weights, and one layer's gradients)
    activations: int  # one micro-batch, estimated
    logprob_head: int  # one chunk of fp32 logits and its gradient (the torch path; the fused kernels hold less)
    recurrent_states: int = 0  # linear-attention layers' state slots, max_num_seqs rows (native engine)
    sleeps: bool = False  # inference.sleep_while_training: the KV cache and the step's memory alternate

    @property
    def engine(self) -> int:
        return self.engine_weights + self.kv_cache + self.recurrent_states + self.engine_reserve + CONTEXT

    @property
    def trainer(self) -> int:
        return self.trainer_state + self.staging + self.step_memory + CONTEXT

    @property
    def step_memory(self) -> int:
        """What the trainer holds only while it steps (freed after every step when the engine sleeps)."""
        return self.gathered + self.activations + self.logprob_head

    @property
    def peak(self) -> int:
        """Both processes at their largest at once; with sleeps, the KV cache and the step's memory
        are never held together."""
        if self.sleeps:
            return self.engine + self.trainer - min(self.kv_cache + self.recurrent_states, self.step_memory)
        return self.engine + self.trainer

    def describe(self) -> str:
        g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
        return (f"engine {g(self.engine)} GiB (weights {g(self.engine_weights)}, KV cache {g(self.kv_cache)}, "
                + (f"recurrent states {g(self.recurrent_states)}, " if self.recurrent_states else "")
                + f"reserve {g(self.engine_reserve + CONTEXT)}) + trainer {g(self.trainer)} GiB (parameters, gradients "
                f"and AdamW {g(self.trainer_state)}, shared weight buffer {g(self.staging)}, gathered weights "
                f"{g(self.gathered)}, activations of one micro-batch ~{g(self.activations)} (estimated), "
                f"logprob head {g(self.logprob_head)}, context {g(CONTEXT)})"
                + (f", {g(self.peak)} GiB at once while the engine sleeps during steps" if self.sleeps else "")
                + f" of {g(self.device)} GiB")


def device_bytes(cfg: RLConfig) -> int:
    """The memory one colocated pair may use: layout.gpu_memory_gib, else the GPU's total."""
    if cfg.layout.gpu_memory_gib is not None:
        return int(cfg.layout.gpu_memory_gib * GIB)
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def kv_budget(cfg: RLConfig, total: int) -> int:
    """The colocated engine's KV-cache budget in bytes."""
    inf = cfg.inference
    return int(inf.kv_cache_gib * GIB) if inf.kv_cache_gib is not None else int(inf.gpu_memory_fraction * total)


def plan(cfg: RLConfig, total: int) -> MemoryPlan:
    """The plan for `cfg`'s model on a GPU of `total` bytes (inference dtype bf16)."""
    model, adapter, _, _ = policy_skeleton(cfg.model, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    state = 16 * params  # fp32 parameters, gradients and AdamW's two moments
    if cfg.model.lora is not None:  # a frozen fp32 base; gradients and moments for the adapters only
        lo = cfg.model.lora
        chosen = resolve_targets(model, adapter, lo.target_modules)
        adapters = sum(lo.rank * (m.in_features + m.out_features) for m in map(model.get_submodule, chosen))
        state = 4 * params + 16 * adapters
    vocab, dim = model.output_weight.shape
    layers = list(model.layers.values() if hasattr(model.layers, "values") else model.layers)
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    t = cfg.trainer
    ac = t.parallel.activation_checkpointing
    tokens = t.micro_batch_tokens
    chunk = min(t.logprob_chunk_tokens, tokens)
    reshards = t.parallel.reshards(cfg.layout.num_trainer_ranks, True, cfg.model.lora is not None)
    return MemoryPlan(
        device=total,
        engine_weights=2 * params,
        kv_cache=kv_budget(cfg, total),
        # vLLM's worker is one more process on the GPU, with its own CUDA context
        engine_reserve=(ENGINE_RESERVE + SAMPLER_BYTES * cfg.inference.max_num_seqs * vocab
                        + (CONTEXT if cfg.inference.backend == "vllm" else 0)),
        trainer_state=state // cfg.layout.num_trainer_ranks,
        staging=2 * params,
        gathered=(2 * 2 * layer_params if reshards
                  else 2 * sum(p.numel() for layer in layers for p in layer.parameters()) + 2 * layer_params),
        activations=_ACTIVATION_BYTES_PER_DIM[ac] * dim * tokens * len(layers),
        logprob_head=3 * 4 * chunk * vocab,
        recurrent_states=_recurrent_states(cfg, model),
        sleeps=cfg.inference.sleep_while_training,
    )


def _recurrent_states(cfg: RLConfig, model: torch.nn.Module) -> int:
    """The native engine's linear-attention state slots for `model` (0 for vLLM, which sizes its
    own inside its KV budget, and for models without linear-attention layers)."""
    if cfg.inference.backend == "vllm":
        return 0
    return recurrent_state_bytes(model, cfg.inference.max_num_seqs, torch.bfloat16)


def check(cfg: RLConfig) -> MemoryPlan:
    """ValueError (with the numbers) when one GPU cannot hold a colocated trainer rank and its engine."""
    p = plan(cfg, device_bytes(cfg))
    if p.peak > p.device:
        raise ValueError(f"layout.colocate: one GPU cannot hold the trainer and its engine: {p.describe()}; lower "
                         "inference.gpu_memory_fraction / inference.kv_cache_gib or trainer.micro_batch_tokens, "
                         "or use trainer.parallel.activation_checkpointing")
    return p


def cap_process(cfg: RLConfig, role: str, device: torch.device) -> None:
    """With layout.gpu_memory_gib, cap this process (the engine at its plan, the trainer at the rest)."""
    if cfg.layout.gpu_memory_gib is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    p = plan(cfg, device_bytes(cfg))
    # a sleeping engine gives its KV cache and states to the trainer while it steps: the trainer may use them then
    engine = p.engine - p.kv_cache - p.recurrent_states if p.sleeps else p.engine
    share = p.engine if role == "inference" else p.device - engine
    torch.cuda.set_per_process_memory_fraction(min(share / total, 1.0), device)
