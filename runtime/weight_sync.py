"""Trainer -> inference weight broadcast in flat buckets.

After every optimizer step the trainer ranks gather each parameter's full tensor (a
collective over the trainer mesh), trainer rank 0 packs them into flat buckets of about
`bucket_mb` MiB in the inference dtype, and broadcasts each bucket on the sync group
(trainer rank 0 + every inference rank; NCCL on GPU, gloo on CPU). Each inference rank
receives the same buckets and copies the slices into its engine's parameters in place,
between two decode steps, so requests in flight keep their KV cache and go on.

Both sides derive the same bucket plan from the parameter names and shapes of the same
model definition, so nothing but the flat buffers crosses the wire.

LoRA (models/common/lora.py): the trainer sends merged weights W + (B @ A) * alpha / r under the
base weights' names (`full_tensors` merges after the gather, on every trainer rank alike), so the
engines hold a plain model of the base architecture and both layouts work unchanged.

Tensor-parallel inference ranks (parallel/tensor_parallel.py) receive the same full buckets and
copy only their slice of each sharded parameter: the plan is made of full shapes on both sides
(`tensor_parallel.full_shape`), and `tensor_parallel.local_slice` picks the rank's rows or
columns out of the received tensor. The trainer does not know how the engines are split.

Colocated layout (layout.colocate): trainer rank k and engine k share one device, and NCCL
refuses two ranks of one communicator on one device, so nothing is broadcast. Trainer k keeps
one flat buffer of the whole model in the inference dtype that both processes map
(`SharedBuffer`: CUDA IPC on a GPU, a shared memory file on the CPU):

    trainer k:  wait "v-1 copied" -> write every full tensor into the buffer -> sync the device
                -> "v written"                                    (`ColocatedSender.send`)
    engine k:   on LOAD_WEIGHTS v, between two engine steps: wait "v written" -> one copy of the
                buffer into its parameters (laid out as views of one flat tensor in the same
                order) -> "v copied"                              (`ColocatedReceiver.receive`)

FP8 engines (inference.quantization = "fp8", models/common/fp8.py): the trainer still sends bf16;
each receiver quantises the tensors of the engine's e4m3 linears on its own side, in place, as it
copies (split: from each received bucket; colocated: straight from the shared buffer, so the engine
keeps no bf16 copy), between two engine steps like any other copy.

The buffer is never rewritten before the engine has copied the last version, and the engine
never copies before the version is whole, so it never sees a half-written version; tokens record
exact versions as in the split layout. A vLLM engine keeps its weights in its worker process:
its rank hands the views of the buffer to `VLLMEngine.load_weights` (one device copy into the
worker's parameters, runtime/engine/vllm_engine.py) instead of copying into its own. The signals are int64 tensors on two gloo pair groups
(one per direction); the buffer's handle travels once, in a STAGING message (runtime/protocol.py).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import math
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrl.models.common import packed_projections
from meshrl.models.common.fp8 import quantized_params
from meshrl.models.common.lora import policy_parameters
from meshrl.parallel import full_tensors
from meshrl.parallel.tensor_parallel import full_shape, local_slice
from meshrl.runtime import protocol, transport
from meshrl.runtime.protocol import Kind


def bucket_plan(shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, bucket_mb: float) -> list[list[int]]:
    """Group parameter indices into consecutive buckets of at most ~bucket_mb MiB (one big tensor may exceed it)."""
    limit = bucket_mb * 2**20
    plan: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, shape) in enumerate(shapes):
        nbytes = math.prod(shape) * itemsize
        if current and size + nbytes > limit:
            plan.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        plan.append(current)
    return plan


def _shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    # full shapes, so the trainer's sharded (FSDP / expert-parallel) model and a tensor-parallel
    # engine's model give the same plan; a LoRA trainer's adapters are merged into the base
    # weights by `full_tensors` and take no place of their own (models/common/lora.py)
    return [(name, full_shape(model, name, p)) for name, p in policy_parameters(model)]


@torch.no_grad()
def send_weights(model: nn.Module, group: dist.ProcessGroup | None, src: int, dtype: torch.dtype,
                 bucket_mb: float, device: torch.device) -> int:
    """Trainer side. Every trainer rank calls it (full-tensor gathers); only `src` broadcasts.

    `group` is the sync group on trainer rank 0 and None on the other trainer ranks.
    Returns the number of bytes broadcast.
    """
    shapes = _shapes(model)
    plan = bucket_plan(shapes, dtype.itemsize, bucket_mb)
    tensors = full_tensors(model)
    sent = 0
    for bucket in plan:
        numel = sum(math.prod(shapes[i][1]) for i in bucket)
        # cast straight into the bucket: no per-parameter temporary, no concatenation
        flat = torch.empty(numel, dtype=dtype, device=device) if group is not None else None
        offset = 0
        for _ in bucket:
            t = next(tensors)[1]
            if flat is not None:
                flat[offset:offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
        if flat is None:
            continue
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    assert next(tensors, None) is None, "bucket plan does not cover every parameter"
    return sent


@torch.no_grad()
def receive_weights(model: nn.Module, group: dist.ProcessGroup, src: int, dtype: torch.dtype,
                    bucket_mb: float, device: torch.device) -> None:
    """Inference side: receive every bucket and copy it into `model`'s parameters in place
    (a tensor-parallel model's sharded parameters take only their slice of the full tensor; an
    FP8 engine's e4m3 weights are quantised from the received tensor, models/common/fp8.py)."""
    shapes = _shapes(model)
    params = [p for _, p in model.named_parameters()]
    quantized = quantized_params(model)
    for bucket in bucket_plan(shapes, dtype.itemsize, bucket_mb):
        numel = sum(math.prod(shapes[i][1]) for i in bucket)
        flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in bucket:
            name, shape = shapes[i]
            size = math.prod(shape)
            tensor = local_slice(model, name, flat[offset:offset + size].view(shape))
            if i in quantized:
                quantized[i].load_weight(tensor)
            else:
                params[i].copy_(tensor)
            offset += size


# ----------------------------------------------------------------------------- colocated layout


def flat_plan(model: nn.Module) -> tuple[list[tuple[int, tuple[int, ...]]], int]:
    """[(offset, full shape)] of every parameter in `named_parameters` order, and the total numel:
    where each parameter lives in the flat buffer (the same on the trainer and the engine)."""
    entries, offset = [], 0
    for _, shape in _shapes(model):
        entries.append((offset, shape))
        offset += math.prod(shape)
    return entries, offset


def _fingerprint(entries: list[tuple[int, tuple[int, ...]]], dtype: torch.dtype) -> str:
    # shapes and order only: the trainer's names carry wrapper prefixes (activation checkpointing,
    # compile) that the engine's model does not
    return hashlib.sha256(repr((str(dtype), [shape for _, shape in entries])).encode()).hexdigest()[:16]


class SharedBuffer:
    """A flat tensor two processes on one device map: created by the trainer, opened by its engine.

    The descriptor is JSON-safe (it travels in a message header, never pickled): on CUDA the IPC
    handle of the buffer's storage, on the CPU the path of a file in /dev/shm (the trainer deletes
    it once the engine has mapped it; the mappings stay valid).
    """

    @staticmethod
    def create(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
        if device.type == "cuda":
            tensor = torch.empty(numel, dtype=dtype, device=device)
            handle = tensor.untyped_storage()._share_cuda_()
            fields = [base64.b64encode(x).decode() if isinstance(x, bytes) else x for x in handle]
            kinds = ["b" if isinstance(x, bytes) else "v" for x in handle]
            return tensor, {"kind": "cuda_ipc", "handle": fields, "types": kinds, "numel": numel, "dtype": str(dtype)}
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"meshrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        return tensor, {"kind": "file", "path": path, "numel": numel, "dtype": str(dtype)}

    @staticmethod
    def open(descriptor: dict[str, Any], device: torch.device) -> torch.Tensor:
        dtype = getattr(torch, descriptor["dtype"].removeprefix("torch."))
        numel = descriptor["numel"]
        if descriptor["kind"] == "cuda_ipc":
            if device.type != "cuda":
                raise ValueError(f"a colocated engine on {device} cannot open its trainer's CUDA buffer")
            handle = [base64.b64decode(x) if kind == "b" else x
                      for x, kind in zip(descriptor["handle"], descriptor["types"])]
            storage = torch.UntypedStorage._new_shared_cuda(*handle)
            return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))
        return torch.from_file(descriptor["path"], shared=True, size=numel, dtype=dtype)

    @staticmethod
    def unlink(descriptor: dict[str, Any]) -> None:
        """Remove the buffer's name (CPU file); the processes' mappings stay valid."""
        if descriptor["kind"] == "file" and os.path.exists(descriptor["path"]):
            os.unlink(descriptor["path"])


