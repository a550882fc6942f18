"""Log-probs, entropies and the exact reverse KL a chunk of positions at a time
(trainers/lm/policy.py, ``chunk``: the most logits one pass holds), and TinyLM's
activation checkpointing:

- chunked values and parameter gradients equal one pass over the whole batch, for
  TinyLM (float32 and float64) and the built-in Hugging Face Llama (left-padded
  prompts too); a batch within one chunk computes exactly the unchunked formula;
- the chunked passes never hold the whole batch's logits, forward or backward (the
  point of chunks), where one pass does;
- TinyLM with activation checkpointing recomputes its blocks in backward and gives the
  same gradients as without.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from corun.engines import decode
from trainers.hf.policy import HFPolicy, load_policy
from trainers.lm.engine import Rollouts
from trainers.lm.model import ModelConfig, TinyLM
from trainers.lm.policy import (
    LOGITS_CHUNK,
    exact_reverse_kl,
    response_logprobs,
    rollout_logprobs,
    with_checkpointing,
)
from trainers.lm.settings import LMTrainerConfig
from trainers.lm.sft import masked_loss_sum, target_loss_sum
from trainers.lm.tasks import encode_examples

VOCAB = 200
ROWS, PROMPT, RESPONSE = 5, 3, 7  # 35 response positions: not a multiple of 3
POSITIONS = ROWS * RESPONSE
CHUNK = 3  # positions per chunk in the chunked cases: 12 chunks, the last of 2
TEMPERATURE = 0.7


def tiny_lm(dtype: torch.dtype = torch.float32) -> TinyLM:
    """A seeded TinyLM whose whole logits (35 x 200) outsize any other tensor of a step:
    d_model 16 < 35 positions, so the head's weight and gradient (200 x 16) are smaller."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=16)
    return TinyLM(config).to(dtype)


def sequences(vocab: int, prompt: int = PROMPT) -> Tensor:
    return torch.randint(
        0, vocab, (ROWS, prompt + RESPONSE), generator=torch.Generator().manual_seed(1)
    )


def loss_of(logp: Tensor, entropy: Tensor) -> Tensor:
    """A loss from both outputs with a different weight at every position, so a
    position's gradient landing on another's would show."""
    weights = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view(logp.shape)
    return (weights * logp).mean() + 0.1 * entropy.mean()


def logprobs_and_grads(
    model: TinyLM | HFPolicy, ids: Tensor, chunk: int, prompt: int = PROMPT,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, list[Tensor]]:  # fmt: skip
    """(logp, entropy, the parameters' gradients of :func:`loss_of`) at ``chunk``."""
    model.zero_grad(set_to_none=True)
    logp, entropy, _ = response_logprobs(model, ids, prompt, TEMPERATURE, mask, chunk=chunk)
    loss_of(logp, entropy).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp.detach(), entropy.detach(), grads


def assert_same(chunked: Any, whole: Any, tol: float) -> None:
    (logp, entropy, grads), (logp0, entropy0, grads0) = chunked, whole
    torch.testing.assert_close(logp, logp0, rtol=tol, atol=tol)
    torch.testing.assert_close(entropy, entropy0, rtol=tol, atol=tol)
    assert len(grads) == len(grads0) > 0
    for grad, grad0 in zip(grads, grads0, strict=True):
        torch.testing.assert_close(grad, grad0, rtol=tol, atol=tol)


@contextmanager
def head_calls(model: Any) -> Iterator[list[int]]:
    """The number of positions each call of ``model.head`` computes logits for."""
    calls: list[int] = []
    head = model.head

    def counted(hidden: Tensor) -> Tensor:
        calls.append(hidden.shape[:-1].numel())
        return head(hidden)

    model.head = counted
    try:
        yield calls
    finally:
        del model.head


# ------------------------------------------------------------------------------- TinyLM


