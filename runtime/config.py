"""Configuration: pydantic models, TOML composition and dotted CLI overrides.

A run is described by one root object (`RLConfig` or `SFTConfig`). It can be built in Python
or from the command line::

    meshrl rl @ base.toml @ small.toml --trainer.optim.lr 3e-6 --output-dir runs/x

TOML files are merged left to right (later files win, tables merge key by key), then the
dotted overrides are applied, then the whole thing is validated once. Every field carries a
docstring (it becomes the field's description), models forbid unknown keys, validators only
validate (derived values are properties), and each component receives only its own section.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

# `Base` (extra="forbid", field docstrings as descriptions) is defined once, in envs/ (the lower
# layer, which may not import the runtime), for the environments' sections and these alike.
from meshrl.envs.config import Base
from meshrl.envs.registry import ENV_NAMES, EnvConfig
from meshrl.envs.reverse_text import ReverseTextEnvConfig


# ----------------------------------------------------------------------------- model


class LoRAConfig(Base):
    """LoRA adapters on the policy's linear layers: the base weights are frozen and only the adapters
    train (docs/lora.md). The engines receive merged weights; exports add a PEFT adapter folder."""

    rank: int = Field(16, ge=1)
    """Rank r of every adapter (A is r x in, B is out x r)."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the update is (B @ A) * alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only; the merged weights the engines get have none)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Linear modules to adapt, by HF name (q_proj, ..., down_proj) or ours (wq, ..., w2); each must
    name at least one linear module of the model."""

    @model_validator(mode="after")
    def _targets(self) -> "LoRAConfig":
        if not self.target_modules:
            raise ValueError("model.lora.target_modules: name at least one module (e.g. [\"q_proj\", \"v_proj\"])")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"model.lora.target_modules: {self.target_modules} names a module twice")
        return self


class ModelConfig(Base):
    """Which policy to train: an HF folder, or a flavor built from scratch."""

    path: str | None = None
    """HF model folder (config.json + *.safetensors + tokenizer files) to start from."""
    flavor: str | None = None
    """Build a fresh model of this flavor (see models/) instead of loading `path`."""
    family: str = "qwen3"
    """Model family of `flavor` (a key of meshrl.models.MODEL_FAMILIES)."""
    tokenizer: Literal["char"] | None = None
    """Tokenizer for a fresh `flavor` model; "char" builds the char-level tokenizer in code."""
    init_seed: int = 0
    """Seed of init_weights() for a fresh model."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto is bfloat16 on GPU and float32 on CPU."""
    impl: Literal["auto", "native", "hf"] = "auto"
    """Implementation of a `path` model: auto = our native family when its model_type has one, else
    the generic transformers wrapper (models/generic_hf.py); native = ours or an error; hf = the
    wrapper always. Fresh `flavor` models are always native."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of every weight (`[model.lora]`; None: full fine-tuning)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.flavor is None):
            raise ValueError("model: set exactly one of model.path (an HF folder) or model.flavor (a fresh model)")
        if self.flavor is not None and self.tokenizer is None:
            raise ValueError("model.tokenizer is required with model.flavor (e.g. \"char\")")
        if self.flavor is not None and self.impl == "hf":
            raise ValueError("model.impl = \"hf\" needs model.path: fresh flavor models are always native")
        return self

    def check_folder(self) -> None:
        """Raise ValueError (one line) when `path` is set but is no HF model folder: missing, or without
        config.json or *.safetensors. Only the file system is read (no torch): the CLI runs it before
        the heavy imports, and the pre-flight check (runtime/policy.py) runs it again."""
        if self.path is None:
            return
        folder = Path(self.path)
        if not folder.is_dir():
            raise ValueError(f"model.path: folder not found: {self.path}")
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.path: {self.path} has no config.json (an HF model folder is expected)")
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"model.path: {self.path} has no *.safetensors weights")


# ----------------------------------------------------------------------------- trainer


class OptimConfig(Base):
    """AdamW with linear warm-up and gradient clipping."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up of the learning rate over this many optimizer steps."""


