"""Hugging Face policies: any ``AutoModelForCausalLM`` with its tokenizer and chat
template, trained by the same template, generating through the rollout engines of
corun/engines/ (transformers in process; vLLM in process or as a server).

- :mod:`.policy`: the model as a policy, loaded from ``hf:<dir>``, and its chat format
- :mod:`.prompts`: a prompt as data gives it (text or chat messages)
- :mod:`.tasks`: the built-in arithmetic word problems, and JSONL prompt datasets
- :mod:`.rewards`: reward functions by name or ``package.module:function``
- :mod:`.tiny`: builds a tiny Llama and its tokenizer offline (``python -m trainers.hf.tiny DIR``)
"""
