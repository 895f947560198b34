"""The lines printed at the end of every run: what it did, where its outputs are, what to run next.

    meshrl: rl finished: 20 steps in 3m12s; final reward/mean 0.412 (step 19)
      checkpoint  runs/rl/checkpoints/final (HF folder)
      metrics     runs/rl/metrics.jsonl
      samples     runs/rl/samples/ (20 files)
      plots       runs/rl/plots/ (make them: meshrl plot runs/rl)
      next        meshrl plot runs/rl
                  meshrl eval @ configs/reverse_text/eval.toml --model.path runs/rl/checkpoints/final
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["print_summary", "summary_lines"]


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{sec:02d}s" if hours else f"{minutes}m{sec:02d}s" if minutes else f"{sec}s"


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


def eval_config_for(env_name: str) -> str | None:
    """configs/<env>/eval.toml of a built-in environment, if this directory has it."""
    path = Path("configs") / env_name.replace("-", "_") / "eval.toml"
    return str(path) if path.is_file() else None


def summary_lines(cfg: Any, kind: str, wall_s: float) -> list[str]:
    """The summary of a finished run (`kind` "rl" or "sft") from its run directory."""
    run = Path(cfg.output_dir)
    rows = _rows(run / "metrics.jsonl")
    head = f"meshrl: {kind} finished: {len(rows)} steps in {_duration(wall_s)}"
    last = rows[-1] if rows else {}
    for key in ("reward/mean", "eval/reward", "loss"):
        if isinstance(last.get(key), (int, float)):
            head += f"; final {key} {last[key]:.4g} (step {last['step']})"
            break
    final = run / "checkpoints" / "final"
    samples = sorted((run / "samples").glob("step_*.jsonl"))
    plots = run / "plots"
    lines = [head,
             f"  checkpoint  {final} (HF folder)" if final.is_dir() else "  checkpoint  none written",
             f"  metrics     {run / 'metrics.jsonl'}",
             f"  samples     {run / 'samples'}/ ({len(samples)} files)" if samples else "  samples     none",
             f"  plots       {plots}/" if any(plots.glob("*.png")) else f"  plots       not made yet (meshrl plot {run})",
             f"  next        meshrl plot {run}"]
    if final.is_dir():
        env = getattr(cfg, "env", None)
        name = getattr(env, "name", None)
        config = eval_config_for(name) if name else None
        base = f"@ {config}" if config else f"--env.name {name}" if name and name != "mix" else "@ EVAL.toml"
        lines.append(f"              meshrl eval {base} --model.path {final}")
    return lines


def print_summary(cfg: Any, kind: str, wall_s: float) -> None:
    print("\n".join(summary_lines(cfg, kind, wall_s)), file=sys.stderr, flush=True)
