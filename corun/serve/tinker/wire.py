"""The Tinker API's wire formats (SDK ``tinker`` 0.38): the JSON request bodies as msgspec
Structs (unknown fields ignored, as the SDK adds some), and the protobuf messages the SDK
insists on — forward-backward requests in, forward-backward outputs and samples out —
through the schema compiled inside the SDK (``tinker.proto.tinker_public_pb2``).

Every decoding error is a :class:`RequestError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import torch

from corun.base.errors import ConfigError
from corun.contract.engine import Generation
from corun.contract.training_api import (
    LOSSES,
    Datum,
    ForwardResult,
    LossName,
    PromptScores,
    RequestError,
)

if TYPE_CHECKING:
    from tinker.proto import tinker_public_pb2

SDK_VERSION = "0.38.0"
PROTOBUF = "application/x-protobuf"
EMPTY_LOGPROB = -99999.0  # an empty cell of a TopkLogprobs matrix (the SDK reads its row as None)


def proto() -> Any:
    """The SDK's compiled schema; without the SDK installed, a usage error saying how."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise ConfigError(
            "`$.serve.tinker`: the Tinker API needs the `tinker` package: "
            "pip install 'corun[tinker]'"
        ) from None
    return tinker_public_pb2


# ---------------------------------------------------------------- JSON request bodies


class LoraConfig(msgspec.Struct, kw_only=True):
    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(msgspec.Struct, kw_only=True):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    """A request about one model, in its order (``seq_id``)."""

    model_id: str
    seq_id: int | None = None


class AdamParams(msgspec.Struct, kw_only=True):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(ModelRequest, kw_only=True):
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(ModelRequest, kw_only=True):
    path: str | None = None
    overwrite: bool = False
    sampling_session_seq_id: int | None = None


class LoadWeights(msgspec.Struct, kw_only=True):
    """``load_state`` (``model_id``, ``seq_id``), or a new model from a saved state
    (``session_id``, ``model_seq_id``: create-via-load)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None


class CreateSamplingSession(msgspec.Struct, kw_only=True):
    session_id: str
    sampling_session_seq_id: int = 0
    model_path: str | None = None
    base_model: str | None = None


class PromptChunk(msgspec.Struct, kw_only=True):
    type: str = "encoded_text"
    tokens: list[int] = []


class Prompt(msgspec.Struct, kw_only=True):
    chunks: list[PromptChunk]


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | list[str | int] | None = None


class Sample(msgspec.Struct, kw_only=True):
    prompt: Prompt
    sampling_params: SamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0


class RequestId(msgspec.Struct, kw_only=True):
    request_id: str


class SessionRequest(msgspec.Struct, kw_only=True):
    session_id: str | None = None
    model_id: str | None = None
    tinker_path: str | None = None


def decode(body: bytes, kind: type[Any]) -> Any:
    """A JSON body as ``kind``; a malformed one refused naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None


def prompt_tokens(prompt: Prompt) -> list[int]:
    """The prompt's tokens; an image or audio chunk is not served (text models only)."""
    tokens: list[int] = []
    for index, chunk in enumerate(prompt.chunks):
        if chunk.type != "encoded_text":
            raise RequestError(
                f"prompt.chunks[{index}]: a {chunk.type!r} chunk; corun serves text models only"
            )
        tokens += chunk.tokens
    return tokens


# ---------------------------------------------------------------- forward-backward in


def forward_backward_request(
    body: bytes,
) -> tuple[str, int, LossName, dict[str, float], bool, list[Datum]]:
    """``(model_id, seq_id, loss, loss_config, forward_only, data)`` of a protobuf body."""
    pb = proto()
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError, or anything a truncated body raises
        raise RequestError(f"the body is not a ForwardBackwardRequest ({exc})") from None
    if request.loss_fn not in LOSSES:
        raise RequestError(
            f"loss_fn {request.loss_fn!r} is not served (served: {', '.join(LOSSES)})"
        )
    config = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = value.number
    data = [_datum(d, index) for index, d in enumerate(request.data)]
    loss: LossName = request.loss_fn
    return request.model_id, request.seq_id, loss, config, request.forward_only, data


