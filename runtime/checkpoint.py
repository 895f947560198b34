"""Checkpoints: the resumable state of a run, and the HF-format export of the policy.

    RUN_DIR/checkpoints/
      step_N/               a complete checkpoint after N optimizer steps (never written in place)
        COMPLETE            the manifest (JSON), written last: kind, step, config hash, model config,
                            parameter shapes, trainer layout, every file with its size and checksum
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
writes trainer.json, hashes every file and writes COMPLETE last (fsynced), then renames the folder
to step_N. Old checkpoints are deleted only after a newer one is complete, so a failed save (a full
disk) never costs the previous checkpoint; every write of a save is inside its error handling
(`checkpoint.on_error`: warn and go on, or fail).

Integrity: COMPLETE lists every file with its size and a checksum (sha256 over the sha256 digests
of its 64 MiB blocks, so one large file is hashed by many threads). A run verifies the checkpoint
it resumes from (rank 0, before any rank loads it); one that fails, or whose manifest is
malformed, is skipped with one warning line naming the file, and the previous one is used (also
on an elastic restart).

Safety: loading never runs code. Trainer shards are tensors only; DCP reads them with
`torch.load(weights_only=True)`. Its `.metadata` file (a pickle) is read by an unpickler that
accepts only DCP's metadata classes, torch sizes and dtypes; an entry declared as bytes (which DCP
would read with `torch.load(weights_only=False)`) is refused, and so is any entry that names no
parameter or optimizer state of the model. Everything else is JSON.

Resharding: the trainer state is sharded DTensors (FSDP2 / HSDP), so DCP loads it into any other
number of trainer ranks or parallel layout. Expert-parallel experts are plain local tensors of
E/ep experts (parallel/expert_parallel.py); they are saved as DTensors over an (ep, expert-FSDP)
mesh whose global shape counts all E experts, so they reshard too (to another ep as well).

Step semantics: checkpoint N holds the trainer after N optimizer steps and the controller state
for dispatching step N next (see docs/checkpoints.md for what is and is not reproduced).
"""

from __future__ import annotations

import dataclasses
import errno
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

from meshrl.envs.base import stop_token_ids
from meshrl.models.common.lora import has_lora, is_lora_param, peft_adapter
from meshrl.runtime.rundir import check_run_dir_free, check_run_dir_fresh, log, restart_count

FORMAT = 2  # 2: every file has a checksum (format 1 had sizes only and is refused: it cannot be verified)
HASH = "sha256-of-64MiB-blocks"
"""The manifest's checksum: sha256 over the concatenated sha256 digests of a file's 64 MiB blocks."""
HASH_BLOCK = 64 * 2**20
MARKER = "COMPLETE"
TRAINER_DIR = "trainer"
TRAINER_FILE = "trainer.json"
CONTROLLER_FILE = "controller.json"
RUN_FILE = "run.json"


# ----------------------------------------------------------------------------- HF export


def export_hf(model: nn.Module, args, tokenizer, path: Path, leader: bool, base_model: str | None = None) -> Path:
    """Write the full fp32 policy to `path` as an HF folder (leader only; all trainer ranks call).

    `full_tensors` gathers each parameter (a collective over the trainer ranks); the folder
    appears atomically (written beside, renamed). A LoRA policy is written merged, and its
    adapters as a PEFT folder `path/adapter/` too (for the base model `base_model`, the run's
    model.path: docs/lora.md).
    """
    from meshrl.models.hf import save_hf_model, state_dict_adapter  # the models and the tokenizer stack
    from meshrl.parallel import full_adapters, full_tensors
    from meshrl.runtime.tokenizer import save_tokenizer

    state = {name: t.detach().to("cpu", torch.float32) for name, t in full_tensors(model)}
    peft = None
    if has_lora(model):
        adapters = {p: (a.to("cpu", torch.float32), b.to("cpu", torch.float32))
                    for p, (a, b) in full_adapters(model).items()}
        peft = peft_adapter(model, state_dict_adapter(args), adapters, base_model)
    if leader:
        with tempfile.TemporaryDirectory() as tok_dir:
            save_tokenizer(tokenizer, tok_dir)
            stop = list(stop_token_ids(tokenizer))  # generation_config.json lists every stop id
            save_hf_model(state, args, path, tokenizer_dir=tok_dir, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=stop[0] if len(stop) == 1 else stop, pad_token_id=tokenizer.pad_token_id,
                          peft_adapter=peft)
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


