"""An HF policy driven step by step through the training API (the Tinker API, served by
``corun serve CONFIG serve.tinker=true``): each model a client creates is a copy of the
trainer's base model with fresh LoRA adapters (``peft``, trainers/hf/lora.py) and its
own AdamW state; it trains by forward-backward passes under a named loss and optimizer
steps with the client's hyper-parameters, and saves and loads corun checkpoints of the
same layout as an ``hf_*`` run's (``python -m trainers.hf.export`` reads them).

The losses are the API's, summed over tokens and data (the client normalises):

- ``cross_entropy``: ``-Σ w_t · log π(y_t)``;
- ``importance_sampling``: ``-Σ A_t · π(y_t) / q(y_t)`` (``q``: the sampler's log-probs);
- ``ppo``: ``-Σ min(r_t A_t, clip(r_t, low, high) A_t)``, ``r_t = π(y_t) / q(y_t)``,
  with ``loss_fn_config`` ``clip_low_threshold`` (0.8) and ``clip_high_threshold`` (1.2);
- ``cispo``: ``-Σ sg(clip(r_t, low, high)) · A_t · log π(y_t)`` (the clipped ratio a
  weight without gradient; the same ``loss_fn_config``);
- ``dro``: ``-Σ (A_t · log π(y_t) - β/2 · (log π(y_t) - log q(y_t))²)``, with
  ``loss_fn_config`` ``beta`` (:data:`DRO_BETA` unless given).

LoRA alpha is :data:`LORA_ALPHA` whatever the rank (the API has no alpha); the adapters
cover the attention projections, the MLP and the output head as the client asks.
Every model shares the base weights (:func:`sharing_weights`): a model adds its adapters
and their optimizer state, not a copy of the base.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
from torch import Tensor

from corun import CheckpointError, ConfigError
from corun.agents.chat import find_stop
from corun.base.config import Config
from corun.contract.engine import Engine, Generation, Sampling
from corun.contract.training_api import (
    LOSS_INPUTS,
    AdamStep,
    Datum,
    ForwardResult,
    LoraShape,
    LossName,
    ModelInfo,
    PromptScores,
    RequestError,
)
from corun.engines.options import EngineOptions
from corun.engines.start import EngineKind
from corun.records import checkpoint
from trainers.hf.lora import (
    PREFIX,
    LoraSettings,
    add_lora,
    is_lora,
    load_adapter_state,
    saved_adapter,
    trainable_parameters,
)
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.samplers import Samplers, SavedAdapter
from trainers.hf.state import check_same_model, hf_state, load_hf_state

LORA_ALPHA = 32.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
KIND = "tinker-lora"  # the trainer kind a saved state records
MICRO_BATCH = 16  # data per forward pass: gradients add up, so this bounds memory only
MAX_RANK = 128
DRO_BETA = 0.05  # the value Tinker's documentation shows for `beta`


def target_modules(policy: HFPolicy, shape: LoraShape) -> list[str]:
    """The module names (suffixes) ``shape`` adapts that this model has."""
    wanted = [
        *(ATTENTION if shape.train_attn else ()),
        *(MLP if shape.train_mlp else ()),
        *(UNEMBED if shape.train_unembed else ()),
    ]
    names = {name.rsplit(".", 1)[-1] for name, _ in policy.model.named_modules()}
    found = [name for name in wanted if name in names]
    if not found:
        raise RequestError(
            "lora_config adapts no weight of this model (train_attn, train_mlp and "
            "train_unembed select none it has)"
        )
    return found


def sharing_weights(base: HFPolicy) -> HFPolicy:
    """A copy of ``base`` with modules of its own and ``base``'s weight tensors
    themselves: a model's adapters go into the copy's modules, and the base weights are
    held once, however many models there are. Nothing writes to them: LoRA freezes them
    (add_lora), and a model's saved state holds its adapters alone."""
    shared: dict[int, Any] = {id(t): t for t in (*base.parameters(), *base.buffers())}
    return copy.deepcopy(base, memo=shared)


