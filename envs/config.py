"""The pydantic bases of every configuration section, defined here because envs/ is the lowest layer.

`Base` is the one base of all config sections: each environment's config class (next to the
environment, e.g. envs/reverse_text.py) and every section of runtime/config.py, which imports it
from here (envs/ may never import the runtime, so the shared definition lives below it).
`EnvConfigBase` adds what every single environment's section has: its mix `weight` and
`kwargs()`, the environment's constructor arguments. The registry (envs/registry.py) ties each
config class to its constructor.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Base", "EnvConfigBase"]


class Base(BaseModel):
    """Common settings: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class EnvConfigBase(Base):
    """Settings every environment has.

    A subclass declares ``name: Literal["<its registry key>"] = "<its registry key>"`` (the tag of
    the `EnvConfig` union) and one field per constructor argument of its environment.
    """

    weight: float = Field(1.0, gt=0)
    """Share of the prompts when this environment is one of a mix (name = "mix"); ratios, any scale."""

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of the environment."""
        return self.model_dump(exclude={"name", "weight"})
