"""LoRA on an HF policy (trainers/hf/lora.py), on the tiny Llama: only the adapters
train and the adapted model starts equal to the base; the adapter leaves as peft's own
(a directory PeftModel loads, merged weights a plain model loads, a checkpoint state a
fresh policy restores bitwise); bad settings and states are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from torch import Tensor

from corun import CheckpointError, ConfigError
from trainers.hf.lora import (
    LoraSettings,
    adapter,
    adapter_state,
    add_lora,
    is_lora,
    load_adapter_state,
    merged_weights,
    param_groups,
    save_adapter,
    trainable_parameters,
)
from trainers.hf.policy import BUILT_IN, HFPolicy, load_policy

SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def _policy() -> HFPolicy:
    return load_policy(BUILT_IN, "model")[0]


def _logits(policy: HFPolicy) -> Tensor:
    with torch.no_grad():
        return policy(IDS)


def _base_weights(policy: HFPolicy) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}


def test_the_optimizer_groups_give_b_its_own_rate() -> None:
    """LoRA+: A (every adapter weight but B) at lr x lr_scale, B at b_lr_ratio times
    that; without LoRA one group at the optimizer's own rate."""
    plain = _policy()
    assert param_groups(plain, None, 1e-3) == [{"params": list(plain.parameters())}]
    policy, settings = _policy(), LoraSettings(lr_scale=2.0, b_lr_ratio=8.0)
    add_lora(policy, settings, seed=1)
    a, b = param_groups(policy, settings, 1e-3)
    names = {id(p): name for name, p in policy.named_parameters()}
    assert a["lr"] == pytest.approx(2e-3) and b["lr"] == pytest.approx(16e-3)
    assert {names[id(p)].split(".lora_")[1][0] for p in a["params"]} == {"A"}
    assert {names[id(p)].split(".lora_")[1][0] for p in b["params"]} == {"B"}
    assert len(a["params"]) == len(b["params"]) == 2 * 7  # 2 layers x 7 projections
    assert {id(p) for p in a["params"] + b["params"]} == {
        id(p) for p in trainable_parameters(policy)
    }


@pytest.fixture(scope="module")
def trained() -> tuple[HFPolicy, dict[str, Tensor]]:
    """A LoRA policy after a few AdamW steps, and its base weights before them."""
    policy = _policy()
    add_lora(policy, SETTINGS, seed=1)
    before = _base_weights(policy)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2)
    for _ in range(3):
        logits = policy(IDS)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return policy, before


def test_only_adapters_train_and_start_equal_to_the_base() -> None:
    from peft import get_peft_model_state_dict

    policy = _policy()
    base = _logits(policy)
    rng = torch.get_rng_state()
    add_lora(policy, SETTINGS, seed=1)
    assert torch.equal(torch.get_rng_state(), rng)  # the init drew from the seed alone
    assert is_lora(policy) and not is_lora(_policy())
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable_parameters(policy)) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    assert torch.equal(_logits(policy), base)  # B starts at zero
    state = adapter_state(policy)
    assert state.keys() == get_peft_model_state_dict(policy.model).keys()
    again = _policy()
    add_lora(again, SETTINGS, seed=1)
    assert all(torch.equal(state[k], v) for k, v in adapter_state(again).items())


def test_training_moves_the_adapter_only(trained: tuple[HFPolicy, dict[str, Tensor]]) -> None:
    policy, before = trained
    after = _base_weights(policy)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(t.abs().sum() > 0 for k, t in adapter_state(policy).items() if "lora_B" in k)


def test_merged_weights_load_into_a_plain_model(
    trained: tuple[HFPolicy, dict[str, Tensor]],
) -> None:
    policy, _ = trained
    merged = merged_weights(policy)
    fresh = _policy()
    assert merged.keys() == fresh.model.state_dict().keys()
    fresh.model.load_state_dict(merged)
    torch.testing.assert_close(_logits(fresh), _logits(policy), rtol=0, atol=1e-5)
    assert not torch.allclose(_logits(_policy()), _logits(policy), atol=1e-3)


def test_saved_adapter_loads_in_peft(
    trained: tuple[HFPolicy, dict[str, Tensor]], tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    policy, _ = trained
    out = save_adapter(policy, tmp_path / "adapter")
    sent = adapter(policy)
    assert load_file(out / "adapter_model.safetensors").keys() == sent.tensors.keys()
    assert sent.config["base_model_name_or_path"] == str(policy.source)
    assert (sent.config["peft_type"], sent.config["r"]) == ("LORA", 4)
    loaded = PeftModel.from_pretrained(_policy().model, out)
    with torch.no_grad():
        logits = loaded(input_ids=IDS).logits
    torch.testing.assert_close(logits, _logits(policy), rtol=0, atol=1e-6)
    loaded.save_pretrained(str(tmp_path / "again"))  # peft writes the same config
    again = json.loads((tmp_path / "again/adapter_config.json").read_text())
    assert set(again.pop("target_modules")) == set(sent.config["target_modules"])  # a set
    assert again == {k: v for k, v in sent.config.items() if k != "target_modules"}


def test_adapter_state_round_trips(trained: tuple[HFPolicy, dict[str, Tensor]]) -> None:
    policy, _ = trained
    state = {k: v.clone() for k, v in adapter_state(policy).items()}
    fresh = _policy()
    add_lora(fresh, SETTINGS, seed=2)
    load_adapter_state(fresh, state)
    assert torch.equal(_logits(fresh), _logits(policy))
    other = _policy()
    add_lora(other, msgspec.structs.replace(SETTINGS, rank=2), seed=2)
    with pytest.raises(CheckpointError, match=r"^the checkpoint's adapter .*\(another rank\?\)$"):
        load_adapter_state(other, state)
    fewer = _policy()
    add_lora(fewer, msgspec.structs.replace(SETTINGS, target_modules=["q_proj"]), seed=2)
    with pytest.raises(
        CheckpointError,
        match=r"^[^\n]*has model\.layers\.0\.mlp\.down_proj\.lora_A\.weight, .*8 extra\)$",
    ):
        load_adapter_state(fewer, state)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj", "qkv_proj"], r"'qkv_proj' matches no module .*\(it has .*q_proj"),
        (["self_attn"], r"'self_attn' is a LlamaAttention; LoRA adapts linear"),
    ],
)
def test_bad_targets_are_refused(targets: list[str], message: str) -> None:
    policy = _policy()
    settings = LoraSettings(target_modules=targets)
    with pytest.raises(
        ConfigError, match=rf"^`\$\.trainer\.lora\.target_modules`: {message}"
    ) as exc:
        add_lora(policy, settings, seed=0)
    assert "\n" not in str(exc.value) and not is_lora(policy)
    assert all(p.requires_grad for p in policy.parameters())  # left as it was


def test_settings_are_checked() -> None:
    assert msgspec.convert({}, LoraSettings) == LoraSettings()
    bads: list[dict[str, object]] = [
        {"rank": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}, {"r": 4}
    ]  # fmt: skip
    for bad in bads:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, LoraSettings)