LOSS_PARAMS: dict[str, tuple[str, ...]] = {
    "dppo": ("delta_low", "delta_high"),
    "aipo": ("ratio_cap",),
    "ppo_clip": ("clip_low", "clip_high"),
    "gspo": ("clip_low", "clip_high"),
    "cispo": ("clip_low", "clip_high"),
}
"""Each loss type's own fields of `LossConfig` (the others must keep their defaults)."""
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {"ppo_clip": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}
"""(clip_low, clip_high) of a loss type when unset: PPO's 0.2, GSPO's paper values, MiniMax-M1's CISPO
(no lower bound on the weight)."""
CORRECTION_DEFAULTS: dict[str, tuple[float, float]] = {"tis": (0.0, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}
"""(correction_low, correction_high) of a correction when unset (icepop: the IcePop paper's band)."""


class LossConfig(Base):
    """The RL loss (runtime/train/losses.py; formulas and when to use which: docs/algorithms.md).

    Every loss sums per-token terms over the step's loss tokens and divides by the step's global
    loss-token count, plus the KL penalty kl_coef * 0.5 * d^2 with d = trainer - engine logprob.
    A field that belongs to another loss type or correction than the one chosen must keep its
    default (a config error otherwise), so a config says what it runs.
    """

    type: Literal["dppo", "aipo", "ppo_clip", "gspo", "cispo"] = "dppo"
    """dppo: ratio * A with a binary trust region in probability space (prime-rl's default loss);
    aipo: truncated importance weight min(ratio, ratio_cap) * A; ppo_clip: PPO's clipped surrogate;
    gspo: the clipped surrogate on the length-normalised sequence ratio; cispo: clipped
    stop-gradient importance weight, no token dropped."""
    delta_low: float = Field(0.2, gt=0, le=1)
    """dppo: mask a negative-advantage token once its probability fell by more than this."""
    delta_high: float = Field(0.2, gt=0, le=1)
    """dppo: mask a positive-advantage token once its probability rose by more than this."""
    ratio_cap: float = Field(8.0, gt=0)
    """aipo: the importance weight is min(ratio, ratio_cap) (a stop-gradient weight)."""
    clip_low: float | None = Field(None, ge=0, le=1)
    """ppo_clip, gspo, cispo: the ratio is clipped below at 1 - clip_low; unset: 0.2 (ppo_clip),
    3e-4 (gspo), 1.0 (cispo: no lower bound)."""
    clip_high: float | None = Field(None, ge=0)
    """ppo_clip, gspo, cispo: the ratio is clipped above at 1 + clip_high; unset: 0.2 (ppo_clip),
    4e-4 (gspo), 0.28 (cispo)."""
    kl_coef: float = Field(2e-3, ge=0)
    """Weight of the kl_coef * 0.5 * d^2 penalty between trainer and inference logprobs (every loss
    type). The default 2e-3 makes dppo prime-rl's default loss (its kl_tau * d^2, kl_tau = 1e-3):
    kl_coef = 2 * kl_tau."""
    correction: Literal["none", "tis", "mis", "icepop"] = "none"
    """Trainer/engine mismatch correction of each policy-gradient term by rho = trainer / engine
    probability: tis truncates the weight at correction_high, mis drops tokens (samples) with rho above
    correction_high, icepop drops those outside [correction_low, correction_high]; the share of loss
    tokens touched is logged as loss/correction_fraction."""
    correction_level: Literal["token", "sequence"] = "token"
    """rho per token, or per sample (the product of its tokens' ratios, applied to all of them)."""
    correction_low: float | None = Field(None, ge=0, le=1)
    """icepop's lower bound on rho; unset: 0.5."""
    correction_high: float | None = Field(None, ge=1)
    """The upper bound on rho of tis, mis and icepop; unset: 2.0 (tis, mis), 5.0 (icepop)."""

    @model_validator(mode="after")
    def _fields_of_type(self) -> "LossConfig":
        own = set(LOSS_PARAMS[self.type])
        for name in sorted({f for fields in LOSS_PARAMS.values() for f in fields} - own):
            if getattr(self, name) != type(self).model_fields[name].default:
                users = ", ".join(t for t, fields in LOSS_PARAMS.items() if name in fields)
                raise ValueError(f"trainer.loss.{name} applies to loss type {users}, not {self.type!r}")
        bounds = {"correction_low": ("icepop",), "correction_high": ("tis", "mis", "icepop"),
                  "correction_level": ("tis", "mis", "icepop")}
        for name, users in bounds.items():
            if self.correction not in users and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"trainer.loss.{name} applies to correction {' | '.join(users)}, "
                                 f"not {self.correction!r}")
        return self

    @property
    def params(self) -> dict[str, float]:
        """The chosen loss type's own keyword arguments (runtime/train/losses.py), defaults resolved."""
        if self.type in CLIP_DEFAULTS:
            low, high = CLIP_DEFAULTS[self.type]
            return {"clip_low": low if self.clip_low is None else self.clip_low,
                    "clip_high": high if self.clip_high is None else self.clip_high}
        return {name: getattr(self, name) for name in LOSS_PARAMS[self.type]}

    @property
    def correction_bounds(self) -> tuple[float, float]:
        """(low, high) bounds on rho of the chosen correction (unset ones resolved); (0, inf) for none."""
        if self.correction == "none":
            return 0.0, math.inf
        low, high = CORRECTION_DEFAULTS[self.correction]
        return (low if self.correction_low is None else self.correction_low,
                high if self.correction_high is None else self.correction_high)

    @property
    def sequence_level(self) -> bool:
        """Whether the loss needs every token of a sample on one rank (gspo, sequence corrections)."""
        return self.type == "gspo" or (self.correction != "none" and self.correction_level == "sequence")


