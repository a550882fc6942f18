"""FlowDiT: a tiny conditional velocity network for rectified flow, and its checkpoints.

Convention (Flow-GRPO's, SD3's): ``x_t = (1 − t)·x0 + t·ε`` with data ``x0`` at t = 0
and Gaussian noise ``ε`` at t = 1; the network predicts the velocity
``v = dx_t/dt = ε − x0``, and sampling integrates from t = 1 down to t = 0.

The network is a small DiT over 4×4 patches (16 patch tokens for a 16×16 image): the
three prompt tokens are prepended to the sequence (in-context conditioning, so a
patch attends directly to "top-left"), and the timestep, plus the pooled prompt,
modulates every block through adaLN-Zero. The last projection is zero-initialised,
so a fresh model predicts v = 0. ~316k parameters at d_model 64, 3 layers; a
training step on batch 64 takes ~30 ms on one CPU thread.

An all-``NULL`` prompt is the unconditional model of classifier-free guidance.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from corun.base.errors import CheckpointError
from trainers.diffusion.shapes import IMAGE_SIZE, PROMPT_LEN, VOCAB_SIZE
from trainers.weights import load_optimizer_state, optimizer_state, rebuild, warm_start

Size = Annotated[int, msgspec.Meta(ge=1)]


class FlowModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of a FlowDiT; saved with checkpoints so a model can be rebuilt from one."""

    image_size: Size = IMAGE_SIZE
    channels: Size = 3
    patch_size: Size = 4
    d_model: Size = 64
    n_layers: Size = 3
    n_heads: Size = 4
    vocab_size: Size = VOCAB_SIZE
    prompt_len: Size = PROMPT_LEN

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})"
            )
        if self.d_model % self.n_heads or self.d_model % 2:
            raise ValueError(
                f"d_model ({self.d_model}) must be even and divisible by n_heads ({self.n_heads})"
            )


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of t ∈ [0, 1], (N,) → (N, dim); t is scaled by 1000 as in DiT.
    Computed in float32, or in float64 for a float64 t (a model built in float64)."""
    half = dim // 2
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=dtype, device=t.device) / half)
    angles = 1000.0 * t.to(dtype).unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Block(nn.Module):
    """Pre-norm transformer block whose norms are modulated by the condition (adaLN-Zero)."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm_attn = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm_mlp = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        # Zero-initialised: each block starts as the identity.
        self.ada = nn.Linear(d, 6 * d)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: Tensor, c: Tensor, causal: bool = False) -> Tensor:
        """``causal`` masks attention to earlier positions (a text track on these blocks)."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(c).chunk(6, dim=1)
        batch, length, d = x.shape
        h = modulate(self.norm_attn(x), shift_a, scale_a)
        q, k, v = self.qkv(h).split(d, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        attn = attn.transpose(1, 2).reshape(batch, length, d)
        x = x + gate_a.unsqueeze(1) * self.proj(attn)
        h = modulate(self.norm_mlp(x), shift_m, scale_m)
        return x + gate_m.unsqueeze(1) * self.mlp(h)


class FlowDiT(nn.Module):
    """``model(x_t, t, tokens) → v``: (N, C, H, W), (N,), (N, prompt_len) → (N, C, H, W)."""

    def __init__(self, config: FlowModelConfig) -> None:
        super().__init__()
        self.config = config
        d, p = config.d_model, config.patch_size
        self.grid = config.image_size // p
        patch_dim = config.channels * p * p
        self.patch_in = nn.Linear(patch_dim, d)
        self.patch_pos = nn.Parameter(torch.randn(self.grid * self.grid, d) * 0.02)
        self.token_emb = nn.Embedding(config.vocab_size, d)
        # Per slot, so that NULL in the colour slot differs from NULL in the place slot.
        self.slot_emb = nn.Parameter(torch.randn(config.prompt_len, d) * 0.02)
        # A prompt-dependent offset per patch position: "top-left" reaches the right
        # patches linearly from the first step. Through attention alone, position was
        # learned only after a ~1000-step plateau (measured), colour long before.
        self.prompt_pos = nn.Linear(d, self.grid * self.grid * d)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(Block(d, config.n_heads) for _ in range(config.n_layers))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.ada_out = nn.Linear(d, 2 * d)
        self.patch_out = nn.Linear(d, patch_dim)
        for layer in (self.ada_out, self.patch_out):  # a fresh model predicts v = 0
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: Tensor, t: Tensor, tokens: Tensor) -> Tensor:
        n, channels = x.shape[:2]
        p, g = self.config.patch_size, self.grid
        # (N, C, H, W) → (N, g·g, C·p·p), patches in row-major order.
        patches = x.view(n, channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, -1)
        prompt = self.token_emb(tokens) + self.slot_emb
        pooled = prompt.mean(dim=1)
        c = F.silu(self.time_mlp(timestep_embedding(t.expand(n), self.config.d_model))) + pooled
        pos = self.patch_pos + self.prompt_pos(pooled).view(n, g * g, -1)
        h = torch.cat([prompt, self.patch_in(patches) + pos], dim=1)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.ada_out(c).chunk(2, dim=1)
        out = self.patch_out(modulate(self.norm_out(h[:, tokens.shape[1] :]), shift, scale))
        return out.view(n, g, g, channels, p, p).permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


# ----------------------------------------------------------------------------- checkpoints


def build_model(config: FlowModelConfig) -> FlowDiT:
    """A fresh model; its init draws from the global torch RNG (seeded by the runtime)."""
    return FlowDiT(config)


def load_model(state: dict[str, Any], device: torch.device | str = "cpu") -> FlowDiT:
    """Rebuild the FlowDiT of a trainer ``state_dict()`` (``model_config`` + ``model``) on
    ``device``."""
    return rebuild(FlowDiT, FlowModelConfig, state, device)


def model_from(init_from: str) -> FlowDiT:
    """Warm start: the model in a checkpoint, given its directory or its run's config."""
    return warm_start(init_from, load_model, "flow model")


def model_state(model: FlowDiT, optimizer: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    """A trainer's resumable state around a FlowDiT: live tensors, so the runtime
    snapshots them before the next step changes them."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer_state(optimizer, {"model": model}),
        "model_config": msgspec.structs.asdict(model.config),
        **extra,
    }


def load_model_state(
    state: dict[str, Any], model: FlowDiT, optimizer: torch.optim.Optimizer
) -> None:
    """Restore :func:`model_state`; a checkpoint of another shape is refused."""
    saved, ours = state.get("model_config"), msgspec.structs.asdict(model.config)
    if saved != ours:
        raise CheckpointError(f"checkpoint is for model {saved}, this run builds {ours}")
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, {"model": model}, state["optimizer"])
