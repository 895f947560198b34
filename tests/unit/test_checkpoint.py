"""Checkpoints: sharded save/load across layouts (real gloo processes), atomicity, fallback over
partial, corrupt (checksums) or malformed checkpoints, resume decisions, safe loading (the
BytesStorageMetadata exploit), a full disk (a real tmpfs where one can be mounted), non-finite
steps, metrics truncation on resume, the heartbeat and the W&B sink (a fake module and offline W&B)."""

import errno
import io
import json
import logging
import pickle
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshrl.runtime import checkpoint as ckpt
from meshrl.runtime.config import CheckpointConfig, ResumeConfig, WandbConfig
from meshrl.runtime.train.packing import count_loss_tokens, pack
from meshrl.runtime.rundir import Heartbeat, MetricsWriter
from meshrl.runtime.train.trainer import Trainer
from tests.dist.multirank import run_ranks
from tests.dist.test_parallel_trainer import LOSS, OPTIM, SEQ_LEN, make_model, make_samples

MODEL = {"path": None, "flavor": "debug", "family": "qwen3", "tokenizer": "char", "init_seed": 0, "dtype": "auto",
         "impl": "auto"}


@pytest.fixture(autouse=True)
def _meshrl_logs_propagate():
    # setup_logging (run by other tests in this process) turns propagation off; caplog needs it
    logger = logging.getLogger("meshrl")
    old = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = old


# ----------------------------------------------------------------------------- sharded state