class ParallelConfig(Base):
    """How the trainer sub-mesh parallelizes the model (see parallel/ and docs/parallelism.md).

    dp_replicate x dp_shard x cp must equal the number of trainer ranks; ep splits the
    dp_shard x cp ranks further for the experts of a MoE model.
    """

    dp_replicate: int = Field(1, ge=1)
    """Replicated data-parallel degree (HSDP outer axis: FSDP2 shards within, all-reduces across)."""
    dp_shard: int = Field(-1, ge=-1)
    """Sharded data-parallel degree (FSDP2); -1 takes all trainer ranks left over."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree: each packed row is split over this many ranks (exact attention)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (MoE models): experts split over ep ranks, tokens moved by all-to-all."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: full blocks, or selective (keep matmul/attention outputs)."""
    ac_every: int = Field(1, ge=1)
    """With activation_checkpointing = "full": checkpoint every N-th block only."""
    compile: bool = False
    """torch.compile every transformer block (GPU; on CPU it needs a C++ compiler)."""
    reshard_after_forward: bool | None = None
    """FSDP2: free each block's gathered compute-dtype weights after its forward and gather them again
    in its backward (true), or keep them until its backward (false: one gather a step instead of two,
    for the model's weights held once more in the compute dtype through the step). None: false for
    full fine-tuning on a one-rank trainer mesh outside the colocated layout (nothing is sharded there,
    the second gather is only copies, and the copy costs 2 bytes a parameter beside the 16 of fp32
    weights, gradients and AdamW: 0.5-1.4% of a 1.7B step on an H200, docs/benchmarks.md), true
    otherwise (with LoRA the copy would add half of the trainer's state). The last block is never
    resharded after forward (backward needs it at once)."""

    def reshards(self, num_ranks: int, colocated: bool, lora: bool = False) -> bool:
        """`reshard_after_forward` resolved for `num_ranks` trainer ranks (see its docstring)."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return num_ranks > 1 or colocated or lora

    def dims(self, num_ranks: int):
        """The validated `parallel.dims.ParallelDims` for `num_ranks` trainer ranks."""
        from meshrl.parallel.dims import ParallelDims

        return ParallelDims.resolve(num_ranks, self.dp_replicate, self.dp_shard, self.cp, self.ep)

    @model_validator(mode="after")
    def _no_zero(self) -> "ParallelConfig":
        if self.dp_shard == 0:
            raise ValueError("trainer.parallel.dp_shard must be >= 1 or -1 (all remaining ranks)")
        if self.ac_every > 1 and self.activation_checkpointing != "full":
            raise ValueError("trainer.parallel.ac_every applies only to activation_checkpointing = \"full\"")
        return self


class TrainerConfig(Base):
    """The trainer sub-mesh: optimizer, loss, packing and parallelism."""

    optim: OptimConfig = OptimConfig()
    """Optimizer settings."""
    loss: LossConfig = LossConfig()
    """RL loss settings (unused by SFT)."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallel degrees of the trainer sub-mesh."""
    micro_batch_tokens: int = Field(2048, ge=16)
    """Tokens per packed micro-batch row (several documents per row)."""
    attention: Literal["auto", "sdpa", "flex", "varlen", "flash_attn", "split"] = "auto"
    """Attention kernel for packed rows: auto = varlen on GPU in bf16/fp16, split (one SDPA per document) on
    CPU, else sdpa (a dense document mask); flex is opt-in."""
    share_prompts: bool = True
    """RL: pack the samples of one prompt (same token ids; a GRPO group) on one copy of it, each completion
    attending the shared prompt and itself (runtime/train/packing.py): the logprobs, loss and gradients of
    the unshared packing from fewer tokens. Every attention backend takes it; context parallelism
    (parallel.cp > 1) and linear-attention models do not, and pack unshared rows (said once in the log)."""
    overlap_rollout: bool = True
    """RL: train a step's GRPO groups as they finish, while the engines still generate its other groups
    (forward + backward, gradients accumulating); the optimizer step comes once all are in, so the update
    is the step's without overlap, up to float reassociation (losses divide by a provisional normaliser
    and the gradients are rescaled to the step's loss-token count at the end; docs/architecture.md,
    "Overlapped training"). Which groups share a part depends on timing, so two runs agree up to float
    reassociation only; off for bit-identical reruns. Not with inference.sleep_while_training (the trainer
    then needs the engine's memory), where it is ignored."""
    logprob_chunk_tokens: int = Field(4096, ge=1)
    """Tokens per chunk of the LM head + logprob computation (bounds the logits held at once: one chunk's
    input-dtype logits with the fused kernels on CUDA, also its fp32 temporaries on the torch path)."""
    moe_aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the MoE load-balancing loss (its value is logged as moe/aux_loss either way)."""

    @model_validator(mode="after")
    def _sequence_loss_fits(self) -> "TrainerConfig":
        if self.loss.sequence_level and self.parallel.cp > 1:
            what = ('trainer.loss.type = "gspo"' if self.loss.type == "gspo"
                    else 'trainer.loss.correction_level = "sequence"')
            raise ValueError(f"{what} needs whole samples on one rank, but trainer.parallel.cp = "
                             f"{self.parallel.cp} splits them over ranks")
        return self


# ----------------------------------------------------------------------------- inference


class SamplingConfig(Base):
    """Sampling of rollouts."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1 = off). Logprobs are of the un-truncated distribution."""
    max_tokens: int = Field(64, ge=1)
    """Maximum completion tokens per rollout."""


class VLLMConfig(Base):
    """vLLM engine settings (used only with inference.backend = "vllm"; see docs/inference.md)."""

    gpu_memory_utilization: float = Field(0.8, gt=0, lt=1)
    """Fraction of the GPU's memory vLLM may take for weights and KV cache; the rest stays for the
    inference rank's own process (CUDA context, NCCL buffers, one weight bucket)."""
    enforce_eager: bool = False
    """Run without CUDA graphs (faster start-up, slower decoding)."""


