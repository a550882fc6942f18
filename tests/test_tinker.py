"""The Tinker API served by corun, driven by the official SDK (``tinker`` 0.38, no
patches) against a real ``corun serve ... serve.tinker=true`` process: a LoRA training
client on the built-in tiny model learns under ``cross_entropy`` and
``importance_sampling``; sampled log-probs equal the trainer's; ``save_state`` then
``load_state`` resumes exactly; futures awaited together on asyncio; bad requests are
the SDK's ``user`` errors and the server goes on; Ctrl-C fails in-flight futures
cleanly, saves the open models and exits 130 with nothing left listening."""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.support.cli import assert_usage_error, base_toml, call_main
from tests.support.tinker_server import API_KEY, TinkerProcess, end_heartbeats, tinker_server

pytestmark = pytest.mark.slow
os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry would post to the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerProcess]:
    with tinker_server(tmp_path_factory.mktemp("tinker")) as running:
        yield running
        assert running.stop() == 130, running.stderr()[-2000:]
        assert not running.listening()


@pytest.fixture(scope="module")
def service(server: TinkerProcess) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def _chat(tokenizer: Any, question: str, answer: str) -> types.Datum:
    """A teacher-forced datum: predict every token after the first, the reply weighted."""
    prompt = tokenizer(f"user: {question}\nassistant:")["input_ids"]
    ids = prompt + tokenizer(f" {answer}</s>")["input_ids"]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def _loss(client: tinker.TrainingClient, data: list[types.Datum], lr: float) -> float:
    result = client.forward_backward(data, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=lr)).result()
    return float(result.metrics["loss:sum"])


def test_lora_client_learns_and_samples_with_the_trainers_logprobs(
    service: tinker.ServiceClient, server: TinkerProcess
) -> None:
    client = service.create_lora_training_client(base_model=server.model_dir, rank=8).result()
    info = client.get_info()
    assert info.lora_rank == 8 and info.model_data.tokenizer_id == server.model_dir
    tokenizer = client.get_tokenizer()
    data = [_chat(tokenizer, f"{a}+{a}=?", str(2 * a)) for a in range(1, 9)]
    losses = [_loss(client, data, 5e-3) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses

    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = tokenizer("user: 3+3=?\nassistant:")["input_ids"]
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    named = client.save_weights_for_sampler("named").result().path
    assert named.endswith("/sampler_weights/named")
    again = service.create_sampling_client(model_path=named).result()
    resampled = again.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    assert [s.tokens for s in resampled.sequences] == [s.tokens for s in sampled.sequences]
    for sequence in sampled.sequences:
        ids = prompt + sequence.tokens
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        trained = client.forward([datum], "cross_entropy").result()
        ours = trained.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        assert len(ours) == len(sequence.tokens) == len(sequence.logprobs or [])
        assert np.allclose(ours, sequence.logprobs, atol=1e-4), (ours, sequence.logprobs)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        assert scored[0] is None and len(scored) == len(ids)
        assert np.allclose(scored[1:], trained.loss_fn_outputs[0]["logprobs"].tolist(), atol=1e-4)

    # importance sampling on the samples: advantages up for the first, down for the rest
    is_data = []
    for index, sequence in enumerate(sampled.sequences):
        ids = prompt + sequence.tokens
        size = len(ids) - 1
        sampled_lp = [0.0] * (len(prompt) - 1) + list(sequence.logprobs or [])
        # Not summing to zero over equal lengths (three samples cut at max_tokens).
        advantage = 1.0 if index == 0 else -0.25
        advantages = [0.0] * (len(prompt) - 1) + [advantage] * len(sequence.tokens)
        is_data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "logprobs": sampled_lp,
                            "advantages": advantages},
        ))  # fmt: skip
        assert len(advantages) == size
    first = client.forward_backward(is_data, "importance_sampling").result()
    # The ratio is 1 at the sampling weights: the loss is -Σ advantages over sampled tokens.
    expected = -sum(sum(d.loss_fn_inputs["advantages"].tolist()) for d in is_data)
    assert math.isclose(first.metrics["loss:sum"], expected, rel_tol=1e-3, abs_tol=1e-4)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = client.forward(is_data, "importance_sampling").result()
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]