def _block_digest(path: Path, offset: int) -> bytes:
    """sha256 of the HASH_BLOCK bytes of `path` from `offset` (hashlib drops the GIL: threads scale)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(8 * 2**20))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = HASH_BLOCK
        while left and (n := f.readinto(buf[:min(len(buf), left)])):
            h.update(buf[:n])
            left -= n
    return h.digest()


def checksums(folder: Path, names: list[str], threads: int | None = None) -> dict[str, str]:
    """The HASH checksum of every file `names` (relative to `folder`), its blocks hashed in parallel."""
    jobs = [(name, offset) for name in names
            for offset in range(0, max((folder / name).stat().st_size, 1), HASH_BLOCK)]
    threads = threads or min(16, os.cpu_count() or 1, max(len(jobs), 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="checksum") as pool:
        digests = list(pool.map(lambda job: _block_digest(folder / job[0], job[1]), jobs))
    files: dict[str, Any] = {}
    for (name, _), digest in zip(jobs, digests):
        files.setdefault(name, hashlib.sha256()).update(digest)
    return {name: h.hexdigest() for name, h in files.items()}


def _check_structure(manifest: Any, path: Path) -> None:
    """ValueError naming what is wrong with a manifest's shape (a hand-edited or foreign COMPLETE)."""
    if not isinstance(manifest, dict):
        raise ValueError(f"{MARKER} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{MARKER} is format {manifest.get('format')!r}, not {FORMAT} (a checkpoint of format 1 "
                         "has no checksums and cannot be verified)")
    if f"step_{manifest.get('step')}" != path.name:
        raise ValueError(f"{MARKER} names step {manifest.get('step')!r}, the folder is {path.name}")
    files = manifest.get("files")
    if manifest.get("hash") != HASH or not isinstance(files, dict) or not files:
        raise ValueError(f"{MARKER} is malformed: no 'files' with {HASH} checksums")
    for rel, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"{MARKER} is malformed: the entry of {rel!r} has no size and sha256")
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{MARKER} is malformed: {rel!r} is outside the checkpoint folder")
    for key, kind in (("kind", str), ("model", dict), ("shapes", dict), ("layout", dict)):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(f"{MARKER} is malformed: no {key!r} ({kind.__name__})")
    for name in (TRAINER_FILE, f"{TRAINER_DIR}/.metadata"):
        if name not in files:
            raise ValueError(f"{MARKER} is malformed: it does not list {name}")


def read_manifest(path: Path, verify: bool = False) -> dict[str, Any]:
    """The manifest of a complete checkpoint folder; ValueError saying why it is not valid.

    Always checked: the manifest's structure and every listed file's presence and size. With
    `verify`, every file's checksum too (reads the whole checkpoint; see docs/benchmarks.md)."""
    marker = path / MARKER
    if not marker.is_file():
        raise ValueError(f"no {MARKER} marker (the save did not finish)")
    try:
        manifest = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable {MARKER} marker ({e})") from None
    _check_structure(manifest, path)
    files = manifest["files"]
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"file {rel} is missing")
        if f.stat().st_size != entry["size"]:
            raise ValueError(f"file {rel} has {f.stat().st_size} bytes, the manifest says {entry['size']}")
    if verify:
        sums = checksums(path, sorted(files))
        bad = [rel for rel in sorted(files) if sums[rel] != files[rel]["sha256"]]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ValueError(f"file {bad[0]} does not match its checksum{more}: changed after the save")
        read_dcp_metadata(path, manifest)  # a crafted one is refused here too, before any rank loads
    return manifest


