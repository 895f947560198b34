"""`meshrl plot RUN_DIR [--out DIR]`: PNG charts of a run's metrics.jsonl, for a person to read.

    OUT_DIR/ (default RUN_DIR/plots)
      reward.png        reward/mean with a ±reward/std band, and eval/reward (SFT evaluations)
      mismatch_kl.png   KL(inference || trainer) on sampled tokens; log scale when all values > 0
      policy_lag.png    policy_lag/mean and policy_lag/max (policy versions behind the trainer)
      throughput.png    tokens/rollout_per_s and tokens/train_per_s
      loss.png          loss and entropy, one panel each

A chart whose metrics are all absent is not written, so an SFT run gets reward (from
eval/reward), throughput and loss only. MetricsWriter stores non-finite floats as the strings
"nan"/"inf"; those points are dropped rather than failing the whole chart. matplotlib is an
extra (`meshrl[plot]`) and is imported only when a chart is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

USAGE = "usage: meshrl plot RUN_DIR [--out DIR]"
DPI = 100
WIDTH_IN, PANEL_HEIGHT_IN = 8.0, 4.5
KEYS = ("reward/mean", "reward/std", "eval/reward", "mismatch_kl", "policy_lag/mean", "policy_lag/max",
        "tokens/rollout_per_s", "tokens/train_per_s", "loss", "entropy")

Series = dict[float, float]  # step -> value, finite values only


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; ValueError naming the file if it is missing, empty or not JSONL."""
    if not path.is_file():
        raise ValueError(f"{path} not found: RUN_DIR must be a meshrl run directory")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected one JSON object per line")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged a step yet")
    return rows


def _finite(value: Any) -> float | None:
    # Strings ("nan", "inf") are how MetricsWriter writes non-finite floats; bools are not metrics.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def series(rows: list[dict[str, Any]], key: str) -> Series:
    """The finite values of `key`, by step (the row's position when a row has no usable step)."""
    out: Series = {}
    for index, row in enumerate(rows):
        value = _finite(row.get(key))
        if value is not None:
            step = _finite(row.get("step"))
            out[index if step is None else step] = value
    return out


def _figure(num_panels: int = 1):
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        raise ModuleNotFoundError("meshrl plot needs matplotlib: pip install 'meshrl[plot]'",
                                  name="matplotlib") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on an Agg canvas, not pyplot: no global backend switch and no figure registry
    # to leak, so plot_run is safe to call from a notebook or a long-lived process.
    fig = Figure(figsize=(WIDTH_IN, PANEL_HEIGHT_IN * (1 if num_panels == 1 else 0.7 * num_panels)),
                 dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(num_panels, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _line(ax, s: Series, label: str, marker: str | None = None, linestyle: str = "-"):
    xs = sorted(s)
    # Markers keep short runs and sparse metrics (eval every N steps) visible.
    marker = marker or ("o" if len(xs) <= 50 else None)
    (line,) = ax.plot(xs, [s[x] for x in xs], marker=marker, markersize=3, linewidth=1.5,
                      linestyle=linestyle, label=label)
    return line


def _finish(ax, title: str | None, ylabel: str, xlabel: bool = True, integer_y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    if title:
        ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _reward(d: dict[str, Series], name: str):
    mean, std, evals = d["reward/mean"], d["reward/std"], d["eval/reward"]
    if not mean and not evals:
        return None
    fig, (ax,) = _figure()
    if mean:
        line = _line(ax, mean, "reward/mean")
        band = [x for x in sorted(mean) if x in std]
        if band:
            ax.fill_between(band, [mean[x] - std[x] for x in band], [mean[x] + std[x] for x in band],
                            color=line.get_color(), alpha=0.2, linewidth=0, label="± reward/std")
    if evals:
        _line(ax, evals, "eval/reward", marker="o")
    _finish(ax, f"reward — {name}", "reward")
    return fig


def _mismatch_kl(d: dict[str, Series], name: str):
    s = d["mismatch_kl"]
    if not s:
        return None
    fig, (ax,) = _figure()
    _line(ax, s, "mismatch_kl")
    # The k3 estimate can dip just below 0 (rounding); a log axis would hide those points.
    if all(v > 0 for v in s.values()):
        ax.set_yscale("log")
    _finish(ax, f"KL(inference || trainer) on sampled tokens — {name}", "mismatch_kl")
    return fig


def _lines(keys: tuple[str, ...], title: str, ylabel: str, integer_y: bool = False):
    def draw(d: dict[str, Series], name: str):
        present = [k for k in keys if d[k]]
        if not present:
            return None
        fig, (ax,) = _figure()
        # Dashed second line: policy_lag/mean often equals policy_lag/max and would hide under it.
        for k, linestyle in zip(present, ("-", "--")):
            _line(ax, d[k], k, linestyle=linestyle)
        _finish(ax, f"{title} — {name}", ylabel, integer_y=integer_y)
        return fig
    return draw


def _loss(d: dict[str, Series], name: str):
    present = [k for k in ("loss", "entropy") if d[k]]
    if not present:
        return None
    fig, axes = _figure(len(present))
    for i, (ax, k) in enumerate(zip(axes, present)):
        _line(ax, d[k], k)
        _finish(ax, f"{' and '.join(present)} — {name}" if i == 0 else None, k, xlabel=i == len(present) - 1)
    return fig


CHARTS = {
    "reward": _reward,
    "mismatch_kl": _mismatch_kl,
    "policy_lag": _lines(("policy_lag/mean", "policy_lag/max"), "policy lag", "policy versions behind",
                         integer_y=True),
    "throughput": _lines(("tokens/rollout_per_s", "tokens/train_per_s"), "throughput", "tokens/s"),
    "loss": _loss,
}


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per chart that has data into `out_dir` (default RUN_DIR/plots); return the paths."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path)
    data = {key: series(rows, key) for key in KEYS}
    name = run_dir.resolve().name
    figures = {chart: fig for chart, draw in CHARTS.items() if (fig := draw(data, name)) is not None}
    if not figures:
        raise ValueError(f"{path} has no finite values of any plotted metric ({', '.join(KEYS)})")
    out_dir = run_dir / "plots" if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chart, fig in figures.items():
        written.append(out_dir / f"{chart}.png")
        fig.savefig(written[-1], dpi=DPI)
    return written


def main(argv: list[str]) -> None:
    """The `meshrl plot` command: print each written path; one line and exit 2 on a mistake."""
    from meshrl.runtime.launch import fail

    positional: list[str] = []
    out: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--out" and i + 1 < len(argv):
            out, i = argv[i + 1], i + 2
        elif arg.startswith("--out="):
            out, i = arg.removeprefix("--out="), i + 1
        elif arg.startswith("-"):
            fail(f"unexpected argument {arg!r}; {USAGE}")
        else:
            positional.append(arg)
            i += 1
    if len(positional) != 1:
        fail(USAGE)
    try:
        paths = plot_run(Path(positional[0]), None if out is None else Path(out))
    except ValueError as e:
        fail(str(e))
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        fail(str(e))
    for p in paths:
        print(p)
