"""GPU check of "models that do not fit one device": LoRA training of a Qwen2.5-0.5B-
shaped model (random weights) in bfloat16 through corun.execution.parallel (FSDP2 per
decoder layer at world size > 1), a vLLM engine in bfloat16, and its weight syncs (full
weights, then LoRA adapters), each verified by the engine's fingerprint; one table of
step time, sync time and bytes, and each row's peak GPU memory. About 3-5 minutes on one GPU::

    python benchmarks/gpu_check.py                # every GPU: torchrun for training
    python benchmarks/gpu_check.py --eager        # vLLM without CUDA graphs
    python benchmarks/gpu_check.py --cpu-smoke    # the same code on CPU, tiny (~20 s)

Without CUDA (and without ``--cpu-smoke``) it prints one line saying it skipped and
exits 0. ``--cpu-smoke``: a tiny model, 2 gloo ranks, float32, 2 steps, and the
transformers engine instead of vLLM.

Three phases, nothing downloaded: (1) the model directory: ``Qwen2Config`` with
Qwen2.5-0.5B's shape (tied embeddings), random weights, a word-level tokenizer (the
training feeds random token ids); (2) training, under ``torch.distributed.run`` with a
rank per GPU: LoRA (rank 8, attention projections) injected by trainers/hf/lora.py,
``parallelize(strategy="fsdp", dtype=bfloat16)``, AdamW on the adapters; (3) syncs in
this process at world size 1 (in-process vLLM sets up its own torch.distributed state,
which is why corun refuses ``engine = "vllm"`` under ``run.nproc > 1``): a policy
perturbed before each version, ``sync_verified`` with its full weights, then with its
adapter, and a generation after each kind checking the version it ran on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # corun and trainers, uninstalled

from benchmarks import gpu_recipes

QWEN: dict[str, Any] = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2}  # fmt: skip
TINY: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
GPU: dict[str, Any] = {"shape": QWEN, "steps": 12, "batch": 8, "seq": 512, "syncs": 4,
                       "dtype": "bfloat16"}  # fmt: skip
SMOKE: dict[str, Any] = {"shape": TINY, "steps": 2, "batch": 4, "seq": 32, "syncs": 2,
                         "dtype": "float32"}  # fmt: skip
LORA_RANK = 8
MB = 1 << 20


def build(path: Path, shape: dict[str, Any], device: str) -> Path:
    """A save_pretrained directory: random weights of ``shape`` and a small tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<s>", "</s>", "<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(path)  # fmt: skip
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    (model.bfloat16() if device == "cuda" else model).save_pretrained(path)  # as Qwen ships
    return path


def policy_with_lora(model_dir: Path, device: torch.device) -> Any:
    from trainers.hf.lora import LoraSettings, add_lora
    from trainers.hf.policy import load_policy

    policy, _ = load_policy(f"hf:{model_dir}", "--model")
    add_lora(policy, LoraSettings(rank=LORA_RANK), seed=0)
    return policy.to(device)