def read_dcp_metadata(path: Path, manifest: dict[str, Any], expected: set[str] | None = None,
                      what: str = f"{TRAINER_DIR}/.metadata"):
    """The trainer's DCP metadata of checkpoint `path`, through the allow-listed unpickler and
    `_check_metadata` (tensors only; storage only in files the manifest lists; with `expected`,
    exactly these entries). ValueError naming the problem."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO((path / TRAINER_DIR / ".metadata").read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
        raise ValueError(f"{what} cannot be read safely: {e}") from None
    _check_metadata(metadata, expected, _trainer_files(manifest), what)
    return metadata


def _trainer_files(manifest: dict[str, Any]) -> set[str]:
    """The DCP files a manifest lists, relative to the trainer folder (as DCP's metadata names them)."""
    return {rel.removeprefix(f"{TRAINER_DIR}/") for rel in manifest["files"] if rel.startswith(f"{TRAINER_DIR}/")}


def find_checkpoint(root: Path, step: int | None = None, verify: bool = True,
                    warn: bool = True) -> tuple[int, Path, dict[str, Any]] | None:
    """The checkpoint to resume from: `step_{step}` (ValueError if it is not valid), or the newest
    valid one, skipping (with a warning, unless `warn` is off) any that is partial, corrupt or
    malformed. None if there is none. `verify`: check every file's checksum (`read_manifest`)."""
    if step is not None:
        path = step_path(root, step)
        if not path.is_dir():
            raise ValueError(f"--resume.step {step}: {path} does not exist (checkpoints: {list_steps(root) or 'none'})")
        try:
            return step, path, read_manifest(path, verify)
        except ValueError as e:
            raise ValueError(f"--resume.step {step}: {path} is not a complete checkpoint: {e}") from None
    for s in reversed(list_steps(root)):
        path = step_path(root, s)
        try:
            return s, path, read_manifest(path, verify)
        except ValueError as e:
            if warn:
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
                env: dict[str, Any] | None, restart_count: int = 0, verify: bool = True,
                warn: bool = True) -> int | None:
    """The step to resume from, or None to start fresh. ValueError (one clear line) on a misuse.

    `resume` is the config's value: False, True (latest), "auto" (latest if any) or a
    ResumeConfig (`step`, None = latest). A torchrun restart (`restart_count > 0`) means "auto",
    whatever the config says: the run continues from where the failed attempt got to.
    `verify`/`warn`: see `find_checkpoint`.
    """
    root = checkpoints_dir(run_dir)
    if restart_count > 0:
        resume = "auto"
    if resume is False:
        found = find_checkpoint(root, verify=False, warn=False)
        if found is not None:
            raise ValueError(f"{root} holds checkpoints of an earlier run (latest step_{found[0]}): pass --resume to "
                             f"continue it, --overwrite to start over, or choose another output_dir")
        return None
    step = getattr(resume, "step", None)
    found = find_checkpoint(root, step, verify, warn)
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


def check_resume(cfg, kind: str, decide: bool = False) -> int | None:
    """`resume_step` for a run config (RLConfig or SFTConfig): a pre-flight check on the launcher
    (sizes only, silent; the run directory must be free, `check_run_dir_free`, and a fresh start needs
    it empty or `overwrite`, `check_run_dir_fresh`), and with `decide` the decision on rank 0 (`decide_resume`: checksums verified, skips warned once)."""
    run_dir = Path(cfg.output_dir)
    if not decide:
        check_run_dir_free(run_dir)
        if cfg.overwrite and restart_count() == 0:  # the launcher clears it (runtime/launch.py)
            check_run_dir_fresh(run_dir, overwrite=True)
            return None
    env = cfg.env.model_dump() if hasattr(cfg, "env") else None
    start = resume_step(cfg.resume, run_dir, cfg.max_steps, kind, cfg.model.model_dump(), env,
                        restart_count(), verify=decide, warn=decide)
    if start is None and not decide and restart_count() == 0:  # a fresh start: nothing of an earlier run
        check_run_dir_fresh(run_dir, overwrite=cfg.resume == "auto")  # "auto" without a checkpoint starts over
    return start