def test_top_k_sampling_and_top_k_prompt_logprobs(
    service: tinker.ServiceClient, server: TinkerProcess
) -> None:
    """``top_k`` 1 at temperature 1 draws the greedy reply, its log-probs still those of
    the whole distribution; ``topk_prompt_logprobs`` gives each prompt position after the
    first its k best tokens, best first, which hold the prompt's own token where it is
    among them, with the log-prob ``include_prompt_logprobs`` gives it."""
    sampler = service.create_sampling_client(base_model=server.model_dir).result()
    ids = sampler.get_tokenizer()("user: 4+4=?\nassistant:")["input_ids"]
    prompt = types.ModelInput.from_ints(ids)
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    top1 = types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=3)
    drawn = sampler.sample(prompt, 2, top1, include_prompt_logprobs=True,
                           topk_prompt_logprobs=3).result()  # fmt: skip
    assert all(s.tokens == greedy.sequences[0].tokens for s in drawn.sequences)
    assert np.allclose(drawn.sequences[0].logprobs or [], greedy.sequences[0].logprobs or [],
                       atol=1e-5)  # fmt: skip
    chosen, top = drawn.prompt_logprobs, drawn.topk_prompt_logprobs
    assert chosen is not None and top is not None and top[0] is None
    assert len(top) == len(ids)
    for position in range(1, len(ids)):
        best = top[position]
        assert best is not None and len(best) == 3
        values = [value for _, value in best]
        assert values == sorted(values, reverse=True)
        own = dict(best).get(ids[position])
        assert own is None or math.isclose(own, chosen[position], abs_tol=1e-5)
        assert chosen[position] <= values[0] + 1e-6
    with pytest.raises(tinker.RequestFailedError, match="top_k = -2"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, top_k=-2)).result()


def test_models_past_the_bound_are_evicted_and_train_on_exactly(tmp_path: Path) -> None:
    """``serve.tinker_max_models = 4`` and 16 models trained in turn, a step each per
    round: each is saved and dropped before its next step and reloaded for it, and loses
    bit for bit what a model of its seed trained alone loses (its adapters and optimizer
    state kept); an evicted model still answers ``get_info``, and the stop saves all."""
    with tinker_server(tmp_path, serve={"tinker_max_models": 4}) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)

        def train(client: tinker.TrainingClient) -> float:
            data = [_chat(client.get_tokenizer(), f"{a}+2=?", str(a + 2)) for a in range(3)]
            return _loss(client, data, 1e-2)

        def create(seed: int) -> tinker.TrainingClient:
            return service.create_lora_training_client(base_model=server.model_dir, rank=4,
                                                       seed=seed).result()  # fmt: skip

        alone = create(5)
        expected = [train(alone) for _ in range(3)]
        clients = [create(seed) for seed in range(16)]
        losses: list[list[float]] = [[] for _ in clients]
        for _ in range(3):
            for client, lost in zip(clients, losses, strict=True):
                lost.append(train(client))
        assert losses[5] == expected
        evicted = sorted(server.run_dir.glob("tinker/*/evicted"))
        assert len(evicted) >= 12, evicted  # 4 held at most: the others saved
        assert clients[0].get_info().lora_rank == 4  # evicted, still described
        assert server.stop() == 130, server.stderr()[-2000:]
        end_heartbeats(service)
        # The stop saves every model, an evicted one reloaded for it.
        assert len(list(server.run_dir.glob("tinker/*/weights/last"))) == 17


def test_cispo_and_dro_at_the_sampling_weights(
    service: tinker.ServiceClient, server: TinkerProcess
) -> None:
    """Where the sampler's log-probs are the model's own (the ratio 1), ``cispo``'s loss
    is ``-Σ A·log π`` and so is ``dro``'s (its penalty 0); a negative ``beta`` and a band
    that is not one are the client's errors."""
    client = service.create_lora_training_client(base_model=server.model_dir, rank=2).result()
    good = _chat(client.get_tokenizer(), "2+3=?", "5")
    own = client.forward([good], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    advantages = [0.5 * w for w in good.loss_fn_inputs["weights"].tolist()]
    datum = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist(), "logprobs": own,
        "advantages": advantages})  # fmt: skip
    expected = -sum(a * lp for a, lp in zip(advantages, own, strict=True))
    for loss in ("cispo", "dro"):
        got = client.forward([datum], loss).result().metrics["loss:sum"]
        assert math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-5), (loss, got, expected)
    with pytest.raises(tinker.RequestFailedError, match=r"beta -1\.0"):
        client.forward_backward([datum], "dro", {"beta": -1.0}).result()
    with pytest.raises(tinker.RequestFailedError, match=r"clip_high_threshold 0\.9"):
        client.forward_backward([datum], "cispo", {"clip_high_threshold": 0.9}).result()


