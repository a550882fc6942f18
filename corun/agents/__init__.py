"""The agentic machinery, for any tool-use task: the episode runners (token rows for a
policy of its own vocabulary; chat transcripts for a Hugging Face chat policy), chat
templates and tool-call parsing (chat.py), the served policy of any rollout engine
(served.py), the Gymnasium adapter (text environments as corun environments), the
OpenEnv adapter (an episode through openenv's client) and the HTTP agent client (an
agent on the OpenAI-compatible endpoint). A task's own
environment, policy and tool live with its trainer (trainers/agentic/ for the built-in
calculator; trainers/hf/tools.py for it as a chat function tool).
"""
