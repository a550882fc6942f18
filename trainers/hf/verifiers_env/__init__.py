"""What runs in the verifiers environment (its own, since verifiers pins openai<3):
the worker, the shipped taskset and harness, and how to build that environment
(``python -m trainers.hf.verifiers_env``). A package so a wheel carries it, with its
requirements files; none of it is imported by corun (the worker runs by path)."""