@pytest.mark.parametrize("chunk", [VOCAB * CHUNK, 1], ids=["3-positions", "below-vocab"])
def test_tinylm_chunks_equal_one_pass_float32(chunk: int) -> None:
    """Several chunks (3 positions each; below the vocabulary, one each): the same
    log-probs, entropies and gradients as one pass, within float32 rounding."""
    model, ids = tiny_lm(), sequences(VOCAB)
    with head_calls(model) as calls, torch.no_grad():
        response_logprobs(model, ids, PROMPT, TEMPERATURE, chunk=chunk)
    per_chunk = max(1, chunk // VOCAB)
    assert max(calls) == per_chunk and sum(calls) == POSITIONS  # chunked as asked
    assert_same(logprobs_and_grads(model, ids, chunk), logprobs_and_grads(model, ids, 0), 1e-6)


def test_tinylm_chunks_equal_one_pass_float64() -> None:
    model, ids = tiny_lm(torch.float64), sequences(VOCAB)
    chunked = logprobs_and_grads(model, ids, VOCAB * CHUNK)
    assert chunked[0].dtype == torch.float64
    assert_same(chunked, logprobs_and_grads(model, ids, 0), 1e-10)


def test_a_batch_within_one_chunk_is_the_unchunked_formula_bit_for_bit() -> None:
    """chunk 0, or one that holds the whole batch's logits: one pass, the same numbers
    as the formula before chunks (parity tests elsewhere compare bitwise)."""
    model, ids = tiny_lm(), sequences(VOCAB)
    hidden = model.hidden(ids[:, :-1])[:, PROMPT - 1 :]
    log_dist = F.log_softmax(model.head(hidden) / TEMPERATURE, dim=-1)
    logp = log_dist.gather(-1, ids[:, PROMPT:, None]).squeeze(-1)
    entropy = -(log_dist.exp() * log_dist).sum(dim=-1)
    for chunk in (0, POSITIONS * VOCAB, LOGITS_CHUNK):
        with head_calls(model) as calls:
            got_logp, got_entropy, got_hidden = response_logprobs(
                model, ids, PROMPT, TEMPERATURE, chunk=chunk
            )
            loss_of(got_logp, got_entropy).backward(retain_graph=True)
        assert calls == [POSITIONS]  # once: no chunk, and nothing recomputed in backward
        assert torch.equal(got_logp, logp) and torch.equal(got_entropy, entropy)
        assert torch.equal(got_hidden, hidden)
    with head_calls(model) as calls:  # one logit fewer than the batch's: two chunks
        response_logprobs(model, ids, PROMPT, TEMPERATURE, chunk=POSITIONS * VOCAB - 1)
    assert calls == [POSITIONS - 1, 1]


def test_rollout_logprobs_passes_its_chunk_on() -> None:
    model, ids = tiny_lm(), sequences(VOCAB)
    rollouts = Rollouts(
        ids[:, :PROMPT], ids[:, PROMPT:], torch.ones(ROWS, RESPONSE, dtype=torch.bool),
        torch.zeros(ROWS, RESPONSE), torch.zeros(ROWS, dtype=torch.bool),
        torch.zeros(ROWS, RESPONSE, dtype=torch.long), 0,
    )  # fmt: skip
    with head_calls(model) as calls, torch.no_grad():
        logp, _, _ = rollout_logprobs(model, rollouts, TEMPERATURE, chunk=VOCAB * CHUNK)
    assert max(calls) == CHUNK
    whole, _, _ = response_logprobs(model, ids, PROMPT, TEMPERATURE, chunk=0)
    torch.testing.assert_close(logp, whole.detach(), rtol=0, atol=1e-6)


def test_the_default_chunk_is_the_configs() -> None:
    fields = {f.name: f.default for f in msgspec.structs.fields(LMTrainerConfig)}
    assert fields["logits_chunk"] == LOGITS_CHUNK


# ------------------------------------------------------------------ the whole logits, never


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator computes, inside checkpointed
    chunks and their recomputation included (views of existing tensors aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for value in out if isinstance(out, tuple | list) else [out]:
            if isinstance(value, Tensor):
                self.numel = max(self.numel, value.numel())
        return out


class OnHidden:
    """TinyLM's head on hidden states computed beforehand (a leaf that takes gradients):
    what autograd keeps while log-probs are computed from them is the log-prob pass's
    alone."""

    def __init__(self, model: TinyLM, ids: Tensor) -> None:
        with torch.no_grad():
            self.states = model.hidden(ids[:, :-1]).requires_grad_()
        self.head, self.vocab_size = model.head, model.vocab_size
        self.hidden_size = model.hidden_size

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.states


def memory(forward: Callable[[], Tensor], given: Tensor | None = None) -> tuple[int, int, int, int]:
    """What ``forward``'s loss costs: (bytes autograd keeps for backward, in distinct
    storages other than the caller's ``given``; elements of the largest tensor it keeps;
    of the largest tensor computed forward; of the largest computed backward). A
    checkpointed chunk's own saved tensors are not kept: backward recomputes them."""
    storages: dict[int, int] = {}
    largest = [0]
    caller = None if given is None else given.untyped_storage().data_ptr()

    def keep(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() != caller:
            storages[storage.data_ptr()] = storage.nbytes()
        largest[0] = max(largest[0], tensor.numel())
        return tensor

    with LargestTensor() as computed, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = forward()
    with LargestTensor() as backward:
        loss.backward()
    return sum(storages.values()), largest[0], computed.numel, backward.numel


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "one-pass"])
def test_log_prob_chunks_never_hold_the_whole_logits(chunked: bool) -> None:
    ids = sequences(VOCAB)
    policy, whole = OnHidden(tiny_lm(), ids), POSITIONS * VOCAB

    def forward() -> Tensor:
        chunk = VOCAB * CHUNK if chunked else 0
        logp, entropy, _ = response_logprobs(policy, ids, PROMPT, TEMPERATURE, chunk=chunk)
        return loss_of(logp, entropy)

    kept, largest_kept, forward_largest, backward_largest = memory(forward)
    if chunked:  # kept: the chunks' inputs; computed: a chunk's logits at a time
        assert kept < whole * 4 and forward_largest < whole and backward_largest < whole
        assert backward_largest >= VOCAB * CHUNK  # a chunk's logits, recomputed
    else:
        assert largest_kept >= whole and forward_largest >= whole and backward_largest >= whole


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "one-pass"])
def test_reverse_kl_chunks_never_hold_the_whole_logits(chunked: bool) -> None:
    ids = sequences(VOCAB)
    policy, whole = OnHidden(tiny_lm(), ids), POSITIONS * VOCAB
    # The teacher's rows are the caller's (and as large); the student's are ours.
    teacher = torch.log_softmax(torch.randn(ROWS, RESPONSE, VOCAB), -1)

    def forward() -> Tensor:
        hidden = policy.states[:, PROMPT - 1 :]
        chunk = VOCAB * CHUNK if chunked else 0
        return exact_reverse_kl(policy, hidden, teacher, TEMPERATURE, chunk=chunk).mean()

    kept, largest_kept, forward_largest, backward_largest = memory(forward, teacher)
    if chunked:
        assert kept < whole * 4 and forward_largest < whole and backward_largest < whole
    else:
        assert largest_kept >= whole and forward_largest >= whole and backward_largest >= whole