def _datum(datum: tinker_public_pb2.Datum, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        which = chunk.WhichOneof("chunk")
        if which != "encoded_text":
            raise RequestError(f"data[{index}].model_input: a {which!r} chunk; text models only")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise RequestError(f"data[{index}].model_input: tokens are int32, {len(raw)} bytes")
        tokens += np.frombuffer(raw, "<i4").tolist()
    inputs = {key: _tensor(t, f"data[{index}].loss_fn_inputs[{key!r}]")
              for key, t in datum.loss_fn_inputs.items()}  # fmt: skip
    return Datum(tokens, inputs)


_DTYPES = {1: ("<f4", torch.float32), 2: ("<i8", torch.int64), 3: ("<i4", torch.int32)}


def _tensor(tensor: tinker_public_pb2.Tensor, where: str) -> torch.Tensor:
    if tensor.dtype not in _DTYPES:
        raise RequestError(f"{where}: dtype {tensor.dtype} is not float32, int64 or int32")
    if tensor.WhichOneof("encoding") != "dense":
        raise RequestError(f"{where}: only dense tensors are served (one value per token)")
    layout, _ = _DTYPES[tensor.dtype]
    size = np.dtype(layout).itemsize
    if len(tensor.dense) % size:
        raise RequestError(f"{where}: {len(tensor.dense)} bytes is no whole number of values")
    values = np.frombuffer(tensor.dense, layout)
    shape = list(tensor.shape)
    if any(size < 0 for size in shape) or math.prod(shape) != values.size:
        raise RequestError(f"{where}: shape {shape} does not hold {values.size} values")
    return torch.from_numpy(values.copy()).reshape(shape)


# ---------------------------------------------------------------- results out


def forward_backward_output(result: ForwardResult) -> bytes:
    """A ForwardBackwardOutput: one record of per-datum float32 arrays, and the metrics."""
    pb = proto()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result.outputs))
    names = result.outputs[0].keys() if result.outputs else ()
    for name in names:
        arrays = [o[name].detach().float().numpy().astype("<f4") for o in result.outputs]
        offsets = np.cumsum([0, *(a.nbytes for a in arrays)]).astype("<i8")
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
            dtype=pb.DTYPE_FLOAT32,
        ))  # fmt: skip
    for key, value in result.metrics.items():
        out.metrics[key] = value
    return bytes(out.SerializeToString())


StopReason = Literal["stop", "length"]


def sample_response(
    generations: Sequence[Generation], scored: PromptScores | None = None,
    chosen: bool = True, top_k: int = 0,
) -> bytes:  # fmt: skip
    """A SampleResponse: per sequence its tokens, log-probs and why it ended; the prompt's
    log-probs (``chosen``: NaN first, nothing predicts the first token) and its top
    ``top_k`` per position (the first row empty) from ``scored``, when asked for."""
    pb = proto()
    response = pb.SampleResponse()
    for generation in generations:
        response.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if generation.finish == "stop"
            else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(generation.ids, "<i4").tobytes(),
            logprobs=np.asarray(generation.logprobs, "<f4").tobytes(),
        )  # fmt: skip
    if scored is not None and chosen:
        response.prompt_logprobs = np.asarray([math.nan, *scored.chosen], "<f4").tobytes()
    if scored is not None and top_k:
        ids = np.zeros((len(scored.top) + 1, top_k), "<i4")
        values = np.full((len(scored.top) + 1, top_k), EMPTY_LOGPROB, "<f4")
        for row, best in enumerate(scored.top, start=1):
            ids[row, : len(best)] = [token for token, _ in best]
            values[row, : len(best)] = [value for _, value in best]
        response.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=ids.tobytes(), logprobs=values.tobytes(), k=top_k, length=len(ids)
        ))  # fmt: skip
    return bytes(response.SerializeToString())