class InferenceConfig(Base):
    """Inference engines on the inference sub-mesh (one replica per `tensor_parallel` ranks)."""

    backend: Literal["native", "vllm"] = "native"
    """Engine implementation: "native" (models/ + our KV cache; CPU and GPU) or "vllm" (GPU only,
    installed in a separate environment; see docs/inference.md)."""
    vllm: VLLMConfig = VLLMConfig()
    """vLLM engine settings (backend = "vllm" only)."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences decoded together in one batch per replica."""
    max_model_len: int = Field(512, ge=8)
    """Prompt plus completion tokens a sequence may reach."""
    block_size: int = Field(16, ge=1)
    """Native engine: tokens per block of the paged KV cache."""
    num_blocks: int | None = Field(None, ge=2)
    """Native engine: KV-cache size in blocks; unset: room for max_num_seqs full-length sequences, on GPU
    at most kv_cache_memory_fraction of the memory left free after loading the model."""
    kv_cache_memory_fraction: float = Field(0.85, gt=0, le=1)
    """Native engine: most of the GPU memory left free after loading the model that the KV cache may take."""
    max_num_batched_tokens: int | None = Field(None, ge=2)
    """Native engine: prefill tokens per step (padded batch x length); unset: max(8192, max_model_len)."""
    prefix_sharing: bool = True
    """Native engine: reuse cached prompt blocks and prefill the samples of one prompt once (copy-on-write)."""
    cuda_graphs: bool = True
    """Native engine: replay decode steps from CUDA graphs captured per batch-size bucket (GPU only)."""
    attention: Literal["auto", "torch", "triton"] = "auto"
    """Native engine: decode attention over the paged cache, a triton kernel (GPU) or gather + SDPA;
    auto = triton when it is installed and the device is a GPU."""
    tensor_parallel: int = Field(1, ge=1)
    """Ranks per engine replica (native engine, dense qwen3 / llama models): each of the N ranks holds
    1/N of every attention and FFN matrix (docs/parallelism.md). layout.num_inference_ranks must be a
    multiple, and N must divide the model's attention heads, kv heads and FFN width."""
    gpu_memory_fraction: float = Field(0.3, gt=0, lt=1)
    """Colocated layout, native engine: the share of the GPU's total memory the engine's KV cache may
    take (the trainer gets what the engine's weights and cache leave); ignored when kv_cache_gib is set.
    A split-layout engine has its GPU to itself and uses kv_cache_memory_fraction instead."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """Native engine: a fixed KV-cache budget in GiB (at most what max_num_seqs full-length sequences
    need), instead of a fraction of the GPU's memory."""
    quantization: Literal["none", "fp8"] = "none"
    """fp8: the engine keeps its decoder linear weights in float8 e4m3 with 128x128 block scales and
    multiplies on FP8 tensor cores (Hopper/Ada; elsewhere emulated, with a warning), quantising the
    trainer's bf16 weights itself at every weight sync (docs/inference.md, FP8). vLLM backend: passed
    as vLLM's quantization="fp8". Native engine: not with tensor_parallel > 1."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """fp8: the paged KV cache stores e4m3 keys and values with one scale per token and head (about half
    the bytes); auto: the model dtype. Not for MLA latent caches (DeepSeek-V3, GLM-5). vLLM backend:
    passed as vLLM's kv_cache_dtype="fp8"."""
    sleep_while_training: bool = False
    """Colocated layout, synchronous RL only (max_off_policy_steps = 0), native engine: the engine frees
    its KV cache (and linear-attention states) and CUDA graphs while the trainer steps and takes them
    back for the next rollouts, so the trainer can use that memory (small GPUs)."""
    prefill_ranks: int = Field(0, ge=0)
    """Prefill/decode disaggregation (native engine, split layout, tensor_parallel = 1, no model with
    linear-attention layers): the first K engine replicas only prefill prompts; their KV blocks, first
    tokens and versions then move to one of the other (decode) replicas over a dedicated process
    group, which decodes them; multi-turn continuations are prefilled by the decode replica that
    holds the episode's cache. 0: every replica does both (docs/inference.md, Prefill/decode
    disaggregation)."""
    prefill_backlog_tokens: int | None = Field(None, ge=1)
    """Prefill/decode disaggregation: when the least loaded prefill replica already has this many
    prompt tokens outstanding, a new first turn is prefilled by its decode replica instead (as it
    prefills multi-turn continuations), so the decode pool does not wait idle behind a long prefill
    queue; unset: 4 x the prefill budget of a step (max_num_batched_tokens or its default)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings."""

    @model_validator(mode="after")
    def _tensor_parallel_native(self) -> "InferenceConfig":
        if self.tensor_parallel > 1 and self.backend != "native":
            raise ValueError(f'inference.tensor_parallel ({self.tensor_parallel}) > 1 needs inference.backend = '
                             '"native": the vLLM adapter runs one GPU per replica')
        return self

    @model_validator(mode="after")
    def _fp8_tensor_parallel(self) -> "InferenceConfig":
        if self.quantization == "fp8" and self.tensor_parallel > 1:
            raise ValueError(f'inference.quantization = "fp8" is not supported with inference.tensor_parallel '
                             f'({self.tensor_parallel}) > 1 yet: use one rank per replica or quantization = "none"')
        return self

    @model_validator(mode="after")
    def _vllm_logprobs(self) -> "InferenceConfig":
        if self.backend == "vllm" and self.sampling.top_p < 1:
            raise ValueError(
                f'inference.sampling.top_p ({self.sampling.top_p}) must be 1 with inference.backend = "vllm": '
                "vLLM reports logprobs of the truncated distribution, the trainer those of the full one"
            )
        return self

    @model_validator(mode="after")
    def _fits(self) -> "InferenceConfig":
        if self.sampling.max_tokens >= self.max_model_len:
            raise ValueError(
                f"inference.sampling.max_tokens ({self.sampling.max_tokens}) must be smaller than "
                f"inference.max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def prefill_backlog(self) -> int:
        """prefill_backlog_tokens, or its default: 4 x the native engine's prefill tokens per step."""
        return self.prefill_backlog_tokens or 4 * (self.max_num_batched_tokens or max(8192, self.max_model_len))


class WeightSyncConfig(Base):
    """Trainer -> inference weight broadcast after every optimizer step."""

    bucket_mb: float = Field(64.0, gt=0)
    """Parameters are broadcast in flat buckets of about this many MiB."""


# ----------------------------------------------------------------------------- environments


# The environments' config classes live next to the environments (envs/<name>.py); envs/registry.py
# builds their union, `EnvConfig`, and their tags from its one table (imported above).


class EpisodesConfig(Base):
    """How environment work (starting, stepping, scoring episodes) runs; see runtime/rollout/episodes.py."""

    workers: int = Field(4, ge=1)
    """Worker threads for environment calls (a verifiers harness episode holds one while it runs)."""
    timeout_s: float = Field(60.0, gt=0)
    """Longest one environment call (episode start, a step with its tool calls, scoring) may take; past
    it the rollout fails (counted in rollouts/failed, excluded from training)."""
    score_memory_mb: int = Field(0, ge=0)
    """> 0: score each episode in a forked child process with this many MiB of address space beyond the
    parent's (a reward function that exhausts memory or hangs is killed); 0: score on a worker thread."""


class AdvantageConfig(Base):
    """How the controller turns a group's rewards into advantages, and which groups and samples it
    trains on (runtime/rollout/controller.py, the functions in runtime/train/losses.py;
    docs/algorithms.md). Failed rollouts never count."""

    type: Literal["grpo", "grpo_std", "drgrpo", "rloo"] = "grpo"
    """grpo: reward minus the group mean; grpo_std: that divided by the group's std (GRPO as
    published); drgrpo: grpo's advantage, and the step's loss divided by samples x
    inference.sampling.max_tokens instead of its loss-token count (Dr.GRPO: no length
    normalisation at all); rloo: reward minus the mean of the group's other samples."""
    length_penalty: float = Field(0.0, ge=0)
    """Subtract length_penalty * sampled tokens / inference.sampling.max_tokens from each reward
    before advantages (reward/mean stays the environment's reward)."""
    mask_truncated: bool = False
    """Overlong filtering: a sample cut off at max_tokens (finish_reason "length") is not trained on;
    its reward still counts in its group's baseline. Counted as batch/samples_masked_truncated."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is >= this (for min_pass_rate / max_pass_rate)."""
    min_pass_rate: float = Field(0.0, ge=0, le=1)
    """Online difficulty filtering: drop a group whose share of passing samples is below this (too
    hard; e.g. 0.01 drops groups where none passed). Counted as batch/groups_dropped_too_hard."""
    max_pass_rate: float = Field(1.0, ge=0, le=1)
    """Drop a group whose share of passing samples is above this (too easy; e.g. 0.99 drops groups
    where all passed). Counted as batch/groups_dropped_too_easy."""

    @model_validator(mode="after")
    def _band(self) -> "AdvantageConfig":
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"advantage.min_pass_rate ({self.min_pass_rate}) > advantage.max_pass_rate "
                             f"({self.max_pass_rate}): every group would be dropped")
        return self


