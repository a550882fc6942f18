"""The job of ``corun bench peers`` and ``corun bench generation`` on trainers/hf's
pieces (the word problems, their chat format and reward, the exported warm start, a
bigger Llama: ~50M, ~6M for --quick), and TRL's ``GRPOTrainer`` on it. The suites
reach trainers/ only through this module's processes (docs/architecture.md)::

    python -m benchmarks.peers_job warm-start SCRATCH   # the exported hf_sft model
    python -m benchmarks.peers_job big-model SCRATCH HIDDEN LAYERS HEADS
    python -m benchmarks.peers_job tiny-model           # the built-in tiny Llama
    python -m benchmarks.peers_job export RUN_DIR OUT   # a corun run's final model
    python -m benchmarks.peers_job score DIR...         # held-out reward of each model
    python -m benchmarks.peers_job prompts DIR          # one hf_grpo step's prompt ids
    python -m benchmarks.peers_job trl MODEL OUT --steps N --eval-every K

Each prints its answer as one JSON line. ``trl`` writes ``OUT/figures.json`` (each
step's seconds and generation seconds, completion lengths, the held-out reward over
training seconds) and ``OUT/final-model``; with ``--eval-every 0`` the figures of speed
alone. It needs the ``peers`` extra (TRL)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.peers import ENV, EVAL_SIZE, JOB, THREADS, Shape
from corun.contract.engine import Sampling
from corun.engines.continuous import generate
from trainers.hf.policy import ChatFormat
from trainers.hf.rewards import numeric_match
from trainers.hf.state import export
from trainers.hf.tasks import WordProblems, eval_problems
from trainers.hf.tiny import build, built_in

# ----------------------------------------------------------------------------- the job


def warm_start(scratch: Path) -> Path:
    """The shipped hf_sft recipe's final model, exported once under ``scratch``."""
    model = scratch / "warm-start"
    if not (model / "config.json").is_file():
        run_dir = scratch / "hf_sft"
        command = [sys.executable, "-m", "corun", "train", "hf_sft", f"run.dir={run_dir}",
                   "log.progress=off"]  # fmt: skip
        subprocess.run(command, check=True, env=ENV, capture_output=True)
        export(str(run_dir), model)
    return model


def big_model(scratch: Path, shape: Shape) -> tuple[Path, int]:
    """A model of ``shape``, built once under ``scratch``, and its parameter count.
    Untrained, it never says EOS: every completion is the full 8 tokens in both
    runtimes."""
    from safetensors import safe_open

    model = scratch / f"llama-{shape.hidden}x{shape.layers}"
    if not (model / "config.json").is_file():
        build(model, hidden=shape.hidden, layers=shape.layers, heads=shape.heads)
    with safe_open(str(model / "model.safetensors"), "pt") as weights:  # shapes, not tensors
        return model, sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())


def score(model: Any, tokenizer: Any, n: int = EVAL_SIZE) -> tuple[float, float]:
    """The mean numeric-match reward (and its standard error) of greedy replies to the
    first ``n`` held-out word problems: what both runtimes' models are scored by."""
    chat = ChatFormat(tokenizer)
    examples = eval_problems(n)
    greedy = Sampling(JOB.max_new_tokens, 0.0, 1.0, (chat.eos_id,))
    prompts = [chat.encode(e.prompt) for e in examples]
    made = generate(SimpleNamespace(model=model), prompts, greedy, None, chat.pad_id)
    rewards = [numeric_match(response=chat.decode(g.ids), answer=e.answer)
               for g, e in zip(made, examples, strict=True)]  # fmt: skip
    mean = statistics.fmean(rewards)
    return mean, statistics.stdev(rewards) / len(rewards) ** 0.5


def held_out_reward(model_dir: Path) -> tuple[float, float]:
    """:func:`score` of a ``save_pretrained`` directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return score(model, AutoTokenizer.from_pretrained(model_dir))


def step_prompts(model_dir: Path) -> dict[str, Any]:
    """The hf_grpo step's prompt ids (batch 0, each prompt 8 times) and the pad id."""
    from transformers import AutoTokenizer

    chat = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    batch = WordProblems(JOB.prompts_per_step, 0).batch(0)
    rows = [chat.encode(e.prompt) for e in batch for _ in range(JOB.samples_per_prompt)]
    return {"rows": rows, "pad_id": chat.pad_id}


# ----------------------------------------------------------------------------- TRL


