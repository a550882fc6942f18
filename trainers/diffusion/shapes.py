"""Synthetic text-to-image data: one coloured shape at one of nine places, with rewards.

An image is 16×16 RGB in [-1, 1], shape (N, 3, 16, 16): a square or a disc a few
pixels wide, of one of six colours, centred on one of nine places (a 3×3 grid), on a
dark background, with random jitter in position, size, colour and background (the
position and colour jitter scale with ``jitter``: small by default). A prompt
names the three attributes ("red disc top-left"); the model sees it as three token
ids in a tiny vocabulary whose id 0 (``NULL``) is the empty condition of
classifier-free guidance.

Rewards are computed from pixels, per image, in [0, 1], and are meant for generated
(imperfect) images as much as for clean ones: colour (mean hue of the bright pixels)
and position (centroid of the bright mass, penalised when the mass is spread out).
The shape is not rewarded: at 16 px a disc and a square differ by a few pixels.

Randomness comes only from ``torch.Generator`` instances seeded by stable hashes, so
a batch is a pure function of (seed, index) in every process and never touches the
global RNGs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

import corun

IMAGE_SIZE = 16

# ----------------------------------------------------------------------------- prompts

COLORS: dict[str, tuple[float, float, float]] = {  # RGB in [0, 1]
    "red": (0.92, 0.14, 0.12),
    "green": (0.15, 0.85, 0.20),
    "blue": (0.20, 0.35, 1.00),
    "yellow": (0.95, 0.90, 0.15),
    "magenta": (0.90, 0.15, 0.90),
    "cyan": (0.15, 0.88, 0.95),
}
SHAPES = ("square", "disc")
# Centres in pixel coordinates (pixel i covers [i, i + 1)), row-major over the 3×3 grid.
PLACES: dict[str, tuple[float, float]] = {
    f"{row}{'-' if row and col else ''}{col}" or "centre": (x, y)
    for row, y in (("top", 4.0), ("", 8.0), ("bottom", 12.0))
    for col, x in (("left", 4.0), ("", 8.0), ("right", 12.0))
}

NULL = 0  # the empty condition (classifier-free guidance), in every slot
VOCAB = ("<null>", *COLORS, *SHAPES, *PLACES)
VOCAB_SIZE = len(VOCAB)
PROMPT_LEN = 3  # tokens: colour, shape, place
_OFFSETS = (1, 1 + len(COLORS), 1 + len(COLORS) + len(SHAPES))
_COLOR_NAMES, _PLACE_NAMES = tuple(COLORS), tuple(PLACES)


class Prompt(NamedTuple):
    color: str
    shape: str
    place: str


def describe(prompt: Prompt) -> str:
    """The caption of a prompt: ``"red disc top-left"``."""
    return " ".join(prompt)


def all_prompts() -> list[Prompt]:
    return [Prompt(c, s, p) for c in COLORS for s in SHAPES for p in PLACES]


def in_eval_split(prompt: Prompt) -> bool:
    """Held out of training: 18 of the 108 combinations.

    A Latin-square rule rather than a hash, so every (colour, place) pair is still
    trained with at least one shape and held-out prompts test composition, not
    unseen attributes: (colour, place) pairs with (c + p) % 6 == 0 hold out the
    square, pairs with (c + p) % 6 == 3 the disc.
    """
    c, p = _COLOR_NAMES.index(prompt.color), _PLACE_NAMES.index(prompt.place)
    return (c + p) % 6 == 3 * SHAPES.index(prompt.shape)


TRAIN_PROMPTS = [p for p in all_prompts() if not in_eval_split(p)]
EVAL_PROMPTS = [p for p in all_prompts() if in_eval_split(p)]


def encode(prompts: Sequence[Prompt]) -> Tensor:
    """Token ids, (N, 3) int64: one per attribute, each in its own range of the vocabulary."""
    rows = []
    for prompt in prompts:
        try:
            ids = (
                _COLOR_NAMES.index(prompt.color),
                SHAPES.index(prompt.shape),
                _PLACE_NAMES.index(prompt.place),
            )
        except ValueError:
            raise ValueError(f"unknown attribute in prompt {prompt!r}") from None
        rows.append([offset + i for offset, i in zip(_OFFSETS, ids, strict=True)])
    return torch.tensor(rows, dtype=torch.long).view(-1, PROMPT_LEN)


def decode(tokens: Tensor) -> list[Prompt]:
    """The prompts of (N, 3) token ids (none may be ``NULL``)."""
    return [Prompt(*(VOCAB[i] for i in row)) for row in tokens.tolist()]


def captions(tokens: Tensor) -> list[str]:
    return [describe(prompt) for prompt in decode(tokens)]


def _attributes(tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(colour, shape, place) indices of (N, 3) token ids."""
    offsets = torch.tensor(_OFFSETS, device=tokens.device)
    index = tokens - offsets
    assert bool((index >= 0).all()), "NULL tokens have no attributes"
    return index[:, 0], index[:, 1], index[:, 2]


