"""Parallelism of the trainer sub-mesh: degrees -> DeviceMesh, and parallelize(model).

`parallelize`, `full_tensors` and `full_adapters` (parallel/parallelize.py) are loaded on first use: they pull in
FSDP and DTensor, seconds of imports that `meshrl.parallel.dims` (the layout, the launcher's
pre-flight checks) does not need. `meshrl.parallel.parallelize` stays the function, as when it was
imported here eagerly: the import system's binding of the submodule of the same name is ignored.
"""

import importlib
import sys
import types
from typing import Any

__all__ = ["parallelize", "full_tensors", "full_adapters"]


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "parallelize" and isinstance(value, types.ModuleType):
            return  # the submodule, bound by the import system: the name belongs to the function
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name not in __all__:
            raise AttributeError(f"module 'meshrl.parallel' has no attribute {name!r}")
        module = importlib.import_module("meshrl.parallel.parallelize")
        for public in __all__:
            super().__setattr__(public, getattr(module, public))
        return getattr(module, name)


sys.modules[__name__].__class__ = _Package
