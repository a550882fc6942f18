"""Hugging Face policies: any ``AutoModelForCausalLM`` with its tokenizer and chat
template, trained by the same template, generating through the rollout engines of
corun/contract/engine.py (transformers here; vLLM in process or as a server).

- :mod:`.tasks`: the built-in arithmetic word problems, and JSONL prompt datasets
- :mod:`.rewards`: reward functions by name or ``package.module:function``
- :mod:`.tiny`: builds a tiny Llama and its tokenizer offline (``python -m trainers.hf.tiny DIR``)
"""
