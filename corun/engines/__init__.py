"""Rollout engines behind :class:`corun.contract.engine.Engine` (``trainer.engine``),
and their child-process, health and deadline plumbing. Importing this package imports
none of them: torch, transformers and vLLM load with the module that needs them.

- :mod:`.options`: ``[trainer.engine_options]`` and a vLLM engine's settings
- :mod:`.start`: the engine a config names, started within its deadlines
- :mod:`.decode`: batched KV-cache sampling from a transformers causal LM
- :mod:`.transformers_engine`: ``local``, that sampling on a compute lane
- :mod:`.vllm_engine`: ``vllm``, vLLM in this process
- :mod:`.vllm_server`: ``vllm-server``, vLLM's OpenAI server as a child process
- :mod:`.vllm_common`: what the two vLLM engines share
- :mod:`.vllm_worker`: what runs inside vLLM (behaviour and top log-probs, weight
  reloads, the weights fingerprint)
- :mod:`.fingerprint`: fingerprints of weights, and the weight sync that checks one
- :mod:`.lora`: LoRA adapters on the engine side (names, files, which engines take them)
"""
