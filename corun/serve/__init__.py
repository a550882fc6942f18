"""The policy endpoint: an OpenAI-compatible HTTP API served from the current rollout
weights, on loopback (starlette under hypercorn, so the same app serves on asyncio
and on trio, from inside the caller's event loop).

- :mod:`corun.contract.policy` (in the contract): what a trainer implements to be
  served (:class:`ServedPolicy`), the request and response types, errors
- :mod:`.batching`: concurrent requests generated together, on a compute lane
- :mod:`.capture`: episodes recorded token for token, handed to training
- :mod:`.app`: the routes
- :mod:`.server`: the server as a task with a lifetime
"""