_COLOR_TABLE = torch.tensor(list(COLORS.values()))
_PLACE_TABLE = torch.tensor(list(PLACES.values()))


# ----------------------------------------------------------------------------- images

_SUPERSAMPLE = 4  # anti-aliasing: coverage is the mean over 4×4 points per pixel
# Jitter at scale 1: the object's centre moves up to ±1 px on each axis and each colour
# channel up to ±0.08. A larger scale makes the data sloppy (at 2.5 its own images earn
# a mean reward of ~0.5): "roughly the right colour at roughly the right place", which
# leaves reward-driven fine-tuning something to sharpen.
_PLACE_JITTER, _COLOR_JITTER = 1.0, 0.08


def render(tokens: Tensor, generator: torch.Generator, jitter: float = 1.0) -> Tensor:
    """Images of the prompts in ``tokens``, (N, 3, 16, 16) in [-1, 1]; ``jitter`` scales
    the random offsets of position and colour (0: every object exactly on target)."""
    n = tokens.shape[0]
    color_i, shape_i, place_i = _attributes(tokens)

    def uniform(*shape: int, low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator)

    place_jitter, color_jitter = jitter * _PLACE_JITTER, jitter * _COLOR_JITTER
    centre = _PLACE_TABLE[place_i] + uniform(n, 2, low=-place_jitter, high=place_jitter)
    radius = uniform(n, low=2.3, high=3.0)
    color = _COLOR_TABLE[color_i] + uniform(n, 3, low=-color_jitter, high=color_jitter)
    color = color.clamp(0, 1)
    background = uniform(n, 1, low=0.03, high=0.10) * torch.tensor([1.0, 1.0, 1.2])

    # Sub-pixel sample points, (S,) with S = 16 × 4 along each axis.
    points = (torch.arange(IMAGE_SIZE * _SUPERSAMPLE) + 0.5) / _SUPERSAMPLE
    dx = points.view(1, 1, -1) - centre[:, 0].view(n, 1, 1)
    dy = points.view(1, -1, 1) - centre[:, 1].view(n, 1, 1)
    r = radius.view(n, 1, 1)
    disc = dx.square() + dy.square() <= r.square()
    # A square of about the disc's area (half-side 0.89 r), so shape is not a size cue.
    square = torch.maximum(dx.abs(), dy.abs()) <= 0.89 * r
    is_square = (shape_i == SHAPES.index("square")).view(n, 1, 1)
    inside = torch.where(is_square, square, disc).float()
    coverage = torch.nn.functional.avg_pool2d(inside.unsqueeze(1), _SUPERSAMPLE)  # (N,1,16,16)
    rgb = background.view(n, 3, 1, 1) * (1 - coverage) + color.view(n, 3, 1, 1) * coverage
    return rgb * 2 - 1


@dataclass(frozen=True)
class ShapeBatch:
    images: Tensor  # (N, 3, 16, 16) float32 in [-1, 1]
    tokens: Tensor  # (N, 3) int64

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, rows: slice) -> ShapeBatch:
        """Some prompts (a data-parallel rank's share, corun.execution.distributed.shard)."""
        return ShapeBatch(self.images[rows], self.tokens[rows])


def sample_prompts(prompts: Sequence[Prompt], n: int, generator: torch.Generator) -> Tensor:
    """Tokens of ``n`` prompts drawn uniformly (with replacement) from ``prompts``."""
    table = encode(prompts)
    return table[torch.randint(len(prompts), (n,), generator=generator)]