def test_cispo_and_dro_gradients_are_the_documented_ones() -> None:
    """Per token, d loss / d log π: ``cispo``'s is ``-clip(r, low, high)·A`` (the clipped
    ratio carries no gradient, so a token outside the band still moves, unlike under
    ``ppo``); ``dro``'s is ``-(A - β·(log π - log q))``."""
    from trainers.hf.tinker import LOSS_TERMS

    sampled = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    logprobs = torch.tensor([-1.0, -1.0, -1.5, -3.05], requires_grad=True)
    advantages = torch.tensor([1.0, 2.0, 0.5, 3.0])
    inputs = {"logprobs": sampled, "advantages": advantages}
    ratio = torch.exp(logprobs.detach() - sampled)  # 1, e, 1/e, ~0.95
    for loss, config, gradient in (
        ("cispo", {}, -ratio.clamp(0.8, 1.2) * advantages),
        ("dro", {"beta": 0.3}, -(advantages - 0.3 * (logprobs.detach() - sampled))),
    ):
        logprobs.grad = None
        LOSS_TERMS[loss](logprobs, inputs, config).sum().backward()
        assert logprobs.grad is not None
        torch.testing.assert_close(logprobs.grad, gradient)
    logprobs.grad = None  # ppo, by contrast: no gradient where the clip holds (r = e, A > 0)
    LOSS_TERMS["ppo"](logprobs, inputs, {}).sum().backward()
    assert logprobs.grad is not None and logprobs.grad[1] == 0 and logprobs.grad[0] != 0


def test_save_state_then_load_state_resumes_exactly(
    service: tinker.ServiceClient, server: TinkerProcess
) -> None:
    client = service.create_lora_training_client(base_model=server.model_dir, rank=4).result()
    tokenizer = client.get_tokenizer()
    data = [_chat(tokenizer, f"{a}+1=?", str(a + 1)) for a in range(1, 5)]
    for _ in range(2):
        _loss(client, data, 1e-2)
    path = client.save_state("before").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/before")
    straight = [_loss(client, data, 1e-2) for _ in range(3)]

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 4
    again = [_loss(resumed, data, 1e-2) for _ in range(3)]
    assert again == straight

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    listed = rest.list_checkpoints(path.split("/")[2]).result().checkpoints
    assert "weights/before" in [c.checkpoint_id for c in listed]
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4


def test_futures_awaited_together_on_asyncio(server: TinkerProcess) -> None:
    async def main() -> None:
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        client = await service.create_lora_training_client(base_model=server.model_dir, rank=8)
        tokenizer = client.get_tokenizer()
        data = [_chat(tokenizer, f"{a}+2=?", str(a + 2)) for a in range(1, 5)]
        # Submitted back to back, awaited together: they run in submission order.
        submitted = []
        for _ in range(3):
            submitted.append(client.forward_backward(data, "cross_entropy"))
            submitted.append(client.optim_step(types.AdamParams(learning_rate=1e-2)))
        results = await asyncio.wait_for(asyncio.gather(*submitted), 120)
        losses = [r.metrics["loss:sum"] for r in results[::2]]
        assert losses[2] < losses[1] < losses[0], losses
        sampler = await client.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(tokenizer("user: 1+2=?\nassistant:")["input_ids"])
        params = types.SamplingParams(max_tokens=8, seed=3)
        samples = await asyncio.wait_for(
            asyncio.gather(*(sampler.sample(prompt, 2, params) for _ in range(4))), 120
        )
        assert all(len(s.sequences) == 2 for s in samples)
        assert samples[0].sequences[0].tokens == samples[1].sequences[0].tokens  # one seed
        await service.close("success")

    asyncio.run(main())


def test_a_busy_model_does_not_starve_another(server: TinkerProcess) -> None:
    """Twelve requests queued for one model, then one for another model on the same
    base: the lane holds one call per model at a time, so the other's runs after at most
    the busy model's running call and its next, not after all twelve."""

    async def main() -> list[str]:
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        busy = await service.create_lora_training_client(base_model=server.model_dir, rank=8)
        other = await service.create_lora_training_client(base_model=server.model_dir, rank=8)
        tokenizer = busy.get_tokenizer()
        data = [_chat(tokenizer, f"{a}+2=?", str(a + 2)) for a in range(1, 9)]
        finished: list[str] = []

        async def done(name: str, future: Any) -> None:
            await future
            finished.append(name)

        waits = [done(f"busy-{i}", busy.forward_backward(data, "cross_entropy"))
                 for i in range(12)]  # fmt: skip
        waits.append(done("other", other.forward_backward(data, "cross_entropy")))
        await asyncio.wait_for(asyncio.gather(*waits), 120)
        await service.close("success")
        return finished

    finished = asyncio.run(main())
    assert finished.index("other") <= 3, finished


