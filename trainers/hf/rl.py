"""GRPO and PPO on a Hugging Face policy (registered as ``hf_grpo`` and ``hf_ppo``).

What differs from the TinyLM trainers lives here: the policy and tokenizer come from
``trainer.model = "hf:<dir>"`` (weights from ``init_from`` when warm-started),
prompts from the word-problem task or a JSONL file, rewards from configured
functions, and generation from an async rollout engine (``trainer.engine``: local
transformers, vLLM in process, or a vLLM server) that a weight sync updates in
place. The algorithms — group advantages, GAE with a value head on the model's
hidden states, the clipped and decoupled losses — are GRPO's and PPO's, unchanged.

A sample whose reward function failed is not trained on (its tokens are masked out)
and, under GRPO, takes its group's mean reward, so it moves nobody's advantage.

Every weight sync is verified: the engine reports a fingerprint of the weights it now
serves, computed on its side, and a mismatch with the trained weights fails the run
naming the version (corun/engines/fingerprint.py). The fingerprint of each version
goes with the batches it generated (the ``step`` event's ``weights``) and with the
served policy (:class:`HFRollouts.served_policy`: the endpoint generates on the same
engine). :class:`HFRollouts` is what an hf: policy on an engine is, whatever the task;
:class:`HFPrompts` adds the prompts-and-reward-functions task (trainers/hf/agentic.py
adds multi-turn tool episodes instead).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import Tensor

from corun import Batch, ConfigError, Dataset, Lane, RolloutContext, SetupContext, world
from corun.agents.chat import ChatTemplate, configured_stop_ids
from corun.agents.served import EnginePolicy
from corun.contract.engine import Engine, Generation, Sampling, engine_metrics
from corun.engines.decode import left_pad
from corun.engines.fingerprint import checked
from corun.engines.options import EngineOptions, resolved_dtype
from corun.engines.start import EngineKind, check_engine, start_engine
from trainers.hf import lora, reasoning_gym, sync
from trainers.hf.evaluation import evaluate
from trainers.hf.policy import ChatFormat, HFPolicy
from trainers.hf.rewards import Rewards
from trainers.hf.state import hf_state, load_hf_state, load_model
from trainers.hf.tasks import Example, held_out_examples, training_batches
from trainers.hf.tinker import HFTrainingBackend, training_backend
from trainers.hf.training import ModelSettings, parallelize_policy, with_adapters
from trainers.lm.engine import Rollouts
from trainers.lm.grpo import GRPO, GRPOConfig
from trainers.lm.policy_gradient import PolicyGradientTrainer, Scored, require_correction
from trainers.lm.ppo import PPO, PPOConfig
from trainers.lm.settings import LMTrainerConfig, PositiveInt, with_settings
from trainers.pg import fill_failed
from trainers.weights import whole_copy

DEFAULT_REWARDS = {"numeric_match": 1.0}
TaskName = Literal["word-problems"]


def check_hf_config(config: Any) -> None:
    """What a TinyLM setting means nothing to an HF policy: refused, naming it."""
    defaults = LMTrainerConfig(kind="")
    for name in ("d_model", "n_layers", "n_heads"):
        if getattr(config, name) != getattr(defaults, name):
            raise ValueError(f"`$.{name}` shapes the built-in TinyLM; an hf: model has its own")
    if getattr(config, "dynamic_sampling", False):
        raise ValueError("`$.dynamic_sampling` is not supported with an hf: model")
    if hasattr(config, "engine"):  # refused before anything loads
        check_engine(config.engine, config.engine_options, config.inflight_at_sync == "interrupt")


class HFSettings(ModelSettings, frozen=True, kw_only=True):
    """What an hf: policy adds to GRPO's and PPO's settings (keys of [trainer] itself;
    with_settings builds the two configs), besides how it trains (ModelSettings)."""

    task: TaskName = "word-problems"  # data.path: a JSONL instead
    model: str  # "hf:<dir>": architecture, tokenizer, chat template (and weights, unless init_from)
    engine: EngineKind = "local"
    engine_options: EngineOptions = EngineOptions()  # [trainer.engine_options]
    rewards: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_REWARDS))
    system_prompt: str = ""
    max_new_tokens: PositiveInt = 8
    # A weight sync from a sharded policy (run.parallel = "fsdp") gathers at most this
    # many bytes of whole tensors at once on its way to the engine.
    sync_bucket_bytes: Annotated[int, msgspec.Meta(ge=1)] = 1 << 26


HFGRPOConfig = with_settings("HFGRPOConfig", GRPOConfig, HFSettings, check_hf_config)
HFPPOConfig = with_settings("HFPPOConfig", PPOConfig, HFSettings, check_hf_config)


class HFRollouts(PolicyGradientTrainer[Any]):
    """An hf: policy generating on an async rollout engine, each sync verified by the
    engine's fingerprint; the task is the subclass's (``build_task``, ``dataset``,
    ``rollout``, ``evaluate``), the algorithm too (``Algorithm``)."""

    policy: HFPolicy
    engine: Engine
    engine_source: HFPolicy | None = None
    # Under torchrun each rank samples its shard's groups from its own local engine,
    # and the policy may shard (run.parallel = "fsdp": trainers/hf/training.py).
    data_parallel = True
    shards_model = True

    async def setup(self, ctx: SetupContext) -> None:
        cfg, loop = self.config, self.run_config.loop
        if cfg.engine != "local" and world().parallel:
            raise ConfigError(
                f"`$.trainer.engine` = {cfg.engine!r}: data-parallel training samples from "
                'engine = "local" only; run it with run.nproc = 1'
            )
        if loop.concurrency > 1 and loop.version_schedule == "fixed":
            raise ConfigError(
                '`$.loop.version_schedule` = "fixed": an hf: model\'s engine holds only the '
                "newest weights, which a scheduled rollout may not want"
            )
        if (
            cfg.engine != "local"
            or cfg.dtype != "float32"
            or resolved_dtype(cfg.engine_options) != "float32"
        ):
            engine = f"engine {cfg.engine!r} in {resolved_dtype(cfg.engine_options)}"
            require_correction(cfg, loop.concurrency, engine)
        self.train_lane = ctx.lane
        # The model, optimizer and task (blocking: loading weights) on the train lane.
        await _on(ctx, self.build, ctx)
        # The engine copies the policy as it was before sharding (it samples from whole
        # weights); a sync then streams it the gathered shards.
        source, self.engine_source = self.engine_source or self.policy, None
        self.engine = await start_engine(
            cfg.engine, sync.engine_options(cfg, loop), source, self.chat.pad_id, ctx,
            interrupt=cfg.inflight_at_sync == "interrupt", wrap=self.wrap_engine,
            adapter=lora.adapter(source) if lora.is_lora(source) else None,
        )  # fmt: skip
        del source
        # The fingerprint of each synced version's weights, as the engine reported them.
        self.fingerprints: dict[int, str] = {}
        self.fingerprints[0] = await self._started_weights()

    async def wrap_engine(self, engine: Engine) -> Engine:
        """The started engine as rollouts and syncs see it; a subclass may wrap it (to
        instrument it; tests/support/faults.py injects faults). Within the start's deadline, and
        the wrapper's calls within the engine's (trainer.engine_options)."""
        return engine

    def initial_policy(self) -> HFPolicy:
        cfg = self.config
        policy, self.tokenizer = load_model(cfg.model, cfg.init_from, "`$.trainer.model`")
        self.chat = ChatFormat(self.tokenizer, cfg.system_prompt)
        return with_adapters(policy, cfg, self.run_config)

    def policy_groups(self, lr: float) -> list[dict[str, Any]]:
        return lora.param_groups(self.policy, self.config.lora, lr)

    def trained_policy(self, policy: HFPolicy) -> HFPolicy:
        """Sharded over the ranks (a whole copy kept for the engine to start from)."""
        self.engine_source = whole_copy(policy)
        return parallelize_policy(policy, self.config, self.run_config)

    def build(self, ctx: SetupContext) -> None:
        """The policy and what trains it, then the task's pieces."""
        super().build(ctx)
        self.build_task()

    def build_task(self) -> None:
        """The task's pieces (blocking work allowed: on the train lane)."""

    def chat_template(self) -> ChatTemplate:
        """The model's chat template over OpenAI-shaped messages (with tools)."""
        return chat_template(self.policy, self.tokenizer, self.config)

    # ---- sync: verified by the engine's fingerprint (trainers/hf/sync.py)
    async def sync_weights(self, version: int) -> str:
        self.fingerprints[version] = await sync.sync(
            self.engine, self.policy, self.config, version, self.train_lane,
            self.run_config.loop.compute,
        )  # fmt: skip
        return self.fingerprints[version]

    async def _started_weights(self) -> str:
        """The fingerprint the started engine reports (with its first adapter, under
        LoRA), checked against the policy's."""
        trained = await sync.on_lane(
            self.train_lane, sync.trained_fingerprint, self.engine, self.policy, self.config
        )
        return checked(await self.engine.fingerprint(), trained, "the started engine")

    def weights(self, version: int) -> str:
        """The fingerprint of the weights of ``version`` ("" when not synced in this run)."""
        return self.fingerprints.get(version, "")

    # ---- serving: the endpoint generates on the rollout engine (the lane is unused)
    def served_policy(self, lane: Lane) -> EnginePolicy:
        return EnginePolicy(
            self.run_config.run.name, self.engine, self.chat_template(), self.max_len,
            self.fingerprints, continuous_batching=True,
        )  # fmt: skip

    def rollout_engine(self) -> Engine:
        return self.engine

    def training_backend(self) -> HFTrainingBackend:
        cfg = self.config
        return training_backend(self.policy, self.chat, cfg.engine, cfg.engine_options,
                                self.run_config, self.engine)  # fmt: skip

    @property
    def max_len(self) -> int:
        return max_len(self.policy, self.config.engine_options.max_model_len)

    def wandb_extra(self) -> dict[str, Any]:
        return super().wandb_extra() | {"model/source": str(self.policy.source)}

    def state_dict(self) -> dict[str, Any]:
        return hf_state(self.policy, self.optimizer, self.extra_modules,
                        extra=self.modules_state())  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_hf_state(state, self.policy, self.optimizer, self.extra_modules)
        self.load_modules_state(state)


