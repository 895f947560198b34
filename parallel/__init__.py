"""Parallelism of the trainer sub-mesh: degrees -> DeviceMesh, and parallelize(model)."""

from meshrl.parallel.parallelize import parallelize, full_tensors

__all__ = ["parallelize", "full_tensors"]