class EvalSettings(Base):
    """Evaluation: held-out examples, n samples each, mean reward and pass@k (runtime/rollout/evals.py)."""

    every: int = Field(0, ge=0)
    """`meshrl rl`: evaluate the policy every this many steps and at the end (0 = off); results are logged
    as eval/... on the metrics row of the step that produced the weights."""
    num_examples: int = Field(32, ge=1)
    """Examples per evaluation."""
    samples_per_prompt: int = Field(1, ge=1)
    """Samples per example (n of pass@k)."""
    pass_k: list[int] = [1]
    """The k of pass@k (each <= samples_per_prompt), estimated without bias from the n samples."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature (0 = greedy; needs samples_per_prompt = 1)."""
    max_tokens: int | None = Field(None, ge=1)
    """Tokens per turn; unset: inference.sampling.max_tokens."""
    example_offset: int = Field(10**9, ge=0)
    """Evaluation examples are env.example(example_offset + i): far from the training cursor."""
    env: EnvConfig | None = None
    """The environment to evaluate on; unset: the run's env."""

    @model_validator(mode="after")
    def _pass_k(self) -> "EvalSettings":
        if not self.pass_k or any(k < 1 or k > self.samples_per_prompt for k in self.pass_k):
            raise ValueError(f"eval.pass_k {self.pass_k}: each k must be in 1..samples_per_prompt "
                             f"({self.samples_per_prompt})")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError("eval.samples_per_prompt > 1 needs eval.temperature > 0 (greedy samples are identical)")
        return self


# ----------------------------------------------------------------------------- layout and run


def _default_env_name(data: Any) -> Any:
    """Let `--env.seed 3` alone select the default environment (the union needs its tag); a table
    with `envs` is a mix."""
    if isinstance(data, dict) and isinstance(data.get("env"), dict) and "name" not in data["env"]:
        default = "mix" if "envs" in data["env"] else "reverse-text"
        data = {**data, "env": {"name": default, **data["env"]}}
    return data



class LayoutConfig(Base):
    """How the ranks of the job split into roles: 1 controller + trainers + inference."""

    num_trainer_ranks: int = Field(1, ge=1)
    """Ranks of the trainer sub-mesh."""
    num_inference_ranks: int = Field(1, ge=1)
    """Ranks of the inference sub-mesh (one engine replica per inference.tensor_parallel ranks)."""
    colocate: bool | Literal["auto"] = "auto"
    """true: every trainer rank shares its device with one engine (N GPUs hold N trainer ranks and
    N engines; num_inference_ranks = num_trainer_ranks, inference.tensor_parallel = 1), and weights
    reach the engine through memory both processes map instead of a broadcast. false: one device per
    rank (the split layout). "auto": colocate when a one-node GPU job needs more GPUs than the node
    has (the launcher says so in one line); otherwise split. docs/architecture.md."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Colocated layout: use at most this much of each GPU, as a smaller card would have (to try a
    small-GPU setup on a big one): the engine process is capped at its weights + KV cache + a reserve
    (runtime/memory.py), the trainer process at the rest (torch.cuda.set_per_process_memory_fraction)."""

    @property
    def world_size(self) -> int:
        """Processes the job needs: one controller, the trainers and the inference ranks."""
        return 1 + self.num_trainer_ranks + self.num_inference_ranks


class DistConfig(Base):
    """torch.distributed settings."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto uses CUDA when it is available."""
    timeout_s: float = Field(600.0, gt=0)
    """A collective (FSDP, weight broadcast) that waits longer than this fails the job."""
    message_timeout_s: float = Field(3600.0, gt=0)
    """A rank that hears nothing on a control channel for this long fails the job. Channels are
    legitimately idle while the other side works (a long step), so this is longer than timeout_s;
    a peer that dies closes its connections and is detected at once, not after this timeout, and a
    frozen one by heartbeat_timeout_s."""
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    """Every rank's process publishes a heartbeat (a background thread, on torchrun's store) a few
    times per this period; a rank silent this long (frozen, stopped, swapped out) ends the job, or
    restarts it under max_restarts, with a message naming the rank, its role and its last activity
    (docs/checkpoints.md). It watches processes, not progress: a long step is not silence."""
    max_restarts: int = Field(0, ge=0)
    """Restart the whole job up to this many times after a rank fails (`torchrun --max-restarts`, set
    by `meshrl rl|sft`); every restart resumes from the latest complete checkpoint (docs/checkpoints.md)."""
    allow_oversubscribe: bool = False
    """Run a CPU job whose trainer and inference ranks outnumber this node's CPU cores (refused otherwise:
    the ranks would thrash; the environment variable MESHRL_ALLOW_OVERSUBSCRIBE=1 does the same, for
    test suites)."""
    threads_per_rank: int | None = Field(None, ge=1)
    """torch threads of each rank (torch.set_num_threads, OMP_NUM_THREADS); unset: OMP_NUM_THREADS when the
    environment sets it, else this node's CPU cores divided by its trainer and inference ranks, at least 1,
    so the ranks share the cores."""


