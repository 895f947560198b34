"""The SFT loop: supervised training on an environment's reference completions or on a data set.

It runs on the same trainer stack as RL (FSDP2 over all ranks, packed rows, the same Trainer).
There is no controller: every rank derives the same packed batch from the dataset cursor
(examples are a pure function of the cursor, runtime/train/sft_data.py) and trains on its own
data rank's share. With `eval_every`, an environment run has rank 0 greedily decode held-out
prompts with the native engine and log eval/reward, so the warm start's quality is known before
RL begins; a `[data]` run logs val/loss, the mean loss over its validation split. Checkpoints hold
the trainer state and the cursor; the final weights are exported as an HF folder to
checkpoints/final.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from meshrl.envs import make_env
from meshrl.envs.base import decode_reply, stop_token_ids
from meshrl.parallel import full_tensors, parallelize
from meshrl.parallel.dims import build_meshes
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime.checkpoint import export_hf
from meshrl.runtime.config import SFTConfig
from meshrl.runtime.engine.api import Request, SamplingParams, generate
from meshrl.runtime.engine.native import NativeEngine
from meshrl.runtime.policy import build_policy, build_trainer_policy, compute_dtype, load_tokenizer_for
from meshrl.runtime.rundir import (MetricsWriter, ProgressLine, TrainingWatch, log, record_restart, restart_count,
                                   write_config)
from meshrl.runtime.train.packing import count_loss_tokens, pack_sft
from meshrl.runtime.train.sft_data import DataDocuments, EnvDocuments
from meshrl.runtime.train.trainer import Trainer

EVAL_OFFSET = 10**9  # held-out examples come from far past any training cursor


def run_sft(cfg: SFTConfig, rank: int, world: int, device: torch.device, start: int | None = None,
            ckpt_group=None) -> None:
    """Train cfg.max_steps steps (fewer when data.epochs ends the run first) on every rank of the
    default group. `start`: the checkpoint step to resume from (None: fresh)."""
    SFTLoop(cfg, rank, world, device, start, ckpt_group).run()


class SFTLoop:
    """One rank's SFT run: its policy shard, Trainer, checkpointer and (rank 0) metrics."""

    def __init__(self, cfg: SFTConfig, rank: int, world: int, device: torch.device, start: int | None,
                 ckpt_group) -> None:
        self.cfg, self.rank, self.start = cfg, rank, start
        self.run_dir = Path(cfg.output_dir)
        self.leader = rank == 0
        self.tokenizer = load_tokenizer_for(cfg.model)
        self.env = make_env(cfg.env.name, **cfg.env.kwargs())
        self.docs = (EnvDocuments(self.env, self.tokenizer) if cfg.data is None
                     else DataDocuments(cfg.data, self.tokenizer, cfg.trainer.micro_batch_tokens))
        self.num_steps = self.docs.num_steps(cfg.max_steps, cfg.batch_size)
        if cfg.data is not None and self.docs.skipped and self.leader:
            log.warning("%d malformed rows skipped (data.on_error = \"skip\"); the first: %s", len(self.docs.skipped),
                        self.docs.skipped[0])
        self.dims = cfg.trainer.parallel.dims(world)
        meshes = build_meshes(self.dims, list(range(world)), rank, device.type)
        p, t, dtype = cfg.trainer.parallel, cfg.trainer, compute_dtype(cfg.model, device)
        self.model, self.args = build_trainer_policy(
            cfg.model, device, lambda m: parallelize(m, meshes, dtype, p.activation_checkpointing, p.ac_every,
                                                     p.compile, p.reshards(world, False, cfg.model.lora is not None)),
            self.tokenizer)
        self.trainer = Trainer(self.model, t.optim, device, dist.group.WORLD, meshes, t.attention,
                               t.logprob_chunk_tokens, t.moe_aux_loss_coef, dtype)
        self.checkpointer = ckpt.TrainerCheckpointer(self.trainer, meshes, ckpt_group, self.leader, cfg.checkpoint,
                                                     ckpt.manifest_base(cfg, "sft", self.dims, world))
        self.cursor = 0  # index of the first example of the next step
        if start is not None:
            path = ckpt.step_path(ckpt.checkpoints_dir(self.run_dir), start)
            self.checkpointer.load(path, ckpt.read_manifest(path))
            self.cursor = ckpt.read_state(self.run_dir, start, ckpt.RUN_FILE)["cursor"]
        self.metrics = self._metrics() if self.leader else None
        self.progress = ProgressLine(self.num_steps, self.leader, "sft")
        self.evaluator = Evaluator(cfg, self.env, self.tokenizer, device) if cfg.eval_every and cfg.data is None else None
        self.validation = (pack_sft(self.docs.validation, cfg.trainer.micro_batch_tokens, self.dims.num_data_ranks,
                                    pad_id=self.tokenizer.pad_token_id or 0) if self.docs.validation else None)
        self.watch = TrainingWatch(cfg.checkpoint.every or 10)  # stops a run of only non-finite updates

    def _metrics(self) -> MetricsWriter:
        from meshrl.runtime.wandb_logger import make_sinks

        cfg, start = self.cfg, self.start
        metrics = MetricsWriter(self.run_dir, start or 0,
                                make_sinks(cfg.wandb, self.run_dir, cfg.model_dump(), start is not None))
        if start is not None or restart_count():
            record_restart(self.run_dir, start, metrics.steps_lost)
        write_config(self.run_dir, cfg.model_dump_json(indent=2))
        return metrics

    def run(self) -> None:
        cfg = self.cfg
        for step in range(self.start or 0, self.num_steps):
            count = self.docs.batch_size_at(self.cursor, cfg.batch_size)
            batches = self._batches(count)
            stats = self.trainer.sft_step(batches[self.dims.data_rank(self.rank)], count_loss_tokens(batches))
            row = {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                   "tokens/train": stats["train_tokens"], "time/train_s": stats["train_time_s"],
                   "tokens/train_per_s": stats["train_tokens"] / max(stats["train_time_s"], 1e-9),
                   **{k: v for k, v in stats.items() if k.startswith("moe/")}}
            self.cursor += count
            if cfg.data is not None:
                row["data/epoch"] = self.docs.epoch(self.cursor)
                row.update(self.docs.summary() if step == (self.start or 0) else {})
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == self.num_steps):
                self._evaluate(row)
            if self.leader:
                self._log(step, row)
            self.watch.step(step, stats["grad_norm"])  # the same global norm on every rank: all stop together
            self._maybe_checkpoint(step + 1)
        self.progress.close()
        self.checkpointer.close()
        if self.metrics is not None:
            self.metrics.close()
        export_hf(self.model, self.args, self.tokenizer, self.run_dir / "checkpoints" / "final", self.leader,
                  self.cfg.model.path)

    def _batches(self, count: int) -> list:
        """The packed micro-batches of every data rank for the `count` examples at the cursor."""
        return pack_sft(self.docs.examples(self.cursor, count), self.cfg.trainer.micro_batch_tokens,
                        self.dims.num_data_ranks, pad_id=self.tokenizer.pad_token_id or 0)

    def _evaluate(self, row: dict) -> None:
        """eval/reward (an environment run) or val/loss (a [data] run) into `row` (collective)."""
        if self.evaluator is not None:
            row["eval/reward"] = self.evaluator.run(self.model, self.leader)
        if self.validation is not None:
            row["val/loss"] = self.trainer.eval_loss(self.validation[self.dims.data_rank(self.rank)])

    def _log(self, step: int, row: dict) -> None:
        self.metrics.write(row)
        status = f"loss {row['loss']:.3f}" + "".join(f"  {k} {row[k]:.3f}" for k in ("eval/reward", "val/loss")
                                                      if k in row)
        self.progress.update(step, status)
        log.info("step %d: %s", step, row)

    def _maybe_checkpoint(self, n: int) -> None:
        """After step n - 1: a resumable checkpoint every checkpoint.every steps and at the end, an
        HF export every checkpoint.export_every steps."""
        c, root = self.cfg.checkpoint, ckpt.checkpoints_dir(self.run_dir)
        if c.every and (n % c.every == 0 or n == self.num_steps):
            self.checkpointer.save_with(n, root, {ckpt.RUN_FILE: {"step": n, "cursor": self.cursor}})
        if c.export_every and n % c.export_every == 0 and n < self.num_steps:
            export_hf(self.model, self.args, self.tokenizer, root / f"hf_step_{n}", self.leader, self.cfg.model.path)