def _raw_forward_backward(url: str, model_id: str, seq_id: int, datum: pb.Datum) -> str:
    """A forward-backward request written by hand, and its future's error (if any)."""
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    request.data.append(datum)
    headers = {"X-API-Key": API_KEY, "Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=f"{url}/api/v1", headers=headers, timeout=60) as http:
        submitted = http.post("/forward_backward", content=request.SerializeToString())
        assert submitted.status_code == 200, submitted.text
        reply = http.post("/retrieve_future", json=submitted.json())
    assert reply.status_code == 200
    if reply.headers["content-type"].startswith("application/x-protobuf"):
        return ""
    body = reply.json()
    assert body["category"] == "user", body
    return str(body["error"])


def _datum(tokens: list[int], targets: np.ndarray, weights: np.ndarray) -> pb.Datum:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    for name, values, dtype in (("target_tokens", targets, pb.DTYPE_INT64),
                                ("weights", weights, pb.DTYPE_FLOAT32)):  # fmt: skip
        tensor = datum.loss_fn_inputs[name]
        tensor.dense, tensor.dtype = values.tobytes(), dtype
        tensor.shape.extend(values.shape)
    return datum


def test_bad_requests_are_user_errors_and_the_server_goes_on(
    service: tinker.ServiceClient, server: TinkerProcess
) -> None:
    client = service.create_lora_training_client(base_model=server.model_dir, rank=2).result()
    # Another model on the same base, mid-training: the first one's refusals touch
    # nothing of its state (its loss after them is bitwise the one before).
    bystander = service.create_lora_training_client(base_model=server.model_dir, rank=2).result()
    tokenizer = client.get_tokenizer()
    good = _chat(tokenizer, "1+1=?", "2")
    bystander.forward_backward([good], "cross_entropy").result()
    bystander.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    bystanding = bystander.forward([good], "cross_entropy").result().metrics["loss:sum"]
    bad_shape = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist()[:-1],
        "weights": good.loss_fn_inputs["weights"].tolist()[:-1],
    })  # fmt: skip
    with pytest.raises(tinker.RequestFailedError) as refused:
        client.forward_backward([bad_shape], "cross_entropy").result()
    assert refused.value.category == "user" and "one per input token" in str(refused.value)
    missing = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist()})  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match="needs 'weights'"):
        client.forward_backward([missing], "cross_entropy").result()
    ppo = types.Datum(model_input=good.model_input, loss_fn_inputs={
        "target_tokens": good.loss_fn_inputs["target_tokens"].tolist(),
        "logprobs": [-1.0] * len(good.loss_fn_inputs["weights"].tolist()),
        "advantages": good.loss_fn_inputs["weights"].tolist()})  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match=r"clip_low_threshold 1\.5"):
        client.forward_backward([ppo], "ppo", {"clip_low_threshold": 1.5}).result()
    with pytest.raises(tinker.RequestFailedError, match=r"adam_params\.learning_rate"):
        client.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    with pytest.raises(tinker.RequestFailedError, match="not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    # The client goes on after its refusals: its next request runs.
    assert client.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0
    assert bystander.forward([good], "cross_entropy").result().metrics["loss:sum"] == bystanding

    model_id = client.model_id  # its requests so far: seq_id 1 to 5
    tokens = np.asarray(good.model_input.to_ints(), "<i4")
    floats = _datum(tokens.tolist(), np.zeros(len(tokens), "<f4"), np.ones(len(tokens), "<f4"))
    floats.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_FLOAT32
    assert "target_tokens" in _raw_forward_backward(server.url, model_id, 6, floats)
    plain = _datum(tokens.tolist(), np.zeros(len(tokens), "<i8"), np.ones(len(tokens), "<f4"))
    assert "no such model" in _raw_forward_backward(server.url, "nobody:train:0", 1, plain)
    assert "its optim_step request" in _raw_forward_backward(server.url, model_id, 4, plain)
    assert _raw_forward_backward(server.url, model_id, 7, plain) == ""


def test_unsupported_client_versions_and_routes_are_named(server: TinkerProcess) -> None:
    headers = {"X-API-Key": API_KEY}
    with httpx.Client(base_url=f"{server.url}/api/v1", headers=headers, timeout=30) as http:
        old = http.post("/client/config", json={"sdk_version": "0.30.1"})
        assert old.status_code == 400 and "corun serves SDK 0.38.0" in old.json()["detail"]
        route = http.post("/save_weights_external", json={})
        assert route.status_code == 404 and "not served" in route.json()["detail"]
        bad = http.post("/optim_step", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["category"] == "user"


def test_ctrl_c_fails_inflight_futures_saves_open_models_and_exits_130(tmp_path: Path) -> None:
    with tinker_server(tmp_path) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        client = service.create_lora_training_client(base_model=server.model_dir, rank=8).result()
        tokenizer = client.get_tokenizer()
        data = [_chat(tokenizer, f"{a}+{a}=?", str(2 * a)) for a in range(64)]
        outcomes: list[str] = []

        def train() -> None:
            try:
                while True:
                    # A call the stop catches before its result is asked for sees a
                    # closed server: the SDK retries until this timeout (not a hang).
                    client.forward_backward(data, "cross_entropy").result(timeout=20)
                    outcomes.append("ok")
            except Exception as exc:  # the stop: a failed future or a closed connection
                outcomes.append(type(exc).__name__ + f": {exc}")

        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        assert _wait(lambda: outcomes.count("ok") >= 2), outcomes
        model_id = client.model_id
        assert server.stop() == 130, server.stderr()[-2000:]
        worker.join(timeout=40)
        assert not worker.is_alive(), "a client call hung after the server stopped"
        end_heartbeats(service)
        assert outcomes[-1] != "ok"
        assert not server.listening()
        last = server.run_dir / "tinker" / model_id / "weights" / "last"
        assert (last / "tinker.json").is_file(), server.stderr()[-2000:]
        assert f"saved tinker://{model_id}/weights/last" in server.stderr()


def _wait(predicate: Any, timeout_s: float = 120) -> bool:
    from tests.support.processes import wait_until

    return bool(wait_until(predicate, timeout_s, poll_s=0.1))


@pytest.mark.skipif(find_spec("vllm") is None, reason="needs the vllm extra")
def test_samples_on_the_runs_vllm_engine(tmp_path: Path) -> None:
    """An hf_grpo config with a vLLM engine: the sampled log-probs are the trainer's,
    the base model samples, and a rank above the engine's is the client's error."""
    engine = {"engine": "vllm", "engine_options": {"lora_rank": 8}}
    with tinker_server(tmp_path, kind="hf_grpo", rollout_correction="none", **engine) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        client = service.create_lora_training_client(base_model=server.model_dir, rank=8).result()
        tokenizer = client.get_tokenizer()
        data = [_chat(tokenizer, f"{a}+{a}=?", str(2 * a)) for a in range(1, 5)]
        for _ in range(3):
            _loss(client, data, 1e-2)
        sampler = client.save_weights_and_get_sampling_client().result()
        prompt = tokenizer("user: 3+3=?\nassistant:")["input_ids"]
        asked, params = types.ModelInput.from_ints(prompt), types.SamplingParams(max_tokens=8)
        (sequence,) = sampler.sample(asked, 1, params).result().sequences
        ids = prompt + sequence.tokens
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})  # fmt: skip
        trained = client.forward([datum], "cross_entropy").result()
        ours = trained.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        assert np.allclose(ours, sequence.logprobs, atol=1e-4), (ours, sequence.logprobs)
        base = service.create_sampling_client(base_model=server.model_dir).result()
        assert (
            len(base.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences) == 2
        )
        wide = service.create_lora_training_client(base_model=server.model_dir, rank=16).result()
        with pytest.raises(tinker.RequestFailedError, match="takes ranks up to 8") as refused:
            wide.save_weights_and_get_sampling_client().result().sample(asked, 1, params).result()
        assert refused.value.category == "user"
        service.close("success").result()
        assert server.stop() == 130, server.stderr()[-2000:]
        assert not server.listening()


@pytest.mark.usefixtures("restore_process_state")
def test_tinker_is_served_not_trained_and_only_by_hf_kinds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = call_main(["train", "tinker", f"run.dir={tmp_path / 'a'}"], capsys)
    assert_usage_error(code, err, "$.serve.tinker", "corun serve")
    config = tmp_path / "fake.toml"
    config.write_text(base_toml(tmp_path / "b", "") + "\n[serve]\ntinker = true\n")
    code, _, err = call_main(["serve", str(config)], capsys)
    assert_usage_error(code, err, "$.serve.tinker", "serves no models to train")
