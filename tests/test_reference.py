"""docs/reference.md, the building blocks a trainer author uses, is generated from the
code: each listed name's signature and the first paragraph of its docstring. The test
regenerates it and compares, so the page never drifts from the code;
``python -m tests.test_reference`` rewrites it after a change."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from tests.support.names import resolve

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"

# (section, what it is for, names): the order the page reads in.
BLOCKS: list[tuple[str, str, list[str]]] = [
    ("The contract (`corun`)", "what every trainer is written against "
     "(docs/writing-a-trainer.md)", [
        "corun.Trainer", "corun.TrainerConfig", "corun.Batch", "corun.Part",
        "corun.Part.rows", "corun.Part.mini_rows", "corun.Part.share", "corun.Trainer.row_tokens",
        "corun.SetupContext.add_optimizer", "corun.SetupContext.on_teardown",
        "corun.SetupContext.keep_state", "corun.RolloutContext",
        "corun.cancel_point", "corun.shared_count", "corun.shared_mean_std",
        "corun.stable_seed", "corun.read_jsonl", "corun.ShuffledBatches", "corun.world",
    ]),
    ("Tasks and their data (`trainers.lm.tasks`)", "the built-in digit tasks (`sort`, "
     "`addition`, `reverse`), their batches, prompt encoding and decoding", [
        "trainers.lm.tasks.TASKS", "trainers.lm.tasks.Task", "trainers.lm.tasks.Task.sample",
        "trainers.lm.tasks.Task.eval_set", "trainers.lm.tasks.Task.reward",
        "trainers.lm.tasks.TaskData", "trainers.lm.tasks.TokenBatch",
        "trainers.lm.tasks.encode_examples", "trainers.lm.tasks.encode_prompts",
        "trainers.lm.tasks.decode_responses", "trainers.lm.tasks.teacher_forcing",
    ]),
    ("The policy (`trainers.lm.policy`, `trainers.lm.model`, `trainers.lm.engine`)",
     "TinyLM: building, warm starts, checkpoint state, log-probs, held-out evaluation, "
     "generation", [
        "trainers.lm.model.ModelConfig", "trainers.lm.model.TinyLM",
        "trainers.lm.model.TinyLM.generate", "trainers.lm.policy.build_policy",
        "trainers.lm.policy.load_policy", "trainers.lm.policy.policy_from",
        "trainers.lm.policy.policy_state", "trainers.lm.policy.load_policy_state",
        "trainers.lm.policy.response_logprobs", "trainers.lm.policy.rollout_logprobs",
        "trainers.lm.policy.HeldOutEval", "trainers.lm.engine.Rollouts",
        "trainers.lm.engine.LocalEngine", "trainers.lm.engine.LocalEngine.generate",
    ]),
    ("Policy-gradient math (`trainers.pg`)", "cross-checked against verl "
     "(docs/writing-a-trainer.md, Numerics)", [
        "trainers.pg.group_advantages", "trainers.pg.clipped_surrogate",
        "trainers.pg.decoupled_surrogate", "trainers.pg.aggregate", "trainers.pg.kl_k3",
        "trainers.pg.gae", "trainers.pg.clipped_value_loss",
        "trainers.pg.rollout_correction", "trainers.pg.mismatch_metrics",
    ]),
    ("Hugging Face models (`trainers.hf`)", "the word problems, their chat format and "
     "reward, exporting a run's model", [
        "trainers.hf.tasks.WordProblems", "trainers.hf.tasks.eval_problems",
        "trainers.hf.policy.ChatFormat", "trainers.hf.rewards.numeric_match",
        "trainers.hf.state.export",
    ]),
]  # fmt: skip


def summary(obj: object) -> str:
    """The docstring's first paragraph on one line (a class's own, not its base's)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else inspect.getdoc(obj)
    text = inspect.cleandoc(doc) if isinstance(doc, str) else ""
    return re.sub(r"\s+", " ", text.split("\n\n", 1)[0]).strip().replace("|", "\\|")


def signature(obj: object) -> str:
    if not callable(obj):
        return ""
    try:
        found = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return found.replace("'", "").replace("|", "\\|")


def entry(name: str) -> str:
    obj = resolve(name)
    if isinstance(obj, dict):  # a registry: its keys
        text = f"a dict of {len(obj)}: " + ", ".join(f"`{key}`" for key in obj)
    else:
        text = summary(obj) or "(no docstring)"
    return f"| `{name}{signature(obj)}` | {text} |"


def page() -> str:
    lines = [
        "# Reference: a trainer's building blocks",
        "",
        "Generated from the code by tests/test_reference.py (`python -m tests.test_reference`",
        "rewrites it; the test fails when the page and the code differ): what each name is",
        "for, in the order a trainer uses them. [writing-a-trainer.md](writing-a-trainer.md)",
        "shows them at work.",
    ]
    for title, purpose, names in BLOCKS:
        lines += ["", f"## {title}", "", f"{purpose[0].upper()}{purpose[1:]}.", "",
                  "| name | what |", "|---|---|", *map(entry, names)]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_reference_page_matches_the_code() -> None:
    assert PAGE.read_text() == page(), "docs/reference.md is stale: python -m tests.test_reference"


if __name__ == "__main__":
    PAGE.write_text(page())
    print(PAGE)