def reset_gpu_peak() -> None:
    """Start a row's peak GPU memory from what torch holds now."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict[str, float | None]:
    """Peak GPU memory of this process's torch allocations since the last reset (None
    without CUDA), and the process's peak RSS (never reset: the process's so far)."""
    gpu = torch.cuda.max_memory_allocated() / MB if torch.cuda.is_available() else None
    return {"gpu_mib": gpu, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ----------------------------------------------------------------------------- training


def train(model_dir: Path, grid: dict[str, Any], out: Path) -> None:
    """One rank's training (under torch.distributed.run); rank 0 writes the figures."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from corun.execution import distributed, parallel
    from trainers.hf.training import decoder_layers

    # Joined at world size 1 too: parallel.device_type() says "cuda" only in a group.
    distributed.init(600.0)
    world = distributed.world()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")  # fmt: skip
    policy = policy_with_lora(model_dir, device)
    parallel.parallelize(
        policy, strategy="fsdp", blocks=decoder_layers(policy), methods=("hidden", "head"),
        dtype=parallel.DTYPES[grid["dtype"]],
    )  # fmt: skip
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    vocab, draw = grid["shape"]["vocab_size"], torch.Generator().manual_seed(world.rank)
    times = []
    reset_gpu_peak()  # the steps' peak: the model held, AdamW's state and the activations
    for _ in range(grid["steps"]):
        ids = torch.randint(vocab, (grid["batch"] // max(world.size, 1), grid["seq"]),
                            generator=draw).to(device)  # fmt: skip
        started = time.perf_counter()
        logits = policy(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.autograd.backward(loss)
        parallel.clip_grad_norm(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    with torch.no_grad():  # what the forward computed in: autocast or FSDP's param_dtype
        computed = str(policy.hidden(ids[:1]).dtype).removeprefix("torch.")
    peaks = [peak_memory()]
    if world.parallel:
        peaks = [{}] * world.size
        dist.all_gather_object(peaks, peak_memory())
    if world.rank == 0:
        out.write_text(json.dumps({
            "world": world.size, "sharded": parallel.is_sharded(policy), "times": times,
            "computed": computed,
            "peak": largest(peaks), "loss": float(loss.detach()),
            "trained": sum(p.numel() for p in trained),  # a DTensor's numel is the whole's
            "params": sum(p.numel() for p in policy.parameters()),
        }))  # fmt: skip
    distributed.finish(clean=True)


def largest(peaks: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each figure's largest over the ranks (None where none has one)."""
    return {key: max((v for p in peaks if (v := p[key]) is not None), default=None)
            for key in peaks[0]}  # fmt: skip


# ----------------------------------------------------------------------------- syncs


async def syncs(model_dir: Path, grid: dict[str, Any], engine_kind: str, eager: bool) -> Any:
    """Full-weight syncs, then adapter syncs, to an engine on ``model_dir``; each timed
    and verified, a generation after each kind (its tokens on the synced version)."""
    from corun.engines.fingerprint import sync_verified
    from corun.engines.lora import base_weights
    from corun.engines.options import EngineOptions, engine_dtype
    from trainers.hf.lora import adapter

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the build's
    policy = policy_with_lora(model_dir, device)
    options = EngineOptions(dtype=grid["dtype"], enforce_eager=eager or None,
                            lora_rank=LORA_RANK, max_loras=2)  # fmt: skip
    engine = await start(engine_kind, options, policy, model_dir)
    dtype, noise = engine_dtype(options), torch.Generator(device=device).manual_seed(0)
    figures: dict[str, Any] = {"engine": engine_kind}
    try:
        version = 0
        for kind in ("full", "adapter"):
            took, sent = [], 0
            # Each kind's own peak, over the policy and the engine it holds now.
            reset_gpu_peak()
            for _ in range(grid["syncs"]):
                version += 1
                perturb(policy, adapters=kind == "adapter", noise=noise)
                state = policy.weights()
                if kind == "full" and engine_kind != "local":
                    state = base_weights(state)  # vLLM loads the base model's names
                lora = adapter(policy) if kind == "adapter" else None
                sent = nbytes(lora.tensors if lora is not None else state)
                started = time.perf_counter()
                await sync_verified(engine, state, version, dtype=dtype, adapter=lora)
                took.append(time.perf_counter() - started)
            figures[f"{kind}_generate_s"] = await generate(engine, version)
            figures[kind] = {"times": took, "bytes": sent, "peak": peak_memory()}
    finally:
        await engine.shutdown()
    return figures


async def start(kind: str, options: Any, policy: Any, model_dir: Path) -> Any:
    """The engine on ``model_dir`` (vLLM) or on a copy of ``policy`` (transformers)."""
    import msgspec

    from corun.engines.options import VLLMConfig, engine_dtype

    if kind == "local":
        from corun.engines.transformers_engine import TransformersEngine
        from corun.execution.compute import Lane

        return TransformersEngine(policy, 0, Lane("engine"), owns_lane=True, interrupt=False,
                                  dtype=engine_dtype(options))  # fmt: skip
    from corun.engines.vllm_engine import VLLMEngine

    # The trainer's policy shares the GPU: vLLM takes half of it, not its default 90%.
    settings = msgspec.structs.replace(
        options, max_model_len=1024, options={"gpu_memory_utilization": 0.5}
    )
    return await VLLMEngine.start(
        VLLMConfig(model=str(model_dir), **msgspec.structs.asdict(settings))
    )


def perturb(policy: Any, adapters: bool, noise: torch.Generator) -> None:
    """Every base weight (or every adapter tensor) moved a little: each version differs."""
    from trainers.hf.lora import trainable_parameters

    chosen = trainable_parameters(policy) if adapters else [
        p for p in policy.parameters() if not p.requires_grad]  # fmt: skip
    with torch.no_grad():
        for weight in chosen:
            weight.add_(torch.randn(weight.shape, generator=noise, device=weight.device) * 1e-3)


async def generate(engine: Any, version: int) -> float:
    from corun.contract.engine import Sampling

    started = time.perf_counter()
    out = await engine.generate([[4, 5, 6, 7]] * 4, Sampling(max_tokens=8), 0)
    if any(v != version for g in out for v in g.versions):
        raise RuntimeError(f"generation after the sync to {version} ran on {out[0].versions}")
    return time.perf_counter() - started


def nbytes(tensors: Any) -> int:
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors.values()}
    return sum(seen.values())


# ----------------------------------------------------------------------------- the table


def report(trained: dict[str, Any], synced: dict[str, Any], grid: dict[str, Any]) -> str:
    from benchmarks.report import Table, fmt, markdown_table

    def ms(times: list[float]) -> str:
        return fmt(1e3 * statistics.median(times[1:] or times), 1)

    def peaks(figures: dict[str, Any]) -> list[str]:
        gpu, rss = figures["peak"]["gpu_mib"], figures["peak"]["rss_mib"]
        return ["-" if gpu is None else fmt(gpu, 0), fmt(rss, 0)]

    full, lora = synced["full"], synced["adapter"]
    rows = [
        ["train step", f"world size {trained['world']}, "
         f"{'FSDP2-sharded' if trained['sharded'] else 'whole (world size 1)'}, {grid['dtype']} "
         f"asked, {trained['computed']} computed, "
         f"LoRA r{LORA_RANK}: {trained['trained'] / 1e6:.2f}M of {trained['params'] / 1e6:.2f}M "
         f"parameters train, batch {grid['batch']} x {grid['seq']}", ms(trained["times"]), "-",
         *peaks(trained)],
        ["full-weight sync", f"{synced['engine']} engine, {grid['dtype']}, verified",
         ms(full["times"]), fmt(full["bytes"] / MB, 1), *peaks(full)],
        ["adapter sync", f"{synced['engine']} engine, update_adapter, verified",
         ms(lora["times"]), fmt(lora["bytes"] / MB, 2), *peaks(lora)],
    ]  # fmt: skip
    ratio = statistics.median(lora["times"][1:] or lora["times"]) / statistics.median(
        full["times"][1:] or full["times"]
    )
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
    table = Table(
        "gpu_check", "check", f"GPU check on {where}",
        ["what", "how", "ms (median after the first)", "bytes sent, MB", "peak GPU MiB",
         "peak RSS MiB"],
        rows, [("adapter sync", ratio)], "the full-weight sync",
        [f"Peak GPU MiB: torch.cuda.max_memory_allocated, reset before each row's work "
         f"(training: its steps, the largest rank's; each kind of sync: its syncs and "
         f"generation, with the policy and the in-process engine held); '-' without CUDA. "
         f"Peak RSS MiB: the process's (the syncs share one process, so the adapter row's "
         f"includes the full-weight row's). "
         f"Generation after the syncs: {fmt(1e3 * synced['full_generate_s'], 0)} ms "
         f"(full), {fmt(1e3 * synced['adapter_generate_s'], 0)} ms (adapter), 4 x 8 tokens."],
    )  # fmt: skip
    return "\n".join(markdown_table(table, plot=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny, on CPU (gloo, float32)")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--phase", choices=("train",), help=argparse.SUPPRESS)  # a rank's
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "--cpu-smoke runs the same code on CPU")  # fmt: skip
        return 0
    grid = SMOKE if args.cpu_smoke else GPU
    if args.phase == "train":
        from corun.host.entry import leave

        train(args.model, grid, args.out)
        # As a corun rank ends: without the interpreter's teardown, where a torch thread
        # still unwinding aborted a rank once in a CI run ("terminate called without an
        # active exception").
        return leave(0)
    import anyio

    from trainers.hf.policy import quiet_transformers

    quiet_transformers()
    ranks = 2 if args.cpu_smoke else torch.cuda.device_count()
    # vLLM where it is installed (the GPU check's point); else the transformers engine.
    has_vllm = importlib.util.find_spec("vllm") is not None
    engine_kind = "vllm" if has_vllm and not args.cpu_smoke else "local"
    with tempfile.TemporaryDirectory(prefix="corun-gpu-check-") as tmp:
        model_dir = build(Path(tmp) / "model", grid["shape"], "cpu" if args.cpu_smoke else "cuda")
        out = Path(tmp) / "train.json"
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", __file__, "--phase", "train", "--model",
             str(model_dir), "--out", str(out), *(["--cpu-smoke"] if args.cpu_smoke else [])],
            check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        trained = json.loads(out.read_text())
        synced = anyio.run(syncs, model_dir, grid, engine_kind, args.eager)
        print(report(trained, synced, grid), flush=True)
        device = "cpu" if args.cpu_smoke else "cuda"
        recipes, ok = gpu_recipes.check(device, ranks, args.cpu_smoke, Path(tmp))
    print(recipes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