def _full_state(trainer, meshes) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor, unsharded (a collective)."""
    from torch.distributed.tensor import DTensor

    from meshrl.parallel import full_tensors

    view, _, _ = ckpt.trainer_state(trainer, meshes)
    out = {}
    for k, v in view["model"].items():
        out["model." + k] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    for k, state in view["optim"].items():
        for s, v in state.items():
            out[f"optim.{k}.{s}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    # the expert view's global tensors are the experts gathered over ep
    for name, t in full_tensors(trainer.model):
        assert torch.equal(out["model." + name], t), name
    return out


def _reshard_job(rank, world, family, degrees, mode, root):
    from meshrl.parallel import parallelize
    from meshrl.parallel.dims import ParallelDims, build_meshes

    root = Path(root)
    dims = ParallelDims.resolve(world, **degrees)
    meshes = build_meshes(dims, list(range(world)), rank, "cpu")
    model = parallelize(make_model(family), meshes, torch.float32)
    trainer = Trainer(model, OPTIM, torch.device("cpu"), dist.group.WORLD, meshes)
    group = dist.new_group(backend="gloo")
    saver = ckpt.TrainerCheckpointer(trainer, meshes, group, rank == 0, CheckpointConfig(),
                                     {"kind": "rl", "model": MODEL, "layout": ckpt.layout_info(dims, world)})
    if mode == "save":
        batches = pack(make_samples(), SEQ_LEN, dims.num_data_ranks)
        trainer.rl_step(batches[dims.data_rank(rank)], count_loss_tokens(batches), LOSS, temperature=0.7)
        if rank == 0:
            ckpt.begin(root, 1, {})
        dist.barrier()
        saver.save(1, root / "step_1.tmp")  # asynchronous: a CPU copy is written in the background
        with torch.no_grad():  # training goes on meanwhile; the checkpoint keeps the staged values
            for p in model.parameters():
                p.add_(1.0)
            for p in model.parameters():
                p.sub_(1.0)
        saver.close()
        full = _full_state(trainer, meshes)
        if rank == 0:
            torch.save(full, root / "reference.pt")
    else:
        step, path, manifest = ckpt.find_checkpoint(root)
        saver.load(path, manifest)
        full = _full_state(trainer, meshes)
        ref = torch.load(root / "reference.pt")
        assert full.keys() == ref.keys(), set(full) ^ set(ref)
        for k in ref:
            # +1 then -1 above may round a parameter; the staged copy must not see it
            torch.testing.assert_close(full[k], ref[k], rtol=0, atol=1e-6, msg=k)
        assert trainer.version == step == 1


@pytest.mark.parametrize("family, save, loads", [
    ("qwen3", (2, {}), [(3, {})]),
    pytest.param("qwen3_moe", (2, {"ep": 2}), [(1, {})], marks=pytest.mark.heavy),  # heavy: ~15 s on 2 cores
], ids=["dense-fsdp2-to-3-ranks", "moe-ep2-to-1-rank"])
def test_trainer_state_reshards_to_another_layout(tmp_path, family, save, loads):
    run_ranks(_reshard_job, save[0], family, save[1], "save", str(tmp_path))
    manifest = json.loads((tmp_path / "step_1" / ckpt.MARKER).read_text())
    assert manifest["layout"]["num_trainer_ranks"] == save[0] and ".metadata" in " ".join(manifest["files"])
    assert len(list((tmp_path / "step_1" / "trainer").glob("*.distcp"))) == save[0]  # one shard file per rank
    for world, degrees in loads:
        run_ranks(_reshard_job, world, family, degrees, "load", str(tmp_path))


# ----------------------------------------------------------------------------- single-process trainer


def _trainer():
    return Trainer(make_model(), OPTIM, torch.device("cpu"), group=None)


def _step(trainer, advantage_scale=1.0):
    batches = pack(make_samples(), SEQ_LEN, 1)
    for mb in batches[0]:
        mb["advantages"] = mb["advantages"] * advantage_scale
    return trainer.rl_step(batches[0], count_loss_tokens(batches), LOSS, temperature=0.7)


def _save(trainer, root: Path, step: int, cfg: CheckpointConfig | None = None) -> ckpt.TrainerCheckpointer:
    saver = ckpt.TrainerCheckpointer(trainer, None, None, True, cfg or CheckpointConfig(async_save=False),
                                     {"kind": "rl", "model": MODEL, "env": None,
                                      "layout": {"num_trainer_ranks": 1, "parallel": {}}})
    tmp = ckpt.begin(root, step, {ckpt.CONTROLLER_FILE: {"step": step}})
    trainer.version = step  # a checkpoint of step N holds the trainer after N optimizer steps
    saver.save(step, tmp)
    saver.wait()
    return saver


def test_resumed_trainer_takes_the_same_next_step(tmp_path):
    a = _trainer()
    _step(a)
    _save(a, tmp_path, 1)
    b = _trainer()
    step, path, manifest = ckpt.find_checkpoint(tmp_path)
    ckpt.TrainerCheckpointer(b, None, None, True, CheckpointConfig(), {}).load(path, manifest)
    sa, sb = _step(a), _step(b)
    assert sa["loss"] == sb["loss"] and sa["grad_norm"] == sb["grad_norm"]
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert b.version == 2


def test_schedule_position_and_a_changed_lr_apply_on_resume():
    t = Trainer(make_model(), OPTIM.model_copy(update={"warmup_steps": 4}), torch.device("cpu"), group=None)
    t.load_state_dict({"version": 2, "nonfinite_steps": 1})
    assert t.scheduler.get_last_lr()[0] == pytest.approx(OPTIM.lr * 3 / 4)  # warm-up continues at step 2
    t2 = Trainer(make_model(), OPTIM.model_copy(update={"lr": 5e-3}), torch.device("cpu"), group=None)
    t2.load_state_dict({"version": 7})
    assert t2.optimizer.param_groups[0]["lr"] == 5e-3 and t2.nonfinite_steps == 0


def test_nonfinite_gradients_skip_the_step_and_are_counted(caplog):
    t = _trainer()
    before = {k: v.detach().clone() for k, v in t.model.named_parameters()}
    schedule = t.scheduler.last_epoch
    with caplog.at_level(logging.WARNING, logger="meshrl"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" from PyTorch
        stats = _step(t, advantage_scale=float("nan"))
    assert not all(map(lambda x: x == x, [stats["grad_norm"]]))  # NaN
    assert stats["nonfinite_steps"] == 1 and t.nonfinite_steps == 1 and t.version == 1
    assert t.scheduler.last_epoch == schedule  # the skipped step did not advance the learning-rate schedule
    for k, v in t.model.named_parameters():
        assert torch.equal(v, before[k]), k  # weights untouched
    assert "update skipped" in caplog.text
    stats = _step(t)  # the next finite step trains normally
    assert stats["nonfinite_steps"] == 1 and t.version == 2
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())


# ----------------------------------------------------------------------------- atomicity, fallback


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path, caplog):
    t = _trainer()
    for step in (1, 2, 3, 4, 5, 6):
        _save(t, tmp_path, step, CheckpointConfig(async_save=False, keep_last=9))
    (tmp_path / "step_7.tmp").mkdir()  # a save that never finished is invisible
    (tmp_path / "step_6" / ckpt.MARKER).unlink()  # a marker that was never written
    manifest = json.loads((tmp_path / "step_5" / ckpt.MARKER).read_text())
    del manifest["files"]
    (tmp_path / "step_5" / ckpt.MARKER).write_text(json.dumps(manifest))  # a malformed manifest
    trainer_json = tmp_path / "step_4" / ckpt.TRAINER_FILE
    trainer_json.write_bytes(b"x" * trainer_json.stat().st_size)  # garbage of the same length
    shard = next((tmp_path / "step_3" / "trainer").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])  # 4 KiB flipped, the size unchanged
    shard.write_bytes(bytes(data))
    shard = next((tmp_path / "step_2" / "trainer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        step, path, _ = ckpt.find_checkpoint(tmp_path)
    assert step == 1 and path == tmp_path / "step_1"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5 and all("\n" not in w for w in warnings)  # one line per skipped checkpoint
    assert "step_6: no COMPLETE marker" in caplog.text
    assert "step_5: COMPLETE is malformed: no 'files'" in caplog.text
    assert "step_4: file trainer.json does not match its checksum" in caplog.text
    assert "step_3: file trainer/__0_0.distcp does not match its checksum" in caplog.text
    assert "step_2: file trainer/__0_0.distcp has 100 bytes" in caplog.text
    # sizes alone (the launcher's quick look) miss same-size damage; rank 0 verifies checksums
    assert ckpt.find_checkpoint(tmp_path, verify=False, warn=False)[0] == 4
    with pytest.raises(ValueError, match="--resume.step 3: .* is not a complete checkpoint: file trainer/__0_0"):
        ckpt.find_checkpoint(tmp_path, 3)
    for broken in ([], {"format": 2, "step": 1, "hash": ckpt.HASH, "files": {"a": 3}}, {"format": 1, "step": 1}):
        (tmp_path / "step_1" / ckpt.MARKER).write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="COMPLETE is"):
            ckpt.read_manifest(tmp_path / "step_1")
    assert ckpt.find_checkpoint(tmp_path) is None  # nothing valid left: start fresh, not a traceback
    ckpt.clean_partial(tmp_path)
    assert not (tmp_path / "step_7.tmp").exists()


def test_checksums_hash_blocks_in_parallel_and_match_a_plain_sha256_of_the_blocks(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setattr(ckpt, "HASH_BLOCK", 1000)
    data = bytes(range(256)) * 10  # 2560 bytes: blocks of 1000, 1000, 560
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    want = hashlib.sha256(b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in (0, 1000, 2000))).hexdigest()
    sums = ckpt.checksums(tmp_path, ["f", "empty"], threads=3)
    assert sums["f"] == want and sums["empty"] == hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    import torch.distributed.checkpoint as dcp

    t = _trainer()
    _save(t, tmp_path, 1, CheckpointConfig(async_save=False, keep_last=1))
    _step(t)
    real_write_json = ckpt.write_json
    for where in ("shards", "trainer.json"):
        with monkeypatch.context() as m:
            if where == "shards":
                m.setattr(dcp.FileSystemWriter, "write_data", _no_space)
            else:  # the write that used to escape the save's error handling
                m.setattr(ckpt, "write_json", lambda path, value: _no_space() if path.name == ckpt.TRAINER_FILE
                          else real_write_json(path, value))
            for async_save in (True, False):
                caplog.clear()
                with caplog.at_level(logging.ERROR, logger="meshrl"):
                    saver = _save(t, tmp_path, 2, CheckpointConfig(async_save=async_save, keep_last=1))
                assert saver.failed == 1, (where, async_save)
                assert "checkpoint step_2 failed: no space left on device" in caplog.text, caplog.text
                assert "the previous checkpoint (step_1) is kept" in caplog.text
                assert ckpt.list_steps(tmp_path) == [1] and not (tmp_path / "step_2.tmp").exists()
                assert ckpt.find_checkpoint(tmp_path)[0] == 1  # still complete and valid
            # checkpoint.on_error = "fail": the run stops, the previous checkpoint stays
            with pytest.raises(ckpt.CheckpointError, match="no space left on device .*step_2.tmp.*step_1.*kept"):
                _save(t, tmp_path, 2, CheckpointConfig(async_save=False, on_error="fail"))
            assert ckpt.find_checkpoint(tmp_path)[0] == 1
    # the controller's part of a save
    with monkeypatch.context() as m:
        m.setattr(ckpt, "write_json", _no_space)
        assert ckpt.begin_save(tmp_path, 2, {ckpt.CONTROLLER_FILE: {}}, "warn") is None
        assert not (tmp_path / "step_2.tmp").exists()
        with pytest.raises(ckpt.CheckpointError, match="no space left on device"):
            ckpt.begin_save(tmp_path, 2, {ckpt.CONTROLLER_FILE: {}}, "fail")


def _recording(write_data, calls: list):
    def record(self, *args, **kwargs):
        calls.append(1)
        return write_data(self, *args, **kwargs)
    return record


def test_a_real_full_disk_is_named_and_keeps_the_previous_checkpoint(tmp_path, caplog, monkeypatch):
    """On a small tmpfs (skipped where none can be mounted): the save that cannot fit fails before it
    writes anything (check_room), so the disk keeps its free space. Without that check (the disk
    filled by another process meanwhile), torch.save's zip writer reports the short write as a
    RuntimeError, not ENOSPC; the message still says what happened."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        t = _trainer()
        _save(t, disk, 1, CheckpointConfig(async_save=False))
        (disk / "filler").write_bytes(b"\0" * (ckpt._free_bytes(disk) - 64 * 1024))
        free = ckpt._free_bytes(disk)
        for checked, async_save in ((True, True), (True, False), (False, True), (False, False)):
            if not checked:
                monkeypatch.setattr(ckpt, "check_room", lambda *args: None)
            writes = []
            monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data",
                                _recording(torch.distributed.checkpoint.FileSystemWriter.write_data, writes))
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="meshrl"):
                saver = _save(t, disk, 2, CheckpointConfig(async_save=async_save))
            assert saver.failed == 1 and "checkpoint step_2 failed: no space left on device" in caplog.text
            assert str(disk / "step_2.tmp") in caplog.text
            assert ckpt.find_checkpoint(disk)[0] == 1 and not (disk / "step_2.tmp").exists()
            assert bool(writes) != checked, (checked, writes)  # checked: failed before writing a shard
            assert ckpt._free_bytes(disk) == free
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_prune_keeps_the_last_k_and_every_mth(tmp_path):
    for s in range(1, 11):
        (tmp_path / f"step_{s}").mkdir()
    assert ckpt.prune(tmp_path, keep_last=2, keep_every=4) == [1, 2, 3, 5, 6, 7]
    assert ckpt.list_steps(tmp_path) == [4, 8, 9, 10]
    # resuming from step_8 abandons step_9 and step_10: a restart must not jump back to them
    assert ckpt.supersede_later(tmp_path, 8) == [9, 10]
    assert ckpt.list_steps(tmp_path) == [4, 8] and (tmp_path / "step_10.superseded").is_dir()
    ckpt.prune(tmp_path, keep_last=2, keep_every=0)
    assert not list(tmp_path.glob("*.superseded"))