def decide_resume(cfg, kind: str) -> int | None:
    """Rank 0 picks the checkpoint (and removes abandoned partial ones: nothing saves yet); every
    rank of the default group gets its step (None: start fresh). A collective."""
    value = None
    if dist.get_rank() == 0:
        value = check_resume(cfg, kind, decide=True)
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
    """Create `step_N.tmp/` (replacing any leftover) with the given JSON files; returns its path.
    OSError if it cannot be written (a full disk), with the partial folder removed."""
    tmp = root / f"step_{step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, value in files.items():
            write_json(tmp / name, value)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def begin_save(root: Path, step: int, files: dict[str, Any], on_error: str) -> Path | None:
    """`begin` for a save: None when the files cannot be written, reported as a failed save
    (`report_failed_save`: an ERROR line, or CheckpointError under on_error = "fail")."""
    try:
        return begin(root, step, files)
    except OSError as e:
        report_failed_save(step, root / f"step_{step}.tmp", e, on_error)
        return None


def finalize(tmp: Path, manifest: dict[str, Any], files: dict[str, Any] | None = None) -> Path:
    """Write `files` (JSON) into `tmp`, hash every file of it, write COMPLETE last (fsynced) and
    rename the folder to step_N."""
    for name, value in (files or {}).items():
        write_json(tmp / name, value)
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    sums = checksums(tmp, names)
    listing = {name: {"size": (tmp / name).stat().st_size, "sha256": sums[name]} for name in names}
    write_json(tmp / MARKER, {**manifest, "format": FORMAT, "hash": HASH, "files": listing})
    final = tmp.with_name(f"step_{manifest['step']}")
    if final.exists():  # an older save of the same step (a resumed run passing it again)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


class CheckpointError(RuntimeError):
    """A save failed and `checkpoint.on_error` is "fail": the run stops (the previous checkpoint stays)."""


def _causes(e: BaseException) -> list[BaseException]:
    """`e`, the per-rank errors a DCP CheckpointException carries, and their causes."""
    from torch.distributed.checkpoint.api import CheckpointException

    out, todo = [], [e]
    while todo:
        c = todo.pop(0)
        if c is None or any(c is seen for seen in out):
            continue
        out.append(c)
        if isinstance(c, CheckpointException):
            todo += [exc for exc, _ in c.failures.values()]
        todo += [c.__cause__, c.__context__]
    return out


_FULL_BYTES = 2**20  # less free space than this after a failed write: the disk is full


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def describe_write_error(e: BaseException, where: Path) -> str:
    """One line for a failed write: "no space left on device (PATH)" for ENOSPC, or when the
    filesystem is full after it (torch.save's zip writer reports a short write as a RuntimeError),
    else the OS error with its path, else the first error's first line."""
    causes = _causes(e)
    errors = [c for c in causes if isinstance(c, OSError)]
    for c in errors:
        if c.errno in (errno.ENOSPC, errno.EDQUOT):
            reason = "no space left on device" if c.errno == errno.ENOSPC else "disk quota exceeded"
            return f"{reason} ({c.filename or where})"
    free = _free_bytes(where)
    if free < _FULL_BYTES:
        return f"no space left on device ({where}: {free // 1024} KiB free)"
    if errors:
        return f"{errors[0].strerror or errors[0]} ({errors[0].filename or where})"
    from torch.distributed.checkpoint.api import CheckpointException

    first = next((c for c in causes if not isinstance(c, CheckpointException)), e)
    text = str(first).strip()
    return f"{type(first).__name__}: {text.splitlines()[0] if text else ''} ({where})"


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a DCP state (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    leaves = (x.to_local() if isinstance(x, DTensor) else x for x in tree_leaves(state))
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def check_room(state: dict[str, Any], tmp: Path, group: dist.ProcessGroup | None) -> None:
    """OSError ENOSPC on every rank of `group` (a collective) when one of them has less free space
    for its shards than they take plus _FULL_BYTES. A save that cannot fit then fails before writing:
    its partial files never fill the disk, so the run's other writes (metrics.jsonl, samples, logs,
    another rank's shards) keep their room."""
    need, free = state_bytes(state), _free_bytes(tmp)
    short = torch.tensor([int(free < need + _FULL_BYTES)])
    if dist.is_initialized():
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=group)  # CPU: gloo carries it
    if short.item():
        raise OSError(errno.ENOSPC, f"the save needs {need // 1024} KiB here or on another trainer rank, "
                                    f"{free // 1024} KiB free here", str(tmp))