class HFPrompts(HFRollouts):
    """Prompts (the word problems, or a JSONL file) answered once and scored by the
    configured reward functions."""

    def build_task(self) -> None:
        """The data source, the rewards and the held-out prompts."""
        data, cfg = self.run_config.data, self.config
        self.generated = reasoning_gym.source(data)
        scorer = self.generated.score if self.generated else None
        self.rewards = Rewards(
            cfg.rewards, "`$.trainer.rewards`", self.run_config.run.reward_timeout_s, scorer
        )
        self.eval_examples = held_out_examples(data, cfg.eval_size, self.generated)
        self.chat.check([e.prompt for e in self.eval_examples], "`$.data.path`")
        self.sampling = Sampling(
            cfg.max_new_tokens, cfg.temperature, cfg.top_p, (self.chat.eos_id,)
        )

    def dataset(self) -> Dataset:
        return training_batches(self.run_config.data, self.run_config.run.seed, self.generated)

    # ---- rollout
    async def rollout(self, examples: list[Example], ctx: RolloutContext) -> Batch:
        cfg, n = self.config, self.config.samples_per_prompt
        started = time.monotonic()
        self.chat.check([e.prompt for e in examples], "`$.data.path`")
        rows = [e for e in examples for _ in range(n)]
        prompt_ids = await ctx.compute(lambda: [self.chat.encode(e.prompt) for e in rows])
        seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator))
        with ctx.span("generate", ctx.track, rows=len(rows)):
            generations = await self.engine.generate(prompt_ids, self.sampling, seed)
        generated = time.monotonic()
        rollouts = to_rollouts(prompt_ids, generations, self.chat.pad_id)
        responses = [self.chat.decode(g.ids) for g in generations]
        scores = await self.rewards.score(
            [str(e.prompt) for e in rows], responses, [e.answer for e in rows], ctx.compute,
            [e.entry for e in rows],
        )  # fmt: skip
        rewards = torch.tensor(scores.rewards)
        if cfg.truncated_reward == "zero":
            rewards = rewards.masked_fill(rollouts.truncated, 0.0)
        ok = torch.tensor(scores.ok)
        rollouts.response_mask &= ok[:, None]
        metrics = {
            "rollout/reward_mean": float(rewards[ok].mean()) if ok.any() else 0.0,
            "rollout/reward_failures": float((~ok).sum()),
            "rollout/response_len_mean": sum(len(g.ids) for g in generations) / len(generations),
            "rollout/truncated_ratio": float(rollouts.truncated.float().mean()),
            "rollout/partial_ratio": float(rollouts.spans_versions().float().mean()),
            **{f"rollout/reward/{name}": value for name, value in scores.by_function.items()},
            "perf/generate_time_s": generated - started,
            "perf/reward_time_s": time.monotonic() - generated,
            **engine_metrics(self.engine),  # a fleet's: members serving, dropped, retried
        }
        scored = Scored(rollouts, [str(e.prompt) for e in rows], fill_failed(rewards, ok, n))
        scored, annotated = await self.annotate(scored, ctx)
        metrics |= annotated
        data = self.training_data(scored)
        version = rollouts.version
        return Batch(data, metrics=metrics, version=version, weights=self.weights(version))

    async def annotate(
        self, scored: Scored, ctx: RolloutContext
    ) -> tuple[Scored, dict[str, float]]:
        """What a subclass adds to a scored batch before it becomes training data, with
        its metrics (trainers/hf/distill.py: the teacher's log-probs)."""
        return scored, {}

    # ---- evaluation
    async def evaluate(self) -> dict[str, float]:
        cfg = self.config
        return await evaluate(
            self.policy, self.chat, self.eval_examples, cfg.max_new_tokens, self.rewards,
            self.train_lane,
        )  # fmt: skip


