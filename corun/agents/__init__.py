"""The agentic machinery, for any tool-use task: the episode runner (many episodes in
flight per rollout, token-in/token-out), the Gymnasium adapter (text environments as
corun environments) and the HTTP agent client (an agent on the OpenAI-compatible
endpoint). A task's own environment, policy and tool live with its trainer
(trainers/agentic/ for the built-in calculator).
"""
