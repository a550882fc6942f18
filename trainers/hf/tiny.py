"""A tiny Llama-architecture model and its tokenizer, built offline: ``python -m
trainers.hf.tiny DIR`` writes a ``save_pretrained`` directory (safetensors weights,
``config.json``, a byte-level BPE tokenizer trained in memory with ``tokenizers`` on
the word-problem corpus (or, for "tiny-llama-rg", reasoning-gym's arithmetic tasks),
digits split one per token, and a chat template) that
transformers and vLLM both load. Random weights, seeded: the same directory every time.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, hence ``head_dim`` 32.
"""

from __future__ import annotations

import argparse
import fcntl
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainers.hf import reasoning_gym, tasks

# The text a tokenizer is trained on, by name.
CORPORA: dict[str, Callable[[], list[str]]] = {
    "word-problems": tasks.corpus,
    "reasoning-gym-arithmetic": reasoning_gym.corpus,  # needs the reasoning-gym extra
}

# A chat as plain text: "user: ...\nassistant: ...</s>\n"; the generation prompt ends
# with "assistant:" so a reply starts right after it. Compact for 256 positions: offered
# tools are one first line, "tools: calculator(expression)" (names and parameter names);
# an assistant's tool calls follow its content as Hermes blocks,
# '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'; a tool message is
# "tool: <content>\n". Plain system/user/assistant messages render byte for byte as the
# first template did (tests/test_chat_template.py), so plain chat runs are unchanged.
# (transformers renders templates with trim_blocks: a literal newline after a tag is
# dropped, hence the '\\n' expressions.)
CHAT_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{% set f = t['function'] %}"
    "{% set p = f['parameters'] or {} %}{{ f['name'] }}({{ (p['properties'] or {}) | list "
    "| join(', ') }}){% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build(path: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 2,
          vocab: int = 400, seed: int = 0, corpus: str = "word-problems") -> Path:  # fmt: skip
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # `corun serve`'s first line is its URL, even on first use
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPORA[corpus](), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=32, max_position_embeddings=256, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


# The built-in models by name: (directory, build arguments). Versioned: a directory
# built with an older chat template is never picked up. The first two share one
# tokenizer (trained the same way on the same corpus), so either can teach the other
# (trainers/hf/distill.py).
BUILT_INS: dict[str, tuple[Path, dict[str, Any]]] = {
    "tiny-llama": (Path("runs/models/tiny-llama-2"), {}),
    # About 4x the parameters (hidden 128, 4 layers): a teacher for the tiny one.
    "tiny-llama-large": (Path("runs/models/tiny-llama-large-2"), {"hidden": 128, "layers": 4}),
    # The tiny shape, its tokenizer trained on reasoning-gym's arithmetic tasks
    # (configs/rg_sft.toml, rg_grpo.toml), whose questions then take fewer positions.
    "tiny-llama-rg": (Path("runs/models/tiny-llama-rg-1"), {"corpus": "reasoning-gym-arithmetic"}),
}
BUILT_IN_DIR = BUILT_INS["tiny-llama"][0]


def built_in(name: str = "tiny-llama") -> Path:
    """A built-in model's directory (under the working directory), written on first
    use; written to a temporary sibling and renamed, so an interrupted build never
    leaves half a model behind, under a file lock, so processes starting together
    (data-parallel ranks, test workers) build it once."""
    directory, shape = BUILT_INS[name]
    if not (directory / "config.json").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with open(directory.parent / f".{directory.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (directory / "config.json").is_file():
                with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
                    build(Path(tmp) / "model", **shape)
                    (Path(tmp) / "model").rename(directory)
    return directory


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="where to write the model")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(build(args.dir, hidden=args.hidden, layers=args.layers))
