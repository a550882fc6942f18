"""The vLLM tests' shared fixtures (a pytest plugin: ``pytest_plugins`` in
tests/conftest.py): the built-in tiny Llama, its chat format, a fresh policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers.hf.policy import ChatFormat, HFPolicy, load_policy
from trainers.hf.tiny import built_in


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The built-in tiny Llama (head size 32, which vLLM's CPU attention takes)."""
    return built_in().resolve()


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatFormat:
    return ChatFormat(load_policy(f"hf:{model_dir}", "model")[1])


@pytest.fixture
def policy(model_dir: Path) -> HFPolicy:
    """A fresh copy of the model's weights (tests change them)."""
    return load_policy(f"hf:{model_dir}", "model")[0].eval()
