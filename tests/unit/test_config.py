"""Configuration: composition order, overrides, and one readable line for every bad input."""

import os
import subprocess
import sys

import pytest

from meshrl.runtime.config import ConfigError, ModelConfig, RLConfig, load_config, parse_args
from meshrl.runtime.launch import check_world_size
from meshrl.runtime.policy import check_model_source


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BASE = """
max_steps = 5
[model]
flavor = "debug"
tokenizer = "char"
[trainer.optim]
lr = 1e-4
weight_decay = 0.1
"""


def test_files_compose_left_to_right_and_overrides_win(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    b = write(tmp_path, "b.toml", "max_steps = 7\n[trainer.optim]\nlr = 2e-4\n")
    cfg, _ = load_config(RLConfig, ["@", a, "@", b, "--trainer.optim.warmup-steps", "3", "--output-dir", "runs/x"])
    assert cfg.max_steps == 7                      # b overrides a
    assert cfg.trainer.optim.lr == 2e-4            # nested tables merge key by key ...
    assert cfg.trainer.optim.weight_decay == 0.1   # ... keeping a's other keys
    assert cfg.trainer.optim.warmup_steps == 3     # dotted override, dashes accepted
    assert cfg.output_dir == "runs/x"
    cfg2, _ = load_config(RLConfig, ["@", b, "@", a])
    assert cfg2.max_steps == 5 and cfg2.trainer.optim.lr == 1e-4


def test_override_values_parse_as_toml_literals(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    raw, _ = parse_args(["@", a, "--trainer.optim.betas", "[0.8, 0.95]", "--log.console", "false",
                         "--model.flavor=tiny"])
    assert raw["trainer"]["optim"]["betas"] == [0.8, 0.95]
    assert raw["log"]["console"] is False
    assert raw["model"]["flavor"] == "tiny"


def test_python_objects_equal_file_configs(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    from_file, _ = load_config(RLConfig, ["@", a])
    in_code = RLConfig(max_steps=5, model=ModelConfig(flavor="debug", tokenizer="char"),
                       trainer={"optim": {"lr": 1e-4, "weight_decay": 0.1}})
    assert from_file == in_code
    assert RLConfig.model_fields["max_steps"].description  # field docstrings become descriptions


@pytest.mark.parametrize("args, expected", [
    (["--trainer.optim.lrr", "1"], "trainer.optim.lrr: unknown key"),
    (["--max-steps", "many"], "max_steps: Input should be a valid integer"),
    (["--trainer.optim.lr", "-1"], "trainer.optim.lr: Input should be greater than 0"),
    (["--samples-per-prompt", "1"], "samples_per_prompt: Input should be greater than or equal to 2"),
    (["--inference.sampling.max-tokens", "600"], "max_tokens (600) must be smaller than inference.max_model_len"),
    (["--model.path", "x"], "set exactly one of model.path"),
    (["--env.name", "nope"], "env"),
    (["--trainer.parallel.dp-shard", "3"], "trainer.parallel: dp_replicate (1) x dp_shard (3) x cp (1) = 3"),
])
def test_bad_values_name_the_field(tmp_path, args, expected):
    a = write(tmp_path, "a.toml", BASE)
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["@", a, *args])
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(RLConfig, ["@", str(tmp_path / "nope.toml")])
    bad = write(tmp_path, "bad.toml", "max_steps = = 3")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(RLConfig, ["@", bad])


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="model.path: folder not found"):
        check_model_source(ModelConfig(path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_source(ModelConfig(path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="unknown flavor"):
        check_model_source(ModelConfig(flavor="huge", tokenizer="char"))


def test_world_size_must_match_layout(tmp_path, monkeypatch):
    cfg = RLConfig(model=ModelConfig(flavor="debug", tokenizer="char"),
                   layout={"num_trainer_ranks": 2, "num_inference_ranks": 1})
    assert cfg.world_size == 4
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="lays out 4 ranks but torchrun started 3"):
        check_world_size(cfg)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_cli_bad_config_exits_2_with_one_line_before_any_process_group(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    r = _cli("rl", "@", a, "--trainer.optim.lr", "-1", "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["meshrl: config error: trainer.optim.lr: Input should be greater than 0 (got -1)"], r.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    b = write(tmp_path, "b.toml", f'[model]\npath = "{tmp_path / "nowhere"}"\n')
    r = _cli("rl", "@", b, cwd=tmp_path)
    assert r.returncode == 2 and "model.path: folder not found" in r.stderr


def test_rank_module_rejects_a_wrong_world_size(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    env = {**os.environ, "WORLD_SIZE": "5", "RANK": "0", "LOCAL_RANK": "0"}
    r = subprocess.run([sys.executable, "-m", "meshrl.runtime.rl", "@", a], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2
    assert "lays out 3 ranks but torchrun started 5" in r.stderr


def test_env_overrides_alone_select_the_default_env(tmp_path):
    a = write(tmp_path, "a.toml", BASE)
    cfg, _ = load_config(RLConfig, ["@", a, "--env.seed", "3"])
    assert cfg.env.name == "reverse-text" and cfg.env.seed == 3
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["@", a, "--env.min-words", "3", "--env.max-words", "2"])
    assert str(e.value) == "config error: env.min_words (3) > env.max_words (2)"
