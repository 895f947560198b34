"""Model families, as a plain-dict registry keyed by the HF `model_type`.

A family bundles what the trainer, the engine and parallel/ need to handle one architecture:
its args dataclass (with `from_hf_config` / `to_hf_config`), the model class (constructed as
`model_cls(args)`, on the meta device), named flavors, the HF state-dict adapter class
(constructed as `state_dict_adapter(args)`, with `to_hf` / `from_hf`), and the parallel plan.
Adding a family = one file in models/ plus one entry in `MODEL_FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshrl.models import (deepseek_v3, glm4_moe, glm_moe_dsa, gpt_oss, llama3, minimax_m2, qwen3, qwen3_moe,
                          qwen3_next)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    args_cls: type
    model_cls: type
    flavors: dict[str, Any]
    state_dict_adapter: type
    parallel_plan: dict[str, Any]


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        args_cls=qwen3.Qwen3Args,
        model_cls=qwen3.Qwen3,
        flavors=qwen3.FLAVORS,
        state_dict_adapter=qwen3.Qwen3StateDictAdapter,
        parallel_plan=qwen3.PARALLEL_PLAN,
    ),
    "llama": ModelFamily(
        name="llama",
        args_cls=llama3.Llama3Args,
        model_cls=llama3.Llama3,
        flavors=llama3.FLAVORS,
        state_dict_adapter=llama3.Llama3StateDictAdapter,
        parallel_plan=llama3.PARALLEL_PLAN,
    ),
    "qwen3_moe": ModelFamily(
        name="qwen3_moe",
        args_cls=qwen3_moe.Qwen3MoeArgs,
        model_cls=qwen3_moe.Qwen3Moe,
        flavors=qwen3_moe.FLAVORS,
        state_dict_adapter=qwen3_moe.Qwen3MoeStateDictAdapter,
        parallel_plan=qwen3_moe.PARALLEL_PLAN,
    ),
    "glm4_moe": ModelFamily(
        name="glm4_moe",
        args_cls=glm4_moe.Glm4MoeArgs,
        model_cls=glm4_moe.Glm4Moe,
        flavors=glm4_moe.FLAVORS,
        state_dict_adapter=glm4_moe.Glm4MoeStateDictAdapter,
        parallel_plan=glm4_moe.PARALLEL_PLAN,
    ),
    "minimax_m2": ModelFamily(
        name="minimax_m2",
        args_cls=minimax_m2.MiniMaxM2Args,
        model_cls=minimax_m2.MiniMaxM2,
        flavors=minimax_m2.FLAVORS,
        state_dict_adapter=minimax_m2.MiniMaxM2StateDictAdapter,
        parallel_plan=minimax_m2.PARALLEL_PLAN,
    ),
    "deepseek_v3": ModelFamily(
        name="deepseek_v3",
        args_cls=deepseek_v3.DeepseekV3Args,
        model_cls=deepseek_v3.DeepseekV3,
        flavors=deepseek_v3.FLAVORS,
        state_dict_adapter=deepseek_v3.DeepseekV3StateDictAdapter,
        parallel_plan=deepseek_v3.PARALLEL_PLAN,
    ),
    "gpt_oss": ModelFamily(
        name="gpt_oss",
        args_cls=gpt_oss.GptOssArgs,
        model_cls=gpt_oss.GptOss,
        flavors=gpt_oss.FLAVORS,
        state_dict_adapter=gpt_oss.GptOssStateDictAdapter,
        parallel_plan=gpt_oss.PARALLEL_PLAN,
    ),
    "glm_moe_dsa": ModelFamily(
        name="glm_moe_dsa",
        args_cls=glm_moe_dsa.GlmMoeDsaArgs,
        model_cls=glm_moe_dsa.GlmMoeDsa,
        flavors=glm_moe_dsa.FLAVORS,
        state_dict_adapter=glm_moe_dsa.GlmMoeDsaStateDictAdapter,
        parallel_plan=glm_moe_dsa.PARALLEL_PLAN,
    ),
    # Hybrid Gated DeltaNet + full attention: one model class, three args classes; Qwen3.5's
    # vision-language folders ("qwen3_5", "qwen3_5_moe") and the text-only types meshrl saves.
    **{key: ModelFamily(name=key, args_cls=args_cls, model_cls=qwen3_next.Qwen3Next,
                        flavors=flavors,
                        state_dict_adapter=qwen3_next.Qwen3NextStateDictAdapter, parallel_plan=plan)
       for key, args_cls, flavors, plan in [
           ("qwen3_next", qwen3_next.Qwen3NextArgs, qwen3_next.NEXT_FLAVORS, qwen3_next.PARALLEL_PLAN),
           ("qwen3_5", qwen3_next.Qwen3_5Args, qwen3_next.QWEN3_5_FLAVORS, qwen3_next.DENSE_PARALLEL_PLAN),
           ("qwen3_5_text", qwen3_next.Qwen3_5Args, qwen3_next.QWEN3_5_FLAVORS, qwen3_next.DENSE_PARALLEL_PLAN),
           ("qwen3_5_moe", qwen3_next.Qwen3_5MoeArgs, qwen3_next.QWEN3_5_MOE_FLAVORS, qwen3_next.PARALLEL_PLAN),
           ("qwen3_5_moe_text", qwen3_next.Qwen3_5MoeArgs, qwen3_next.QWEN3_5_MOE_FLAVORS,
            qwen3_next.PARALLEL_PLAN)]},
}


def get_family(model_type: str) -> ModelFamily:
    """The family registered under an HF `model_type` (e.g. "qwen3")."""
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; known types: {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def family_of_args(args: object) -> ModelFamily:
    """The family whose args dataclass `args` is an instance of."""
    for family in MODEL_FAMILIES.values():
        if isinstance(args, family.args_cls):
            return family
    raise ValueError(f"no model family uses args of type {type(args).__name__}; known: {sorted(MODEL_FAMILIES)}")
