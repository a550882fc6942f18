"""The job of ``corun bench memory`` (benchmarks/memory.py), a fresh process per point,
so that each peak resident size is that point's alone:

::

    python -m benchmarks.memory_job build VOCAB DIR
    python -m benchmarks.memory_job update MODEL_DIR ROWS TOKENS [--before]
    python -m benchmarks.memory_job update MODEL_DIR ROWS TOKENS --end-to-end RUN_DIR [--before]

``build`` writes the built-in tiny Llama (trainers/hf/tiny.py) with its input
embeddings and output head resized to VOCAB rows into DIR (once: a DIR that holds a
model is kept). ``update`` sets up a real ``hf_grpo`` trainer on MODEL_DIR (its set-up
as the runtime runs it, the local engine included), fabricates scored batches of ROWS
rows (ROWS/8 prompts x 8 samples, prompts of 22 tokens, TOKENS response tokens of
random ids, every row full length, random rewards: every row has an advantage) and
runs 2 updates through the runtime's update protocol (corun.loop.update.Updater).
``--end-to-end`` instead runs ``corun train hf_grpo`` for 2 steps on MODEL_DIR with
TOKENS new tokens, generation included, as a user runs it, in a child process.
``--before``: the update as it was, ``loop.micro_batch_tokens=0
trainer.logits_chunk=0``; without it, the defaults.

Each prints one JSON line: the point, its settings, seconds per update and its own
peak RSS (``ru_maxrss``; end to end: the ``corun train`` child's, from ``wait4``). The
suite's figure is the peak its parent measures with ``wait4``, the job's process
alone (end to end: with its ``corun train`` child, which it waits for). It drives
trainers/hf directly; the suite runs it as a process, never imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers import measured

PROMPT_TOKENS = 22  # the built-in word problems' chat prompts: 21-22 tokens
SAMPLES = 8  # per prompt, as configs/hf_grpo.toml
UPDATES = 2  # the first allocates the optimizer's state; the peak needs both
BEFORE = {"loop.micro_batch_tokens": 0, "trainer.logits_chunk": 0}  # the update unsplit


# ----------------------------------------------------------------------------- the model


def build(vocab: int, directory: Path) -> Path:
    """The tiny Llama resized to ``vocab`` rows in ``directory`` (kept when there):
    written beside it and renamed, so a half-written model is never picked up."""
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainers.hf.policy import quiet_transformers
    from trainers.hf.tiny import build as build_tiny

    quiet_transformers()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
        base = build_tiny(Path(tmp) / "base")  # the built-in's shape and seed
        model = AutoModelForCausalLM.from_pretrained(base)
        model.resize_token_embeddings(vocab)  # the embeddings and the (untied) head
        model.save_pretrained(Path(tmp) / "model")
        AutoTokenizer.from_pretrained(base).save_pretrained(Path(tmp) / "model")
        (Path(tmp) / "model").rename(directory)
    return directory


# ----------------------------------------------------------------------------- in process


def config(model: Path, rows: int, tokens: int, before: bool, budget: int | None = None) -> Any:
    """hf_grpo on ``model`` as the runtime would configure it, with ``rows`` per step."""
    from corun.contract.config_file import config_from_dict

    trainer = {
        "kind": "trainers.hf.rl:HFGRPOTrainer", "model": f"hf:{model}", "init_from": "",
        "engine": "local", "eval_size": 8, "samples_per_prompt": SAMPLES,
        "max_new_tokens": tokens, "truncated_reward": "keep",
    }  # fmt: skip
    loop: dict[str, Any] = {"baseline_eval": False}
    if before:
        trainer["logits_chunk"] = BEFORE["trainer.logits_chunk"]
        loop["micro_batch_tokens"] = BEFORE["loop.micro_batch_tokens"]
    elif budget is not None:
        loop["micro_batch_tokens"] = budget
    raw = {"run": {"steps": UPDATES, "seed": 0}, "loop": loop,
           "data": {"batch_size": rows // SAMPLES}, "trainer": trainer}  # fmt: skip
    return config_from_dict(raw, "benchmarks.memory_job")


def scored_batch(trainer: Any, rows: int, tokens: int, step: int) -> Any:
    """A batch as a rollout of ``step`` would make it: full-length random responses,
    random rewards (so every row's advantage is nonzero), its own version's tokens."""
    import torch

    import corun
    from trainers.lm.engine import Rollouts
    from trainers.lm.policy_gradient import Scored

    vocab = int(trainer.policy.model.config.vocab_size)
    draw = torch.Generator().manual_seed(step)
    rollouts = Rollouts(
        prompt_ids=torch.randint(3, vocab, (rows, PROMPT_TOKENS), generator=draw),
        response_ids=torch.randint(3, vocab, (rows, tokens), generator=draw),
        response_mask=torch.ones(rows, tokens, dtype=torch.bool),
        # About what a fresh model's near-uniform distribution gives every token.
        logprobs=torch.full((rows, tokens), -math.log(vocab)),
        truncated=torch.ones(rows, dtype=torch.bool),
        token_versions=torch.full((rows, tokens), step),
        version=step,
    )  # fmt: skip
    rewards = torch.rand(rows, generator=draw)
    prompts = [f"prompt {row // SAMPLES}" for row in range(rows)]
    data = trainer.training_data(Scored(rollouts, prompts, rewards))
    return corun.Batch(data, index=step, version=step)


def updates(
    model: Path, rows: int, tokens: int, before: bool, budget: int | None = None
) -> dict[str, Any]:
    """:data:`UPDATES` updates of the set-up trainer; the seconds of each, the peak RSS."""
    import anyio

    import corun
    from corun.loop.update import Updater
    from trainers.hf.rl import HFGRPOTrainer

    settings = config(model, rows, tokens, before, budget)
    corun.seed_everything(settings.run.seed)
    trainer = HFGRPOTrainer(settings)
    ctx = corun.SetupContext(settings)
    anyio.run(trainer.setup, ctx)
    updater = Updater.of(trainer, ctx.optimizers, settings)
    assert updater is not None, "hf_grpo defines a loss: the runtime's protocol updates it"
    setup_mib = peak_rss_mib()
    seconds = []
    for step in range(UPDATES):
        batch = scored_batch(trainer, rows, tokens, step)
        started = time.perf_counter()
        updater.train(batch, 0, step)
        seconds.append(time.perf_counter() - started)
    anyio.run(torn_down, ctx)
    vocab = int(trainer.policy.model.config.vocab_size)
    return {"rows": rows, "tokens": rows * tokens, "response_tokens": tokens, "vocab": vocab,
            "settings": {"loop.micro_batch_tokens": settings.loop.micro_batch_tokens,
                         "trainer.logits_chunk": settings.trainer.logits_chunk},
            "update_s": seconds, "setup_rss_mib": setup_mib,
            "rss_mib": peak_rss_mib()}  # fmt: skip


async def torn_down(ctx: Any) -> None:
    """What the set-up registered for teardown (the engine's lane), newest first."""
    import inspect

    for _, fn in reversed(ctx.teardowns):
        result = fn()
        if inspect.isawaitable(result):
            await result


def chosen(before: bool) -> dict[str, int | str]:
    """The memory settings a ``corun train`` run is given (the defaults: none)."""
    return dict(BEFORE) if before else {key: "default" for key in BEFORE}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- end to end


def train_command(model: Path, rows: int, tokens: int, run_dir: Path, before: bool) -> list[str]:
    """``corun train hf_grpo`` on ``model``: 2 steps, nothing evaluated or saved."""
    overrides = [f"{key}={value}" for key, value in BEFORE.items()] if before else []
    return [
        sys.executable, "-m", "corun", "train", "hf_grpo", f"trainer.model=hf:{model}",
        "trainer.init_from=", "trainer.truncated_reward=keep",
        f"trainer.max_new_tokens={tokens}", f"data.batch_size={rows // SAMPLES}",
        "trainer.eval_size=8", f"run.steps={UPDATES}", "loop.baseline_eval=false",
        "loop.eval_interval=0", "loop.save_interval=0", f"run.dir={run_dir}",
        "log.progress=off", *overrides,
    ]  # fmt: skip


def end_to_end(model: Path, rows: int, tokens: int, run_dir: Path, before: bool) -> dict[str, Any]:
    """The ``corun train`` run in a child process (this one stays small: no torch)."""
    command = train_command(model, rows, tokens, run_dir, before)
    started = time.perf_counter()
    rss_mib = measured(command, {**os.environ, "WANDB_MODE": "disabled"})
    wall = time.perf_counter() - started
    return {"rows": rows, "tokens": rows * tokens, "response_tokens": tokens,
            "vocab": vocab_of(model), "settings": chosen(before),
            "update_s": train_seconds(run_dir), "wall_s": wall,
            "rss_mib": rss_mib}  # fmt: skip


def vocab_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def train_seconds(run_dir: Path) -> list[float]:
    """Each step's update (``perf/train_time_s``) from the run's metrics."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [float(r["perf/train_time_s"]) for r in records if "perf/train_time_s" in r]


# ----------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    made = modes.add_parser("build", help="the resized model's directory")
    made.add_argument("vocab", type=int)
    made.add_argument("dir", type=Path)
    point = modes.add_parser("update", help="one point, measured")
    point.add_argument("model", type=Path)
    point.add_argument("rows", type=int, help=f"rows per step, a multiple of {SAMPLES}")
    point.add_argument("tokens", type=int, help="response tokens per row")
    point.add_argument("--before", action="store_true", help="the update unsplit")
    point.add_argument("--budget", type=int, help="loop.micro_batch_tokens (in process)")
    point.add_argument("--end-to-end", metavar="RUN_DIR", type=Path,
                       help="corun train hf_grpo instead, its run directory")  # fmt: skip
    args = parser.parse_args(argv)
    if args.mode == "build":
        print(json.dumps({"dir": str(build(args.vocab, args.dir))}))
    elif args.end_to_end is not None:
        print(json.dumps(end_to_end(args.model, args.rows, args.tokens, args.end_to_end,
                                    args.before)))  # fmt: skip
    else:
        got = updates(args.model, args.rows, args.tokens, args.before, args.budget)
        print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