class _Payload:
    """What the crafted checkpoint of issue 13 unpickled: it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"echo pwned > {self.marker}",))


def plant_exploit(step_dir: Path, marker: Path, name: str = "model.tok_embeddings.weight") -> None:
    """Declare `name` in step_dir's DCP metadata as bytes (BytesStorageMetadata) stored in a
    torch.save blob whose unpickling runs a command, and rewrite the manifest's checksums, as an
    attacker who can write the folder would. Only DCP classes are named in the metadata."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_path = step_dir / ckpt.TRAINER_DIR / ".metadata"
    md = pickle.loads(meta_path.read_bytes())
    md.state_dict_metadata[name] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != name}
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    (step_dir / ckpt.TRAINER_DIR / "payload.distcp").write_bytes(blob.getvalue())
    md.storage_data[MetadataIndex(name)] = _StorageInfo("payload.distcp", 0, len(blob.getvalue()))
    meta_path.write_bytes(pickle.dumps(md))
    manifest = json.loads((step_dir / ckpt.MARKER).read_text())
    names = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != ckpt.MARKER)
    sums = ckpt.checksums(step_dir, names)
    manifest["files"] = {n: {"size": (step_dir / n).stat().st_size, "sha256": sums[n]} for n in names}
    (step_dir / ckpt.MARKER).write_text(json.dumps(manifest))


