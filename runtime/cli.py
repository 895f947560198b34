"""The `meshrl` command: `meshrl rl|sft|eval @ cfg.toml [--dotted.key value ...]`, `meshrl plot RUN_DIR`.

Each training sub-command validates its config on this process (a mistake exits 2 with one line,
before any process group exists), then starts torchrun with the rank module on the resolved
config. The rank modules are `meshrl.runtime.rl` and `meshrl.runtime.sft`; `eval` runs in this
process (runtime/eval.py). `bench` and `plot` live in their own modules (runtime/bench.py,
runtime/engine/bench.py, runtime/train/bench.py, runtime/plot.py), imported on use.

Order, so that help and mistakes are answered at once: `--help` and config validation need only
pydantic and the config models (runtime/config.py, runtime/cli_help.py); the rank module, with
torch and the rest, is imported only for the pre-flight checks and the launch that follow.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys

USAGE = """usage: meshrl COMMAND @ config.toml [@ more.toml ...] [--dotted.key value ...]
       meshrl COMMAND --help [SECTION]

commands:
  rl     asynchronous RL: controller + trainer + inference ranks in one torchrun job
  sft    supervised fine-tuning on an environment's reference completions or your data ([data])
  eval   evaluate a checkpoint on environments: mean reward, pass@k, per-environment metrics as
         JSON on stdout; results.json and samples.jsonl in output_dir
  bench  benchmarks: `meshrl bench rl @ cfg.toml` (synchronous vs asynchronous RL),
         `meshrl bench engine [--family F] [--flavor 0.6B] [--device cuda|cpu] [--no-hf] ...` (engine),
         `meshrl bench trainer ...`, `meshrl bench checkpoint ...`
  plot   charts of a run: `meshrl plot RUN_DIR [--out DIR]` writes PNGs (default RUN_DIR/plots)

examples:
  meshrl sft @ configs/reverse_text/sft.toml --output-dir runs/sft
  meshrl rl @ configs/reverse_text/rl.toml --trainer.optim.lr 3e-4 --max-steps 40
  meshrl eval @ configs/alphabet_sort/eval.toml --model.path runs/rl/checkpoints/final
  meshrl plot runs/rl
  meshrl rl --help trainer.optim

Every config field: docs/configs.md (or `meshrl COMMAND --help SECTION`).
"""

# command -> (rank or program module, root config class, one-line summary, main options of sections)
COMMANDS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "rl": ("meshrl.runtime.rl", "RLConfig",
           "Asynchronous RL: one torchrun job of a controller, trainer ranks and inference ranks.",
           ("model.path", "model.flavor", "model.tokenizer", "env.name", "trainer.optim.lr", "trainer.loss.type",
            "inference.sampling.max_tokens", "inference.sampling.temperature", "layout.num_trainer_ranks",
            "layout.num_inference_ranks", "checkpoint.every", "dist.device", "dist.allow_oversubscribe",
            "dist.threads_per_rank", "eval.every", "wandb.enabled")),
    "sft": ("meshrl.runtime.sft", "SFTConfig",
            "Supervised fine-tuning on an environment's reference completions (no controller, no engine).",
            ("model.path", "model.flavor", "model.tokenizer", "env.name", "trainer.optim.lr",
             "trainer.micro_batch_tokens", "checkpoint.every", "dist.device", "dist.allow_oversubscribe",
             "dist.threads_per_rank")),
    "eval": ("meshrl.runtime.eval", "EvalConfig",
             "Evaluate a checkpoint on an environment in this process: mean reward and pass@k as JSON.",
             ("model.path", "model.flavor", "model.tokenizer", "env.name", "eval.num_examples",
              "eval.samples_per_prompt", "eval.pass_k", "eval.temperature", "eval.max_tokens", "dist.device")),
}
BENCH = {"rl": "meshrl.runtime.bench", "checkpoint": "meshrl.runtime.bench", "engine": "meshrl.runtime.engine.bench",
         "trainer": "meshrl.runtime.train.bench"}
HELP = ("-h", "--help")


def module_doc(module: str) -> str:
    """A module's docstring, read from its source without importing it (no torch for `--help`)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    with open(spec.origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def unknown(what: str, name: str, known) -> None:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    print(f"meshrl: unknown {what} {name!r}{hint} (known: {', '.join(known)}; `meshrl --help`)", file=sys.stderr)
    sys.exit(2)


def help_section(rest: list[str]) -> str | None:
    """The SECTION of `--help SECTION` anywhere in the arguments (None: the whole command)."""
    i = next(i for i, a in enumerate(rest) if a in HELP)
    nxt = rest[i + 1] if i + 1 < len(rest) else None
    return nxt if nxt is not None and not nxt.startswith(("-", "@")) else None


def main(argv: list[str] | None = None) -> None:
    """`argv` None: this process is the `meshrl` program (it may end without the interpreter's teardown)."""
    program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in (*HELP, "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "bench":
        _bench(rest)
        return
    if command == "plot":
        from meshrl.runtime import plot

        if any(a in HELP for a in rest):
            print(f"{plot.USAGE}\n\n{module_doc('meshrl.runtime.plot')}")
            sys.exit(0)
        plot.main(rest)
        return
    if command not in COMMANDS:
        unknown("command", command, [*COMMANDS, "bench", "plot"])
    run_command(command, rest, program)


def _bench(rest: list[str]) -> None:
    """`meshrl bench SUB ...`; `--help` reads the benchmark's docstring without importing it."""
    if not rest or rest[0] in HELP:
        from meshrl.runtime import bench

        print(bench.USAGE, file=sys.stdout if rest else sys.stderr)
        sys.exit(0 if rest else 2)
    if rest[0] not in BENCH:
        unknown("benchmark", rest[0], BENCH)
    if any(a in HELP for a in rest[1:]):
        print(module_doc(BENCH[rest[0]]))
        sys.exit(0)
    if rest[0] == "engine":
        from meshrl.runtime.engine import bench as bench_engine

        bench_engine.main(rest[1:])
        return
    from meshrl.runtime import bench

    bench.main(rest)


def run_command(command: str, rest: list[str], program: bool = False) -> None:
    """`meshrl rl|sft|eval ...`: help, or validate (exit 2 on a mistake), then import the program, run its
    pre-flight checks and launch it. `program`: this process is the `meshrl` command, so once the job
    has ended it exits at once (os._exit, after flushing): the interpreter's teardown of torch,
    tensordict and transformers took 1-2 s per job on 2 cores, and nothing in it is the job's."""
    from meshrl.runtime import config
    from meshrl.runtime import launch as launching

    module_name, class_name, summary, main_options = COMMANDS[command]
    cls = getattr(config, class_name)
    if any(a in HELP for a in rest):
        from meshrl.runtime.cli_help import command_help

        try:
            print(command_help(command, cls, summary, help_section(rest), main_options), end="")
        except ValueError as e:
            launching.fail(str(e))
        sys.exit(0)
    cfg = launching.validate_or_exit(cls, rest)
    try:  # a missing or incomplete model folder is reported before torch is imported (~4 s)
        cfg.model.check_folder()
    except ValueError as e:
        launching.fail(str(e))
    module = importlib.import_module(module_name)
    launching.preflight_or_exit(cfg, module.preflight)
    code = module.launch(cfg)
    if program:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