class ShapeData:
    """Training batches over the training prompts: batch ``i`` is a pure function of
    (seed, i, batch_size, jitter)."""

    in_memory = True  # batches computed from memory: fetched without a deadline

    def __init__(self, batch_size: int, seed: int, jitter: float = 1.0) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.jitter = jitter

    def batch(self, index: int) -> ShapeBatch:
        generator = corun.generator("shapes", self.seed, index)
        tokens = sample_prompts(TRAIN_PROMPTS, self.batch_size, generator)
        return ShapeBatch(render(tokens, generator, self.jitter), tokens)


def eval_tokens(n: int) -> Tensor:
    """``n`` held-out prompts, cycling through all of them in a fixed order."""
    return encode([EVAL_PROMPTS[i % len(EVAL_PROMPTS)] for i in range(n)])


# ----------------------------------------------------------------------------- rewards


class Rewards(NamedTuple):
    """Per-image rewards in [0, 1], each (N,)."""

    color: Tensor
    position: Tensor
    total: Tensor  # weighted mean of the two


# Bright-pixel weight: 0 at the background's level, 1 for any palette colour.
_FG_LOW, _FG_HIGH = 0.3, 0.7
# A clean object has a foreground mass of ~15–28 pixels; below this, credit fades.
_PRESENT_MASS = 6.0
# Tolerances: the distance at which credit falls to exp(-1/2). Tight enough that the
# default data's own jitter costs ~13% (clean prompts at jitter 0 earn ~1), and a
# neighbouring place (4 px away) earns exp(-32/9) ≈ 0.03.
_COLOR_TOL = 0.15  # chroma distance
_POSITION_TOL = 1.5  # pixels
# Mean squared distance from the centroid of the largest clean object (~4.9 px²);
# mass spread beyond this (blobs, smears) counts as distance from the target.
_SPREAD_ALLOWED = 6.0


def score(images: Tensor, tokens: Tensor, color_weight: float = 0.5) -> Rewards:
    """Colour and position rewards of ``images`` (N, 3, 16, 16) for prompts ``tokens``.

    Pixels are weighted by brightness (their largest channel), so the dark background
    drops out. Colour compares the chroma (RGB over its largest channel, so a dim red
    is still red) of the weighted mean colour with the target's; position compares the
    weighted centroid with the target place, adding the spread beyond a clean
    object's to the distance. Both fade to 0 when there is almost no bright mass.
    """
    color_i, _, place_i = _attributes(tokens)
    rgb = (images.detach().float().clamp(-1, 1) + 1) / 2
    weight = ((rgb.amax(dim=1) - _FG_LOW) / (_FG_HIGH - _FG_LOW)).clamp(0, 1)  # (N,H,W)
    mass = weight.sum(dim=(1, 2))
    safe_mass = mass.clamp_min(1e-6)
    present = (mass / _PRESENT_MASS).clamp(max=1.0)

    mean_rgb = (rgb * weight.unsqueeze(1)).sum(dim=(2, 3)) / safe_mass.unsqueeze(1)
    target = _COLOR_TABLE[color_i]
    chroma = mean_rgb / mean_rgb.amax(dim=1, keepdim=True).clamp_min(1e-6)
    target_chroma = target / target.amax(dim=1, keepdim=True)
    color_dist2 = (chroma - target_chroma).square().sum(dim=1)
    color = present * torch.exp(-color_dist2 / (2 * _COLOR_TOL**2))

    coords = torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5
    cx = (weight.sum(dim=1) * coords).sum(dim=1) / safe_mass
    cy = (weight.sum(dim=2) * coords).sum(dim=1) / safe_mass
    spread = (
        weight * ((coords.view(1, 1, -1) - cx.view(-1, 1, 1)).square()
                  + (coords.view(1, -1, 1) - cy.view(-1, 1, 1)).square())
    ).sum(dim=(1, 2)) / safe_mass  # fmt: skip
    goal = _PLACE_TABLE[place_i]
    dist2 = (cx - goal[:, 0]).square() + (cy - goal[:, 1]).square()
    dist2 = dist2 + (spread - _SPREAD_ALLOWED).clamp_min(0)
    position = present * torch.exp(-dist2 / (2 * _POSITION_TOL**2))

    total = color_weight * color + (1 - color_weight) * position
    return Rewards(color, position, total)
