"""Parallelism of the trainer sub-mesh: degrees -> DeviceMesh, and parallelize(model)."""

from meshrl.parallel.parallelize import full_adapters, full_tensors, parallelize

__all__ = ["parallelize", "full_tensors", "full_adapters"]
