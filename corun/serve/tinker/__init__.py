"""The Tinker training API served locally (``corun serve CONFIG serve.tinker=true``): the
official SDK (``tinker`` 0.38, the ``corun[tinker]`` extra) and recipes written against
it (tinker-cookbook) create LoRA models of the trainer's base model and drive them step
by step — forward-backward, optimizer steps, sampling, saved states — while corun runs
them with its guarantees (requests in order per model, exact resume, ordered teardown).

- :mod:`.wire`: the JSON bodies and the SDK's protobuf messages
- :mod:`.futures`: request ids, long-polled results, each model's requests in order
- :mod:`.service`: sessions, models, sampling sessions, saved states
- :mod:`.app`: the routes
- :mod:`.server`: the server as a task with a lifetime

What a trainer implements to be served so: corun/contract/training_api.py.
"""
