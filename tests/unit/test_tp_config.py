"""inference.tensor_parallel: config validation, the preflight model check and the replica layout."""

import pytest

from meshrl.runtime.config import ConfigError, EvalConfig, InferenceConfig, ModelConfig, RLConfig, load_config
from meshrl.runtime.engine.build import check_tensor_parallel_model
from meshrl.runtime.layout import assign_roles

BASE = ["--model.flavor", "debug", "--model.tokenizer", "char"]


@pytest.mark.parametrize("args, expected", [
    (["--inference.tensor-parallel", "2", "--layout.num-inference-ranks", "3"],
     "layout.num_inference_ranks (3) must be a multiple of inference.tensor_parallel (2)"),
    (["--inference.tensor-parallel", "2", "--layout.num-inference-ranks", "2", "--inference.backend", "vllm"],
     'inference.tensor_parallel (2) > 1 needs inference.backend = "native"'),
])
def test_bad_tensor_parallel_is_one_line(args, expected):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [*BASE, *args])
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_tensor_parallel_replicas_validate():
    cfg, _ = load_config(RLConfig, [*BASE, "--inference.tensor-parallel", "2", "--layout.num-inference-ranks", "4"])
    assert cfg.world_size == 1 + 1 + 4
    with pytest.raises(ConfigError, match="meshrl eval runs one engine"):
        load_config(EvalConfig, [*BASE, "--inference.tensor-parallel", "2"])


def test_preflight_refuses_models_that_do_not_split():
    tp2, tp8 = InferenceConfig(tensor_parallel=2), InferenceConfig(tensor_parallel=8)
    check_tensor_parallel_model(tp2, ModelConfig(flavor="debug", tokenizer="char"))
    check_tensor_parallel_model(tp2, ModelConfig(flavor="debug", family="llama", tokenizer="char"))
    with pytest.raises(ValueError, match=r"must divide the qwen3 model's attention heads \(4\)"):
        check_tensor_parallel_model(tp8, ModelConfig(flavor="debug", tokenizer="char"))
    with pytest.raises(ValueError, match="qwen3_moe model has no tensor-parallel plan"):
        check_tensor_parallel_model(tp2, ModelConfig(flavor="debug", family="qwen3_moe", tokenizer="char"))
    check_tensor_parallel_model(InferenceConfig(), ModelConfig(flavor="debug", family="qwen3_moe", tokenizer="char"))


def test_inference_ranks_form_replicas_of_consecutive_ranks():
    roles = assign_roles(9, 2, 6, controller=-1, tensor_parallel=3)
    assert roles.controller == 8 and roles.trainers == (0, 1) and roles.inference == (2, 3, 4, 5, 6, 7)
    assert roles.replicas == ((2, 3, 4), (5, 6, 7)) and roles.engines == (2, 5)
    assert roles.replica_of(6) == (5, 6, 7)
    one = assign_roles(4, 1, 2)
    assert one.replicas == ((1,), (2,)) and one.engines == one.inference
    with pytest.raises(ValueError, match=r"num_inference_ranks \(3\) must be a multiple of inference.tensor_parallel \(2\)"):
        assign_roles(5, 1, 3, tensor_parallel=2)
