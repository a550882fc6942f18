"""The SFT trainer and its small-LM parts, called directly (no runtime loop)."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from corun.base.config import Config
from corun.base.errors import CheckpointError, ConfigError, DataError
from corun.contract.config_file import config_from_dict, load_config
from tests.support.loops import Harness
from trainers.lm.model import ModelConfig, TinyLM
from trainers.lm.sft import SFTConfig, SFTTrainer, load_policy
from trainers.lm.tasks import (
    EOS,
    PAD,
    TASKS,
    TaskData,
    decode,
    encode,
    encode_examples,
    encode_prompts,
)

KIND = "trainers.lm.sft:SFTTrainer"  # entry points may not be installed in the test env
REPO = Path(__file__).resolve().parents[1]


def make_config(data: dict[str, Any] | None = None, **trainer: Any) -> Config:
    trainer = {"kind": KIND, "eval_size": 32, **trainer}
    return config_from_dict({"trainer": trainer, "data": {"batch_size": 16, **(data or {})}})


def make_trainer(seed: int = 0, **trainer: Any) -> Harness[SFTTrainer]:
    return Harness(SFTTrainer, make_config(**trainer), seed=seed)


def train(sft: Harness[SFTTrainer], steps: int) -> None:
    sft.train(range(steps))


def global_rng_states() -> tuple[Any, ...]:
    numpy_state = np.random.get_state(legacy=False)["state"]
    numpy_key = numpy_state["key"].tobytes(), numpy_state["pos"]
    return random.getstate(), numpy_key, torch.get_rng_state()


def assert_same_rng(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert before[:2] == after[:2]
    assert torch.equal(before[2], after[2])


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_data_is_a_pure_function_of_seed_and_index(name: str) -> None:
    data = TaskData(TASKS[name], batch_size=8, seed=3)
    before = global_rng_states()
    first = data.batch(5)
    assert_same_rng(before, global_rng_states())
    random.seed(123)
    torch.manual_seed(123)
    assert data.batch(5) == first
    assert TaskData(TASKS[name], batch_size=8, seed=3).batch(5) == first
    assert data.batch(6) != first
    assert TaskData(TASKS[name], batch_size=8, seed=4).batch(5) != first
    for prompt, answer in first:
        assert TASKS[name].solve(prompt) == answer


def test_examples_of_each_task() -> None:
    assert TASKS["sort"].solve("314259>") == "123459"
    assert TASKS["addition"].solve("07+34=") == "41"
    assert TASKS["addition"].solve("99+99=") == "198"
    assert TASKS["reverse"].solve("314259=") == "952413"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_eval_split_is_held_out_of_training(name: str) -> None:
    task = TASKS[name]
    eval_set = task.eval_set(512)
    assert eval_set == task.eval_set(512)  # deterministic
    eval_prompts = {prompt for prompt, _ in eval_set}
    assert len(eval_prompts) == 512
    assert all(task.in_eval_split(prompt) for prompt in eval_prompts)
    data = TaskData(task, batch_size=500, seed=0)
    trained = {prompt for i in range(40) for prompt, _ in data.batch(i)}
    assert not trained & eval_prompts
    assert not any(task.in_eval_split(prompt) for prompt in trained)


def test_reward_gives_partial_credit() -> None:
    reward = TASKS["sort"].reward
    assert reward("314259>", "123459", "123459") == 1.0
    assert reward("314259>", "123459", "123450") == pytest.approx(0.5 * 5 / 6)
    assert reward("314259>", "123459", "1234599") == 0.5  # right digits, too long
    assert reward("314259>", "123459", "") == 0.0
    assert TASKS["addition"].reward("07+34=", "41", "4") == 0.25


def test_tokenisation_masks_answer_and_eos_only() -> None:
    assert decode([*encode("07+34="), EOS, 5, 6]) == "07+34="
    tokens = encode_examples([("07+34=", "41"), ("99+99=", "198")])
    assert tokens.inputs.shape == tokens.targets.shape == tokens.loss_mask.shape == (2, 9)
    for row, (prompt, answer) in enumerate([("07+34=", "41"), ("99+99=", "198")]):
        seq = [*encode(prompt + answer), EOS]
        n = len(seq) - 1
        assert tokens.inputs[row, :n].tolist() == seq[:-1]
        assert tokens.targets[row, :n].tolist() == seq[1:]
        assert tokens.inputs[row, n:].eq(PAD).all()
        masked = tokens.targets[row][tokens.loss_mask[row]].tolist()
        assert masked == [*encode(answer), EOS]
    with pytest.raises(ValueError, match="share a length"):
        encode_prompts(["1>", "12>"])


# ----------------------------------------------------------------------------- model


def test_generate_stops_and_samples_reproducibly() -> None:
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(vocab_size=15, d_model=32, n_layers=1, n_heads=2, max_len=12))
    prompts = encode_prompts(["314259>", "000111>"])
    greedy = model.generate(prompts, 6, stop_id=EOS)
    assert greedy.shape[0] == 2 and greedy.shape[1] <= 6
    for row in greedy.tolist():  # after a stop, only stops
        if EOS in row:
            assert set(row[row.index(EOS) :]) == {EOS}
    draws = [
        model.generate(
            prompts, 6, stop_id=EOS, temperature=1.0, generator=torch.Generator().manual_seed(1)
        )
        for _ in range(2)
    ]
    assert torch.equal(draws[0], draws[1])
    with pytest.raises(ValueError, match="max_len"):
        model.generate(prompts, 7, stop_id=EOS)


# ----------------------------------------------------------------------------- config and data


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"\$\.trainer\.lr"):
        make_config(lr=0.0)
    with pytest.raises(ConfigError, match=r"`\$\.trainer\.d_model` \(30\) must be divisible"):
        make_config(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="unknown field `learning_rate`"):
        make_config(learning_rate=1e-3)
    with pytest.raises(ConfigError, match=r"\$\.trainer\.task"):
        make_config(task="division")
    shipped = load_config(REPO / "configs/sft.toml", [f"trainer.kind={KIND}"])
    assert isinstance(shipped.trainer, SFTConfig) and shipped.trainer.task == "sort"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "12>" "answer": "12"}', "malformed"),
        ('{"prompt": "12>"}', "missing required field `answer`"),
        ('{"prompt": "ab>", "answer": "12"}', "'ab'"),
    ],
)
def test_bad_data_file_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(f'{{"prompt": "21>", "answer": "12"}}\n\n{line}\n')
    sft = SFTTrainer(make_config(data={"path": str(path)}))
    with pytest.raises(DataError, match=f"{path}:3: .*{message}"):
        sft.dataset()


def test_data_file_feeds_rollout(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "21>", "answer": "12"}\n{"prompt": "1+1=", "answer": "2"}\n')
    sft = SFTTrainer(make_config(data={"path": str(path), "batch_size": 3}))
    examples = sft.dataset().batch(0)
    assert len(examples) == 3 and set(examples) <= {("21>", "12"), ("1+1=", "2")}
    assert Harness(SFTTrainer, sft.run_config).rollout(0, examples).data.inputs.shape[0] == 3


# ----------------------------------------------------------------------------- trainer


def test_seeded_runs_give_bitwise_equal_weights() -> None:
    runs = []
    for _ in range(2):
        sft = make_trainer(seed=7, micro_batches=2)
        train(sft, 3)
        runs.append(sft.trainer.model.state_dict())
    assert_same_tensors(*runs)


def test_micro_batches_match_one_big_batch() -> None:
    """The same loss and gradients up to float rounding. (Gradients, not the weights
    after an Adam step: Adam divides by the gradient's own size, so a rounding-level
    difference on a near-zero gradient becomes a full-size step difference.)"""
    one, four = make_trainer(micro_batches=1), make_trainer(micro_batches=4)
    losses = [sft.train([0])[0]["train/loss"] for sft in (one, four)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    grads = [{n: p.grad for n, p in sft.trainer.model.named_parameters()} for sft in (one, four)]
    for key, value in grads[0].items():
        torch.testing.assert_close(grads[1][key], value, rtol=1e-4, atol=1e-7)


def test_evaluate_draws_no_global_randomness() -> None:
    sft = make_trainer().trainer
    before = global_rng_states()
    metrics = sft.evaluate()
    assert_same_rng(before, global_rng_states())
    assert set(metrics) == {"eval/loss", "eval/accuracy", "eval/reward"}
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0


def test_state_dict_round_trips_and_warm_starts_a_policy() -> None:
    sft = make_trainer()
    train(sft, 2)
    buffer = io.BytesIO()
    torch.save(sft.trainer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["task"] == "sort" and state["model_config"]["d_model"] == 128

    resumed = make_trainer(seed=99)
    resumed.trainer.load_state_dict(state)
    assert_same_tensors(sft.trainer.model.state_dict(), resumed.trainer.model.state_dict())
    sft.train([2])  # the optimizer state came back too: the next step agrees bitwise
    resumed.train([2])
    assert_same_tensors(sft.trainer.model.state_dict(), resumed.trainer.model.state_dict())

    before = global_rng_states()
    policy = load_policy(state)
    assert_same_rng(before, global_rng_states())
    reference = make_trainer(seed=5).trainer
    reference.model.load_state_dict(state["model"])
    ids = encode_prompts(["314259>"])
    assert torch.equal(policy(ids), reference.model(ids))

    with pytest.raises(CheckpointError, match="task 'sort'"):
        make_trainer(task="reverse").trainer.load_state_dict(state)
