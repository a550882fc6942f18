"""Synthetic verifiable tasks for TinyLM: vocabulary, tasks, held-out split, data, tokens.

Every task makes (prompt, answer) pairs in code and scores any response, so SFT,
GRPO and PPO need no downloads and evaluation is exact. All randomness comes from
``random.Random`` instances seeded from stable hashes (hashlib, never Python's
salted ``hash()``), so a batch or an eval set is the same in every process and
never touches, or depends on, the global RNGs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainers.lm.vocab import EOS as EOS
from trainers.lm.vocab import PAD as PAD
from trainers.lm.vocab import CharVocab

# ----------------------------------------------------------------------------- vocabulary

CHARS = "0123456789+=>"
VOCABULARY = CharVocab(CHARS)
VOCAB = VOCABULARY.tokens
VOCAB_SIZE = len(VOCABULARY)
# Longest token sequence (prompt + answer + EOS) the models are built for.
MAX_LEN = 32

Example = tuple[str, str]  # (prompt, answer)
unknown_chars = VOCABULARY.unknown
encode = VOCABULARY.encode
decode = VOCABULARY.decode


def _stable_int(*parts: object) -> int:
    """A 64-bit integer from ``parts``, the same in every process (unlike ``hash()``)."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


# ----------------------------------------------------------------------------- tasks

# One prompt in EVAL_BUCKETS is held out; addition has 10^4 prompts, so ~1000 held out.
EVAL_BUCKETS = 10


@dataclass(frozen=True)
class Task:
    """A prompt generator and its exact solver; prompts of one task share a length."""

    name: str
    make_prompt: Callable[[random.Random], str]
    solve: Callable[[str], str]
    max_answer_len: int

    def in_eval_split(self, prompt: str) -> bool:
        """Held out from training, decided by a stable hash of the prompt alone."""
        return _stable_int("eval-split", prompt) % EVAL_BUCKETS == 0

    def sample(self, rng: random.Random) -> Example:
        """A training example: never a prompt of the held-out split."""
        while True:
            prompt = self.make_prompt(rng)
            if not self.in_eval_split(prompt):
                return prompt, self.solve(prompt)

    def eval_set(self, n: int) -> list[Example]:
        """``n`` distinct held-out examples, the same on every call and in every process."""
        rng = random.Random(_stable_int("eval-set", self.name))
        prompts: dict[str, None] = {}  # insertion-ordered set
        for _ in range(100 * n + 10_000):
            prompt = self.make_prompt(rng)
            if self.in_eval_split(prompt):
                prompts[prompt] = None
                if len(prompts) == n:
                    return [(prompt, self.solve(prompt)) for prompt in prompts]
        raise ValueError(f"task {self.name!r} has fewer than {n} held-out prompts")

    def reward(self, prompt: str, answer: str, response: str) -> float:
        """1 for an exact answer, else 0.5 x the fraction of answer positions right.

        Partial credit gives RL a gradient before the first exact answer.
        """
        if response == answer:
            return 1.0
        right = sum(a == r for a, r in zip(answer, response, strict=False))
        return 0.5 * right / max(len(answer), 1)


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        # 314259> -> 123459
        Task("sort", lambda rng: _digits(rng, 6) + ">", lambda p: "".join(sorted(p[:-1])), 6),
        # 07+34= -> 41
        Task(
            "addition",
            lambda rng: f"{_digits(rng, 2)}+{_digits(rng, 2)}=",
            lambda p: str(int(p[:2]) + int(p[3:5])),
            3,
        ),
        # 314259= -> 952413
        Task("reverse", lambda rng: _digits(rng, 6) + "=", lambda p: p[-2::-1], 6),
    )
}


class TaskData:
    """Training batches of a task: batch ``i`` is a pure function of (seed, i, batch_size)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, task: Task, batch_size: int, seed: int) -> None:
        self.task = task
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, index: int) -> list[Example]:
        rng = random.Random(_stable_int("batch", self.task.name, self.seed, index))
        return [self.task.sample(rng) for _ in range(self.batch_size)]


# ----------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class TokenBatch:
    """Teacher-forcing tensors, right-padded with PAD; ``loss_mask`` marks answer + EOS targets."""

    inputs: Tensor  # (batch, length) int64
    targets: Tensor  # (batch, length) int64: inputs shifted left by one
    loss_mask: Tensor  # (batch, length) bool

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def rows(self, rows: slice | Tensor) -> TokenBatch:
        return TokenBatch(self.inputs[rows], self.targets[rows], self.loss_mask[rows])

    def lengths(self) -> list[int]:
        """Each row's positions up to its last target: what a chunk cut to it computes."""
        mask = self.loss_mask
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        return torch.where(mask, positions, 0).amax(dim=1).tolist()

    def trimmed(self) -> TokenBatch:
        """The same rows cut to the longest one (at least one position): right padding
        past every row's last target changes nothing a causal model computes there."""
        width = max(1, *self.lengths())
        return TokenBatch(
            self.inputs[:, :width], self.targets[:, :width], self.loss_mask[:, :width]
        )


def encode_examples(examples: Sequence[Example]) -> TokenBatch:
    """Sequences ``prompt + answer + EOS``; the loss covers only the answer and EOS."""
    return teacher_forcing([(encode(p), [*encode(a), EOS]) for p, a in examples], PAD)


def teacher_forcing(sequences: Sequence[tuple[list[int], list[int]]], pad: int) -> TokenBatch:
    """(prompt ids, target ids) pairs as one batch; the loss covers the targets.

    Right padding is safe without an attention mask: causal attention never lets a
    real token see the pads after it, and pad targets are masked out.
    """
    length = max(len(p) + len(a) for p, a in sequences) - 1
    inputs, targets, mask = [], [], []
    for prompt, answer in sequences:
        seq = prompt + answer
        fill = length - (len(seq) - 1)
        inputs.append(seq[:-1] + [pad] * fill)
        targets.append(seq[1:] + [pad] * fill)
        # targets[t] = seq[t + 1]; the answer sits at seq[len(prompt):].
        mask.append([False] * (len(prompt) - 1) + [True] * len(answer) + [False] * fill)
    return TokenBatch(torch.tensor(inputs), torch.tensor(targets), torch.tensor(mask))


def encode_prompts(prompts: Sequence[str]) -> Tensor:
    """Prompts as one (batch, length) tensor for ``TinyLM.generate``; lengths must match."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts in one generate call must share a length, got {lengths}")
    return torch.tensor([encode(p) for p in prompts])


def decode_responses(ids: Tensor) -> list[str]:
    """Each row of generated ids as text, cut at the first EOS."""
    return [decode(row) for row in ids.tolist()]
