"""The verifiers worker of a corun run (``trainer.task = "verifiers"``): plays a
verifiers environment's episodes against the run's policy endpoint and reports each
episode's rubric reward for training.

Runs in the verifiers environment (its own interpreter: verifiers pins ``openai<3``,
corun's test extra needs ``openai>=3``), so it imports verifiers and never corun.
corun starts it once its endpoint serves (trainers/hf/verifiers_task.py); it prints
``ready`` once the environment is loaded, then plays rounds until the endpoint is
gone. Round ``i``: ``--batch`` tasks drawn from (seed, i), ``--group`` episodes of
each at once (the group GRPO compares), every episode with its own base URL
``<url>/episodes/<id>/v1`` so each model call is captured token for token; the
reward report waits while the run holds two steps' worth (its backpressure).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

FAILED_TO_START = 3  # the exit status of a worker that never got ready


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="corun_verifiers_worker")
    parser.add_argument("--url", required=True, help="the run's endpoint")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--taskset", required=True, help="a verifiers taskset id")
    parser.add_argument("--taskset-args", default="{}", help="its settings, JSON")
    parser.add_argument("--harness", default="corun-chat", help="a verifiers harness id")
    parser.add_argument("--batch", type=int, required=True, help="tasks per round")
    parser.add_argument("--group", type=int, required=True, help="episodes per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=1.0)
    return parser.parse_args(argv)


def share_tls_context() -> None:
    """Give every verifiers client one TLS context. verifiers builds an HTTP client per
    episode (its base URL is the episode's), and each would load the CA bundle into a
    context of its own: ~20 ms of CPU and ~1 MB of memory that is never handed back,
    per episode (measured with 0.4.0). Patched where its eval client looks it up."""
    import ssl

    import httpx
    from verifiers.v1.clients import base, eval

    context = ssl.create_default_context()

    def build(config: Any) -> httpx.AsyncClient:
        timeout = httpx.Timeout(**config.timeout.model_dump())
        return httpx.AsyncClient(timeout=timeout, limits=base.DEFAULT_LIMITS, verify=context)

    eval.build_async_httpx = build


def load_env(args: argparse.Namespace) -> Any:
    """The verifiers environment: the taskset by id, played by one agent whose harness
    runs on this host (the subprocess runtime: no container)."""
    import json

    import verifiers.v1 as vf

    share_tls_context()
    taskset = {"id": args.taskset, **json.loads(args.taskset_args)}
    agent = {"harness": {"id": args.harness}, "runtime": {"type": "subprocess"}}
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent=agent))


class Worker:
    def __init__(self, args: argparse.Namespace, env: Any, http: httpx.AsyncClient) -> None:
        self.args, self.env, self.http = args, env, http
        self.tasks = list(env.taskset)

    async def run(self) -> None:
        """Rounds until the endpoint is gone."""
        for index in range(sys.maxsize):
            picked = random.Random(f"{self.args.seed}-{index}").sample(
                self.tasks, min(self.args.batch, len(self.tasks))
            )
            groups = [self.group(task, f"{index}-{task.data.idx}") for task in picked]
            await asyncio.gather(*groups)

    async def group(self, task: Any, group: str) -> None:
        await asyncio.gather(*(self.episode(task, group) for _ in range(self.args.group)))

    async def episode(self, task: Any, group: str) -> None:
        """One episode on its own base URL; its rubric reward reported to the run (the
        report waits while the run's inbox is full)."""
        import verifiers.v1 as vf
        from verifiers.v1.env import RunSlot

        episode_id = f"vf-{group}-{uuid.uuid4().hex[:12]}"
        client = vf.EvalClientConfig(
            base_url=f"{self.args.url}/episodes/{episode_id}/v1", api_key_var="CORUN_API_KEY"
        )
        sampling = vf.SamplingConfig(
            max_tokens=self.args.max_tokens, temperature=self.args.temperature
        )
        ctx = vf.ModelContext(model=self.args.model, client=client, sampling=sampling)
        # run_slot, not run_episode: it also hands freed memory back to the OS.
        played = await self.env.run_slot(RunSlot(task), ctx)
        reward = played.traces[0].reward if played.traces else 0.0
        if not played.ok:  # scored 0 (or as far as it got); said once per episode
            errors = [*played.errors, *(e for t in played.traces for e in t.errors)]
            print(f"corun_verifiers_worker: {episode_id}: {errors[:1]}", file=sys.stderr)
        answer = await self.http.post(
            f"/v1/episodes/{episode_id}/reward", json={"reward": reward, "group": group}
        )
        if answer.status_code == 404:  # no model call was recorded: nothing to train
            print(f"corun_verifiers_worker: episode {episode_id} not recorded", file=sys.stderr)
        else:
            answer.raise_for_status()


async def play(args: argparse.Namespace) -> None:
    try:
        import httpx

        env = load_env(args)
        tasks = len(list(env.taskset))
    except ImportError as exc:
        fail(f"cannot import verifiers in {sys.executable}: {exc}")
    except Exception as exc:  # a bad taskset ends the worker in one line
        fail(f"cannot load the taskset {args.taskset!r}: {type(exc).__name__}: {exc}")
    print(f"ready {tasks} tasks", flush=True)
    timeout = httpx.Timeout(30.0, read=None)  # a report waits while the inbox is full
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout) as http, env.serving():
        try:
            await Worker(args, env, http).run()
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            pass  # the endpoint is gone: the run ended


def fail(message: str) -> None:
    print(f"corun_verifiers_worker: {message}", file=sys.stderr, flush=True)
    raise SystemExit(FAILED_TO_START)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(play(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