def test_metadata_is_loaded_without_arbitrary_pickle(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        ckpt._MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    # only the classes DCP's metadata is made of: not every class of DCP's modules
    from torch.distributed.checkpoint import FileSystemWriter

    with pytest.raises(pickle.UnpicklingError, match="FileSystemWriter"):
        ckpt._MetadataUnpickler(io.BytesIO(pickle.dumps(FileSystemWriter))).load()
    # a real DCP metadata file passes
    t = _trainer()
    _save(t, tmp_path, 1)
    reader = ckpt._safe_reader(tmp_path / "step_1" / "trainer")
    assert "model.tok_embeddings.weight" in reader.read_metadata().state_dict_metadata


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    """The exploit of issue 13: with DCP's own reader and planner the payload runs (and the
    parameter is silently left as it was); ours refuses the checkpoint before reading a byte, both
    when rank 0 picks the checkpoint to resume from (it is skipped) and when a trainer loads it."""
    import torch.distributed.checkpoint as dcp

    t = _trainer()
    _step(t)
    _save(t, tmp_path, 1)
    marker = tmp_path / "PWNED"
    plant_exploit(tmp_path / "step_1", marker)
    path = tmp_path / "step_1"
    manifest = ckpt.read_manifest(path)
    # rank 0 skips it when it picks the checkpoint to resume from (the checksums match: rewritten)
    with pytest.raises(ValueError, match=r"trainer/.metadata declares \['model.tok_embeddings.weight'\] as "
                                         r"pickled objects \(BytesStorageMetadata\)"):
        ckpt.read_manifest(path, verify=True)
    assert ckpt.find_checkpoint(tmp_path) is None and not marker.exists()
    # the exploit is real: DCP's default reader runs the payload
    state, _, _ = ckpt.trainer_state(_trainer())
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / "trainer")))
    assert marker.read_text().strip() == "pwned"
    marker.unlink()
    b = _trainer()
    with pytest.raises(ValueError, match=r"checkpoint step_1: trainer/.metadata declares "
                                         r"\['model.tok_embeddings.weight'\] as pickled objects"):
        ckpt.TrainerCheckpointer(b, None, None, True, CheckpointConfig(), {}).load(path, manifest)
    assert not marker.exists()
    # the second lock: the planner refuses byte entries even if a reader let one through
    with pytest.raises(ValueError, match="pickled object"):
        ckpt._tensors_only_planner().load_bytes(types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="x")),
                                                io.BytesIO())