# --------------------------------------------------------------------- exact reverse KL


def kl_and_grads(model: TinyLM, teacher: Tensor, chunk: int) -> tuple[Tensor, list[Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden = model.hidden(sequences(VOCAB)[:, :-1])[:, PROMPT - 1 :]
    kl = exact_reverse_kl(model, hidden, teacher, TEMPERATURE, chunk=chunk)
    loss_of(kl, kl).backward()
    return kl.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_exact_reverse_kl_chunks_equal_one_pass_and_the_definition() -> None:
    model = tiny_lm()
    teacher = torch.log_softmax(torch.randn(ROWS, RESPONSE, VOCAB) * 2, -1)
    hidden = model.hidden(sequences(VOCAB)[:, :-1])[:, PROMPT - 1 :]
    with head_calls(model) as calls, torch.no_grad():
        exact_reverse_kl(model, hidden, teacher, TEMPERATURE, chunk=VOCAB * CHUNK)
    assert max(calls) == CHUNK and sum(calls) == POSITIONS
    kl, grads = kl_and_grads(model, teacher, VOCAB * CHUNK)
    kl0, grads0 = kl_and_grads(model, teacher, 0)
    assert_same((kl, kl, grads), (kl0, kl0, grads0), 1e-6)
    # KL(student ‖ teacher), the student's distribution at the temperature.
    student = torch.distributions.Categorical(logits=model.head(hidden) / TEMPERATURE)
    expected = torch.distributions.kl_divergence(
        student, torch.distributions.Categorical(logits=teacher)
    )
    torch.testing.assert_close(kl, expected.detach(), rtol=1e-5, atol=1e-6)
    assert float(kl.min()) > 0.1  # far from agreeing: the comparison means something
    # One pass is the formula before chunks, bit for bit.
    log_s = F.log_softmax((model.head(hidden) / TEMPERATURE).float(), dim=-1)
    assert torch.equal(kl0, (log_s.exp() * (log_s - teacher)).sum(dim=-1).detach())
    # Zero where the teacher is the student.
    same = exact_reverse_kl(model, hidden, log_s.detach(), TEMPERATURE, chunk=VOCAB * CHUNK)
    torch.testing.assert_close(same, torch.zeros(ROWS, RESPONSE), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- activation checkpointing


def test_tinylm_activation_checkpointing_recomputes_blocks_with_the_same_gradients() -> None:
    model, ids = tiny_lm(), sequences(VOCAB)
    runs: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda *_: runs.append(1))

    def step() -> tuple[Tensor, Tensor, list[Tensor]]:
        runs.clear()
        return logprobs_and_grads(model, ids, 0)

    plain = step()
    assert len(runs) == 1
    assert with_checkpointing(model, True) is model
    checkpointed = step()
    assert len(runs) == 2  # forward, then again in backward
    assert_same(checkpointed, plain, 1e-6)
    with torch.no_grad():  # nothing to recompute for
        runs.clear()
        model.hidden(ids)
    assert len(runs) == 1
    with_checkpointing(model, False)
    step()
    assert len(runs) == 1


def test_activation_checkpointing_keeps_less() -> None:
    """Autograd keeps the blocks' inputs only, not their activations."""
    model, ids = tiny_lm(), sequences(VOCAB)

    def total_saved() -> int:
        sizes: list[int] = []

        def keep(tensor: Tensor) -> Tensor:
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.hidden(ids)
        return sum(sizes)

    plain = total_saved()
    with_checkpointing(model, True)
    assert total_saved() < plain / 2


# ------------------------------------------------------------------- Hugging Face Llama


@pytest.fixture(scope="module")
def llama() -> HFPolicy:
    policy, _ = load_policy("tiny-llama", "test")
    return policy


def test_hf_vocab_size_is_the_heads_output(llama: HFPolicy) -> None:
    ids = sequences(llama.vocab_size)
    with torch.no_grad():
        assert llama(ids).shape[-1] == llama.vocab_size == llama.model.config.vocab_size


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_hf_chunks_equal_one_pass(llama: HFPolicy, padded: bool) -> None:
    vocab, prompt = llama.vocab_size, 6
    ids, mask = sequences(vocab, prompt), None
    if padded:  # prompts of 6, 5, 4, 3 and 6 real tokens
        mask = torch.ones_like(ids)
        for row, pad in enumerate([0, 1, 2, 3, 0]):
            mask[row, :pad] = 0
        ids = ids.masked_fill(mask == 0, int(llama.model.config.pad_token_id))
    with head_calls(llama) as calls, torch.no_grad():
        response_logprobs(llama, ids, prompt, TEMPERATURE, mask, chunk=vocab * CHUNK)
    assert max(calls) == CHUNK and sum(calls) == POSITIONS
    chunked = logprobs_and_grads(llama, ids, vocab * CHUNK, prompt, mask)
    assert_same(chunked, logprobs_and_grads(llama, ids, 0, prompt, mask), 1e-6)


def test_a_teachers_scores_come_a_few_rows_a_pass(
    llama: HFPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transformers engine's scoring (a distillation teacher's) bounds its logits
    too: rows a pass, the same scores as one pass."""
    generator = torch.Generator().manual_seed(4)
    vocab = llama.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 3, 7, 4)]
    answers = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (2, 6, 1, 3)]
    whole = decode.score(llama, prompts, answers, pad_id=0)
    passes: list[int] = []
    distributions = decode.distributions

    def counted(*args: Any) -> list[Tensor]:
        passes.append(len(args[1]))
        return distributions(*args)

    monkeypatch.setattr(decode, "distributions", counted)
    monkeypatch.setattr(decode, "SCORE_LOGITS", 2 * 10 * vocab)  # two rows of the longest
    split = decode.score(llama, prompts, answers, pad_id=0)
    assert passes == [2, 2]
    for a, b in zip(whole, split, strict=True):
        assert b == pytest.approx(a, abs=1e-5)


def test_teacher_forcing_loss_in_chunks_equals_the_whole_logits_cross_entropy() -> None:
    """SFT's loss (target_loss_sum): chunked, the same value and gradients as the
    cross-entropy of the whole logits; in one pass, the same bits."""
    model = tiny_lm()
    tokens = encode_examples([("12+34=", "46"), ("5+6=", "11"), ("7+8=", "15")])

    def loss_and_grads(compute: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole = loss_and_grads(lambda: masked_loss_sum(model(tokens.inputs), tokens))
    one_pass = loss_and_grads(lambda: target_loss_sum(model, tokens, 0))
    chunked = loss_and_grads(lambda: target_loss_sum(model, tokens, VOCAB * CHUNK))
    assert torch.equal(one_pass[0], whole[0])
    assert all(torch.equal(a, b) for a, b in zip(one_pass[1], whole[1], strict=True))
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    for grad, grad0 in zip(chunked[1], whole[1], strict=True):
        torch.testing.assert_close(grad, grad0, rtol=1e-6, atol=1e-6)