_COPY_GROUP = 64


class ColocatedSender:
    """Trainer rank k's side of the colocated weight path (module docstring). Every trainer rank
    has one; `send` is a collective over the trainer mesh (full-tensor gathers)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, peer: int,
                 to_peer: dist.ProcessGroup, from_peer: dist.ProcessGroup) -> None:
        self.entries, numel = flat_plan(model)
        self.buffer, self.descriptor = SharedBuffer.create(numel, dtype, device)
        self.descriptor["fingerprint"] = _fingerprint(self.entries, dtype)
        self.views = [self.buffer[o:o + math.prod(shape)].view(shape) for o, shape in self.entries]
        self.device, self.peer, self.to_peer, self.from_peer = device, peer, to_peer, from_peer
        self.pending: int | None = None  # the version written that the engine has not copied yet
        self._signal: dist.Work | None = None
        self._announced = False

    @torch.no_grad()
    def send(self, model: nn.Module, version: int) -> None:
        if self.pending is not None:
            self._wait_copied()
        # cast-copies in groups (one foreach launch each): few host calls, and with sharded
        # parameters at most _COPY_GROUP gathered full tensors alive at once
        tensors = full_tensors(model)
        for start in range(0, len(self.views), _COPY_GROUP):
            views = self.views[start:start + _COPY_GROUP]
            torch._foreach_copy_(views, [next(tensors)[1] for _ in views])
        assert next(tensors, None) is None, "the buffer's plan does not cover every parameter"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self._announced:  # the engine waits for it while it starts
            transport.send(protocol.staging(self.descriptor, version), self.peer, self.to_peer)
            self._announced = True
        else:
            self._signal = dist.isend(torch.tensor([version], dtype=torch.int64), self.peer, group=self.to_peer)
        self.pending = version

    def _wait_copied(self) -> None:
        got = torch.zeros(1, dtype=torch.int64)
        dist.recv(got, self.peer, group=self.from_peer)
        assert int(got) == self.pending, f"engine copied version {int(got)}, expected {self.pending}"
        if self._signal is not None:
            self._signal.wait()
            self._signal = None
        SharedBuffer.unlink(self.descriptor)  # mapped by the engine by now
        self.pending = None

    def close(self) -> None:
        """Let the last "written" signal leave before the process may exit (a dropped isend of a
        process that ends can be lost), then remove the buffer's name."""
        if self._signal is not None:
            try:
                self._signal.wait(timeout=datetime.timedelta(seconds=30))
            except RuntimeError:
                pass  # the engine is gone (or stopping): nobody waits for the signal
            self._signal = None
        SharedBuffer.unlink(self.descriptor)


