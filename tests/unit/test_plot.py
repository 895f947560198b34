import json
import math
import subprocess
import sys

import pytest

from meshrl.runtime.plot import plot_run

matplotlib_image = pytest.importorskip("matplotlib.image")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RL_CHARTS = ["reward", "mismatch_kl", "policy_lag", "throughput", "loss"]


def rl_rows(num_steps=20):
    rows = []
    for step in range(num_steps):
        rows.append({
            "step": step, "reward/mean": 0.3 + 0.02 * step, "reward/std": 0.1,
            "mismatch_kl": 1e-3 * (1 + math.sin(step)) + 1e-5,
            "policy_lag/mean": min(step, 2) * 0.5, "policy_lag/max": min(step, 2),
            "tokens/rollout_per_s": 2000.0 + 10 * step, "tokens/train_per_s": 4000.0 - 5 * step,
            "loss": 0.1 / (step + 1), "entropy": 1.5 - 0.03 * step,
            "time/step_s": 0.7, "time/weight_sync_s": 0.005,
        })
    rows[7]["loss"] = "nan"  # how MetricsWriter stores a non-finite float
    return rows


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 0 and data[:8] == PNG_SIGNATURE, path
    image = matplotlib_image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100, image.shape


def test_rl_run_gets_all_five_charts(tmp_path):
    run = write_metrics(tmp_path / "run", rl_rows())
    paths = plot_run(run)
    assert paths == [run / "plots" / f"{name}.png" for name in RL_CHARTS]
    for path in paths:
        assert_png(path)


def test_out_dir_is_created(tmp_path):
    run = write_metrics(tmp_path / "run", rl_rows())
    paths = plot_run(run, tmp_path / "elsewhere" / "charts")
    assert {p.parent for p in paths} == {tmp_path / "elsewhere" / "charts"}
    assert not (run / "plots").exists()


def test_sft_run_gets_only_the_charts_it_has_data_for(tmp_path):
    rows = [{"step": s, "loss": 4.0 - 0.1 * s, "grad_norm": 2.0, "lr": 3e-4, "tokens/train_per_s": 6000.0}
            for s in range(20)]
    rows[9]["eval/reward"] = 0.2
    rows[19]["eval/reward"] = 0.45
    run = write_metrics(tmp_path / "sft", rows)
    paths = plot_run(run)
    assert [p.name for p in paths] == ["reward.png", "throughput.png", "loss.png"]
    for path in paths:
        assert_png(path)


def test_missing_or_empty_metrics_raise_value_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl not found"):
        plot_run(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl is empty"):
        plot_run(tmp_path)


def test_no_plottable_metric_raises(tmp_path):
    run = write_metrics(tmp_path / "run", [{"step": 0, "loss": "nan"}, {"step": 1, "lr": 1e-3}])
    with pytest.raises(ValueError, match="no finite values"):
        plot_run(run)


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    run = write_metrics(tmp_path / "run", rl_rows())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'meshrl\[plot\]'"):
        plot_run(run)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "meshrl.runtime.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_cli_prints_written_paths_and_exits_2_on_a_missing_dir(tmp_path):
    run = write_metrics(tmp_path / "run", rl_rows())
    r = _cli("plot", str(run), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(tmp_path / "out" / f"{name}.png") for name in RL_CHARTS]
    r = _cli("plot", str(tmp_path / "missing"), cwd=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshrl: ") and "metrics.jsonl not found" in lines[0], r.stderr