def report_failed_save(step: int, tmp: Path, error: BaseException, on_error: str, failed: int | None = None,
                       remove: bool = False) -> None:
    """Say that the save of step_N failed and why, naming the checkpoint that stays, and remove the
    partial folder (`remove`: the rank that owns it); CheckpointError under on_error = "fail".
    `failed`: failed saves so far, this one included."""
    reason = describe_write_error(error, tmp)  # before the removal: it may look at the free space
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = [s for s in list_steps(tmp.parent) if s != step]
    message = (f"checkpoint step_{step} failed: {reason}; the previous checkpoint "
               f"({f'step_{kept[-1]}' if kept else 'none'}) is kept")
    if on_error == "fail":
        raise CheckpointError(f"{message}; stopping (checkpoint.on_error = \"fail\")") from error
    count = f"{failed} failed save(s) so far; " if failed is not None else ""
    log.error("%s (%scheckpoint.on_error = \"warn\": training goes on, the next save tries again)", message, count)


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
    """Unpickles DCP's .metadata and nothing else: only the classes DCP's metadata is made of, torch
    sizes, dtypes and layouts, and paths may be named, so a crafted file cannot run code.
    (BytesStorageMetadata may be named, so that `_check_metadata` can refuse it by name.)"""

    _ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a checkpoint may not contain")


def _flat_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    """DCP's names of the leaves of a nested state dict ("model.<param>", "optim.<param>.<state>")."""
    out = []
    for k, v in state.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


