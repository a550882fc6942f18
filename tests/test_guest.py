"""corun/execution/guest.py: the process-wide settings a run holds for its host (GIL switch
interval at most 1 ms; collector paused during set-up, then frozen) are held while any
run is active, undone by the last one, and leave a host's own choices alone."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

import corun
from corun.execution import guest
from tests.support.config import make_config


@pytest.fixture(autouse=True)
def host_defaults() -> Any:
    sys.setswitchinterval(0.005)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_held_while_any_run_is_active_and_undone_by_the_last() -> None:
    with guest.running():
        assert sys.getswitchinterval() == pytest.approx(guest.SWITCH_INTERVAL_S)
        with guest.running():  # a prerequisite, or a second run in the same host
            with guest.setting_up():
                assert not gc.isenabled()
            assert gc.isenabled() and gc.get_freeze_count() > 0
        assert sys.getswitchinterval() == pytest.approx(guest.SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() > 0  # frozen until the last run ends


def test_a_hosts_own_freeze_and_disabled_collector_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """corun neither freezes nor unfreezes over a host's freeze, nor enables the host's
    disabled collector. What it calls is checked, not the frozen count: other threads of
    the process (a finished run's lanes, a library's) free frozen objects at any time."""
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 1000)  # the host froze objects
    gc.disable()
    try:
        with guest.running(), guest.setting_up():
            assert not gc.isenabled()
        assert calls == [] and not gc.isenabled()
    finally:
        gc.enable()


class _Probe(corun.Trainer[corun.TrainerConfig]):
    """Records the host-visible settings in set-up and in a step."""

    seen: ClassVar[dict[str, Any]] = {}

    def setup(self, ctx: corun.SetupContext) -> None:
        _Probe.seen["setup"] = (sys.getswitchinterval(), gc.isenabled())

    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> dict[str, float]:
        return {}

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        _Probe.seen["step"] = (sys.getswitchinterval(), gc.isenabled(), gc.get_freeze_count())
        return {}


@pytest.mark.anyio
async def test_a_run_holds_them_and_restores_them(tmp_path: Path) -> None:
    kind = f"{_Probe.__module__}:{_Probe.__qualname__}"
    config = make_config(tmp_path, {"kind": kind}, run={"steps": 2})
    await corun.run(_Probe(config), config)
    assert _Probe.seen["setup"] == (pytest.approx(guest.SWITCH_INTERVAL_S), False)
    interval, enabled, frozen = _Probe.seen["step"]
    assert interval == pytest.approx(guest.SWITCH_INTERVAL_S) and enabled and frozen > 0
