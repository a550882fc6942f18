"""TRL's ``GRPOTrainer`` on the job of ``corun bench peers`` (benchmarks/peers.py), in a
process of its own: ``python -m benchmarks.peers_trl MODEL OUT --steps N``. Writes
``OUT/figures.json`` (each step's seconds and generation seconds, completion lengths,
the held-out reward over training seconds) and ``OUT/final-model``. Needs the ``peers``
extra (TRL)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers import EVAL_SIZE, JOB, score


def dataset(steps: int) -> Any:
    """corun's batches 0 .. steps-1 of the word problems (run.seed 0), in order, as
    conversational prompts: TRL renders them with the same chat template."""
    from datasets import Dataset

    from trainers.hf.tasks import WordProblems

    problems = WordProblems(JOB.prompts_per_step, 0)
    rows = [e for i in range(steps) for e in problems.batch(i)]
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": e.prompt.text}], "answer": e.answer}
        for e in rows
    ])  # fmt: skip


def numeric_match(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
    """corun's reward, in TRL's calling convention."""
    from trainers.hf.rewards import numeric_match as reward

    pairs = zip(completions, answer, strict=True)
    return [reward(response=completion[0]["content"], answer=a) for completion, a in pairs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model: Any = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(opts.out / "trl"), max_steps=opts.steps, seed=0,
        per_device_train_batch_size=JOB.batch, gradient_accumulation_steps=1,
        num_generations=JOB.samples_per_prompt, max_completion_length=JOB.max_new_tokens,
        learning_rate=JOB.lr, lr_scheduler_type="constant", optim="adamw_torch",
        beta=0.0, epsilon=JOB.clip, loss_type="dapo",
        temperature=JOB.temperature, top_p=JOB.top_p,
        shuffle_dataset=False, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=numeric_match, args=config,
        train_dataset=dataset(opts.steps), processing_class=tokenizer,
    )  # fmt: skip
    generate_s: list[float] = []
    generate = model.generate  # the model TRL generates with

    def timed_generate(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generate_s.append(time.perf_counter() - started)

    model.generate = timed_generate
    recorded: dict[str, Any] = {"step_s": [], "tokens": [], "curve": []}

    class Clock(TrainerCallback):
        """Step intervals and training seconds, evaluations left out."""

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
            if state.global_step % opts.eval_every == 0 or state.global_step == opts.steps:
                reward, _ = score(model, tokenizer, EVAL_SIZE)
                train_s = now - self.start - self.eval_s
                recorded["curve"].append((state.global_step, train_s, reward))
                self.eval_s += time.perf_counter() - now
                self.last = time.perf_counter()

    trainer.add_callback(Clock())
    trainer.train()
    trainer.save_model(str(opts.out / "final-model"))
    tokenizer.save_pretrained(opts.out / "final-model")
    figures = {**recorded, "generate_s": generate_s}
    (opts.out / "figures.json").write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
