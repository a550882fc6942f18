"""TinyLM: a small character-level decoder-only transformer in plain torch.

Small enough to train in seconds on two CPU cores (~400k parameters at d_model 128,
2 layers), so the runtime's guarantees can be tested end to end with real learning.
Pre-LayerNorm blocks, learned positions, causal attention through
``scaled_dot_product_attention``, and an output head tied to the token embedding.

Generation reruns the whole prefix each step (no KV cache): at these sizes the
prefix is a dozen tokens and the simpler code wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, NamedTuple

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from corun.engines.decode import top_p_log_probs
from corun.execution.compute import cancel_point

Size = Annotated[int, msgspec.Meta(ge=1)]


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape of a TinyLM; saved with checkpoints so a model can be rebuilt from one."""

    vocab_size: Size
    d_model: Size = 128
    n_layers: Size = 2
    n_heads: Size = 4
    # Longest sequence the learned position table covers (prompt + generated tokens).
    max_len: Size = 32

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=-1)
        # (batch, length, d) -> (batch, heads, length, d / heads)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, d))
        return x + self.mlp(self.ln_mlp(x))


class TinyLM(nn.Module):
    """Decoder-only LM over token ids; ``forward`` gives next-token logits at every position."""

    # Recompute each block's activations in the backward pass instead of keeping them
    # (trainers/lm/policy.py's with_checkpointing): memory for a longer step.
    checkpointing: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_out = nn.LayerNorm(config.d_model)
        # Draws from the global torch RNG: callers seed it, so the same seed gives the same model.
        self.apply(_init_weights)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` (batch, length) -> logits (batch, length, vocab_size)."""
        return self.head(self.hidden(ids))

    @property
    def hidden_size(self) -> int:
        return self.config.d_model

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Final hidden states (batch, length, d_model), after the last LayerNorm.

        TinyLM batches are never padded on the left (a task's prompts have one length),
        so there is no ``attention_mask`` to apply."""
        refuse_padding(attention_mask)
        length = ids.shape[1]
        if length > self.config.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds max_len {self.config.max_len}")
        positions = torch.arange(length, device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.ln_out(x)

    def head(self, hidden: Tensor) -> Tensor:
        # Tied head: the output projection is the token embedding.
        return F.linear(hidden, self.tok.weight)

    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        *,
        stop_id: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue equal-length prompts; returns the new ids (batch, n <= max_new_tokens)."""
        return decode(
            self, prompt_ids, max_new_tokens, stop_id=stop_id, temperature=temperature,
            generator=generator,
        ).tokens  # fmt: skip


def refuse_padding(attention_mask: Tensor | None) -> None:
    if attention_mask is not None:
        raise ValueError("TinyLM takes unpadded rows: no attention_mask")


class Decoded(NamedTuple):
    """What :func:`decode` returns: ``tokens``, the (batch, n) new ids (after a row's
    stop id, the stop id again); ``logprobs``, each one's log-prob under the sampling
    distribution; ``versions``, the (n,) weight version that made each position."""

    tokens: Tensor  # (batch, n) new ids; after a row's stop_id, stop_id again
    logprobs: Tensor  # (batch, n) log-prob of each token under the sampling distribution
    versions: Tensor  # (n,) weight version that produced each position's tokens


@torch.no_grad()
def decode(
    model: TinyLM,
    prompt_ids: Tensor,
    max_new_tokens: int,
    *,
    stop_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    weights_version: Callable[[], int] = lambda: 0,
) -> Decoded:
    """Batched decoding of equal-length prompts → :class:`Decoded` (``.tokens``: the
    (batch, n) new ids): greedy at ``temperature`` 0, sampled with top-p above it.

    Greedy draws nothing; sampling draws from ``generator`` (torch's RNG if None;
    :func:`generator_on` for a GPU model); log-probs are under the full
    temperature-scaled distribution. A row that emitted ``stop_id`` keeps emitting it;
    decoding ends once every row has stopped; :func:`cancel_point` between steps.

    ``weights_version`` is asked before each step which weights produce its tokens; it
    may load newer ones into ``model`` first (a partial rollout: the prefix so far is
    continued by the new weights), since every step reruns the whole sequence.
    """
    batch, length = prompt_ids.shape
    if length + max_new_tokens - 1 > model.config.max_len:
        raise ValueError(
            f"prompt of {length} tokens + {max_new_tokens} new exceeds "
            f"max_len {model.config.max_len}"
        )
    ids = prompt_ids
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    if temperature > 0:
        generator = generator_on(prompt_ids.device, generator)
    tokens: list[Tensor] = []
    logprobs: list[Tensor] = []
    versions: list[int] = []
    for step in range(max_new_tokens):
        if step:
            cancel_point()
        versions.append(weights_version())
        logits = model(ids)[:, -1]
        if temperature > 0:
            # Sample from the nucleus, but record log-probs under the full tempered
            # distribution: that is what the trainer recomputes, so the importance
            # ratio is exactly 1 for unchanged weights.
            log_dist = torch.log_softmax(logits / temperature, dim=-1)
            nucleus = top_p_log_probs(logits / temperature, top_p)
            token = torch.multinomial(nucleus.exp(), 1, generator=generator).squeeze(1)
        else:
            log_dist = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
        token = token.masked_fill(done, stop_id)
        tokens.append(token)
        logprobs.append(log_dist.gather(1, token[:, None]).squeeze(1).masked_fill(done, 0.0))
        done |= token == stop_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    stamps = torch.tensor(versions, device=prompt_ids.device)
    return Decoded(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), stamps)


def generator_on(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """``generator`` when it draws on ``device`` (None: torch's default RNG there); else
    a generator on ``device`` seeded by one draw from it: a run's seeded CPU stream
    decides a GPU model's samples too, and a CPU run's draws are unchanged."""
    if generator is None or generator.device == device:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device).manual_seed(seed)


def _init_weights(module: nn.Module) -> None:
    # Small init (GPT-2 style): with the tied head, PyTorch's N(0, 1) embedding init
    # would start at logits ~10x too large and a loss far above log(vocab_size).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