class LogConfig(Base):
    """What is written to the run directory and the console."""

    samples_per_step: int = Field(4, ge=0)
    """Rollouts per step written to samples/step_N.jsonl for a person to read."""
    console: bool = True
    """Show a live progress line on the console."""
    heartbeat_s: float = Field(60.0, gt=0)
    """A rank that stays this long in one phase (a train step, a weight sync, waiting for a message)
    logs which phase, and again every heartbeat_s, so a stuck rank shows where it is."""


class CheckpointConfig(Base):
    """Resumable checkpoints in RUN_DIR/checkpoints/step_N (docs/checkpoints.md)."""

    every: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many steps and at the end (0 = none: only the final HF
    export, and the run cannot be resumed)."""
    keep_last: int = Field(2, ge=1)
    """Keep the newest this many checkpoints; older ones are deleted once a newer one is complete."""
    keep_every: int = Field(0, ge=0)
    """Also keep every checkpoint whose step is a multiple of this (0 = none)."""
    async_save: bool = True
    """Write the trainer shards from a CPU copy in a background thread, so training goes on meanwhile."""
    export_every: int = Field(0, ge=0)
    """Also export the policy as an HF folder checkpoints/hf_step_N every this many steps (0 = only
    checkpoints/final at the end)."""
    on_error: Literal["warn", "fail"] = "warn"
    """A save that fails (a full disk, a lost mount): "warn" logs it, counts it (checkpoint/failed_saves)
    and trains on, the next save trying again; "fail" stops the run. Either way the previous
    checkpoint stays complete and usable."""


class ResumeConfig(Base):
    """Which checkpoint `--resume.step N` continues from."""

    step: int | None = Field(None, ge=1)
    """Resume from checkpoints/step_N; unset: the latest complete checkpoint."""


class WandbConfig(Base):
    """Weights & Biases logging of metrics.jsonl's rows (the `wandb` extra; docs/checkpoints.md)."""

    enabled: bool = False
    """Log every step's metrics to W&B as well (one W&B run per run directory, continued on resume)."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """auto: online when logged in (WANDB_API_KEY or `wandb login`), otherwise offline (`wandb sync` later)."""
    project: str = "meshrl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); unset: the logged-in user's default."""
    name: str | None = None
    """Run name; unset: the run directory's name."""
    group: str | None = None
    """W&B group of related runs."""
    tags: list[str] = []
    """W&B tags."""


class RLConfig(Base):
    """An asynchronous RL run: `meshrl rl @ cfg.toml`."""

    output_dir: str = "runs/rl"
    """Run directory: config.json, metrics.jsonl, samples/, checkpoints/, logs/."""
    seed: int = 0
    """Seed of rollout sampling: request i of step s samples with a seed derived from (seed, s, i)."""
    max_steps: int = Field(20, ge=1)
    """Optimizer steps to run."""
    max_off_policy_steps: int = Field(1, ge=0)
    """Rollouts may come from policies at most this many steps old (0 = synchronous on-policy)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts (groups) per optimizer step."""
    samples_per_prompt: int = Field(8, ge=2)
    """Rollouts per prompt; advantages are relative to the group."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantages, length penalty, and the group and sample filters."""
    model: ModelConfig
    """The policy."""
    env: EnvConfig = ReverseTextEnvConfig()
    """The environment (or a mix: name = "mix" with [[env.envs]])."""
    episodes: EpisodesConfig = EpisodesConfig()
    """How environment work runs (threads, time and memory limits)."""
    eval: EvalSettings = EvalSettings()
    """Online evaluation every `eval.every` steps (off by default)."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer settings."""
    inference: InferenceConfig = InferenceConfig()
    """Inference settings."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Weight broadcast settings."""
    layout: LayoutConfig = LayoutConfig()
    """Role split of the job's ranks."""
    dist: DistConfig = DistConfig()
    """torch.distributed settings."""
    log: LogConfig = LogConfig()
    """Logging settings."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""
    resume: bool | Literal["auto"] | ResumeConfig = False
    """Continue the run in output_dir: true (`--resume`) from the latest complete checkpoint,
    `--resume.step N` from step_N, "auto" from the latest if there is one (else start fresh: for
    requeued jobs). Restarts under `dist.max_restarts` resume by themselves."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, removing its files first (`--overwrite`; only a
    directory with meshrl's .meshrl-run marker). Without it such a directory is refused."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging."""

    _env_name = model_validator(mode="before")(_default_env_name)

    _overwrite = model_validator(mode="after")(lambda self: check_overwrite(self))

    @model_validator(mode="after")
    def _eval_fits(self) -> "RLConfig":
        check_eval_fits(self.eval, self.inference)
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "RLConfig":
        check_parallel(self.trainer.parallel, self.layout.num_trainer_ranks)
        if self.inference.backend == "vllm" and self.dist.device == "cpu":
            raise ValueError('inference.backend = "vllm" needs CUDA, but dist.device is "cpu"; '
                             'use inference.backend = "native" on CPU')
        if self.layout.num_inference_ranks % self.inference.tensor_parallel:
            raise ValueError(f"layout.num_inference_ranks ({self.layout.num_inference_ranks}) must be a multiple of "
                             f"inference.tensor_parallel ({self.inference.tensor_parallel}): one engine replica "
                             "per tensor_parallel ranks")
        check_colocation(self)
        check_disaggregation(self)
        if self.trainer.micro_batch_tokens < self.inference.max_model_len:
            raise ValueError(
                f"trainer.micro_batch_tokens ({self.trainer.micro_batch_tokens}) must be >= "
                f"inference.max_model_len ({self.inference.max_model_len}) so that every rollout fits a row"
            )
        return self

    @property
    def world_size(self) -> int:
        """Processes the job needs."""
        return self.layout.world_size

    @property
    def num_compute_ranks(self) -> int:
        """Ranks that compute (trainers and inference; the controller mostly waits)."""
        return self.layout.num_trainer_ranks + self.layout.num_inference_ranks


def check_overwrite(cfg: Any) -> Any:
    """overwrite (start afresh) and resume (continue) exclude each other."""
    if cfg.overwrite and cfg.resume is not False:
        raise ValueError("overwrite and resume exclude each other: --overwrite starts afresh, --resume continues")
    return cfg