def chat_template(policy: HFPolicy, tokenizer: Any, config: Any) -> ChatTemplate:
    """The chat template of ``config.model`` (a usage error naming it when it has none),
    ``config.system_prompt`` opening its conversations; its stop ids are the tokenizer's
    EOS and those the model's generation config lists."""
    try:
        stops = configured_stop_ids(policy.source)
        return ChatTemplate(tokenizer, config.system_prompt, stop_ids=stops)
    except ValueError as exc:
        raise ConfigError(f"`$.trainer.model` = {config.model!r}: {exc}") from None


def max_len(policy: HFPolicy, limit: int | None = None) -> int:
    """Tokens of prompt and reply together: the model's positions, and ``limit`` (the
    engine's) when set."""
    model_len = int(getattr(policy.model.config, "max_position_embeddings", 0) or 0)
    return min([n for n in (model_len, limit) if n], default=4096)


async def _on(ctx: SetupContext, fn: Any, *args: Any) -> Any:
    return await sync.on_lane(ctx.lane, fn, *args)


def to_rollouts(prompts: list[list[int]], generations: list[Generation], pad_id: int) -> Rollouts:
    """Generations as a batch: prompts left-padded, responses right-padded."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(1, max(len(g.ids) for g in generations))

    def rows(values: list[list[Any]], fill: Any, dtype: torch.dtype) -> Tensor:
        return torch.tensor([[*v, *[fill] * (width - len(v))] for v in values], dtype=dtype)

    oldest = min((v for g in generations for v in g.versions), default=0)
    return Rollouts(
        prompt_ids=prompt_ids,
        response_ids=rows([g.ids for g in generations], pad_id, torch.long),
        response_mask=rows([[True] * len(g.ids) for g in generations], False, torch.bool),
        logprobs=rows([g.logprobs for g in generations], 0.0, torch.float32),
        truncated=torch.tensor([g.finish == "length" for g in generations]),
        token_versions=rows([g.versions for g in generations], oldest, torch.long),
        version=oldest,
        prompt_mask=prompt_mask,
    )


class HFGRPOTrainer(HFPrompts):
    Config = HFGRPOConfig
    Algorithm = GRPO


class HFPPOTrainer(HFPrompts):
    Config = HFPPOConfig
    Algorithm = PPO
