"""PNG sample grids: images scaled up (nearest neighbour) with each caption underneath."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

_PAD = 4  # pixels around each cell
_BACKGROUND = (24, 24, 24)
_TEXT = (230, 230, 230)


def to_uint8(images: Tensor) -> Tensor:
    """(N, C, H, W) in [-1, 1] → (N, H, W, C) uint8; values outside are clipped."""
    return (
        ((images.detach().float().clamp(-1, 1) + 1) * 127.5)
        .round()
        .to(torch.uint8)
        .permute(0, 2, 3, 1)
    )


def _wrap(text: str, font: ImageFont.ImageFont | ImageFont.FreeTypeFont, width: int) -> list[str]:
    """Greedy word wrap to ``width`` pixels (a word longer than that gets a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
        else:
            lines.append(word)
    return lines


def save_grid(
    images: Tensor,
    captions: Sequence[str],
    path: str | Path,
    *,
    columns: int = 8,
    scale: int = 4,
) -> Path:
    """Write ``images`` (N, 3, H, W in [-1, 1]) as a PNG grid, each captioned underneath.

    Written to a temporary name and renamed into place, so a reader never sees half a
    file. Returns ``path``.
    """
    if len(captions) != images.shape[0] or images.shape[0] == 0:
        raise ValueError(f"need one caption per image, got {len(captions)} for {images.shape[0]}")
    if columns < 1 or scale < 1:
        raise ValueError(f"columns and scale must be >= 1, got {columns}, {scale}")
    font = ImageFont.load_default()
    n, _, height, width = images.shape
    cell_w, cell_h = width * scale, height * scale
    wrapped = [_wrap(caption, font, cell_w) for caption in captions]
    line_h = int(font.getbbox("Ay")[3]) + 2  # FreeType or bitmap default font alike
    text_h = line_h * max(len(lines) for lines in wrapped)
    columns = min(columns, n)
    rows = -(-n // columns)
    step_x, step_y = cell_w + 2 * _PAD, cell_h + text_h + 3 * _PAD
    canvas = Image.new("RGB", (columns * step_x, rows * step_y), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    pixels = to_uint8(images).numpy()
    for i in range(n):
        x0, y0 = (i % columns) * step_x + _PAD, (i // columns) * step_y + _PAD
        tile = Image.fromarray(pixels[i], "RGB").resize((cell_w, cell_h), Image.Resampling.NEAREST)
        canvas.paste(tile, (x0, y0))
        for j, line in enumerate(wrapped[i]):
            draw.text((x0, y0 + cell_h + _PAD + j * line_h), line, fill=_TEXT, font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    canvas.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path
