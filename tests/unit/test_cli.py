"""The `meshrl` command's help and its mistakes: answered from the config models, before torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.runtime import cli
from meshrl.runtime.cli_help import command_help, first_line, suggest
from meshrl.runtime.config import ConfigError, EvalConfig, RLConfig, SFTConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_command_help_lists_options_with_defaults_and_docs(capsys):
    code, out, _ = _run(["rl", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: meshrl rl @ config.toml")
    max_steps = next(line for line in out.splitlines() if line.lstrip().startswith("--max-steps "))
    assert "[20]" in max_steps and first_line(RLConfig.model_fields["max_steps"].description) in max_steps
    lr = next(line for line in out.splitlines() if line.lstrip().startswith("--trainer.optim.lr "))
    assert "[1e-05]" in lr and "Peak learning rate." in lr
    assert "  trainer " in out and "docs/configs.md" in out
    for command, cls in (("sft", SFTConfig), ("eval", EvalConfig)):
        code, out, _ = _run([command, "--help"], capsys)
        assert code == 0 and f"usage: meshrl {command} @" in out and "--output-dir str" in out
        assert f'["{cls.model_fields["output_dir"].default}"]' in out


def test_help_of_one_section_and_of_a_union_kind(capsys):
    code, out, _ = _run(["rl", "--help", "trainer.loss"], capsys)
    assert code == 0 and "[trainer.loss]" in out and "--trainer.loss.kl-coef float" in out
    assert "--trainer.optim.lr" not in out and "--max-steps" not in out
    code, out, _ = _run(["rl", "@", "x.toml", "--help", "env.wordle"], capsys)  # files are not read for help
    assert code == 0 and "--env.max-turns int" in out and "--env.max-words" not in out
    code, out, err = _run(["rl", "--help", "trainer.lss"], capsys)
    assert code == 2 and err.strip() == "meshrl: no section 'trainer.lss' in RLConfig; did you mean 'trainer.loss'?"


def test_plot_and_bench_help_and_unknown_commands(capsys):
    code, out, _ = _run(["plot", "--help"], capsys)
    assert code == 0 and out.startswith("usage: meshrl plot RUN_DIR")
    code, out, _ = _run(["bench", "--help"], capsys)
    assert code == 0 and "meshrl bench rl @ cfg.toml" in out
    code, out, _ = _run(["bench", "engine", "--help"], capsys)
    assert code == 0 and "meshrl bench engine [--family qwen3] [--flavor 0.6B]" in out
    code, _, err = _run(["rll"], capsys)
    assert code == 2 and "unknown command 'rll'; did you mean 'rl'?" in err


def test_unknown_keys_get_the_closest_known_key():
    base = ["--model.flavor", "debug", "--model.tokenizer", "char"]
    cases = {("--trainer.optim.lrr", "1"): "trainer.optim.lrr: unknown key; did you mean 'trainer.optim.lr'?",
             ("--max-step", "3"): "max_step: unknown key; did you mean 'max_steps'?",
             ("--lr", "1"): "lr: unknown key; did you mean 'trainer.optim.lr'?",
             ("--env.name", "reverse-text", "--env.max-wordz", "2"):
                 "env.max_wordz: unknown key; did you mean 'env.max_words'?",
             ("--xyzzy", "1"): "xyzzy: unknown key"}
    for args, line in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, [*base, *args])
        assert str(e.value) == f"config error: {line}"
    assert suggest(RLConfig, ["layout", "num_trainer_rank"]) == "; did you mean 'layout.num_trainer_ranks'?"


def test_every_root_field_appears_in_help():
    for cls in (RLConfig, SFTConfig, EvalConfig):
        text = command_help("x", cls, "summary")
        for name in cls.model_fields:
            assert f"--{name.replace('_', '-')} " in text or f"  {name} " in text, name


PROBE = """
import json, sys
from meshrl.runtime import cli
codes = []
for argv in (["rl", "--help"], ["rl", "--help", "trainer.optim"], ["rl", "@", sys.argv[1], "--trainer.optim.lrr", "1"]):
    try:
        cli.main(argv)
    except SystemExit as e:
        codes.append(e.code)
heavy = ("torch", "transformers", "tensordict", "verifiers", "meshrl.runtime.rl", "meshrl.runtime.engine.native")
before = [m for m in heavy if m in sys.modules]
try:
    cli.main(["rl", "--model.path", sys.argv[2]])  # valid; the folder check (before the imports) refuses it
except SystemExit as e:
    codes.append(e.code)