def test_checkpoint_entries_must_match_the_models_state(tmp_path):
    """An entry with no matching parameter (or a missing one) is an error, not a silent skip."""
    t = _trainer()
    _save(t, tmp_path, 1)
    state, _, _ = ckpt.trainer_state(_trainer())
    keys = set(ckpt._flat_keys(state))
    md = ckpt._safe_reader(tmp_path / "step_1" / "trainer").read_metadata()
    assert set(md.state_dict_metadata) == keys  # DCP's names of our state
    with pytest.raises(ValueError, match=r"no matching parameter or optimizer state \['model.extra'\]"):
        ckpt._check_metadata(_with_extra(md, "model.extra"), keys, None, "checkpoint step_1")
    with pytest.raises(ValueError, match=r"missing \['model.new'\]"):
        ckpt._check_metadata(md, keys | {"model.new"}, None, "checkpoint step_1")
    with pytest.raises(ValueError, match="points at files the manifest does not list"):
        ckpt._check_metadata(md, keys, {"other.distcp"}, "checkpoint step_1")
    ckpt._check_metadata(md, keys, {"__0_0.distcp"}, "checkpoint step_1")


def _with_extra(md, name):
    import copy

    md = copy.deepcopy(md)
    md.state_dict_metadata[name] = next(iter(md.state_dict_metadata.values()))
    return md


# ----------------------------------------------------------------------------- resume decisions


