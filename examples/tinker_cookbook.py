"""tinker-cookbook's own recipes, unmodified, trained by corun's Tinker server
(``corun serve tinker``) on the built-in tiny Llama.

One command each (with no --base-url it starts ``corun serve tinker`` itself, with its
run under <log-dir>/server, and stops it with Ctrl-C's SIGINT when done):

    python examples/tinker_cookbook.py --task sl   # chat_sl on corun's word problems
    python examples/tinker_cookbook.py --task rl   # math_rl, arithmetic environment

Or against a server already running (its first line: ``corun: serving URL``):

    corun serve tinker &
    TINKER_BASE_URL=http://127.0.0.1:PORT python examples/tinker_cookbook.py --task rl

- ``--task sl``: the ``chat_sl`` recipe on a conversations JSONL written here from
  corun's built-in word problems (trainers/hf/tasks.py: "Ann has 12 apples and gets 7
  more. How many apples now?" → "19"), rendered by the ``role_colon`` renderer.
- ``--task rl``: the ``math_rl`` recipe on its arithmetic environment ("What is 37 +
  52?") with ``loss_fn=importance_sampling``. The tiny model's weights are random, so it
  never ends an answer with the stop sequence "\\n\\nUser:" by chance and every reward
  is -0.1 (nothing to learn from); a short ``chat_sl`` warm start (--warm-steps) on
  word problems teaches it to end some answers so (~10%), and math_rl starts from that
  state (its ``load_checkpoint_path``, on the same server) and learns to end more of
  them (~55% after 30 steps: reward -0.09 → -0.05). Right sums (up to 200) stay
  beyond it.

On 2 CPU cores: sl ~25 s, rl ~100 s (most of it sampling), server start included.

The model is named by its directory's absolute path (the recipes load the tokenizer
from it): by default the one the server lists as served. Each run ends printing the
first and last loss (train_mean_nll) or reward (env/all/reward/total) from the
recipe's metrics.jsonl (under --log-dir, runs/tinker_cookbook by default). The recipes
come with the test extra (``tinker-cookbook[math-rl]``; math_rl needs its pylatexenc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean

# Run as a file, this folder leads sys.path, and this file would shadow the package
# it drives (tinker_cookbook).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

# Before the cookbook imports transformers, datasets and wandb: offline, no telemetry,
# and the SDK's client-side key check passed (a local server takes any tml- key).
for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TINKER_TELEMETRY": "0",
    "TINKER_API_KEY": "tml-local",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

RENDERER = "role_colon"
LORA_RANK = 8
# Tuned on 2 CPU cores. chat_sl: 40 steps of 16 chats, loss 5.9 → 1.4 in ~25 s (1e-3
# only reaches 3.2; 1e-2 spikes). math_rl: 8 groups of 8 samples a step, ~3 s each (the
# sampling); at 3e-3 a run can collapse (every answer unended, reward -0.1 for good).
# A warm start of 60 steps ends ~10% of the answers on the stop sequence (80: ~40%).
SL_BATCH, SL_LR = 16, 3e-3
RL_GROUP, RL_GROUPS, RL_LR = 8, 8, 1e-3
RL_MAX_TOKENS = 10  # " 137\n\nUser:" is 9 tokens (digits are one each)
DEFAULT_STEPS = {"sl": 40, "rl": 30}
WARM_STEPS = 60
METRIC = {"sl": "train_mean_nll", "rl": "env/all/reward/total"}


def write_conversations(path: Path, rows: int, seed: int = 0) -> str:
    """corun's word problems as the cookbook's conversation file: one
    ``{"messages": [user, assistant]}`` per line."""
    from trainers.hf.tasks import WordProblems

    problems = WordProblems(rows, seed).batch(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for problem in problems:
            messages = [
                {"role": "user", "content": str(problem.prompt)},
                {"role": "assistant", "content": problem.answer},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def supervised(base_url: str, model_dir: str, log_dir: Path, steps: int) -> str:
    """Run chat_sl for ``steps`` steps; the path of the state it saves last."""
    from tinker_cookbook.recipes.chat_sl import train as chat_sl

    data = write_conversations(log_dir.with_name(log_dir.name + "-data") / "chats.jsonl",
                               steps * SL_BATCH)  # fmt: skip
    chat_sl.cli_main(chat_sl.CLIConfig(
        log_path=str(log_dir), model_name=model_dir, dataset=data, renderer_name=RENDERER,
        base_url=base_url, batch_size=SL_BATCH, learning_rate=SL_LR, lora_rank=LORA_RANK,
        max_length=128, max_steps=steps, save_every=0, eval_every=0,
        infrequent_eval_every=0, behavior_if_log_dir_exists="delete",
    ))  # fmt: skip
    saved = (log_dir / "checkpoints.jsonl").read_text().splitlines()
    return str(json.loads(saved[-1])["state_path"])


def reinforce(base_url: str, model_dir: str, log_dir: Path, steps: int, start: str | None) -> None:
    """Run math_rl (arithmetic) for ``steps`` steps, from the saved state ``start``."""
    from tinker_cookbook.recipes.math_rl import train as math_rl

    asyncio.run(math_rl.cli_main(math_rl.CLIConfig(
        model_name=model_dir, load_checkpoint_path=start, env="arithmetic",
        renderer_name=RENDERER, lora_rank=LORA_RANK, loss_fn="importance_sampling",
        group_size=RL_GROUP, groups_per_batch=RL_GROUPS, learning_rate=RL_LR,
        max_tokens=RL_MAX_TOKENS, log_path=str(log_dir), base_url=base_url,
        max_steps=steps, save_every=0, eval_every=0, behavior_if_log_dir_exists="delete",
    )))  # fmt: skip


def logged(metrics: Path, key: str) -> list[float]:
    """Every value of ``key`` in a recipe's metrics.jsonl, step by step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    values = [float(row[key]) for row in rows if key in row]
    if not values:
        raise SystemExit(f"{metrics}: no {key!r} logged")
    return values


