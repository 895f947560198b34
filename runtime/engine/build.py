"""Which engine an inference rank (or `meshrl eval`) runs, built from its config sections.

`build_engine` picks the backend (`inference.backend`): the native engine over a models/ policy,
or the vLLM adapter. A tensor-parallel replica's native engine is built over this rank's shard
only: the model is shaped on the meta device, split there (parallel/tensor_parallel.py) and only
then materialised, so no rank ever holds the full model.
"""

from __future__ import annotations

import torch

from meshrl.models.common import fp8
from meshrl.models.hf import read_hf_config
from meshrl.parallel.tensor_parallel import check_tensor_parallel, shard_for_inference
from meshrl.runtime.config import InferenceConfig, ModelConfig
from meshrl.runtime.engine.api import InferenceEngine
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.policy import build_policy, policy_skeleton


def build_engine(inf: InferenceConfig, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int,
                 tp_group: torch.distributed.ProcessGroup | None = None,
                 kv_cache_bytes: int | None = None, memory_bytes: int | None = None) -> InferenceEngine:
    """The engine of one inference rank; its weights are placeholders until the first weight sync.
    `kv_cache_bytes`: a colocated engine's KV-cache budget, `memory_bytes` all it may hold (vLLM's
    share of the GPU; runtime/memory.py)."""
    if inf.backend == "vllm":
        from meshrl.runtime.engine.vllm_engine import build_vllm_engine

        return build_vllm_engine(inf, model_cfg, device, dtype, seed=seed, kv_cache_bytes=kv_cache_bytes,
                                 memory_bytes=memory_bytes)
    return build_native_engine(inf, model_cfg, device, dtype, seed, tp_group, kv_cache_bytes=kv_cache_bytes)


def build_native_engine(inf: InferenceConfig, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                        seed: int, tp_group: torch.distributed.ProcessGroup | None = None,
                        model: torch.nn.Module | None = None, kv_cache_bytes: int | None = None) -> NativeEngine:
    """The native engine over `model` (default: the policy `model_cfg` names, loaded or initialised);
    with `tp_group`, over this rank's shard of it, whose values are placeholders until the trainer's
    first weight broadcast (which every inference rank receives before serving anything).
    `kv_cache_bytes`: the KV-cache budget (default: inference.kv_cache_gib, else the fraction of
    free memory). An FP8 engine over an FP8 checkpoint takes the checkpoint's e4m3 weights and
    scales as they are (128x128 blocks; other block sizes are re-quantised from the dequantised load)."""
    if kv_cache_bytes is None and inf.kv_cache_gib is not None:
        kv_cache_bytes = int(inf.kv_cache_gib * 2**30)
    checkpoint_fp8: dict = {}  # an FP8 checkpoint's e4m3 weights, taken by an FP8 engine as they are
    if model is None and tp_group is None:
        model, _ = build_policy(model_cfg, device, dtype, fp8_out=checkpoint_fp8 if inf.quantization == "fp8" else None)
    elif model is None:
        model = policy_skeleton(model_cfg, dtype)[0]
        shard_for_inference(model, tp_group)
        model.to_empty(device=device)
        model.init_weights(seed=model_cfg.init_seed)  # finite values for the engine's probe forward
    engine = NativeEngine(model, max_num_seqs=inf.max_num_seqs, max_model_len=inf.max_model_len, device=device,
                          dtype=dtype, block_size=inf.block_size, num_blocks=inf.num_blocks,
                          kv_cache_memory_fraction=inf.kv_cache_memory_fraction, kv_cache_bytes=kv_cache_bytes,
                          max_num_batched_tokens=inf.max_num_batched_tokens, prefix_sharing=inf.prefix_sharing,
                          cuda_graphs=inf.cuda_graphs and device.type == "cuda", attention=inf.attention,
                          seed=seed, tp_group=tp_group, quantization=inf.quantization, kv_cache_dtype=inf.kv_cache_dtype)
    if checkpoint_fp8:
        fp8.load_checkpoint_weights(engine.model, checkpoint_fp8)
    return engine


def check_tensor_parallel_model(inf: InferenceConfig, model_cfg: ModelConfig) -> None:
    """ValueError before any process starts when the model cannot be split inference.tensor_parallel
    ways (a family without a plan, heads or FFN width not divisible); nothing to check at 1."""
    if inf.tensor_parallel > 1:
        check_tensor_parallel(policy_skeleton(model_cfg)[0], inf.tensor_parallel)


def check_disaggregated_model(inf: InferenceConfig, model_cfg: ModelConfig) -> None:
    """ValueError before any process starts when inference.prefill_ranks > 0 and the model has
    linear-attention layers (Qwen3-Next, Qwen3.5): their per-row recurrent state would have to
    travel with the KV blocks (runtime/engine/disagg.py); nothing to check at 0. Read from the
    model's args on the meta device (its `layer_types`, HF's field), no weights."""
    if not inf.prefill_ranks:
        return
    _, _, args, path = policy_skeleton(model_cfg)
    linear = sum(t == "linear_attention" for t in getattr(args, "layer_types", ()) or ())
    if linear:
        model_type = model_cfg.family if path is None else read_hf_config(path).get("model_type")
        raise ValueError(f"inference.prefill_ranks ({inf.prefill_ranks}) > 0 is not supported for the {model_type} "
                         f"model: its {linear} linear-attention layers keep a per-sequence recurrent state that does "
                         "not travel with the KV blocks (set inference.prefill_ranks = 0)")
