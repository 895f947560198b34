"""The `meshrl` command: `meshrl rl|sft|eval @ cfg.toml [--dotted.key value ...]`, `meshrl plot RUN_DIR`.

Each training sub-command validates its config on this process (a mistake exits 2 with one line,
before any process group exists), then starts torchrun with the rank module on the resolved
config. The rank modules are `meshrl.runtime.rl` and `meshrl.runtime.sft`; `eval` runs in this
process (runtime/eval.py). `bench` and
`plot` live in their own modules (runtime/bench.py, runtime/engine/bench.py, runtime/plot.py), imported on use.
"""

from __future__ import annotations

import sys

USAGE = """usage: meshrl COMMAND @ config.toml [@ more.toml ...] [--dotted.key value ...]

commands:
  rl     asynchronous RL: controller + trainer + inference ranks in one torchrun job
  sft    supervised fine-tuning on an environment's reference completions or your data ([data])
  eval   evaluate a checkpoint on environments: mean reward, pass@k, per-environment metrics as
         JSON on stdout; results.json and samples.jsonl in output_dir
  bench  benchmarks: `meshrl bench rl @ cfg.toml` (synchronous vs asynchronous RL),
         `meshrl bench engine [--flavor 0.6B] [--device cuda|cpu] [--no-hf] ...` (inference engine)
  plot   charts of a run: `meshrl plot RUN_DIR [--out DIR]` writes PNGs (default RUN_DIR/plots)

examples:
  meshrl sft @ configs/reverse_text/sft.toml --output-dir runs/sft
  meshrl rl @ configs/reverse_text/rl.toml --trainer.optim.lr 3e-4 --max-steps 40
  meshrl eval @ configs/alphabet_sort/eval.toml --model.path runs/rl/checkpoints/final
  meshrl plot runs/rl
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "bench" and rest[:1] == ["engine"]:
        from meshrl.runtime.engine import bench as bench_engine

        bench_engine.main(rest[1:])
        return
    if command == "bench":
        from meshrl.runtime import bench

        bench.main(rest)
        return
    if command == "plot":
        from meshrl.runtime import plot

        plot.main(rest)
        return
    if command == "rl":
        from meshrl.runtime import rl as module
        from meshrl.runtime.config import RLConfig as cls
    elif command == "sft":
        from meshrl.runtime import sft as module
        from meshrl.runtime.config import SFTConfig as cls
    elif command == "eval":
        from meshrl.runtime import eval as module
        from meshrl.runtime.config import EvalConfig as cls
    else:
        print(f"meshrl: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    from meshrl.runtime import launch

    cfg, _ = launch.parse_or_exit(cls, rest, module.preflight)
    sys.exit(module.launch(cfg))


if __name__ == "__main__":
    main()
