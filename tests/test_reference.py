"""docs/reference.md, the building blocks a trainer author uses, is generated from the
code: each listed name's signature and the first paragraph of its docstring. The test
regenerates it and compares, so the page never drifts from the code;
``python -m tests.test_reference`` rewrites it after a change."""

from __future__ import annotations

import ast
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
        "corun.Trainer", "corun.TrainerConfig", "corun.SetupContext", "corun.Batch",
        "corun.Part",
        "corun.Part.rows", "corun.Part.mini_rows", "corun.Part.share", "corun.Trainer.row_tokens",
        "corun.SetupContext.add_optimizer", "corun.SetupContext.on_teardown",
        "corun.SetupContext.keep_state", "corun.RolloutContext",
        "corun.cancel_point", "corun.shared_count", "corun.shared_mean_std",
        "corun.stable_seed", "corun.Dataset", "corun.read_jsonl", "corun.ShuffledBatches",
        "corun.world", "corun.ConfigError",
    ]),
    ("Tasks and their data (`trainers.lm.tasks`)", "the built-in digit tasks (`sort`, "
     "`addition`, `reverse`), their batches, prompt encoding and decoding", [
        "trainers.lm.tasks.TASKS", "trainers.lm.tasks.Task", "trainers.lm.tasks.Task.sample",
        "trainers.lm.tasks.Task.eval_set", "trainers.lm.tasks.Task.reward",
        "trainers.lm.tasks.TaskData", "trainers.lm.tasks.TokenBatch", "trainers.lm.tasks.EOS",
        "trainers.lm.tasks.encode_examples", "trainers.lm.tasks.encode_prompts",
        "trainers.lm.tasks.decode_responses", "trainers.lm.tasks.teacher_forcing",
    ]),
    ("The policy (`trainers.lm.policy`, `trainers.lm.model`, `trainers.lm.engine`, "
     "`trainers.weights`)",
     "TinyLM: building, warm starts, checkpoint state, log-probs, held-out evaluation, "
     "generation", [
        "trainers.lm.model.ModelConfig", "trainers.lm.model.TinyLM",
        "trainers.lm.model.TinyLM.generate", "trainers.lm.model.decode",
        "trainers.lm.model.Decoded", "trainers.lm.policy.build_policy",
        "trainers.lm.policy.load_policy", "trainers.lm.policy.policy_from",
        "trainers.lm.policy.policy_state", "trainers.lm.policy.load_policy_state",
        "trainers.lm.policy.response_logprobs", "trainers.lm.policy.rollout_logprobs",
        "trainers.lm.policy.HeldOutEval", "trainers.weights.warm_start_runs",
        "trainers.lm.engine.Rollouts",
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
    found = re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"\1", found)  # no addresses
    found = re.sub(r"ForwardRef\('(\w+)'[^)]*\)", r"\1", found)  # a NamedTuple's postponed types
    return found.replace("'", "").replace("|", "\\|")


# What a constant is for (its value is read from the code).
CONSTANTS = {
    "trainers.lm.tasks.EOS": "the end-of-sequence token id: a response ends at its first "
    "EOS, and `decode` pads a stopped row with it",
}


def entry(name: str) -> str:
    obj = resolve(name)
    if isinstance(obj, dict):  # a registry: its keys
        text = f"a dict of {len(obj)}: " + ", ".join(f"`{key}`" for key in obj)
    elif isinstance(obj, int | float | str):
        return f"| `{name} = {obj!r}` | {CONSTANTS[name]} |"
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


# ----------------------------------------------------------------- what the example uses

EXAMPLE = ROOT / "examples" / "loo_trainer.py"


def used_names(source: str) -> set[str]:
    """The public names of corun and trainers that ``source`` uses: what it imports from
    them, ``corun.X``, and the attributes it reads of a parameter annotated with a corun
    class (``ctx: corun.SetupContext`` → ``ctx.device`` is ``corun.SetupContext.device``)."""
    tree, found = ast.parse(source), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
            ("corun", "trainers")
        ):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Attribute) and _dotted(node.value) == "corun":
            found.add(f"corun.{node.attr}")
        elif isinstance(node, ast.FunctionDef):
            found |= _parameter_uses(node)
    return {name for name in found if not name.rsplit(".", 1)[-1].startswith("_")}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else ""


def _parameter_uses(function: ast.FunctionDef) -> set[str]:
    typed = {
        arg.arg: _dotted(arg.annotation) for arg in function.args.args
        if arg.annotation is not None and _dotted(arg.annotation).startswith("corun.")
    }  # fmt: skip
    return {
        f"{typed[node.value.id]}.{node.attr}" for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in typed
    }  # fmt: skip


def missing_from(used: set[str], listed: set[str]) -> list[str]:
    """The used names the reference lacks: a name is covered when listed, or when it is a
    parameter of a listed class's signature (``corun.Batch.data``)."""

    def covered(name: str) -> bool:
        owner, _, attr = name.rpartition(".")
        return name in listed or (
            owner in listed and attr in inspect.signature(resolve(owner)).parameters  # type: ignore[arg-type]
        )

    return sorted(name for name in used if not covered(name))


def listed_names() -> set[str]:
    return {name for _, _, names in BLOCKS for name in names}


def test_the_example_uses_only_names_the_reference_lists() -> None:
    """examples/loo_trainer.py, the code docs/writing-a-trainer.md walks through, is
    written from the reference alone: every corun and trainers name it uses is there."""
    assert missing_from(used_names(EXAMPLE.read_text()), listed_names()) == []


def test_a_name_the_reference_drops_is_reported() -> None:
    used = used_names(EXAMPLE.read_text())
    assert {"trainers.lm.model.decode", "corun.SetupContext.device", "corun.Part.rows"} <= used
    listed = listed_names() - {"trainers.lm.model.decode", "corun.SetupContext"}
    assert missing_from(used, listed) == [
        "corun.SetupContext", "corun.SetupContext.config", "corun.SetupContext.device",
        "trainers.lm.model.decode",
    ]


if __name__ == "__main__":
    PAGE.write_text(page())
    print(PAGE)
