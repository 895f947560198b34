"""Run directory semantics: a fresh run never mixes with an earlier one; --overwrite clears only
meshrl run directories; a resume drops what it redoes; the end-of-run summary."""

import json

import pytest

from meshrl.runtime import cli
from meshrl.runtime.config import RLConfig, SFTConfig, load_config
from meshrl.runtime.launch import prepare_run_dir
from meshrl.runtime.rundir import MARKER_FILE, MetricsWriter, lock_run_dir, unlock_run_dir
from meshrl.runtime.summary import summary_lines

BASE = ["--model.flavor", "debug", "--model.tokenizer", "char", "--dist.device", "cpu"]


def _earlier_run(run, marked=True):
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "step_0.jsonl").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    if marked:
        (run / MARKER_FILE).write_text("{}\n")


def _cli_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


def test_a_fresh_run_into_a_used_directory_is_refused_before_launch(tmp_path, capsys):
    run = tmp_path / "run"
    _earlier_run(run)
    code, err = _cli_exit(["rl", *BASE, "--output-dir", str(run)], capsys)
    assert code == 2 and err.splitlines() == [
        f"meshrl: {run} holds an earlier run (metrics.jsonl, samples): pass --overwrite to clear it, --resume to "
        "continue it, or choose another output_dir"]
    folder = tmp_path / "mine"  # not a run directory: --overwrite leaves it alone
    _earlier_run(folder, marked=False)
    code, err = _cli_exit(["sft", *BASE, "--output-dir", str(folder), "--overwrite"], capsys)
    assert code == 2 and "is not a meshrl run directory (no .meshrl-run marker" in err
    assert (folder / "metrics.jsonl").is_file()
    code, err = _cli_exit(["rl", *BASE, "--output-dir", str(run), "--overwrite", "--resume"], capsys)
    assert code == 2 and "overwrite and resume exclude each other" in err


def test_overwrite_clears_a_marked_directory_and_keeps_the_lock(tmp_path, capsys):
    run = tmp_path / "run"
    _earlier_run(run)
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    cfg, _ = load_config(RLConfig, [*BASE, "--output-dir", str(run), "--overwrite", "true"])
    lock_run_dir(run)
    try:
        prepare_run_dir(cfg, "rl")
        assert sorted(p.name for p in run.iterdir()) == [MARKER_FILE, "job.lock"]
        assert "--overwrite: removed 3 entries" in capsys.readouterr().err
        fresh, _ = load_config(SFTConfig, [*BASE, "--output-dir", str(tmp_path / "new")])
        prepare_run_dir(fresh, "sft")  # a new directory gets the marker
        assert json.loads((tmp_path / "new" / MARKER_FILE).read_text())["kind"] == "sft"
        auto, _ = load_config(RLConfig, [*BASE, "--output-dir", str(run), "--resume", "auto"])
        _earlier_run(run / "x")
        prepare_run_dir(auto, "rl")  # resume = auto and no checkpoint: it starts over, clean
        assert sorted(p.name for p in run.iterdir()) == [MARKER_FILE, "job.lock"]
    finally:
        unlock_run_dir(run)


def test_a_resume_drops_the_samples_and_plots_it_redoes(tmp_path):
    (tmp_path / "samples").mkdir()
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reward.png").write_bytes(b"png")
    for step in range(5):
        (tmp_path / "samples" / f"step_{step}.jsonl").write_text("{}\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    writer = MetricsWriter(tmp_path, start_step=3)
    assert writer.steps_lost == 2 and writer.steps == {0, 1, 2}
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [f"step_{s}.jsonl" for s in range(3)]
    assert not list((tmp_path / "plots").iterdir())


def test_the_summary_names_steps_reward_outputs_and_next_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "reverse_text").mkdir(parents=True)
    (tmp_path / "configs" / "reverse_text" / "eval.toml").write_text("")
    run = tmp_path / "run"
    (run / "checkpoints" / "final").mkdir(parents=True)
    (run / "samples").mkdir()
    (run / "samples" / "step_0.jsonl").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.25}\n{"step": 1, "reward/mean": 0.5}\n')
    cfg, _ = load_config(RLConfig, [*BASE, "--output-dir", str(run)])
    lines = summary_lines(cfg, "rl", 75.2)
    assert lines[0] == "meshrl: rl finished: 2 steps in 1m15s; final reward/mean 0.5 (step 1)"
    assert f"  checkpoint  {run}/checkpoints/final (HF folder)" in lines
    assert f"  metrics     {run}/metrics.jsonl" in lines and f"  samples     {run}/samples/ (1 files)" in lines
    assert f"  next        meshrl plot {run}" in lines
    assert lines[-1].split() == ["meshrl", "eval", "@", "configs/reverse_text/eval.toml", "--model.path",
                                 f"{run}/checkpoints/final"]