class Evaluator:
    """Greedy decoding of held-out prompts on an unsharded copy of the model (rank 0)."""

    def __init__(self, cfg: SFTConfig, env, tokenizer, device: torch.device):
        self.cfg, self.env, self.tokenizer, self.device = cfg, env, tokenizer, device
        self.examples = [env.example(EVAL_OFFSET + i) for i in range(cfg.eval_examples)]
        self.copy = None

    def run(self, model, leader: bool) -> float:
        """Mean reward of greedy completions (collective: every rank gathers the weights)."""
        state = {name: t.detach().clone() for name, t in full_tensors(model)}
        if not leader:
            return float("nan")
        if self.copy is None:
            self.copy, _ = build_policy(self.cfg.model, self.device, torch.float32, tokenizer=self.tokenizer)
        self.copy.load_state_dict(state, strict=True)
        tok = self.tokenizer
        prompts = [tok.encode(ex.prompt, add_special_tokens=False) for ex in self.examples]
        max_len = max(len(p) for p in prompts) + self.cfg.max_tokens + 1
        engine = NativeEngine(self.copy, max_num_seqs=len(prompts), max_model_len=max_len, device=self.device,
                              dtype=compute_dtype(self.cfg.model, self.device))
        sampling = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_tokens, stop_token_ids=stop_token_ids(tok))
        done = generate(engine, [Request(i, p, sampling) for i, p in enumerate(prompts)])
        rewards = [float(self.env.score(ex, decode_reply(tok, c.token_ids))) for ex, c in zip(self.examples, done)]
        return statistics.fmean(rewards)
