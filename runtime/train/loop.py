"""The trainer rank's loop in an RL job: train the controller's batches, sync weights, checkpoint.

    build the policy (sharded), load a checkpoint if resuming, broadcast version 0
    loop:  TRAIN step s    -> forward + backward of its micro-batches; a part that is not the
                              step's last (trainer.overlap_rollout) -> PART_TRAINED, and wait for
                              the next; the last -> one optimizer step -> WEIGHTS v to the
                              controller (so that it tells the inference ranks to join)
                              -> broadcast v on the sync group -> REPORT (stats, weight-sync time)
           CHECKPOINT      -> save the sharded state (async) and/or export an HF folder
           STOP            -> final checkpoint, export checkpoints/final, DONE

Every trainer rank runs it; only the first (the leader) talks to the controller and sends the
weights (runtime/weight_sync.py). In a colocated layout every trainer rank instead writes the
weights into the buffer it shares with the engine on its device (`ColocatedSender`).
Messages: runtime/protocol.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from meshrl.parallel import parallelize
from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime import memory, protocol, transport, weight_sync
from meshrl.runtime.checkpoint import export_hf
from meshrl.runtime.config import RLConfig
from meshrl.runtime.layout import Layout
from meshrl.runtime.policy import build_trainer_policy, compute_dtype, load_tokenizer_for
from meshrl.runtime.protocol import Kind
from meshrl.runtime.rundir import Heartbeat
from meshrl.runtime.train.trainer import Trainer


def run_trainer(cfg: RLConfig, layout: Layout, start: int | None = None, ckpt_group=None) -> None:
    """Serve the controller until STOP. `start`: the checkpoint step a resumed run continues from."""
    TrainerRank(cfg, layout, start, ckpt_group).run()


class TrainerRank:
    """One trainer rank's state in an RL job: the sharded policy, its Trainer and checkpointer."""

    def __init__(self, cfg: RLConfig, layout: Layout, start: int | None, ckpt_group) -> None:
        self.cfg, self.layout = cfg, layout
        device = layout.device
        memory.cap_process(cfg, "trainer", device)
        self.tokenizer = load_tokenizer_for(cfg.model)
        self.dtype = compute_dtype(cfg.model, device)  # of the forward pass and of the weights sent to inference
        p = cfg.trainer.parallel
        reshard = p.reshards(cfg.layout.num_trainer_ranks, layout.roles.colocated, cfg.model.lora is not None)
        self.model, self.args = build_trainer_policy(
            cfg.model, device, lambda m: parallelize(m, layout.trainer_meshes, self.dtype, p.activation_checkpointing,
                                                     p.ac_every, p.compile, reshard), self.tokenizer)
        t = cfg.trainer
        self.trainer = Trainer(self.model, t.optim, device, layout.trainer_group, layout.trainer_meshes, t.attention,
                               t.logprob_chunk_tokens, t.moe_aux_loss_coef, self.dtype)
        self.leader = layout.is_trainer_leader
        self.checkpointer = ckpt.TrainerCheckpointer(
            self.trainer, layout.trainer_meshes, ckpt_group, self.leader, cfg.checkpoint,
            ckpt.manifest_base(cfg, "rl", layout.trainer_meshes.dims, cfg.layout.num_trainer_ranks))
        if start is not None:  # before version `start` goes to the engines
            path = ckpt.step_path(ckpt.checkpoints_dir(cfg.output_dir), start)
            self.checkpointer.load(path, ckpt.read_manifest(path))
        self.beat = Heartbeat(cfg.log.heartbeat_s)
        self.controller = layout.roles.controller
        self.down, self.up = layout.down[layout.rank], layout.up[layout.rank]
        self.colocated = (weight_sync.ColocatedSender(self.model, self.dtype, device, layout.peer, layout.to_peer,
                                                      layout.from_peer) if layout.roles.colocated else None)

    def run(self) -> None:
        self.sync()  # version 0, which also warms the sync group's communicator up
        while True:
            self.beat.set(f"waiting for the controller after version {self.trainer.version}")
            msg = transport.recv(self.controller, self.down)
            self.checkpointer.poll()
            if msg.kind == Kind.STOP:
                return self._stop()
            if msg.kind == Kind.CHECKPOINT:
                self._checkpoint(msg.meta["step"], msg.meta.get("path"), msg.meta.get("export"))
                continue
            self._train(protocol.read_train(msg))

    def sync(self) -> float:
        """Send the current weights to the inference ranks (broadcast, or the colocated buffer);
        returns the seconds it took on this side."""
        layout = self.layout
        if layout.device.type == "cuda":
            # the optimizer step's kernels may still be queued: they belong to the step, not the sync
            torch.cuda.synchronize(layout.device)
        start = time.perf_counter()
        if self.colocated is not None:
            self.colocated.send(self.model, self.trainer.version)
        else:
            weight_sync.send_weights(self.model, layout.sync_group if self.leader else None, layout.roles.trainers[0],
                                     self.dtype, self.cfg.weight_sync.bucket_mb, layout.device)
        return time.perf_counter() - start

    def _train(self, part: protocol.TrainPart) -> None:
        """Train one TRAIN part; the last part of a step takes the optimizer step, syncs and reports."""
        self.beat.set(f"train step {part.step}")
        cfg = self.cfg
        self.trainer.accumulate_rl(part.micro_batches, part.scale, cfg.trainer.loss, cfg.inference.sampling.temperature)
        if not part.last:  # trainer.overlap_rollout: more of the step's groups are still generating
            if self.leader:
                transport.send(protocol.part_trained(part.step), self.controller, self.up)
            return
        step = part.step
        stats = self.trainer.finish_rl_step(part.num_loss_tokens)
        stats["failed_saves"] = self.checkpointer.failed  # checkpoint/failed_saves in metrics.jsonl
        if self.layout.device.type == "cuda":
            stats["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated(self.layout.device) / 2**30
            if cfg.inference.sleep_while_training:
                torch.cuda.empty_cache()  # the engine takes its KV cache back next
        version = self.trainer.version
        if self.leader:  # before the broadcast: the controller must tell inference to join it
            transport.send(protocol.weights(version), self.controller, self.up)
        self.beat.set(f"weight sync v{version}")
        sync_s = self.sync()
        if self.leader:
            transport.send(protocol.report(step, version, stats, sync_s), self.controller, self.up)

    def _checkpoint(self, step: int, path: str | None, export: str | None) -> None:
        self.beat.set(f"checkpoint step_{step}")
        if path is not None:
            self.checkpointer.save(step, Path(path))
        if export is not None:
            export_hf(self.model, self.args, self.tokenizer, Path(export), self.leader, self.cfg.model.path)

    def _stop(self) -> None:
        self.beat.set("final checkpoint and export")
        self.checkpointer.close()
        if self.colocated is not None:
            self.colocated.close()
        export_hf(self.model, self.args, self.tokenizer, Path(self.cfg.output_dir) / "checkpoints" / "final",
                  self.leader, self.cfg.model.path)
        if self.leader:
            transport.send(protocol.done(), self.controller, self.up)
        self.beat.close()