class HFTrainingModel:
    """One client's model (:class:`corun.contract.training_api.TrainingModel`)."""

    def __init__(self, base: HFPolicy, info: ModelInfo, shape: LoraShape, seed: int) -> None:
        if not 1 <= shape.rank <= MAX_RANK:
            raise RequestError(f"lora_config.rank = {shape.rank}: expected 1..{MAX_RANK}")
        self.policy = sharing_weights(base)  # on the base's device (the run's)
        self.device = next(base.parameters()).device
        settings = LoraSettings(
            rank=shape.rank, alpha=LORA_ALPHA, target_modules=target_modules(base, shape)
        )
        add_lora(self.policy, settings, seed)
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.policy), lr=0.0)
        self._info = info
        self._steps = 0

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def holds_gradients(self) -> bool:
        return any(p.grad is not None for p in trainable_parameters(self.policy))

    # ---- training

    def forward_backward(
        self, data: Sequence[Datum], loss: LossName, loss_config: Mapping[str, float],
        backward: bool,
    ) -> ForwardResult:  # fmt: skip
        check_data(data, loss, self._info.max_length, self.vocab_size)
        check_loss_config(loss, loss_config)  # before any gradient is added
        terms = LOSS_TERMS[loss]
        self.policy.train(backward)
        outputs: list[dict[str, Tensor]] = []
        total = 0.0
        for start in range(0, len(data), MICRO_BATCH):
            chunk = data[start : start + MICRO_BATCH]
            with torch.set_grad_enabled(backward):
                logprobs = self._target_logprobs(chunk)
                losses = [
                    terms(lp, _on(datum.inputs, self.device), loss_config)
                    for lp, datum in zip(logprobs, chunk, strict=True)
                ]
                chunk_loss = torch.stack([term.sum() for term in losses]).sum()
                if backward:
                    chunk_loss.backward()
            total += float(chunk_loss.detach())
            outputs += [  # for the client: on the CPU
                {"logprobs": lp.detach().cpu(), "elementwise_loss": term.detach().cpu()}
                for lp, term in zip(logprobs, losses, strict=True)
            ]
        return ForwardResult(outputs, {"loss:sum": total})

    @property
    def vocab_size(self) -> int:
        return int(self.policy.model.config.vocab_size)

    def _target_logprobs(self, data: Sequence[Datum]) -> list[Tensor]:
        """log π(target_t | tokens[:t+1]) per datum: the batch right-padded (on the CPU,
        from the request's ids), one pass on the model's device."""
        longest = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), longest, dtype=torch.long)
        mask = torch.zeros(len(data), longest, dtype=torch.long)
        targets = torch.zeros(len(data), longest, dtype=torch.long)
        for row, datum in enumerate(data):
            size = len(datum.tokens)
            ids[row, :size] = torch.tensor(datum.tokens)
            mask[row, :size] = 1
            targets[row, :size] = datum.inputs["target_tokens"].long()
        ids, mask, targets = (t.to(self.device, non_blocking=True) for t in (ids, mask, targets))
        logits = self.policy(ids, mask)
        picked = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return [picked[row, : len(d.tokens)] for row, d in enumerate(data)]

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        check_adam(step)
        for group in self.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)  # fmt: skip
        params = trainable_parameters(self.policy)
        limit = step.grad_clip_norm if step.grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return {"grad_norm": norm}

    # ---- states

    def save(self, path: Path, *, optimizer: bool) -> None:
        # None (an empty state) without the optimizer, and before a first step: torch's
        # get_optimizer_state_dict would make a state by a step on zero gradients,
        # which counts (Adam's bias correction, one step on).
        kept = self.optimizer if optimizer and self.optimizer.state else None
        state = hf_state(self.policy, kept, tinker_steps=self._steps)
        trainer_state = checkpoint.TrainerState(
            format=checkpoint.FORMAT_VERSION, step=self._steps, version=self._steps,
            data_cursor=0, run_id=path.parent.parent.name, config_digest="",
            trainer_kind=KIND,
        )  # fmt: skip
        checkpoint.write_directory(path, {"trainer": checkpoint.snapshot(state)}, trainer_state)

    def load(self, path: Path, *, optimizer: bool) -> None:
        state = read_state(path)
        try:
            if optimizer:
                load_hf_state(state, self.policy, self.optimizer)
            else:  # the adapters alone: the optimizer keeps its state
                check_same_model(state, self.policy, "checkpoint")
                load_adapter_state(self.policy, state["model"])
        except CheckpointError as exc:
            raise RequestError(f"{path.name}: {exc}") from None
        if optimizer:
            self._steps = int(state.get("tinker_steps", 0))