class ColocatedReceiver:
    """Engine k's side. By default its model's parameters become views of one flat tensor laid out
    like the trainer's buffer, so loading a version is one device copy. With `load` (an engine that
    keeps its weights elsewhere, such as vLLM's worker process), each version is handed to
    `load([(name, view of the trainer's buffer)])` instead, which must have copied what it needs
    when it returns; `model` then only gives names and shapes (it may live on the meta device).
    An FP8 engine (models/common/fp8.py) keeps no bf16 copy: its e4m3 weights are quantised
    straight from the trainer's buffer, and only the other parameters are copied."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, peer: int,
                 to_peer: dist.ProcessGroup, from_peer: dist.ProcessGroup,
                 load: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None) -> None:
        self.entries, numel = flat_plan(model)
        self.names = [name for name, _ in model.named_parameters()]
        self.load = load
        self.params = [p for _, p in model.named_parameters()]
        self.quantized = quantized_params(model) if load is None else {}
        self.flat: torch.Tensor | None = None
        if load is None and not self.quantized:
            self.flat = torch.empty(numel, dtype=dtype, device=device)
            with torch.no_grad():
                for (offset, shape), param in zip(self.entries, model.parameters(), strict=True):
                    view = self.flat[offset:offset + math.prod(shape)].view(shape)
                    view.copy_(param.detach())
                    param.data = view
            packed_projections.bind(model)  # packed projections are views of the flat buffer now, where they can be
        self.fingerprint = _fingerprint(self.entries, dtype)
        self.device, self.peer, self.to_peer, self.from_peer = device, peer, to_peer, from_peer
        self.buffer: torch.Tensor | None = None
        self._signal: dist.Work | None = None

    def receive_first(self) -> int:
        """Map the trainer's buffer (its STAGING message) and copy the version it holds; returns it."""
        msg = transport.recv(self.peer, self.from_peer)
        assert msg.kind == Kind.STAGING, msg.kind
        descriptor = msg.meta["buffer"]
        if descriptor["fingerprint"] != self.fingerprint:
            raise RuntimeError("the trainer's weight buffer is laid out for another model (parameter shapes or "
                               "dtype differ from the engine's)")
        self.buffer = SharedBuffer.open(descriptor, self.device)
        self._copy(msg.meta["version"])
        return msg.meta["version"]

    def receive(self, version: int) -> None:
        """Wait until the trainer has written `version`, then copy it (between two engine steps)."""
        got = torch.zeros(1, dtype=torch.int64)
        dist.recv(got, self.peer, group=self.from_peer)
        if int(got) != version:
            raise RuntimeError(f"the trainer wrote weights v{int(got)} but the controller asked for v{version}")
        self._copy(version)

    @torch.no_grad()
    def _copy(self, version: int) -> None:
        if self.load is not None:
            self.load([(name, self.buffer[offset:offset + math.prod(shape)].view(shape))
                       for name, (offset, shape) in zip(self.names, self.entries, strict=True)])
        elif self.flat is not None:
            self.flat.copy_(self.buffer)
        else:  # FP8 engine: quantise the linear weights out of the buffer, copy the rest
            views = [self.buffer[o:o + math.prod(shape)].view(shape) for o, shape in self.entries]
            plain = [i for i in range(len(views)) if i not in self.quantized]
            torch._foreach_copy_([self.params[i] for i in plain], [views[i] for i in plain])
            for i, module in self.quantized.items():
                module.load_weight(views[i])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copied before the trainer may write again
        if self._signal is not None:
            self._signal.wait()
        self._signal = dist.isend(torch.tensor([version], dtype=torch.int64), self.peer, group=self.to_peer)

    def close(self) -> None:
        """Unmap the trainer's buffer (before the trainer exits). The last "copied" signal is not
        waited for: a stopping trainer never asks for it."""
        self.buffer = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()
