"""How a step's training samples reach the trainer ranks: TRAIN messages, whole or in parts.

Without overlap a step is one TRAIN message per trainer rank, sent once all its rollouts are scored:
its data rank's micro-batches and the step's loss-token count, which every loss divides by.

With trainer.overlap_rollout the controller sends the step's finished GRPO groups (every rollout of
the group scored: advantages need the whole group) while the engines still generate the others:

    groups finish:     g3 g0    g5 g1 g6     g2 g4 g7 (the last rollout)
    TRAIN parts:       [g3 g0]  [g5 g1 g6]   [g2 g4 g7] last, with num_loss_tokens
    trainer:           fwd+bwd  fwd+bwd      fwd+bwd, rescale the gradients, clip, optimizer step

A part goes out only when the trainer has answered PART_TRAINED for the one before (a TRAIN sent to
a busy trainer would block the controller: transport.send waits for the receiver), so parts grow
when the trainer is the slower side, and only while some of the step's turns are still generating
(the controller's `_generating`): once only scoring remains, the last part comes within
milliseconds, and a part sent then would make it wait. The parts' losses divide by one provisional normaliser
(`provisional_scale`), the same on every rank, because FSDP sums the ranks' gradients as they are;
the last part carries the step's real normaliser and the trainer rescales the gradients to it once
(runtime/train/trainer.py: `accumulate_rl`). The losses are linear in 1 / normaliser, so the update
is the unsplit step's up to float reassociation. The controller alone partitions the groups into
parts and `pack` gives every data rank the same number of micro-batches in each part, so every
trainer rank runs the same collectives however the groups arrive. The weights do not change until
the step's optimizer step: the step stays on the policy its rollouts came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrl.runtime import protocol, transport
from meshrl.runtime.config import RLConfig
from meshrl.runtime.layout import Layout
from meshrl.runtime.train.packing import Sample, count_loss_tokens, pack, shared_fraction


@dataclass
class StepParts:
    """What of one step the trainer already has (trainer.overlap_rollout)."""

    sent: set[int] = field(default_factory=set)  # groups in a part already sent (or filtered out then)
    batches: list[list] = field(default_factory=list)  # each sent part's micro-batches per data rank
    scale: int | None = None  # the loss normaliser of the step's parts


class TrainFeed:
    """Packs samples into micro-batches per data rank and sends them to every trainer rank."""

    def __init__(self, cfg: RLConfig, layout: Layout, pad_id: int, share_prompts: bool) -> None:
        self.cfg, self.layout = cfg, layout
        self.pad_id, self.share_prompts = pad_id, share_prompts
        # with sleep_while_training the trainer steps in memory the engine frees: no training beside it
        self.overlap = cfg.trainer.overlap_rollout and not cfg.inference.sleep_while_training
        self.part_out = False
        """A part that is not its step's last is with the trainer (until PART_TRAINED)."""

    def send_part(self, step: int, parts: StepParts, groups: list[int], samples: list[Sample]) -> None:
        """Send finished `groups` (their training `samples`) of `step` as a part that is not the last."""
        assert not self.part_out
        parts.sent.update(groups)
        if not samples:  # every one of them was filtered out
            return
        batches = self.pack(samples)
        parts.scale = parts.scale or self.provisional_scale()
        parts.batches.append(batches)
        self._send(step, batches, None, parts.scale)
        self.part_out = True

    def send_last(self, step: int, parts: StepParts, samples: list[Sample], rest: list[Sample]) -> dict[str, float]:
        """Send the last part of `step`: `rest`, its samples in no earlier part (`samples`: all of the
        step's), with the step's loss normaliser; returns the step's packing statistics."""
        batches = self.pack(rest)
        # every part's rows per data rank: count_loss_tokens and shared_fraction only sum over them
        every = [rows for part in (*parts.batches, batches) for rows in part]
        self._send(step, batches, self.loss_normaliser(samples, every), parts.scale)
        return {"tokens/prompt_shared_fraction": shared_fraction(samples, every),
                "batch/train_parts": len(parts.batches) + 1}

    def on_part_trained(self, step: int, training: int) -> None:
        """PART_TRAINED of `step`; the controller trains step `training`."""
        assert self.part_out and step == training, f"PART_TRAINED of step {step} (training {training}, " \
            f"part out: {self.part_out})"
        self.part_out = False

    def provisional_scale(self) -> int:
        """The loss normaliser of a step's parts before its loss-token count is known: the most tokens
        one turn of the step's rollouts can sample (only its size matters: the gradients are rescaled)."""
        return self.cfg.prompts_per_step * self.cfg.samples_per_prompt * self.cfg.inference.sampling.max_tokens

    def loss_normaliser(self, samples: list[Sample], batches: list[list]) -> int:
        """What every loss of the step divides by: its loss-token count over all ranks, or, for
        advantage.type = "drgrpo", samples x sampling.max_tokens (Dr.GRPO: independent of lengths)."""
        if self.cfg.advantage.type == "drgrpo":
            return len(samples) * self.cfg.inference.sampling.max_tokens
        return count_loss_tokens(batches)

    def pack(self, samples: list[Sample]) -> list[list]:
        """Micro-batches per data rank (the cp ranks of a data rank share its stream)."""
        dims = self.cfg.trainer.parallel.dims(self.cfg.layout.num_trainer_ranks)
        return pack(samples, self.cfg.trainer.micro_batch_tokens, dims.num_data_ranks, pad_id=self.pad_id,
                    share_prompts=self.share_prompts)

    def _send(self, step: int, batches: list[list], num_loss_tokens: int | None, scale: int | None) -> None:
        """One TRAIN message to every trainer rank: its data rank's micro-batches (last: num_loss_tokens set)."""
        ranks = self.layout.roles.trainers
        dims = self.cfg.trainer.parallel.dims(len(ranks))
        for index, rank in enumerate(ranks):
            msg = protocol.train(step, num_loss_tokens, batches[dims.data_rank(index)], scale=scale,
                                 last=num_loss_tokens is not None)
            transport.send(msg, rank, self.layout.down[rank])