def _manifest_dir(root: Path, step: int, **overrides) -> None:
    tmp = ckpt.begin(root, step, {"controller.json": {}, ckpt.TRAINER_FILE: {}})
    (tmp / ckpt.TRAINER_DIR).mkdir()
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp / ckpt.TRAINER_DIR / ".metadata").write_bytes(pickle.dumps(Metadata({}, storage_data={})))
    ckpt.finalize(tmp, {"kind": "rl", "step": step, "model": MODEL, "env": None, "shapes": {}, "layout": {},
                        **overrides})


def _resume(run_dir, resume, max_steps=10, model=MODEL, kind="rl", restart=0):
    return ckpt.resume_step(resume, run_dir, max_steps, kind, model, None, restart)


def test_resume_decisions(tmp_path):
    root = tmp_path / "checkpoints"
    assert _resume(tmp_path, False) is None
    assert _resume(tmp_path, "auto") is None
    with pytest.raises(ValueError, match="has no complete checkpoint"):
        _resume(tmp_path, True)
    _manifest_dir(root, 4)
    _manifest_dir(root, 6)
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run .*step_6.*--resume"):
        _resume(tmp_path, False)
    assert _resume(tmp_path, False, restart=1) == 6  # a torchrun restart resumes by itself
    assert _resume(tmp_path, True) == 6 and _resume(tmp_path, "auto") == 6
    assert _resume(tmp_path, ResumeConfig(step=4)) == 4
    with pytest.raises(ValueError, match="--resume.step 5: .* does not exist"):
        _resume(tmp_path, ResumeConfig(step=5))
    with pytest.raises(ValueError, match="already reached max_steps"):
        _resume(tmp_path, True, max_steps=6)
    assert _resume(tmp_path, "auto", max_steps=6) == 6  # a restart after the last step only exports
    assert _resume(tmp_path, ResumeConfig(step=4), max_steps=6, restart=2) == 6  # restarts take the latest


def test_an_incompatible_config_is_a_clear_error(tmp_path):
    _manifest_dir(tmp_path / "checkpoints", 2)
    with pytest.raises(ValueError, match=r"another model \(model.flavor: 'debug' in the checkpoint, 'tiny' now\)"):
        _resume(tmp_path, True, model={**MODEL, "flavor": "tiny"})
    with pytest.raises(ValueError, match="from a `meshrl rl` run, not `meshrl sft`"):
        _resume(tmp_path, True, kind="sft")
    # lr, layout and the like may change; a moved model folder too (shapes are checked at load)
    t = _trainer()
    manifest = {"step": 2, "shapes": ckpt.global_shapes(t.model)}
    ckpt.check_shapes(t.model, manifest)
    manifest["shapes"]["tok_embeddings.weight"] = [100, 64]
    with pytest.raises(ValueError, match=r"tok_embeddings.weight: \[100, 64\] in the checkpoint, \[128, 64\] now"):
        ckpt.check_shapes(t.model, manifest)


def test_bare_resume_flag_means_latest():
    from meshrl.runtime.launch import expand_flags

    assert expand_flags(["@", "a.toml", "--resume"]) == ["@", "a.toml", "--resume", "true"]
    assert expand_flags(["--resume", "--max-steps", "3"]) == ["--resume", "true", "--max-steps", "3"]
    assert expand_flags(["--resume.step", "4"]) == ["--resume.step", "4"]
    assert expand_flags(["--resume", "auto"]) == ["--resume", "auto"]


# ----------------------------------------------------------------------------- metrics, heartbeat, W&B


