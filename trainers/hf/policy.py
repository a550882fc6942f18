"""A Hugging Face causal LM as a corun policy: loaded from ``hf:<dir>`` with its
tokenizer, seen through the interface the LM trainers use (hidden states, head,
hidden size), prompts rendered with its chat template, and exported back to a
``save_pretrained`` directory.

Nothing is downloaded: ``<dir>`` is a local directory (``python -m trainers.hf.tiny
DIR`` builds one). Weights are kept in float32 whatever the checkpoint's dtype (the
master weights; trainers/hf/training.py sets the compute precision).
Logits are ``lm_head(last hidden state)``, so models that post-process logits (soft
capping, scaling) are refused rather than trained on different log-probs than they
sample with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
from torch import Tensor, nn

from corun import ConfigError
from corun.engines.decode import positions
from trainers.hf.prompts import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PREFIX = "hf:"
BUILT_IN = "tiny-llama"  # trainers/hf/tiny.py (and "tiny-llama-large", its teacher)
# Config keys of models whose logits are not lm_head(hidden): refused (see above).
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def model_dir(spec: str, where: str) -> Path:
    """The directory of ``hf:<dir>``, or of a built-in model (``tiny-llama``,
    ``tiny-llama-large``: built on first use); anything else is a usage error naming
    ``where``."""
    from trainers.hf.tiny import BUILT_INS, built_in

    if spec in BUILT_INS:
        return built_in(spec)
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise ConfigError(f'{where} = {spec!r}: expected "hf:<directory>" or "{BUILT_IN}"')
    path = Path(spec[len(PREFIX) :]).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} = {spec!r}: {path} is not a model directory (no config.json)")
    return path


class HFPolicy(nn.Module):
    """An ``AutoModelForCausalLM`` with position ids that skip left padding, so a
    padded row computes what the same row unpadded does (as a vLLM engine runs it)."""

    def __init__(self, model: PreTrainedModel, source: Path) -> None:
        super().__init__()
        self.model = model
        self.source = source

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: what the head computes logits over (the
        config's ``vocab_size`` may differ where embeddings are padded)."""
        lm_head = self.model.get_output_embeddings()
        assert lm_head is not None
        return int(lm_head.weight.shape[0])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.long()
        out = self.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
        )
        hidden: Tensor = out.last_hidden_state
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        lm_head = self.model.get_output_embeddings()
        assert lm_head is not None
        logits: Tensor = lm_head(hidden)
        # Log-probs in float32 (at least) whatever the compute precision.
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.head(self.hidden(ids, attention_mask))

    def weights(self) -> dict[str, Tensor]:
        """The state dict under the model's own names (what engines load)."""
        return self.model.state_dict()

    def config_json(self) -> str:
        return str(self.model.config.to_json_string(use_diff=False))


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def load_policy(spec: str, where: str) -> tuple[HFPolicy, PreTrainedTokenizerBase]:
    """The model and tokenizer of ``hf:<dir>``; a directory that is not a causal LM, or
    has no usable tokenizer, is a usage error naming ``where``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    quiet_transformers()
    path = model_dir(spec, where)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{where} = {spec!r}: cannot read its config ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{where} = {spec!r}: a {type(config).__name__} ({config.model_type!r}) model is "
            "not a causal LM (AutoModelForCausalLM cannot load it)"
        )
    post = [key for key in LOGIT_POSTPROCESSING if getattr(config, key, None)]
    if post:
        raise ConfigError(f"{where} = {spec!r}: its logits are post-processed ({post[0]})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where} = {spec!r}: cannot load its tokenizer ({exc})") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{where} = {spec!r}: its tokenizer has no end-of-sequence token")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{where} = {spec!r}: cannot load its weights ({exc})") from None
    return HFPolicy(model, path.resolve()), tokenizer


class ChatFormat:
    """Prompts as token ids: messages through the chat template; plain text through
    the template as one user message when the tokenizer has one, else as it is."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = int(tokenizer.eos_token_id)  # type: ignore[arg-type]
        pad = tokenizer.pad_token_id
        self.pad_id = self.eos_id if pad is None else int(pad)

    def check(self, prompts: Sequence[Prompt], where: str) -> None:
        """Messages need a chat template: a usage error naming ``where`` otherwise."""
        if not self.has_template and any(p.messages for p in prompts):
            raise ConfigError(
                f"{where}: the data gives chat messages, and the tokenizer has no chat template"
            )

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        messages = [msgspec.structs.asdict(m) for m in prompt.messages]
        if not messages:
            messages = [{"role": "user", "content": prompt.text}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, prompt: Prompt) -> str:
        if not prompt.messages and not self.has_template:
            return self.system_prompt + prompt.text
        rendered = self.tokenizer.apply_chat_template(
            self.messages(prompt), add_generation_prompt=True, tokenize=False
        )
        return str(rendered)

    def encode(self, prompt: Prompt) -> list[int]:
        # The template wrote any special tokens it wants.
        return self._ids(self.text(prompt))

    def encode_reply(self, prompt: Prompt, reply: str) -> list[int]:
        """The ids the model should produce after :meth:`encode`'s prompt to reply
        ``reply``: what the chat template writes for the assistant's turn, up to and
        including EOS (or the reply and EOS, without a template)."""
        text = reply
        if prompt.messages or self.has_template:
            full = self.tokenizer.apply_chat_template(
                [*self.messages(prompt), {"role": "assistant", "content": reply}], tokenize=False
            )
            start = self.text(prompt)
            if str(full).startswith(start):  # templates that re-render history differ
                text = str(full)[len(start) :]
        ids = self._ids(text)
        return ids[: ids.index(self.eos_id) + 1] if self.eos_id in ids else [*ids, self.eos_id]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
