"""benchmarks/gpu/families.sh on CPU (FAMILIES_TINY=1: debug flavors, a few tokens), so that a typo
in it cannot waste a GPU run: every part runs its real commands, the vLLM part against the fake
vLLM package of test_engine_matrix.py (so the export of the native model's folder and the child
process run too), and every result lands in families.jsonl. The GPU shapes it names must be the
benchmark flavors of docs/models.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.models import get_family
from tests.unit.test_engine_bench import SHAPES
from tests.unit.test_engine_matrix import FAKE_PACKAGE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "families.sh"


def test_the_gpu_shapes_are_the_benchmark_flavors():
    text = SCRIPT.read_text()
    gpu = re.search(r'else\n  SHAPES=\(([^)]*)\)', text).group(1)
    named = [tuple(s.split()) for s in re.findall(r'"([^"]+)"', gpu)]
    assert named == [(family, flavor) for family, flavor, _, _ in SHAPES]
    for family, flavor in named:
        assert flavor in get_family(family).flavors
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "| tail" not in code and code.count("timeout -k 5") == 1  # every command goes through run()


@pytest.mark.heavy  # 10 processes, each importing torch: 50-120 s on the 2-core machine. Run it before a
@pytest.mark.slow   # GPU call of the script: pytest -m heavy tests/unit/test_families_script.py
def test_families_script_runs_every_part_on_cpu(tmp_path):
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    for name, text in FAKE_PACKAGE.items():
        (package / name).write_text(text)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "FAMILIES_TINY": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{tmp_path / 'fake'}:{ROOT}", "FAMILIES_EXPORT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "families.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["rc"] or "error" in r], rows
    families = ["glm4_moe", "deepseek_v3", "qwen3_5"]
    assert [r["family"] for r in rows if r["part"] == "train"] == families
    assert [r["family"] for r in rows if r["part"] == "engine"] == families
    matrix = [(r["family"], r["engine"]) for r in rows if r["part"] == "vllm"]
    assert matrix == [(f, e) for f in families for e in ("native", "vllm")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    status = (out / "families.status").read_text().splitlines()
    assert len(status) == 9 and all("rc=0" in line for line in status)
    assert not list(tmp_path.glob("meshrl-bench-vllm-*"))  # the exported folders are removed
