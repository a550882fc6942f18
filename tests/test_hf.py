"""Hugging Face policies through the template with the transformers engine: the tiny
model builder, parity with the hand-written loop (GRPO, PPO, SFT) and resume parity,
prompt files and reward functions (a failing function fails samples, not the run),
bad input (exit 2, one line naming the setting), and export to ``save_pretrained``."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import corun
from corun.records.events import read_records
from tests.support.cli import assert_usage_error, call_main
from tests.support.config import make_config
from tests.support.loops import handwritten_loop, step_records
from tests.support.state import assert_state_equal
from trainers.hf.policy import ChatFormat, load_policy
from trainers.hf.prompts import Prompt
from trainers.hf.state import export
from trainers.hf.tiny import build, built_in

pytestmark = pytest.mark.anyio

MODEL = "tiny-llama"
# A random model never answers right, nor stops: a dense reward that counts cut replies
# gives every group a spread.
DENSE = {"tests.test_hf:letter_share": 1.0}
RL = {
    "model": MODEL, "samples_per_prompt": 4, "max_new_tokens": 6, "eval_size": 8, "lr": 1e-3,
    "rewards": DENSE, "truncated_reward": "keep",
}  # fmt: skip
KINDS: dict[str, dict[str, Any]] = {
    "hf_grpo": {"kind": "hf_grpo", **RL},
    "hf_ppo": {"kind": "hf_ppo", **RL},
    "hf_sft": {"kind": "hf_sft", "model": MODEL, "eval_size": 8, "max_new_tokens": 6},
}


def _config(run_dir: Path, kind: str, steps: int = 3, **sections: Any) -> corun.Config:
    trainer = {**KINDS[kind], **sections.pop("trainer", {})}
    loop = {"baseline_eval": False, **sections.pop("loop", {})}
    data = {"batch_size": 2, **sections.pop("data", {})}
    return make_config(
        run_dir, trainer, run={"steps": steps, "seed": 3}, loop=loop, data=data, **sections
    )


async def _run(config: corun.Config) -> corun.Trainer[Any]:
    trainer = corun.resolve_trainer(config.trainer.kind)(config)
    with anyio.fail_after(120):
        await corun.run(trainer, config)
    return trainer


# ------------------------------------------------------------------------ the model


def test_tiny_model_is_reproducible_and_a_chat_model(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    _, tokenizer = load_policy(f"hf:{first}", "where")
    chat = ChatFormat(tokenizer, "be brief")
    ids = chat.encode(Prompt("Ann has 12 pens."))
    text = tokenizer.decode(ids)
    assert text.startswith("system: be brief\nuser: Ann has 12 pens.")
    assert text.endswith("assistant:")
    # Digits are one token each: numbers are spelled, not memorised.
    assert len(tokenizer.encode("1234", add_special_tokens=False)) == 4
    reply = chat.encode_reply(Prompt("Ann has 12 pens."), "19")
    assert tokenizer.decode(reply).strip() == "19</s>" and reply[-1] == chat.eos_id


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the backends are checked below
@pytest.mark.parametrize("kind", list(KINDS))
async def test_run_equals_handwritten_loop(tmp_path: Path, anyio_backend: str, kind: str) -> None:
    """At concurrency 1 the template with the transformers engine is a plain loop:
    the same weights bitwise and the same per-step metrics."""
    extra = {"loop": {"accumulate": 2, "mini_batches": 2}} if kind != "hf_sft" else {}
    trainer = await _run(_config(tmp_path / "run", kind, 4, **extra))
    kind_cls = corun.resolve_trainer(kind)
    reference, records = await anyio.to_thread.run_sync(
        handwritten_loop, kind_cls, _config(tmp_path / "ref", kind, 4, **extra)
    )
    assert_state_equal(trainer.state_dict(), reference.state_dict())
    expected = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]
    assert step_records(tmp_path / "run") == expected
    if kind != "hf_sft":
        assert len({r["rollout/reward_mean"] for r in expected}) > 1  # real gradients


@pytest.mark.parametrize("kind", ["hf_grpo", "hf_ppo"])
async def test_resume_equals_uninterrupted(tmp_path: Path, anyio_backend: str, kind: str) -> None:
    loop = {"save_interval": 2}
    straight = await _run(_config(tmp_path / "straight", kind, 4, loop=loop))
    await _run(_config(tmp_path / "split", kind, 2, loop=loop))
    resumed = await _run(_config(tmp_path / "split", kind, 4, loop=loop))
    records = step_records(tmp_path / "split")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records == step_records(tmp_path / "straight")
    assert_state_equal(straight.state_dict(), resumed.state_dict())


async def test_async_partial_rollouts_record_versions(tmp_path: Path, anyio_backend: str) -> None:
    """Concurrency 2 with ``interrupt``: weights change between decode steps of running
    generations, and the batches say so (partial rollouts, staleness within bound)."""
    config = _config(
        tmp_path / "run", "hf_grpo", 8,
        trainer={"inflight_at_sync": "interrupt", "max_new_tokens": 16},
        loop={"concurrency": 2, "max_staleness": 2},
    )  # fmt: skip
    await _run(config)
    records = step_records(tmp_path / "run")
    assert len(records) == 8
    assert all(r["async/staleness_max"] <= 2 for r in records)
    assert all(0.0 <= r["rollout/partial_ratio"] <= 1.0 for r in records)


# ------------------------------------------------------------------ data and rewards


def letter_share(*, response: str, **_: Any) -> float:
    return sum(c.isascii() and c.isalpha() for c in response) / max(1, len(response))


def flaky_reward(*, response: str, **_: Any) -> Any:
    """Fails on some samples: raises, returns text, or returns NaN."""
    digits = sum(c.isdigit() for c in response)
    if digits % 3 == 0:
        raise RuntimeError("no digits to judge")
    return "high" if digits % 3 == 1 else float("nan") if len(response) % 2 else 1.0


async def async_length_reward(*, response: str, **_: Any) -> float:
    await anyio.lowlevel.checkpoint()
    return min(len(response), 10) / 10


async def test_prompt_file_and_failing_rewards_fail_samples_not_the_run(
    tmp_path: Path, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Ann has {i} pens and gets 1 more. How many pens now?",
              "answer": str(i + 1)} for i in range(30)]  # fmt: skip
    lines += [{"messages": [{"role": "user", "content": f"What is {i} plus 2?"}],
               "answer": str(i + 2)} for i in range(30)]  # fmt: skip
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rewards = {f"{__name__}:flaky_reward": 1.0, f"{__name__}:async_length_reward": 0.5}
    config = _config(
        tmp_path / "run", "hf_grpo", 3, trainer={"rewards": rewards, "max_new_tokens": 8},
        data={"path": str(data), "batch_size": 4}, loop={"eval_interval": 3},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        await _run(config)
    records = step_records(tmp_path / "run")
    assert len(records) == 3
    assert sum(r["rollout/reward_failures"] for r in records) > 0
    assert all(math.isfinite(r["train/loss"]) for r in records)
    warnings = [r.getMessage() for r in caplog.records if "flaky_reward failed" in r.getMessage()]
    assert len(warnings) == 1, warnings  # reported once, with its reason
    evals = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "eval/reward" in r]
    assert evals and f"eval/reward/{__name__}:async_length_reward" in evals[-1]


# ----------------------------------------------------------------------- bad input


def _toml(run_dir: Path, trainer: str, data: str = "", model: str = MODEL) -> str:
    return (
        f'[run]\ndir = "{run_dir}"\nsteps = 2\n\n[log]\nprogress = "off"\n\n'
        f'[data]\nbatch_size = 2\n{data}\n[trainer]\nmodel = "{model}"\n{trainer}'
    )


def _not_a_causal_lm(tmp_path: Path) -> Path:
    from transformers import BertConfig

    path = tmp_path / "bert"
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(path)
    return path


def _without_chat_template(tmp_path: Path) -> Path:
    path = tmp_path / "plain"
    shutil.copytree(built_in(), path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


BAD = {
    "not a causal LM": ("kind = 'hf_grpo'\n", "`$.trainer.model`"),
    "reward does not import": (
        "kind = 'hf_grpo'\n[trainer.rewards]\n'nowhere.at_all:fn' = 1.0\n",
        "`$.trainer.rewards`.nowhere.at_all:fn",
    ),
    "engine option the engine lacks": (
        "kind = 'hf_grpo'\n[trainer.engine_options]\nkv_cache_gib = 2\n",
        "`$.trainer.engine_options.kv_cache_gib`",
    ),
    "messages without a chat template": ("kind = 'hf_grpo'\n", "chat template"),
    "TinyLM setting": ("kind = 'hf_sft'\nd_model = 64\n", "d_model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, place = BAD[case]
    data = ""
    if case == "not a causal LM":
        model = f"hf:{_not_a_causal_lm(tmp_path)}"
    elif case == "messages without a chat template":
        model = f"hf:{_without_chat_template(tmp_path)}"
        prompts = tmp_path / "chats.jsonl"
        chat = {"messages": [{"role": "user", "content": "hi"}], "answer": "1"}
        prompts.write_text(json.dumps(chat) + "\n")
        data = f'path = "{prompts}"\n'
    else:
        model = MODEL
    config = tmp_path / "bad.toml"
    text = _toml(tmp_path / "run", trainer, data).replace(
        f'model = "{MODEL}"', f'model = "{model}"'
    )
    config.write_text(text)
    code, _, err = call_main(["train", str(config)], capsys)
    assert_usage_error(code, err, place)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_prompt_line_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "1"}\n{"answer": "2"}\n')
    config = tmp_path / "bad.toml"
    config.write_text(_toml(tmp_path / "run", "kind = 'hf_grpo'\n", f'path = "{prompts}"\n'))
    code, _, err = call_main(["train", str(config)], capsys)
    assert_usage_error(code, err, f"{prompts}:2")


# --------------------------------------------------------------------------- export


async def test_export_round_trip(tmp_path: Path, anyio_backend: str) -> None:
    """A trained checkpoint exported with save_pretrained loads in transformers with
    the trained weights (the same logits), tokenizer and chat template included."""
    trainer = await _run(_config(tmp_path / "run", "hf_grpo", 2))
    out = export(str(tmp_path / "run"), tmp_path / "exported")
    policy, tokenizer = load_policy(f"hf:{out}", "exported")
    ids = torch.tensor([ChatFormat(tokenizer, "").encode(Prompt("Ben has 3 coins."))])
    with torch.no_grad():
        ours = trainer.policy(ids)  # type: ignore[attr-defined]
        theirs = policy(ids)
    assert torch.equal(ours, theirs)
    original, _ = load_policy(f"hf:{built_in()}", "built-in")
    with torch.no_grad():
        assert not torch.equal(original(ids), theirs)  # the trained weights, not the source


# ------------------------------------------------------------------ shipped configs

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["hf_sft", "hf_grpo", "hf_grpo_vllm", "hf_ppo"])
def test_shipped_configs_load(name: str) -> None:
    config = corun.load_config(REPO / f"configs/{name}.toml")
    assert config.trainer.kind.startswith("hf_")


async def test_sft_warm_start_learns(tmp_path: Path, anyio_backend: str) -> None:
    """configs/hf_sft.toml, shortened: held-out numeric match rises from the random
    model's ~0.01 by more than 3 standard errors."""
    config = corun.load_config(REPO / "configs/hf_sft.toml", [
        f"run.dir={tmp_path / 'run'}", "run.steps=100", "loop.eval_interval=100",
        "trainer.eval_size=256", "log.progress=off",
    ])  # fmt: skip
    await _run(config)
    evals = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "eval/reward" in r]
    first, last = evals[0], evals[-1]
    assert last["step"] == 100
    assert last["eval/reward"] - first["eval/reward"] > 3 * last["eval/reward_se"], evals


@pytest.mark.parametrize(("concurrency", "shared"), [(1, True), (2, False)])
async def test_a_synchronous_runs_engine_samples_from_the_policys_own_weights(
    tmp_path: Path, anyio_backend: str, concurrency: int, shared: bool
) -> None:
    """At concurrency 1 generation and updates alternate on one lane: the transformers
    engine holds no copy of the weights (one copy less), and every sync's fingerprint
    still checks. With rollouts in flight during updates it keeps its own copy."""
    config = _config(tmp_path / "run", "hf_grpo", 2, loop={"concurrency": concurrency})
    trainer: Any = await _run(config)
    engine = trainer.engine.inner
    assert engine.shared is shared
    policy_weights = {p.data_ptr() for p in trainer.policy.model.parameters()}
    engine_weights = {p.data_ptr() for p in engine.model.parameters()}
    assert (engine_weights == policy_weights) is shared
    assert not engine_weights & policy_weights or shared
    assert set(trainer.fingerprints) == {0, 1, 2}  # every sync verified