def _on(inputs: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """A datum's loss inputs (the request's, on the CPU) on the model's ``device``."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in inputs.items()}


def read_state(path: Path) -> dict[str, Any]:
    """A saved state's trainer tensors; a damaged one, or another trainer's, refused."""
    try:
        saved, tensors = checkpoint.read(path)
    except CheckpointError as exc:
        raise RequestError(str(exc)) from None
    if saved.trainer_kind != KIND:
        raise RequestError(f"{path}: a {saved.trainer_kind!r} checkpoint, not a saved state")
    state: dict[str, Any] = tensors["trainer"]
    return state


# ---- checks: every refusal names the datum and the field


def check_data(data: Sequence[Datum], loss: LossName, max_length: int, vocab: int) -> None:
    if not data:
        raise RequestError("forward_backward: no data")
    needed = LOSS_INPUTS[loss]
    for index, datum in enumerate(data):
        where = f"data[{index}]"
        size = len(datum.tokens)
        if size == 0:
            raise RequestError(f"{where}.model_input: no tokens")
        if size > max_length:
            raise RequestError(f"{where}.model_input: {size} tokens, the model takes {max_length}")
        if not all(0 <= t < vocab for t in datum.tokens):
            raise RequestError(f"{where}.model_input: a token id outside 0..{vocab - 1}")
        for key in needed:
            value = datum.inputs.get(key)
            if value is None:
                raise RequestError(f"{where}.loss_fn_inputs: {loss} needs {key!r}")
            if tuple(value.shape) != (size,):
                raise RequestError(
                    f"{where}.loss_fn_inputs[{key!r}]: shape {list(value.shape)}, expected "
                    f"[{size}] (one per input token)"
                )
        targets = datum.inputs["target_tokens"]
        if targets.is_floating_point() or not bool(((targets >= 0) & (targets < vocab)).all()):
            raise RequestError(f"{where}.loss_fn_inputs['target_tokens']: ids in 0..{vocab - 1}")


def check_adam(step: AdamStep) -> None:
    checks = {
        "learning_rate": step.learning_rate >= 0,
        "beta1": 0 <= step.beta1 < 1,
        "beta2": 0 <= step.beta2 < 1,
        "eps": step.eps > 0,
        "weight_decay": step.weight_decay >= 0,
        "grad_clip_norm": step.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        if not ok or not math.isfinite(getattr(step, name)):
            raise RequestError(f"adam_params.{name} = {getattr(step, name)} is out of range")


# ---- the losses: per token, from the targets' log-probs under the trained weights


def _ratio(logprobs: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """``π(y_t) / q(y_t)``: the trained weights' probability over the sampler's."""
    return torch.exp(logprobs - inputs["logprobs"].float())


def cross_entropy(logprobs: Tensor, inputs: Mapping[str, Tensor], _: Mapping[str, float]) -> Tensor:
    return -inputs["weights"].float() * logprobs


def importance_sampling(
    logprobs: Tensor, inputs: Mapping[str, Tensor], _: Mapping[str, float]
) -> Tensor:
    ratio = _ratio(logprobs, inputs)
    return -ratio * inputs["advantages"].float()


def clip_band(config: Mapping[str, float]) -> tuple[float, float]:
    """``ppo``'s ratio band from ``loss_fn_config`` (0.8 and 1.2 unless given)."""
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if not 0 < low <= 1 <= high:
        raise RequestError(
            f"loss_fn_config: clip_low_threshold {low}, clip_high_threshold {high}: "
            "expected 0 < low <= 1 <= high"
        )
    return low, high


def ppo(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    low, high = clip_band(config)
    ratio = _ratio(logprobs, inputs)
    advantages = inputs["advantages"].float()
    return -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)


def cispo(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    low, high = clip_band(config)
    ratio = _ratio(logprobs, inputs)
    return -ratio.clamp(low, high).detach() * logprobs * inputs["advantages"].float()


def dro_beta(config: Mapping[str, float]) -> float:
    """``dro``'s ``beta`` from ``loss_fn_config`` (:data:`DRO_BETA` unless given)."""
    beta = float(config.get("beta", DRO_BETA))
    if not (math.isfinite(beta) and beta >= 0):
        raise RequestError(f"loss_fn_config: beta {beta}: expected a finite value >= 0")
    return beta


def dro(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    penalty = (logprobs - inputs["logprobs"].float()) ** 2
    return -(logprobs * inputs["advantages"].float() - 0.5 * dro_beta(config) * penalty)


def check_loss_config(loss: LossName, config: Mapping[str, float]) -> None:
    """A ``loss_fn_config`` that ``loss`` cannot take: the client's error."""
    if loss in ("ppo", "cispo"):
        clip_band(config)
    elif loss == "dro":
        dro_beta(config)


LOSS_TERMS: dict[LossName, Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]]
LOSS_TERMS = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


class HFTrainingBackend:
    """The models of one base policy (:class:`corun.contract.training_api.TrainingBackend`):
    created on request, sampled through :class:`Samplers`."""

    def __init__(
        self, base: HFPolicy, chat: ChatFormat, names: list[str], samplers: Samplers
    ) -> None:
        self.base = base
        self.chat = chat
        self.names = names
        self.samplers = samplers
        self._max_length = int(getattr(base.model.config, "max_position_embeddings", 2048))
        self._scorers: dict[Any, HFPolicy] = {}  # prompt log-probs, per adapter shape

    @property
    def max_length(self) -> int:
        return self._max_length

    def base_models(self) -> list[str]:
        return list(self.names)

    def create_model(self, base_model: str, lora: LoraShape, seed: int) -> HFTrainingModel:
        if not self.serves(base_model):
            raise RequestError(
                f"base_model {base_model!r} is not served here (served: {', '.join(self.names)})"
            )
        info = ModelInfo(self.names[0], lora.rank, str(self.base.source), self._max_length)
        return HFTrainingModel(self.base, info, lora, seed)

    def serves(self, name: str) -> bool:
        if name in self.names:
            return True
        path = Path(name).expanduser()
        return path.is_dir() and path.resolve() == self.base.source

    async def sample(
        self, weights: Path | None, prompts: Sequence[Sequence[int]], sampling: Sampling,
        seed: int, *, stop_strings: Sequence[str] = (), stop_at_eos: bool = True,
    ) -> list[Generation]:  # fmt: skip
        saved = None
        if weights is not None:  # read from disk once, off the event loop
            saved = await anyio.to_thread.run_sync(
                self.samplers.adapter_at, weights, self._read(weights)
            )
        if stop_at_eos:
            sampling = replace(sampling, stop_ids=(*sampling.stop_ids, self.chat.eos_id))
        generations = await self.samplers.sample(saved, prompts, sampling, seed)
        return [self._cut(g, stop_strings) for g in generations] if stop_strings else generations

    def prompt_logprobs(
        self, weights: Path | None, prompt: Sequence[int], top_k: int = 0
    ) -> PromptScores:
        saved = None if weights is None else self.samplers.adapter_at(weights, self._read(weights))
        policy = self.base if saved is None else self._scorer(saved)
        device = next(self.base.parameters()).device
        ids = torch.tensor([list(prompt)]).to(device)  # the request's ids: made on the CPU
        with torch.no_grad():
            logprobs = torch.log_softmax(policy(ids), -1)[0, :-1]
        chosen = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        if not top_k:
            return PromptScores(chosen, [])
        best = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        rows = zip(best.indices.tolist(), best.values.tolist(), strict=True)
        return PromptScores(chosen, [list(zip(i, v, strict=True)) for i, v in rows])

    def _scorer(self, saved: SavedAdapter) -> HFPolicy:
        """A copy of the base with ``saved``'s adapter shape (one per shape, kept), now
        holding its weights."""
        policy = self._scorers.get(saved.shape)
        if policy is None:
            policy = self._scorers[saved.shape] = sharing_weights(self.base)
            add_lora(policy, saved.settings, 0)
            policy.eval()
        tensors = {name.removeprefix(PREFIX): t for name, t in saved.adapter.tensors.items()}
        load_adapter_state(policy, tensors)
        return policy

    def _cut(self, generation: Generation, stops: Sequence[str]) -> Generation:
        """``generation`` through the token that completes its first stop string."""
        match = find_stop(generation.ids, self.chat.decode, stops)
        if match is None:
            return generation
        end = match.kept
        return Generation(generation.ids[:end], generation.logprobs[:end],
                          generation.versions[:end], "stop")  # fmt: skip

    def _read(self, path: Path) -> Callable[[], SavedAdapter]:
        def read() -> SavedAdapter:
            state = read_state(path)
            try:
                check_same_model(state, self.base, "checkpoint")
            except CheckpointError as exc:
                raise RequestError(str(exc)) from None
            settings = msgspec.json.decode(state["lora"], type=LoraSettings)
            return SavedAdapter(
                path, settings, saved_adapter(self.base.source, settings, state["model"])
            )

        return read

    async def close(self) -> None:
        await self.samplers.close()


def training_backend(
    policy: HFPolicy, chat: ChatFormat, kind: EngineKind, options: EngineOptions,
    config: Config, engine: Engine | None = None,
) -> HFTrainingBackend:  # fmt: skip
    """The training API's models over an hf kind's set-up ``policy`` (its base weights),
    sampled on ``kind`` engines with ``options`` (a vLLM kind: the run's ``engine``)."""
    if is_lora(policy):
        raise ConfigError(
            "`$.trainer.lora`: with serve.tinker each client chooses its own adapters; "
            "remove [trainer.lora]"
        )
    spec = str(getattr(config.trainer, "model", ""))
    names = [name for name in (spec, str(policy.source)) if name]
    samplers = Samplers(policy, chat.pad_id, kind, options, config, engine)
    return HFTrainingBackend(policy, chat, names, samplers)