def dataset(steps: int) -> Any:
    """corun's batches 0 .. steps-1 of the word problems (run.seed 0), in order, as
    conversational prompts: TRL renders them with the same chat template."""
    from datasets import Dataset

    problems = WordProblems(JOB.prompts_per_step, 0)
    rows = [e for i in range(steps) for e in problems.batch(i)]
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": e.prompt.text}], "answer": e.answer}
        for e in rows
    ])  # fmt: skip


def trl_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    """corun's reward, in TRL's calling convention."""
    pairs = zip(completions, answer, strict=True)
    return [numeric_match(response=completion[0]["content"], answer=a) for completion, a in pairs]


def trl_config(out: Path, steps: int) -> Any:
    """The job in TRL's terms (benchmarks/peers.py's MATCHED table)."""
    from trl.trainer.grpo_config import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, seed=0,
        per_device_train_batch_size=JOB.batch, gradient_accumulation_steps=1,
        num_generations=JOB.samples_per_prompt, max_completion_length=JOB.max_new_tokens,
        learning_rate=JOB.lr, lr_scheduler_type="constant", optim="adamw_torch",
        beta=0.0, epsilon=JOB.clip, loss_type="dapo",
        temperature=JOB.temperature, top_p=JOB.top_p,
        shuffle_dataset=False, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip


def time_generation(model: Any) -> list[float]:
    """Wrap the ``generate`` TRL calls; the list its durations are appended to."""
    spent: list[float] = []
    untimed = model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return untimed(*a, **k)
        finally:
            spent.append(time.perf_counter() - started)

    model.generate = timed_generate
    return spent


def clock(model: Any, tokenizer: Any, steps: int, eval_every: int, recorded: dict[str, Any]) -> Any:
    """A TrainerCallback recording step intervals, completion lengths and the held-out
    reward over training seconds (evaluations left out of both)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.last = self.start = time.perf_counter()
            self.eval_s = 0.0

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs:
                recorded["tokens"].append(logs["completions/mean_length"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            recorded["step_s"].append(now - self.last)
            self.last = now
            step = state.global_step
            if eval_every and (step % eval_every == 0 or step == steps):
                reward, _ = score(model, tokenizer)
                recorded["curve"].append((step, now - self.start - self.eval_s, reward))
                self.eval_s += time.perf_counter() - now
                self.last = time.perf_counter()

    return Clock()


def run_trl(model_dir: Path, out: Path, steps: int, eval_every: int) -> None:
    """TRL's GRPOTrainer on the job: ``out/figures.json`` (and ``out/final-model``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.grpo_trainer import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=trl_reward, args=trl_config(out, steps),
        train_dataset=dataset(steps), processing_class=tokenizer,
    )  # fmt: skip
    generate_s = time_generation(model)
    recorded: dict[str, Any] = {"step_s": [], "tokens": [], "curve": []}
    trainer.add_callback(clock(model, tokenizer, steps, eval_every, recorded))
    trainer.train()
    if eval_every:
        trainer.save_model(str(out / "final-model"))
        tokenizer.save_pretrained(out / "final-model")
    (out / "figures.json").write_text(json.dumps({**recorded, "generate_s": generate_s}))


# ----------------------------------------------------------------------------- the program


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = found.add_subparsers(dest="command", required=True)
    commands.add_parser("warm-start").add_argument("scratch", type=Path)
    big = commands.add_parser("big-model")
    big.add_argument("scratch", type=Path)
    for size in ("hidden", "layers", "heads"):
        big.add_argument(size, type=int)
    commands.add_parser("tiny-model")
    export_ = commands.add_parser("export")
    export_.add_argument("run_dir", type=Path)
    export_.add_argument("out", type=Path)
    commands.add_parser("score").add_argument("models", type=Path, nargs="+")
    commands.add_parser("prompts").add_argument("model", type=Path)
    trl = commands.add_parser("trl")
    trl.add_argument("model", type=Path)
    trl.add_argument("out", type=Path)
    for option in ("--steps", "--eval-every"):
        trl.add_argument(option, type=int, required=True)
    return found


def answer(args: argparse.Namespace) -> Any:
    if args.command == "warm-start":
        return str(warm_start(args.scratch))
    if args.command == "big-model":
        path, params = big_model(args.scratch, Shape(args.hidden, args.layers, args.heads))
        return [str(path), params]
    if args.command == "tiny-model":
        return str(built_in().resolve())
    if args.command == "export":
        return str(export(str(args.run_dir), args.out))
    if args.command == "score":
        return [held_out_reward(model) for model in args.models]
    if args.command == "prompts":
        return step_prompts(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    run_trl(args.model, args.out, args.steps, args.eval_every)
    return str(args.out / "figures.json")


def main() -> int:
    args = parser().parse_args()
    torch.set_num_threads(THREADS)
    print(json.dumps(answer(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
