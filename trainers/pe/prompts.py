"""User prompts for the prompt enhancer: the shapes prompts said the way a user might.

A user names the same three attributes as the flow model's prompts (colour, shape,
place) but in words the flow model never saw: synonyms ("crimson", "ball", "upper"),
fillers and varied word order ("a disc, red, top left" / "upper left crimson ball").
The text policy reads such a prompt and writes the flow model's three condition
tokens. Its vocabulary is the LM specials, a separator, the user words and the flow
vocabulary, in that order.

Phrasings come from ``torch.Generator`` instances seeded by stable hashes, so a batch
is a pure function of (seed, index) and eval prompts are the same in every process.
The attribute combinations keep the held-out split of :mod:`trainers.diffusion.shapes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import corun
from trainers.diffusion import shapes
from trainers.diffusion.shapes import Prompt
from trainers.lm.tasks import EOS, PAD

COLOR_WORDS = {
    "red": ("red", "crimson", "scarlet"),
    "green": ("green", "emerald", "lime"),
    "blue": ("blue", "azure", "navy"),
    "yellow": ("yellow", "golden", "lemon"),
    "magenta": ("magenta", "pink", "fuchsia"),
    "cyan": ("cyan", "teal", "aqua"),
}
SHAPE_WORDS = {"square": ("square", "box", "block"), "disc": ("disc", "circle", "ball", "dot")}
ROW_WORDS = {"top": ("top", "upper"), "bottom": ("bottom", "lower")}
COL_WORDS = {"left": ("left",), "right": ("right",)}
CENTRE_WORDS = ("centre", "middle")
FILLERS = ("a", "at", "in", "the", ",")
# Word orders: c = colour, s = shape, p = place (one or two words); fillers as written.
TEMPLATES = (("a", "c", "s", "p"), ("c", "s", "at", "p"), ("s", ",", "c", ",", "p"),
             ("p", "c", "s"), ("the", "s", "in", "p", "c"))  # fmt: skip

USER_WORDS = tuple(sorted({
    *(w for table in (COLOR_WORDS, SHAPE_WORDS, ROW_WORDS, COL_WORDS)
      for words in table.values() for w in words),
    *CENTRE_WORDS, *FILLERS,
}))  # fmt: skip
assert PAD == 0 and EOS == 1, "the LM engine stops at EOS and pads with PAD"
SEP = 2  # ends every user prompt: the rewrite starts after it
USER_BASE = 3
FLOW_BASE = USER_BASE + len(USER_WORDS)  # text id of flow token 0
VOCAB = ("<pad>", "<eos>", "<sep>", *USER_WORDS, *(f"<{t}>" for t in shapes.VOCAB))
VOCAB_SIZE = len(VOCAB)
USER_LEN = 6  # words of the longest phrasing
PROMPT_LEN = USER_LEN + 1  # left-padded words, then SEP
REWRITE_LEN = shapes.PROMPT_LEN  # colour, shape, place
_WORD_IDS = {word: USER_BASE + i for i, word in enumerate(USER_WORDS)}


def _pick(options: Sequence[str], generator: torch.Generator) -> str:
    return options[int(torch.randint(len(options), (1,), generator=generator))]


def phrase(prompt: Prompt, generator: torch.Generator, plain: bool = False) -> list[str]:
    """One user phrasing of ``prompt``: synonyms, fillers and a word order drawn from
    ``generator``; ``plain`` keeps to the first synonym of each attribute (the flow
    vocabulary's own word, or the first of a place's)."""

    def pick(options: Sequence[str]) -> str:
        return _pick(options[:1] if plain else options, generator)

    row, col = (
        next((p for p in prompt.place.split("-") if p in t), "") for t in (ROW_WORDS, COL_WORDS)
    )
    place = [pick(ROW_WORDS[row])] if row else []
    place += [pick(COL_WORDS[col])] if col else []
    words = []
    for slot in TEMPLATES[int(torch.randint(len(TEMPLATES), (1,), generator=generator))]:
        if slot == "c":
            words.append(pick(COLOR_WORDS[prompt.color]))
        elif slot == "s":
            words.append(pick(SHAPE_WORDS[prompt.shape]))
        elif slot == "p":
            words += place or [pick(CENTRE_WORDS)]
        else:
            words.append(slot)
    assert len(words) <= USER_LEN, words
    return words


def encode_user(phrasings: Sequence[Sequence[str]]) -> Tensor:
    """Prompt ids (N, PROMPT_LEN): words left-padded with PAD, then SEP, so every
    rewrite starts at the same position."""
    rows = [[PAD] * (USER_LEN - len(ws)) + [_WORD_IDS[w] for w in ws] + [SEP] for ws in phrasings]
    return torch.tensor(rows, dtype=torch.long).view(-1, PROMPT_LEN)


def flow_tokens(rewrite_ids: Tensor) -> Tensor:
    """The flow model's condition tokens (N, 3) of rewrites (text ids, N × ≥3)."""
    tokens = rewrite_ids[:, :REWRITE_LEN] - FLOW_BASE
    assert bool(((tokens > shapes.NULL) & (tokens < shapes.VOCAB_SIZE)).all()), "not flow tokens"
    return tokens


@dataclass(frozen=True)
class UserBatch:
    prompt_ids: Tensor  # (N, PROMPT_LEN)
    targets: Tensor  # (N, 3) flow tokens of what the user asked for
    texts: list[str]  # the user prompts, for captions

    def __len__(self) -> int:
        return self.targets.shape[0]

    def rows(self, rows: slice) -> UserBatch:
        """Some users (a data-parallel rank's share, corun.execution.distributed.shard)."""
        return UserBatch(self.prompt_ids[rows], self.targets[rows], self.texts[rows])


def user_batch(targets: Tensor, generator: torch.Generator, plain: bool = False) -> UserBatch:
    """User phrasings of the prompts in ``targets`` (flow tokens)."""
    phrasings = [phrase(prompt, generator, plain) for prompt in shapes.decode(targets)]
    return UserBatch(encode_user(phrasings), targets, [" ".join(ws) for ws in phrasings])


class UserData:
    """Training batches over the training combinations: batch ``i`` is a pure function
    of (seed, i, batch_size, plain)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, batch_size: int, seed: int, plain: bool = False) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.plain = plain

    def batch(self, index: int) -> UserBatch:
        generator = corun.generator("pe-users", self.seed, index)
        targets = shapes.sample_prompts(shapes.TRAIN_PROMPTS, self.batch_size, generator)
        return user_batch(targets, generator, self.plain)


def eval_users(targets: Tensor) -> UserBatch:
    """Fixed phrasings of held-out prompts (the same ones in every run)."""
    return user_batch(targets, corun.generator("pe-eval-users"))
