"""Weights & Biases logging: every row of metrics.jsonl also goes to one W&B run per run directory.

`wandb` is an optional extra (`pip install 'meshrl[wandb]'`), imported only when
`wandb.enabled`. Only one process logs (the controller in RL, rank 0 in SFT), so a job is one
W&B run. Its id is kept in RUN_DIR/wandb_run_id, so a resumed or restarted job continues the
same W&B run (`resume="allow"`) instead of starting another one. W&B keeps the first value
logged for a step: steps that a restart computes again keep their pre-crash values there, while
metrics.jsonl (the record meshrl reads) holds the recomputed ones.

Mode "auto" logs online when the user is logged in (WANDB_API_KEY, or `wandb login` wrote the
key to ~/.netrc) and offline otherwise (files under RUN_DIR/wandb, uploaded later with
`wandb sync`); WANDB_MODE, when set, wins. Tests run offline.
"""

from __future__ import annotations

import math
import netrc
import os
import uuid
from pathlib import Path
from typing import Any

from meshrl.runtime.config import WandbConfig
from meshrl.runtime.rundir import log, restart_count

ID_FILE = "wandb_run_id"


def logged_in() -> bool:
    """Whether W&B has an API key here (environment or ~/.netrc), without any network access."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("//")[-1]) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if logged_in() else "offline")


class WandbLogger:
    """A metrics sink (rundir.MetricsSink) that logs rows to W&B with the row's step as W&B step."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any], resuming: bool):
        try:
            import wandb
        except ModuleNotFoundError as e:
            if e.name != "wandb":
                raise
            raise ModuleNotFoundError("wandb.enabled needs the wandb package: pip install 'meshrl[wandb]'",
                                      name="wandb") from None
        id_file = run_dir / ID_FILE
        resuming = resuming or restart_count() > 0  # a restart that found no checkpoint continues the W&B run too
        if resuming and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        mode = resolve_mode(cfg.mode)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or Path(run_dir).resolve().name,
                              group=cfg.group, tags=list(cfg.tags), config=config, id=run_id, resume="allow",
                              mode=mode, dir=str(run_dir))
        log.info("W&B run %s (%s mode) in %s", run_id, mode, run_dir)

    def log(self, row: dict[str, Any]) -> None:
        values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(v)}
        self.run.log(values, step=int(row["step"]))

    def finish(self) -> None:
        self.run.finish()


def make_sinks(cfg: WandbConfig, run_dir: Path, config: dict[str, Any], resuming: bool) -> list[WandbLogger]:
    """The metrics sinks of a run: a WandbLogger when `cfg.enabled`, else none."""
    return [WandbLogger(cfg, run_dir, config, resuming)] if cfg.enabled else []