def _check_metadata(metadata, expected: set[str] | None, files: set[str] | None, what: str) -> None:
    """ValueError if DCP's metadata holds anything but tensors, entries this state has no place for,
    or storage in files outside `files` (None: not checked)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = metadata.state_dict_metadata
    objects = sorted(k for k, md in entries.items() if not isinstance(md, TensorStorageMetadata))
    if objects:
        raise ValueError(f"{what} declares {objects[:3]} as pickled objects ({type(entries[objects[0]]).__name__}), "
                         "which DCP would load with torch.load(weights_only=False); a meshrl checkpoint holds tensors "
                         "only, so it is refused")
    if expected is not None and set(entries) != expected:
        extra, missing = sorted(set(entries) - expected), sorted(expected - set(entries))
        raise ValueError(f"{what} does not match this model's state: entries with no matching parameter or "
                         f"optimizer state {extra[:5]}{' ...' if len(extra) > 5 else ''}, missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    stored = {info.relative_path for info in metadata.storage_data.values()}
    if files is not None and not stored <= files:
        raise ValueError(f"{what} points at files the manifest does not list: {sorted(stored - files)[:5]}")


def _safe_reader(path: Path, expected: set[str] | None = None, files: set[str] | None = None,
                 what: str = "the checkpoint"):
    """A DCP reader of `path` whose metadata goes through `_MetadataUnpickler` and `_check_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            _check_metadata(metadata, expected, files, what)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _tensors_only_planner():
    """DCP's load planner, except that it never unpickles a byte entry (`_check_metadata` already
    refuses them; this is the second lock on the same door)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise ValueError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; refusing to load it")

    return TensorsOnlyLoadPlanner()


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
    state, by parameter name; AdamW's param_groups (lr, betas, ...) come from the config. A LoRA
    model's view holds its adapters only (and their AdamW state): the frozen base weights are
    the ones the run builds from model.path or the seed before it loads the checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = trainer.model
    msd = get_model_state_dict(model)
    if has_lora(model):  # the frozen base is rebuilt from model.path / the seed: only adapters change
        msd = {k: v for k, v in msd.items() if is_lora_param(k)}
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
        """Write the trainer state after `step` optimizer steps into `tmp` (created by `begin`).

        Nothing is written here but DCP's shards (DCP reports a failure on any rank to every rank,
        so all ranks agree on it); trainer.json, the checksums and COMPLETE follow in `_complete`,
        every write inside the save's error handling."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        assert self.trainer.version == step, (self.trainer.version, step)
        self.wait()
        start = time.perf_counter()
        state, _, _ = trainer_state(self.trainer, self.meshes)
        counters = self.trainer.state_dict()  # as of this step: training goes on during an async save
        writer = dcp.FileSystemWriter(str(tmp / TRAINER_DIR))  # DCP creates the folder
        saved: Future = Future()
        try:
            check_room(state, tmp, self.group)
            if self.cfg.async_save:
                # the state is copied to CPU before this returns; the files are written in the background
                saved = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            else:
                saved.set_result(dcp.save(state, storage_writer=writer, process_group=self.group))
        except (OSError, CheckpointException) as e:  # a full disk: reported by _complete, as when async
            saved.set_exception(e)
        log.info("checkpoint step_%d: trainer state staged in %.3fs", step, time.perf_counter() - start)
        if self.cfg.async_save:
            self._pending = self._executor.submit(self._complete, step, tmp, saved, counters, start)
        else:  # completed (or reported) before training goes on
            self._complete(step, tmp, saved, counters, start)

    def save_with(self, step: int, root: Path, files: dict[str, Any]) -> None:
        """When every rank is a trainer (SFT): the leader creates step_N.tmp/ with `files`, then all save."""
        self.wait()  # the group is free again: nothing runs in the background now
        ok = True
        if self.leader:
            ok = begin_save(root, step, files, self.cfg.on_error) is not None
            self.failed += not ok
        if agree(1 if ok else None, self.group) is not None:
            self.save(step, root / f"step_{step}.tmp")

    def _complete(self, step: int, tmp: Path, saved: Future, counters: dict[str, Any], start: float) -> bool:
        """Wait for DCP's writes, then (leader) trainer.json, checksums, COMPLETE, rename, prune.
        A failure anywhere is `report_failed_save`'s (the partial folder is removed)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            saved.result()
            if self.leader:
                if self._shapes is None:
                    self._shapes = global_shapes(self.trainer.model)
                manifest = {**self.manifest, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "shapes": self._shapes}
                final = finalize(tmp, manifest, {TRAINER_FILE: counters})
        except (OSError, CheckpointException) as e:
            # The previous checkpoint is untouched; the run goes on (or stops: on_error) without this one.
            self.failed += 1
            report_failed_save(step, tmp, e, self.cfg.on_error, self.failed, remove=self.leader)
            return False
        if self.leader:
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
        """Load `path`'s trainer state into the trainer, resharding to this layout (all trainer ranks).

        ValueError, before anything is read, if the checkpoint's metadata declares an entry that is
        not a tensor (DCP would unpickle it), an entry with no matching parameter or optimizer state,
        or a storage file the manifest does not list (so every byte read was verified)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        start = time.perf_counter()
        check_shapes(self.trainer.model, manifest)
        state, msd, osd = trainer_state(self.trainer, self.meshes)
        expected = set(_flat_keys(state))
        # the checks, on every rank, before DCP's collectives
        read_dcp_metadata(path, manifest, expected, f"checkpoint {path.name}: {TRAINER_DIR}/.metadata")
        reader = _safe_reader(path / TRAINER_DIR, expected, _trainer_files(manifest), f"checkpoint {path.name}")
        dcp.load(state, storage_reader=reader, planner=_tensors_only_planner(), process_group=self.group)
        strict = not has_lora(self.trainer.model)  # a LoRA view holds the adapters only
        set_model_state_dict(self.trainer.model, msd, options=StateDictOptions(strict=strict))
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