@contextmanager
def tinker_server(run_dir: Path) -> Iterator[str]:
    """``corun serve tinker`` as a child process for the block: its URL; stopped with
    SIGINT (it saves its open models and exits 130) and waited for, however the block
    ends. Its own session, so a terminal's Ctrl-C reaches it once, from here."""
    server = subprocess.Popen(
        [sys.executable, "-m", "corun", "serve", "tinker", f"run.dir={run_dir}"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        if not first.startswith("corun: serving "):
            raise SystemExit(f"corun serve tinker did not start (exit {server.wait()})")
        url = first.removeprefix("corun: serving ").strip()
        print(f"started corun serve tinker: {url} (run dir {run_dir})", flush=True)
        # The rest of its stdout passed on, so a full pipe never blocks it.
        threading.Thread(target=sys.stdout.writelines, args=(server.stdout,), daemon=True).start()
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def check_server(base_url: str) -> None:
    """Fail fast: the SDK retries a refused connection silently, for good."""
    try:
        urllib.request.urlopen(f"{base_url.rstrip('/')}/api/v1/healthz", timeout=10).close()
    except OSError as exc:
        raise SystemExit(f"--base-url {base_url}: no Tinker server answers ({exc})") from None


def served_model_dir(base_url: str) -> str:
    """The model directory the server lists (the recipes load its tokenizer)."""
    import tinker

    served = tinker.RestClient(base_url=base_url).get_server_capabilities().result()
    names = [m.model_name for m in served.supported_models if m.model_name]
    paths = [name for name in names if os.path.isabs(name) and os.path.isdir(name)]
    if not paths:
        raise SystemExit(f"{base_url} serves {names}: none is a directory here; give --model-dir")
    return paths[0]


def train(args: argparse.Namespace, base_url: str) -> Path:
    """The task's recipe (after the warm start, for rl); its metrics.jsonl."""
    check_server(base_url)
    model_dir = str(args.model_dir.resolve()) if args.model_dir else served_model_dir(base_url)
    if ":" in model_dir:  # the SDK and the cookbook read ":..." as a checkpoint's name
        raise SystemExit(f"--model-dir {model_dir}: a path without ':' is needed")
    steps = args.steps or DEFAULT_STEPS[args.task]
    log_dir: Path = args.log_dir.resolve()
    if args.task == "sl":
        supervised(base_url, model_dir, log_dir / "sl", steps)
        return log_dir / "sl" / "metrics.jsonl"
    start = None
    if args.warm_steps:
        start = supervised(base_url, model_dir, log_dir / "warm", args.warm_steps)
    reinforce(base_url, model_dir, log_dir / "rl", steps, start)
    return log_dir / "rl" / "metrics.jsonl"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["sl", "rl"], required=True)
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"),
                        help="a server (default $TINKER_BASE_URL; none: start one)")  # fmt: skip
    parser.add_argument("--model-dir", type=Path,
                        help="the model's directory (default: the one served)")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path("runs/tinker_cookbook"))
    parser.add_argument("--steps", type=int, help="default: 40 (sl), 30 (rl)")
    parser.add_argument("--warm-steps", type=int, default=WARM_STEPS,
                        help="rl: chat_sl steps before math_rl (0: none)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    # SIGTERM ends this as Ctrl-C does (KeyboardInterrupt), so a server started here is
    # stopped too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.base_url:
        metrics = train(args, args.base_url)
    else:
        with tinker_server(args.log_dir.resolve() / "server") as url:
            metrics = train(args, url)
    key = METRIC[args.task]
    values = logged(metrics, key)
    n = max(1, len(values) // 4)  # RL rewards are noisy: the first and last quarters too
    print(f"{args.task}: {key} first {values[0]:.4f}, last {values[-1]:.4f}; mean of the "
          f"first {n} {mean(values[:n]):.4f}, of the last {n} {mean(values[-n:]):.4f} "
          f"({metrics})")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the server (if started here) is stopped
        sys.exit(130)
