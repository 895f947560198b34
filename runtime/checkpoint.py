"""Checkpoints: the resumable state of a run, and the HF-format export of the policy.

    RUN_DIR/checkpoints/
      step_N/               a complete checkpoint after N optimizer steps (never written in place)
        COMPLETE            the manifest (JSON), written last: kind, step, config hash, model config,
                            parameter shapes, trainer layout, every file with its size
        trainer/            torch.distributed.checkpoint shards of the model and AdamW state
                            (.metadata + one __R_0.distcp file per trainer rank; no full gather)
        trainer.json        trainer counters: version (= N), non-finite steps skipped
        controller.json     RL: the controller's state (dataset cursor, request ids, RNG, counters)
        run.json            SFT: the run's state (step, cursor)
      step_N.tmp/           being written, or abandoned by a crash: never read, removed later
      final/                the final policy as an HF folder (`export_hf`)
      hf_step_N/            HF exports every `checkpoint.export_every` steps

Atomicity: everything is written into step_N.tmp/, then the trainer leader, once every rank's
shards are on disk (DCP's save returns on the coordinator only after all ranks wrote theirs),
writes COMPLETE (fsynced) and renames the folder to step_N. A folder without a valid COMPLETE,
or whose files differ from the manifest, is skipped with a warning, and the previous one is used.
Old checkpoints are deleted only after a newer one is complete, so a failed save (a full disk)
never costs the previous checkpoint.

Safety: trainer shards are tensors only (no pickled objects); DCP reads them with
`torch.load(weights_only=True)`, and its `.metadata` file (a pickle) is read by an unpickler that
accepts only DCP's metadata classes, torch sizes and dtypes. Everything else is JSON.

Resharding: the trainer state is sharded DTensors (FSDP2 / HSDP), so DCP loads it into any other
number of trainer ranks or parallel layout. Expert-parallel experts are plain local tensors of
E/ep experts (parallel/expert_parallel.py); they are saved as DTensors over an (ep, expert-FSDP)
mesh whose global shape counts all E experts, so they reshard too (to another ep as well).

Step semantics: checkpoint N holds the trainer after N optimizer steps and the controller state
for dispatching step N next (see docs/checkpoints.md for what is and is not reproduced).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrl.models.hf import save_hf_model
from meshrl.parallel import full_tensors
from meshrl.runtime.rundir import log, restart_count
from meshrl.runtime.tokenizer import save_tokenizer

FORMAT = 1
MARKER = "COMPLETE"
TRAINER_DIR = "trainer"
TRAINER_FILE = "trainer.json"
CONTROLLER_FILE = "controller.json"
RUN_FILE = "run.json"


# ----------------------------------------------------------------------------- HF export


def export_hf(model: nn.Module, args, tokenizer, path: Path, leader: bool) -> Path:
    """Write the full fp32 policy to `path` as an HF folder (leader only; all trainer ranks call).

    `full_tensors` gathers each parameter (a collective over the trainer ranks); the folder
    appears atomically (written beside, renamed).
    """
    state = {name: t.detach().to("cpu", torch.float32) for name, t in full_tensors(model)}
    if leader:
        with tempfile.TemporaryDirectory() as tok_dir:
            save_tokenizer(tokenizer, tok_dir)
            save_hf_model(state, args, path, tokenizer_dir=tok_dir, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        log.info("saved the policy to %s", path)
    return path


# ----------------------------------------------------------------------------- layout on disk


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def list_steps(root: Path) -> list[int]:
    """Steps of the `step_N` folders under `root` (complete or not; `.tmp` folders excluded), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        name = p.name
        if p.is_dir() and name.startswith("step_") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return sorted(steps)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any) -> None:
    """Write JSON durably (fsync) under its final name; callers write into a .tmp folder."""
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint folder; ValueError saying why it is not valid."""
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"no {MARKER} marker (the save did not finish)")
    try:
        manifest = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable {MARKER} marker ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{MARKER} is not a format-{FORMAT} manifest")
    if f"step_{manifest.get('step')}" != path.name:
        raise ValueError(f"{MARKER} names step {manifest.get('step')}, the folder is {path.name}")
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"file {rel} is missing")
        if f.stat().st_size != size:
            raise ValueError(f"file {rel} has {f.stat().st_size} bytes, the manifest says {size}")
    return manifest


def find_checkpoint(root: Path, step: int | None = None) -> tuple[int, Path, dict[str, Any]] | None:
    """The checkpoint to resume from: `step_{step}` (ValueError if it is not valid), or the newest
    valid one, skipping (with a warning) any that is partial or corrupt. None if there is none."""
    if step is not None:
        path = step_path(root, step)
        if not path.is_dir():
            raise ValueError(f"--resume.step {step}: {path} does not exist (checkpoints: {list_steps(root) or 'none'})")
        try:
            return step, path, read_manifest(path)
        except ValueError as e:
            raise ValueError(f"--resume.step {step}: {path} is not a complete checkpoint: {e}") from None
    for s in reversed(list_steps(root)):
        path = step_path(root, s)
        try:
            return s, path, read_manifest(path)
        except ValueError as e:
            log.warning("skipping checkpoint %s: %s; falling back to an older one", path, e)
    return None


def config_hash(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- resume decision

# Model settings that change the parameters' meaning; a checkpoint of another value cannot resume.
_MODEL_KEYS = ("family", "flavor", "tokenizer", "impl")


def check_compatible(manifest: dict[str, Any], kind: str, model: dict[str, Any], env: dict[str, Any] | None) -> None:
    """ValueError naming what differs when a checkpoint cannot continue this config.

    Parameter shapes are checked again when the trainer loads (`check_shapes`); a moved model
    folder (`model.path`) is allowed. Learning rate, schedule, max_steps, the parallel layout,
    timeouts and logging may change freely.
    """
    if manifest.get("kind") != kind:
        raise ValueError(f"checkpoint step_{manifest['step']} is from a `meshrl {manifest.get('kind')}` run, "
                         f"not `meshrl {kind}`")
    saved = manifest.get("model", {})
    diffs = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {model.get(k)!r} now"
             for k in _MODEL_KEYS if saved.get(k) != model.get(k)]
    if (saved.get("path") is None) != (model.get("path") is None):
        diffs.append(f"model.path: {saved.get('path')!r} in the checkpoint, {model.get('path')!r} now")
    if diffs:
        raise ValueError(f"checkpoint step_{manifest['step']} was written for another model ({'; '.join(diffs)}); "
                         "resume with the model it was trained with, or start a new run directory")
    if env is not None and manifest.get("env") != env:
        log.warning("the environment config differs from checkpoint step_%s's (%s now, %s then): the dataset "
                    "cursor continues, but the prompts after it change", manifest["step"], env, manifest.get("env"))


def resume_step(resume: Any, run_dir: Path, max_steps: int, kind: str, model: dict[str, Any],
                env: dict[str, Any] | None, restart_count: int = 0) -> int | None:
    """The step to resume from, or None to start fresh. ValueError (one clear line) on a misuse.

    `resume` is the config's value: False, True (latest), "auto" (latest if any) or a
    ResumeConfig (`step`, None = latest). A torchrun restart (`restart_count > 0`) means "auto",
    whatever the config says: the run continues from where the failed attempt got to.
    """
    root = checkpoints_dir(run_dir)
    if restart_count > 0:
        resume = "auto"
    if resume is False:
        found = find_checkpoint(root)
        if found is not None:
            raise ValueError(f"{root} holds checkpoints of an earlier run (latest step_{found[0]}): pass --resume to "
                             f"continue it, or choose another output_dir")
        return None
    step = getattr(resume, "step", None)
    found = find_checkpoint(root, step)
    if found is None:
        if resume == "auto":
            return None
        raise ValueError(f"--resume: {root} has no complete checkpoint (set checkpoint.every to write them)")
    step, _, manifest = found
    check_compatible(manifest, kind, model, env)
    if step > max_steps or (step == max_steps and resume != "auto"):
        raise ValueError(f"checkpoint step_{step} has already reached max_steps ({max_steps}): raise --max-steps to "
                         "train further")
    return step


def check_resume(cfg, kind: str) -> int | None:
    """`resume_step` for a run config (RLConfig or SFTConfig): a pre-flight check on the launcher,
    and the decision on rank 0 (`decide_resume`)."""
    env = cfg.env.model_dump() if hasattr(cfg, "env") else None
    return resume_step(cfg.resume, Path(cfg.output_dir), cfg.max_steps, kind, cfg.model.model_dump(), env,
                       restart_count())


def decide_resume(cfg, kind: str) -> int | None:
    """Rank 0 picks the checkpoint (and removes abandoned partial ones: nothing saves yet); every
    rank of the default group gets its step (None: start fresh). A collective."""
    value = None
    if dist.get_rank() == 0:
        value = check_resume(cfg, kind)
        clean_partial(checkpoints_dir(cfg.output_dir))
        if value is not None:
            supersede_later(checkpoints_dir(cfg.output_dir), value)
    return agree(value)


def manifest_base(cfg, kind: str, dims, num_trainer_ranks: int) -> dict[str, Any]:
    """What every checkpoint of this run records about it (the rest is added when it completes)."""
    return {"kind": kind, "config_hash": config_hash(cfg.model_dump_json()), "model": cfg.model.model_dump(),
            "env": cfg.env.model_dump() if hasattr(cfg, "env") else None,
            "layout": layout_info(dims, num_trainer_ranks)}


def read_state(run_dir: str | Path, step: int, name: str) -> dict[str, Any]:
    """A JSON state file (controller.json, run.json) of checkpoint step_N."""
    return json.loads((step_path(checkpoints_dir(run_dir), step) / name).read_text())


def agree(value: int | None, group: dist.ProcessGroup | None = None) -> int | None:
    """Every rank takes rank 0's value (so all resume from the same checkpoint); a collective."""
    t = torch.tensor([-1 if value is None else value], dtype=torch.int64)  # CPU: gloo carries it
    dist.broadcast(t, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return None if int(t) < 0 else int(t)


def clean_partial(root: Path) -> None:
    """Remove `step_N.tmp` folders abandoned by a crash (call only while no save can be running)."""
    if root.is_dir():
        for p in root.glob("step_*.tmp"):
            log.info("removing the partial checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)


def supersede_later(root: Path, step: int) -> list[int]:
    """Rename checkpoints past `step` (a resume from an earlier one: another timeline) to
    step_M.superseded, so that a restart never jumps back to them; `prune` deletes them later."""
    later = [s for s in list_steps(root) if s > step]
    for s in later:
        target = root / f"step_{s}.superseded"
        if target.exists():
            shutil.rmtree(target)
        step_path(root, s).rename(target)
    if later:
        log.warning("resuming from step_%d: the later checkpoints %s belong to the abandoned continuation; renamed "
                    "to step_M.superseded (deleted with the next complete checkpoint)", step, later)
    return later


def begin(root: Path, step: int, files: dict[str, Any]) -> Path:
    """Create `step_N.tmp/` (replacing any leftover) with the given JSON files; returns its path."""
    tmp = root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, value in files.items():
        write_json(tmp / name, value)
    return tmp


def finalize(tmp: Path, manifest: dict[str, Any]) -> Path:
    """List the files of `tmp`, write COMPLETE last (fsynced) and rename the folder to step_N."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    write_json(tmp / MARKER, {**manifest, "format": FORMAT, "files": files})
    final = tmp.with_name(f"step_{manifest['step']}")
    if final.exists():  # an older save of the same step (a resumed run passing it again)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def prune(root: Path, keep_last: int, keep_every: int) -> list[int]:
    """Delete all but the newest `keep_last` checkpoints and those whose step is a multiple of
    `keep_every`, and superseded ones; returns the deleted steps."""
    steps = list_steps(root)
    keep = set(steps[-keep_last:]) | {s for s in steps if keep_every and s % keep_every == 0}
    deleted = [s for s in steps if s not in keep]
    for s in deleted:
        shutil.rmtree(step_path(root, s), ignore_errors=True)
    for p in root.glob("step_*.superseded"):
        shutil.rmtree(p, ignore_errors=True)
    return deleted


# ----------------------------------------------------------------------------- safe metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata and nothing else: only DCP's metadata dataclasses, torch sizes,
    dtypes and layouts, and paths may be named, so a crafted file cannot run code."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module in self._MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                            torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a checkpoint may not contain")


def _safe_reader(path: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


# ----------------------------------------------------------------------------- trainer state


def global_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Unsharded shape of every parameter (experts count all experts), from local metadata."""
    from meshrl.parallel.parallelize import full_shape

    return {name: list(full_shape(model, name, p)) for name, p in model.named_parameters()}


def check_shapes(model: nn.Module, manifest: dict[str, Any]) -> None:
    """ValueError naming the parameters whose shape (or presence) differs from the checkpoint's."""
    saved, now = manifest["shapes"], global_shapes(model)
    diffs = [f"{k}: {saved.get(k)} in the checkpoint, {now.get(k)} now"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        more = f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else ""
        raise ValueError(f"checkpoint step_{manifest['step']} holds another model's parameters: "
                         f"{'; '.join(diffs[:5])}{more}")


class _ExpertLayout:
    """A DTensor view of expert-parallel shards with all E experts in the global shape.

    Rank (ep index e, expert-FSDP index m) holds rows [e*E/ep, (e+1)*E/ep) of every expert tensor,
    FSDP-sharded over m. That is DTensor placements (Shard(0) over ep, then Shard(0) over
    dp_shard_mod_ep) on an (ep, dp_shard_mod_ep) mesh, plus Replicate over dp_replicate (HSDP).
    """

    def __init__(self, meshes) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        dims = meshes.dims
        rank = dist.get_rank()
        grid = meshes.fsdp.mesh.reshape(dims.dp_replicate, -1, dims.ep)  # (R, S/ep, ep) global ranks
        ep_group = meshes.ep.get_group()
        ef = meshes.expert_fsdp
        self.ep = dims.ep
        if ef.ndim == 1:
            row = int((grid == rank).nonzero()[0, 0])
            self.mesh = DeviceMesh.from_group([ep_group, ef.get_group()], ef.device_type, mesh=grid[row].T,
                                              mesh_dim_names=("ep", "dp_shard_mod_ep"))
            self.placements = (Shard(0), Shard(0))
        else:
            self.mesh = DeviceMesh.from_group(
                [ef.get_group("dp_replicate"), ep_group, ef.get_group("dp_shard_mod_ep")], ef.device_type,
                mesh=grid.permute(0, 2, 1), mesh_dim_names=("dp_replicate", "ep", "dp_shard_mod_ep"))
            self.placements = (Replicate(), Shard(0), Shard(0))

    def view(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        shape = torch.Size((t.shape[0] * self.ep, *t.shape[1:]))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous
        # a view of the same storage: DCP loads into it in place
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=shape, stride=stride)


def _is_expert(model: nn.Module, name: str) -> bool:
    module = model.get_submodule(name.rpartition(".")[0])
    return getattr(module, "ep_group", None) is not None


def trainer_state(trainer, meshes=None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(what DCP saves/loads, model state dict, optimizer state dict) of a Trainer.

    The DCP view holds tensors only: the model's parameters and the optimizer's per-parameter
    state, by parameter name; AdamW's param_groups (lr, betas, ...) come from the config.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = trainer.model
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, trainer.optimizer)
    experts = [name for name in msd if _is_expert(model, name)]
    layout = _ExpertLayout(meshes) if experts and meshes is not None and meshes.ep is not None else None
    if experts and layout is None:
        raise ValueError("expert-parallel parameters need the trainer meshes to be checkpointed")
    view_model = {k: layout.view(v) if k in experts else v for k, v in msd.items()}
    view_optim = {k: {s: layout.view(v) if k in experts and torch.is_tensor(v) and v.dim() > 0 else v
                      for s, v in state.items()}
                  for k, state in osd["state"].items()}
    return {"model": view_model, "optim": view_optim}, msd, osd


class TrainerCheckpointer:
    """Saves and loads a Trainer's state with DCP, asynchronously, and finalizes checkpoints.

    Every trainer rank calls `save`/`load`/`wait`; the leader also finalizes (COMPLETE + rename)
    and prunes. `group` must be a gloo (CPU) group over the trainer ranks used for nothing else:
    an asynchronous save runs its collectives in a background thread, which must not interleave
    with the training collectives of another group.
    """

    def __init__(self, trainer, meshes, group: dist.ProcessGroup | None, leader: bool, cfg, manifest: dict[str, Any]):
        self.trainer = trainer
        self.meshes = meshes
        self.group = group
        self.leader = leader
        self.cfg = cfg
        self.manifest = manifest
        self.failed = 0
        """Saves that failed (a full disk, say); the run went on without them."""
        self._pending: Future | None = None  # writing and completing the last save
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._shapes: dict[str, list[int]] | None = None

    def save(self, step: int, tmp: Path) -> None:
        """Write the trainer state after `step` optimizer steps into `tmp` (created by `begin`)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        assert self.trainer.version == step, (self.trainer.version, step)
        self.wait()
        start = time.perf_counter()
        state, _, _ = trainer_state(self.trainer, self.meshes)
        (tmp / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
        if self.leader:
            write_json(tmp / TRAINER_FILE, self.trainer.state_dict())
        writer = dcp.FileSystemWriter(str(tmp / TRAINER_DIR))
        if self.cfg.async_save:
            # the state is copied to CPU before this returns; the files are written in the background
            saved = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        else:
            saved = Future()
            try:
                saved.set_result(dcp.save(state, storage_writer=writer, process_group=self.group))
            except (OSError, CheckpointException) as e:  # a full disk: reported by _complete, as when async
                saved.set_exception(e)
        log.info("checkpoint step_%d: trainer state staged in %.3fs", step, time.perf_counter() - start)
        self._pending = self._executor.submit(self._complete, step, tmp, saved, start)

    def save_with(self, step: int, root: Path, files: dict[str, Any]) -> None:
        """When every rank is a trainer (SFT): the leader creates step_N.tmp/ with `files`, then all save."""
        self.wait()  # the group is free again: nothing runs in the background now
        ok = True
        if self.leader:
            try:
                begin(root, step, files)
            except OSError as e:
                log.error("checkpoint step_%d: cannot write the run state (%s); skipped", step, e)
                ok = False
        if agree(1 if ok else None, self.group) is not None:
            self.save(step, root / f"step_{step}.tmp")

    def _complete(self, step: int, tmp: Path, saved: Future, start: float) -> bool:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            saved.result()
        except (OSError, CheckpointException) as e:
            # The previous checkpoint is untouched; the run goes on and the next save tries again.
            self.failed += 1
            log.error("checkpoint step_%d failed (%s: %s); keeping the previous checkpoints (%d failed saves)",
                      step, type(e).__name__, e, self.failed)
            if self.leader:
                shutil.rmtree(tmp, ignore_errors=True)
            return False
        if self.leader:
            if self._shapes is None:
                self._shapes = global_shapes(self.trainer.model)
            manifest = {**self.manifest, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "shapes": self._shapes}
            try:
                final = finalize(tmp, manifest)
            except OSError as e:
                self.failed += 1
                log.error("checkpoint step_%d could not be completed (%s); keeping the previous checkpoints", step, e)
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            deleted = prune(final.parent, self.cfg.keep_last, self.cfg.keep_every)
            size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
            log.info("checkpoint %s complete: %.1f MiB in %.2fs%s", final, size / 2**20, time.perf_counter() - start,
                     f"; deleted step {deleted}" if deleted else "")
        return True

    def poll(self) -> None:
        """Re-raise an unexpected error of a finished background save (call at safe points)."""
        if self._pending is not None and self._pending.done():
            self._pending.result()
            self._pending = None

    def wait(self) -> None:
        """Block until the pending save (if any) is written and finalized."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def load(self, path: Path, manifest: dict[str, Any]) -> None:
        """Load `path`'s trainer state into the trainer, resharding to this layout (all trainer ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        start = time.perf_counter()
        check_shapes(self.trainer.model, manifest)
        state, msd, osd = trainer_state(self.trainer, self.meshes)
        dcp.load(state, storage_reader=_safe_reader(path / TRAINER_DIR), process_group=self.group)
        set_model_state_dict(self.trainer.model, msd)
        set_optimizer_state_dict(self.trainer.model, self.trainer.optimizer, osd)
        self.trainer.load_state_dict(json.loads((path / TRAINER_FILE).read_text()))
        log.info("loaded the trainer state of %s (written by %d trainer ranks, %s) in %.2fs", path,
                 manifest["layout"]["num_trainer_ranks"], manifest["layout"]["parallel"], time.perf_counter() - start)

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()


def layout_info(dims, num_trainer_ranks: int) -> dict[str, Any]:
    """The trainer layout recorded in the manifest (informational: loading reshards)."""
    return {"num_trainer_ranks": num_trainer_ranks, "parallel": dataclasses.asdict(dims)}
