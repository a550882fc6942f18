"""Many Tinker models on one base (trainers/hf/tinker.py): every model holds the base's
weight tensors themselves, so 16 models hold one base plus 16 adapters with their
optimizer state; training models in interleaved order changes neither the base nor
another model, and each model trains as it would alone."""

from __future__ import annotations

from typing import Any

import torch

from corun.contract.training_api import AdamStep, Datum, LoraShape, ModelInfo
from trainers.hf.policy import ChatFormat, load_policy
from trainers.hf.prompts import Prompt
from trainers.hf.tinker import HFTrainingModel

SHAPE = LoraShape(rank=8)


def _storages(*tensors: torch.Tensor) -> dict[int, int]:
    """Bytes held, by storage (a tensor shared by several holders counts once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _held(model: HFTrainingModel) -> list[torch.Tensor]:
    """A model's tensors: its weights and its optimizer's state."""
    optimizer = [v for s in model.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]  # fmt: skip
    return [*model.policy.parameters(), *model.policy.buffers(), *optimizer]


def _datum(chat: ChatFormat, question: str, answer: str) -> Datum:
    prompt = chat.encode(Prompt(question))
    ids = prompt + chat.tokenizer(f" {answer}</s>")["input_ids"]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt))
    return Datum(ids[:-1], {"target_tokens": torch.tensor(ids[1:]),
                            "weights": torch.tensor(weights)})  # fmt: skip


def _step(model: HFTrainingModel, data: list[Datum]) -> float:
    result = model.forward_backward(data, "cross_entropy", {}, backward=True)
    model.optim_step(AdamStep(learning_rate=1e-2))
    return result.metrics["loss:sum"]


def _setup() -> tuple[Any, ChatFormat, ModelInfo]:
    base, tokenizer = load_policy("tiny-llama", "base")
    info = ModelInfo("tiny-llama", SHAPE.rank, str(base.source), 256)
    return base, ChatFormat(tokenizer), info


def test_sixteen_models_hold_one_base() -> None:
    base, chat, info = _setup()
    data = [_datum(chat, f"{a}+1=?", str(a + 1)) for a in range(4)]
    base_bytes = sum(_storages(*base.parameters()).values())
    models = [HFTrainingModel(base, info, SHAPE, seed) for seed in range(16)]
    for model in models:
        _step(model, data)  # the optimizer's state exists
    one = sum(_storages(*_held(models[0])).values())
    every = sum(_storages(*(t for m in models for t in _held(m))).values())
    adapter = one - base_bytes  # one model's adapters and optimizer state
    print(f"base {base_bytes} B, one model {one} B, 16 models {every} B")
    assert adapter > 0
    assert every <= base_bytes + 16 * adapter * 1.01, (every, base_bytes, adapter)


def test_interleaved_models_train_as_alone_and_leave_the_base() -> None:
    base, chat, info = _setup()
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    task = [[_datum(chat, f"{a}+{b}=?", str(a + b)) for a in range(3)] for b in (1, 2)]
    alone = HFTrainingModel(base, info, SHAPE, 0)
    alone_losses = [_step(alone, task[0]) for _ in range(3)]
    first, second = HFTrainingModel(base, info, SHAPE, 0), HFTrainingModel(base, info, SHAPE, 1)
    losses = []
    for _ in range(3):  # interleaved, each on its own task
        losses.append(_step(first, task[0]))
        _step(second, task[1])
    assert losses == alone_losses  # bitwise: the other model's steps touched nothing of its
    for name, p in base.named_parameters():
        assert torch.equal(p, before[name]), name
    adapters = {n: p for n, p in first.policy.named_parameters() if p.requires_grad}
    others = dict(second.policy.named_parameters())
    assert adapters and all(not torch.equal(p, others[n]) for n, p in adapters.items())