def check_colocation(cfg: "RLConfig") -> None:
    """The settings a colocated layout needs (layout.colocate = true; "auto" is checked where the GPU
    count is known, runtime/layout.py) and the settings that need one."""
    lay, inf = cfg.layout, cfg.inference
    if lay.colocate is True:
        if lay.num_inference_ranks != lay.num_trainer_ranks:
            raise ValueError(f"layout.num_inference_ranks ({lay.num_inference_ranks}) must equal "
                             f"layout.num_trainer_ranks ({lay.num_trainer_ranks}) with layout.colocate = true: "
                             "every trainer rank shares its GPU with one engine")
        if inf.tensor_parallel != 1:
            raise ValueError(f"inference.tensor_parallel ({inf.tensor_parallel}) must be 1 with layout.colocate = "
                             "true: a colocated engine lives on its trainer's one GPU")
    if lay.gpu_memory_gib is not None and lay.colocate is False:
        raise ValueError("layout.gpu_memory_gib applies to a colocated layout (layout.colocate = true or \"auto\")")
    if inf.sleep_while_training:
        if cfg.max_off_policy_steps != 0:
            raise ValueError(f"inference.sleep_while_training needs max_off_policy_steps = 0 (got "
                             f"{cfg.max_off_policy_steps}): an asynchronous engine generates while the trainer steps")
        if lay.colocate is False:
            raise ValueError("inference.sleep_while_training needs a colocated layout (layout.colocate = true or "
                             '"auto"): a split-layout engine has its GPU to itself')


def check_disaggregation(cfg: "RLConfig") -> None:
    """What inference.prefill_ranks > 0 needs (runtime/engine/disagg.py); layout.colocate = "auto" is
    checked where the GPU count is known (runtime/rl.py's preflight)."""
    inf, lay = cfg.inference, cfg.layout
    k = inf.prefill_ranks
    if k == 0:
        return
    replicas = lay.num_inference_ranks // inf.tensor_parallel
    if k >= replicas:
        raise ValueError(f"inference.prefill_ranks ({k}) must be smaller than the number of engine replicas "
                         f"({replicas}): at least one replica must decode")
    if inf.tensor_parallel != 1:
        raise ValueError(f"inference.prefill_ranks ({k}) > 0 is not supported with inference.tensor_parallel "
                         f"({inf.tensor_parallel}) > 1 yet")
    if inf.backend != "native":
        raise ValueError(f'inference.prefill_ranks ({k}) > 0 needs inference.backend = "native": the vLLM adapter '
                         "cannot hand KV blocks over")
    if lay.colocate is True:
        raise ValueError(f"inference.prefill_ranks ({k}) > 0 needs the split layout (layout.colocate = false): "
                         "disaggregation between colocated engines is not supported (docs/inference.md)")


class DataConfig(Base):
    """SFT on your own data set (meshrl.data; docs/data.md): rows from a local file, rendered with the
    model's chat template, packed into rows without cross-document attention."""

    path: str
    """A JSONL file, a parquet file, or a folder written by datasets' save_to_disk (no hub access)."""
    split: str | None = None
    """The split of a save_to_disk folder holding a DatasetDict (unset: "train")."""
    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    """Row format: messages (a chat: a list of {role, content}), prompt_completion (columns prompt and
    completion: two strings, or two lists of messages), text (plain text, every token trained); auto:
    the first of these whose columns the data has."""
    chat_template: str | None = None
    """A Jinja chat template, or a path to a .jinja file, used instead of the model folder's."""
    loss_on: Literal["assistant", "last_turn", "all"] = "assistant"
    """Which tokens of a chat are trained: every assistant message (its end-of-turn token included), the
    last assistant message only, or every token. Plain prompt_completion rows train the completion (all:
    the prompt too); text rows train every token."""
    shuffle: bool = True
    """Visit the rows of every epoch in a new seeded order (else in file order)."""
    seed: int = 0
    """Seed of the epoch orders and of the validation split."""
    epochs: int | None = Field(None, ge=1)
    """Stop after this many passes over the training rows (or at max_steps, whichever comes first)."""
    validation_path: str | None = None
    """A separate file or folder of held-out rows (same format) for val/loss."""
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Hold out this seeded share of the rows for val/loss instead of a validation_path."""
    on_error: Literal["fail", "skip"] = "fail"
    """A malformed row (not JSON, a missing or mistyped field, a chat without an assistant message, a
    document longer than trainer.micro_batch_tokens): fail naming its file and line, or skip it and count
    it (data/skipped_rows)."""

    @model_validator(mode="after")
    def _one_validation(self) -> "DataConfig":
        if self.validation_path is not None and self.validation_fraction > 0:
            raise ValueError("data: set data.validation_path or data.validation_fraction, not both")
        return self

    @property
    def has_validation(self) -> bool:
        """Whether a validation split is configured."""
        return self.validation_path is not None or self.validation_fraction > 0


class SFTConfig(Base):
    """Supervised warm-up on an environment's reference completions or on
    your own data set ([data]): `meshrl sft @ cfg.toml`."""

    output_dir: str = "runs/sft"
    """Run directory: config.json, metrics.jsonl, checkpoints/, logs/."""
    max_steps: int = Field(100, ge=1)
    """Optimizer steps to run."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step (over all ranks)."""
    eval_every: int = Field(0, ge=0)
    """Every this many steps, greedy-decode a few held-out prompts and log eval/reward (0 = off)."""
    eval_examples: int = Field(32, ge=1)
    """Held-out examples per evaluation."""
    max_tokens: int = Field(64, ge=1)
    """Completion tokens for evaluation."""
    model: ModelConfig
    """The model."""
    env: EnvConfig = ReverseTextEnvConfig()
    """Where examples come from without [data] (its reference completions), and what eval/reward scores."""
    data: DataConfig | None = None
    """Train on your own data set instead of env (docs/data.md); eval_every then logs val/loss."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer settings (loss is ignored)."""
    num_ranks: int = Field(1, ge=1)
    """Trainer ranks (all ranks train; there is no controller)."""
    dist: DistConfig = DistConfig()
    """torch.distributed settings."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Resumable checkpoints."""
    resume: bool | Literal["auto"] | ResumeConfig = False
    """Continue the run in output_dir (see RLConfig.resume)."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, removing its files first (see RLConfig.overwrite)."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging."""

    _env_name = model_validator(mode="before")(_default_env_name)

    _overwrite = model_validator(mode="after")(lambda self: check_overwrite(self))

    @model_validator(mode="after")
    def _consistent(self) -> "SFTConfig":
        check_parallel(self.trainer.parallel, self.num_ranks)
        if self.data is not None and self.eval_every and not self.data.has_validation:
            raise ValueError("eval_every with [data] logs val/loss: set data.validation_path or "
                             "data.validation_fraction")
        return self

    @property
    def world_size(self) -> int:
        """Processes the job needs."""
        return self.num_ranks

    @property
    def num_compute_ranks(self) -> int:
        """Ranks that compute: all of them."""
        return self.num_ranks