def test_metrics_keep_each_step_once_across_a_resume(tmp_path):
    w = MetricsWriter(tmp_path)
    for s in range(7):
        w.write({"step": s, "loss": float(s)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # killed while writing
    resumed = MetricsWriter(tmp_path, start_step=4)
    assert resumed.steps_lost == 3
    resumed.write({"step": 4, "loss": 40.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["loss"] == 40.0
    assert MetricsWriter(tmp_path).path.read_text() == ""  # a fresh run starts empty


def test_heartbeat_names_the_phase_a_rank_is_stuck_in(caplog):
    with caplog.at_level(logging.INFO, logger="meshrl"):
        beat = Heartbeat(0.2)
        beat.set("weight sync v3")
        time.sleep(0.5)
        beat.close()
    assert "heartbeat: in weight sync v3 for 0s" in caplog.text


class _FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_sink_keeps_one_run_per_run_dir(tmp_path, monkeypatch):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    from meshrl.runtime.wandb_logger import make_sinks

    cfg = WandbConfig(enabled=True, project="p", tags=["t"])
    assert make_sinks(WandbConfig(), tmp_path, {}, False) == []
    w = MetricsWriter(tmp_path, sinks=make_sinks(cfg, tmp_path, {"lr": 1}, resuming=False))
    w.write({"step": 0, "loss": 1.5, "reward/mean": float("nan"), "note": "x"})
    w.close()
    run = runs[0]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert run.kwargs["mode"] == "offline" and run.kwargs["id"] == run_id and run.kwargs["resume"] == "allow"
    assert run.kwargs["name"] == tmp_path.name and run.finished
    assert run.logged == [(0, {"loss": 1.5})]  # non-finite and non-numeric values are not sent
    make_sinks(cfg, tmp_path, {}, resuming=True)
    assert runs[1].kwargs["id"] == run_id  # a resumed job continues the same W&B run
    monkeypatch.setenv("WANDB_API_KEY", "k")
    make_sinks(cfg, tmp_path, {}, resuming=False)
    assert runs[2].kwargs["mode"] == "online" and runs[2].kwargs["id"] != run_id


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from meshrl.runtime.wandb_logger import make_sinks

    w = MetricsWriter(tmp_path, sinks=make_sinks(WandbConfig(enabled=True), tmp_path, {"x": 1}, resuming=False))
    for s in range(3):
        w.write({"step": s, "loss": 1.0 / (s + 1)})
    w.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))


# ----------------------------------------------------------------------------- GPU


def _cuda_job(rank, world, mode, root):
    from meshrl.parallel import parallelize
    from meshrl.parallel.dims import ParallelDims, build_meshes

    root, device = Path(root), torch.device("cuda", rank)
    dims = ParallelDims.resolve(world)
    meshes = build_meshes(dims, list(range(world)), rank, "cuda")
    model = parallelize(make_model().to(device), meshes, torch.bfloat16)
    trainer = Trainer(model, OPTIM, device, dist.group.WORLD, meshes, compute_dtype=torch.bfloat16)
    group = dist.new_group(backend="gloo")
    saver = ckpt.TrainerCheckpointer(trainer, meshes, group, rank == 0, CheckpointConfig(),
                                     {"kind": "rl", "model": MODEL, "layout": ckpt.layout_info(dims, world)})
    if mode == "save":
        batches = pack(make_samples(), SEQ_LEN, dims.num_data_ranks)
        trainer.rl_step(batches[dims.data_rank(rank)], count_loss_tokens(batches), LOSS, temperature=0.7)
        if rank == 0:
            ckpt.begin(root, 1, {})
        dist.barrier()
        saver.save(1, root / "step_1.tmp")
        saver.close()
    else:
        saver.load(*ckpt.find_checkpoint(root)[1:])
    full = {k: v.cpu() for k, v in _full_state(trainer, meshes).items()}
    if rank == 0:
        torch.save(full, root / f"{mode}.pt")


@pytest.mark.gpu
def test_cuda_trainer_state_saves_asynchronously_and_reshards(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = min(2, torch.cuda.device_count())
    run_ranks(_cuda_job, world, "save", str(tmp_path), backend="cpu:gloo,cuda:nccl")
    run_ranks(_cuda_job, 1, "load", str(tmp_path), backend="cpu:gloo,cuda:nccl")
    saved, loaded = torch.load(tmp_path / "save.pt"), torch.load(tmp_path / "load.pt")
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_a_restart_archives_earlier_error_files(tmp_path, monkeypatch):
    """A restarted rank renames its earlier attempt's error file, so the launcher's report names
    only errors of the last attempt; a first attempt leaves it alone."""
    from meshrl.runtime.launch import archive_error

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "error-rank2.txt").write_text("rank 2 (inference)\nTraceback ...")
    archive_error(tmp_path, 2)  # attempt 0: nothing to archive
    assert (logs / "error-rank2.txt").is_file()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    archive_error(tmp_path, 2)
    assert not (logs / "error-rank2.txt").exists() and (logs / "restart0-error-rank2.txt").is_file()
    (logs / "error-rank2.txt").write_text("rank 2 (inference) in restart 1\nTraceback ...")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    archive_error(tmp_path, 2)
    assert (logs / "restart1-error-rank2.txt").is_file() and (logs / "restart0-error-rank2.txt").is_file()
