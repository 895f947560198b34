"""The layout's rules, read from the source: who may import whom, and how big a unit may grow.

Layers, lowest first (docs/architecture.md draws them). A module may import its own layer and
the layers below it, never one above:

    0  models/, parallel/, envs/, data/ know nothing of the runtime
    1  runtime base: config, rundir, transport, protocol, tokenizer, wandb_logger, launch,
       layout, policy, weight_sync, checkpoint
    2  runtime/engine/                  the inference engines
    3  runtime/train/                   trainer, losses, packing (its SFT eval decodes on the engine)
    4  runtime/rollout/                 controller, episodes, evals (feeds train's packing)
    5  programs: rl, sft, eval, bench, cli, plot, config_docs

Imports inside functions count too: a lazy import hides a dependency, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"runtime": "meshrl.runtime", "models": "meshrl.models", "parallel": "meshrl.parallel",
            "envs": "meshrl.envs", "data": "meshrl.data"}
PROGRAMS = {"rl", "sft", "eval", "bench", "cli", "plot", "config_docs"}
ROOMS = {"engine": 2, "train": 3, "rollout": 4}
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 400


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """meshrl modules `name` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    parts = name.split(".")
    if parts[1] != "runtime":
        return 0
    if len(parts) == 2:
        return 1  # the runtime package itself
    if parts[2] in ROOMS:
        return ROOMS[parts[2]]
    return 5 if parts[2] in PROGRAMS else 1


def test_no_import_points_to_a_higher_layer():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycles():
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_layer_rules_see_real_imports():
    # the checks above are only as good as the graph: it must hold edges we know exist
    assert "meshrl.runtime.protocol" in GRAPH["meshrl.runtime.rollout.controller"]
    assert "meshrl.runtime.engine.build" in GRAPH["meshrl.runtime.engine.loop"]
    assert "meshrl.runtime.train.bench" in GRAPH["meshrl.runtime.bench"]  # an import inside a function
    assert layer("meshrl.runtime.rl") == 5 and layer("meshrl.runtime.engine.native") == 2
    assert layer("meshrl.runtime.protocol") == 1 and layer("meshrl.models.qwen3") == 0


def test_no_function_or_class_is_too_long():
    too_long = []
    for name, path in MODULES.items():
        if name.split(".")[1] not in ("runtime", "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} function {node.name}: {n} lines")
            elif isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)