class EvalConfig(Base):
    """Evaluate a checkpoint on environments: `meshrl eval @ cfg.toml` (one process, runtime/eval.py)."""

    output_dir: str = "runs/eval"
    """Where results.json and samples.jsonl are written."""
    seed: int = 0
    """Seed of sampling (sample j of example i uses a seed derived from seed, i, j and the turn)."""
    model: ModelConfig
    """The checkpoint (model.path, an HF folder) or a fresh flavor."""
    env: EnvConfig = ReverseTextEnvConfig()
    """The environment (or a mix) to evaluate on."""
    eval: EvalSettings = EvalSettings()
    """Examples, samples, pass@k, temperature (`every` is unused here)."""
    inference: InferenceConfig = InferenceConfig()
    """Engine settings (native engine; sampling.max_tokens is the default tokens per turn)."""
    episodes: EpisodesConfig = EpisodesConfig()
    """How environment work runs."""
    dist: DistConfig = DistConfig()
    """Only `dist.device` is used."""

    _env_name = model_validator(mode="before")(_default_env_name)

    @model_validator(mode="after")
    def _native(self) -> "EvalConfig":
        if self.inference.backend != "native":
            raise ValueError('meshrl eval runs the native engine: inference.backend must be "native"')
        if self.inference.tensor_parallel != 1:
            raise ValueError(f"inference.tensor_parallel ({self.inference.tensor_parallel}) must be 1: meshrl eval "
                             "runs one engine in one process")
        if self.inference.prefill_ranks:
            raise ValueError(f"inference.prefill_ranks ({self.inference.prefill_ranks}) must be 0: meshrl eval runs "
                             "one engine in one process")
        check_eval_fits(self.eval, self.inference)
        return self


def check_eval_fits(settings: EvalSettings, inference: InferenceConfig) -> None:
    """ValueError unless an evaluation turn's max_tokens leaves room for a prompt in max_model_len."""
    if settings.max_tokens is not None and settings.max_tokens >= inference.max_model_len:
        raise ValueError(f"eval.max_tokens ({settings.max_tokens}) must be smaller than inference.max_model_len "
                         f"({inference.max_model_len})")


def check_parallel(p: ParallelConfig, num_ranks: int) -> None:
    """Raise ValueError unless the degrees fit `num_ranks` trainer ranks (see parallel.dims)."""
    p.dims(num_ranks)


# ----------------------------------------------------------------------------- parsing


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one readable line."""


def parse_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split `@ file.toml` references and `--dotted.key value` overrides into a merged dict.

    Returns (merged raw dict, list of flags without values that the caller handles).
    """
    merged: dict[str, Any] = {}
    flags: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            path = argv[i + 1] if arg == "@" and i + 1 < len(argv) else arg[1:]
            if not path:
                raise ConfigError("'@' must be followed by a TOML file")
            deep_merge(merged, load_file(path))
            i += 2 if arg == "@" else 1
        elif arg.startswith("--"):
            key = arg[2:]
            if "=" in key:
                key, value = key.split("=", 1)
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@":
                value = argv[i + 1]
                i += 2
            else:
                flags.append(key)
                i += 1
                continue
            set_dotted(merged, key.replace("-", "_"), parse_value(value))
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use '@ file.toml' or '--dotted.key value'")
    return merged, flags


def load_file(path: str) -> dict[str, Any]:
    """Read a TOML (or JSON, e.g. a run's config.json) configuration file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        if p.suffix == ".json":
            return json.loads(p.read_text())
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_value(text: str) -> Any:
    """Parse an override as a TOML value (numbers, booleans, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def deep_merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Merge `other` into `into`: tables merge key by key, other values are replaced."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Set d[a][b][c] = value for the key "a.b.c", creating tables on the way."""
    *parents, last = dotted.split(".")
    for part in parents:
        nxt = d.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--{dotted}: {part!r} is not a table")
        d = nxt
    d[last] = value


def validate(cls: type[Base], raw: dict[str, Any]) -> Base:
    """Validate a raw dict into `cls`, turning pydantic's report into one readable line."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, cls)) from None


def format_validation_error(e: ValidationError, cls: type[Base] | None = None) -> str:
    """One line per problem, naming the dotted field, joined with '; '. With the root class `cls`, an
    unknown key gets the closest known one ("did you mean ...?", runtime/cli_help.py)."""
    from meshrl.runtime.cli_help import suggest

    parts = []
    for err in e.errors():
        # drop pydantic's internal steps and the tag of a tagged union ("env.reverse-text" -> "env")
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-") and x not in ENV_NAMES)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            if cls is not None:
                msg += suggest(cls, [str(x) for x in err["loc"] if not str(x).startswith("function-")])
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        # a validator's message that already names its field needs no location prefix
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg)
    return "config error: " + "; ".join(parts)


def load_config(cls: type[Base], argv: list[str]) -> tuple[Base, list[str]]:
    """Parse argv (`@ files` and overrides) and validate into `cls`; returns (config, bare flags)."""
    raw, flags = parse_args(argv)
    return validate(cls, raw), flags