folder = [m for m in heavy if m in sys.modules]
try:
    cli.main(["rl", "--model.flavor", "nope", "--model.tokenizer", "char"])  # valid; the pre-flight check refuses it
except SystemExit as e:
    codes.append(e.code)
after = [m for m in ("transformers", "tensordict", "verifiers", "meshrl.runtime.engine.native") if m in sys.modules]
print(json.dumps({"codes": codes, "before": before, "folder": folder, "after": after}))
"""


def test_the_config_path_imports_no_heavy_module(tmp_path):
    """Help, validation and the model-folder check import neither torch nor transformers; the
    pre-flight checks (after them) import torch but not transformers, tensordict, verifiers or the
    engines."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text('[model]\nflavor = "debug"\ntokenizer = "char"\n')
    r = subprocess.run([sys.executable, "-c", PROBE, str(cfg), str(tmp_path / "missing")], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 2, 2, 2], "before": [], "folder": [], "after": []}, (result, r.stderr)
    assert "did you mean 'trainer.optim.lr'?" in r.stderr and "model.path: folder not found" in r.stderr
    assert "model.flavor: unknown flavor 'nope'" in r.stderr


def test_a_cpu_job_with_more_ranks_than_cores_is_refused(tmp_path, monkeypatch, capsys):
    from meshrl.runtime.launch import OVERSUBSCRIBE_ENV, cpu_cores, threads_per_rank

    monkeypatch.delenv(OVERSUBSCRIBE_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = cpu_cores()
    argv = ["rl", "--model.flavor", "debug", "--model.tokenizer", "char", "--dist.device", "cpu",
            "--layout.num-trainer-ranks", str(cores), "--output-dir", str(tmp_path / "run")]
    code, _, err = _run(argv, capsys)
    assert code == 2 and err.splitlines() == [
        f"meshrl: dist: this CPU job runs {cores + 1} trainer + inference ranks on {cores} CPU cores (the "
        f"{cores + 2} processes would thrash): use at most {cores}, or set --dist.allow-oversubscribe true"]
    assert not (tmp_path / "run").exists()
    from meshrl.runtime import rl

    cfg, _ = load_config(RLConfig, [*argv[1:], "--dist.allow-oversubscribe", "true"])
    rl.preflight(cfg)  # allowed
    assert threads_per_rank(cfg) == max(1, cores // (cores + 1)) == 1
    cfg, _ = load_config(RLConfig, [*argv[1:5], "--dist.threads-per-rank", "3"])
    assert threads_per_rank(cfg) == 3
    cfg, _ = load_config(SFTConfig, ["--model.flavor", "debug", "--model.tokenizer", "char"])
    assert threads_per_rank(cfg) == cores  # one rank has the node to itself
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg, _ = load_config(RLConfig, argv[1:5])
    assert threads_per_rank(cfg) == cores  # one rank of the job on this node
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    cfg, _ = load_config(RLConfig, ["--model.flavor", "debug", "--model.tokenizer", "char"])
    assert threads_per_rank(cfg) == max(1, cores // 2)  # one trainer, one engine
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(cfg) == 3  # the environment's choice
    cfg, _ = load_config(RLConfig, ["--model.flavor", "debug", "--model.tokenizer", "char", "--dist.threads-per-rank", "2"])
    assert threads_per_rank(cfg) == 2  # the config's beats it


def test_sft_on_an_environment_without_reference_completions_is_refused_before_launch(tmp_path, capsys):
    argv = ["sft", "--model.flavor", "debug", "--model.tokenizer", "char", "--output-dir", str(tmp_path / "r")]
    code, _, err = _run([*argv, "--env.name", "wordle"], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("meshrl: env: 'wordle' has no reference completions, so meshrl sft cannot train on it "
                          "(environments with them: reverse-text, alphabet-sort, arithmetic")
    code, _, err = _run([*argv, "--env.name", "verifiers", "--env.taskset", "x:y"], capsys)
    assert code == 2 and "'verifiers' has no reference completions" in err
    assert not (tmp_path / "r").exists()


def test_every_builtin_environment_has_an_eval_config():
    from meshrl.envs import ENV_NAMES

    for name in ENV_NAMES:
        if name in ("verifiers", "dataset"):  # the user's taskset or files: no built-in data to evaluate on
            continue
        path = ROOT / "configs" / name.replace("-", "_") / "eval.toml"
        assert path.is_file(), f"{name}: no {path.relative_to(ROOT)}"
        cfg, _ = load_config(EvalConfig, ["@", str(path)])
        assert cfg.env.name == name and cfg.model.path is not None
