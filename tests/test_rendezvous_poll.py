"""The launcher's rendezvous poll (``nvrx_adapter.quicken_rendezvous``): NVRx 0.6+'s barrier
rendezvous sleeps a fixed second between looks at its store while a round is closed; in the
launcher we run, each of those sleeps is capped at ``RENDEZVOUS_POLL_SECONDS``.

NVRx 0.7.0 does not install on this machine's Python, so its module is stood in for by one with
the same shape (a module-level ``time`` its polling loops call ``time.sleep(1.0)`` on); the
wrapper itself runs the real ft_launcher in every end-to-end test.
"""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest

from resilient_training.runtime import nvrx_adapter

BARRIER = "nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier"


@pytest.fixture
def barrier(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(BARRIER)
    module.time = time

    def wait_for_round_open(looks: int) -> None:  # NVRx 0.7.0's Step 0 loop, reduced
        for _ in range(looks):
            module.time.sleep(1.0)

    module.wait_for_round_open = wait_for_round_open
    monkeypatch.setitem(sys.modules, BARRIER, module)
    import nvidia_resiliency_ext.fault_tolerance as ft

    monkeypatch.setattr(ft, "ft_rendezvous_barrier", module, raising=False)
    return module


def test_each_poll_of_a_waiting_launcher_takes_a_tenth_of_a_second_not_a_second(barrier) -> None:
    assert nvrx_adapter.quicken_rendezvous() is True
    started = time.monotonic()
    barrier.wait_for_round_open(looks=3)
    assert time.monotonic() - started < 1.0  # three looks: 3 s before
    assert barrier.time.monotonic() == pytest.approx(time.monotonic(), abs=0.5)  # the rest is time itself


def test_applying_it_twice_does_not_stack_and_takes_the_new_interval(barrier) -> None:
    nvrx_adapter.quicken_rendezvous(0.5)
    nvrx_adapter.quicken_rendezvous(0.05)
    assert barrier.time.poll == 0.05 and barrier.time._clock is time


def test_without_the_barrier_rendezvous_nothing_changes() -> None:
    # NVRx 0.4.1 (this machine's) has torch's rendezvous only.
    assert nvrx_adapter.quicken_rendezvous() is (nvrx_adapter.version_tuple(nvrx_adapter.installed_version()) >= (0, 6, 0))


def test_the_wrapper_is_ft_launcher_with_the_same_arguments() -> None:
    out = subprocess.run([sys.executable, "-m", nvrx_adapter.FT_LAUNCHER_MODULE, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--ft-rank-heartbeat-timeout" in out.stdout.replace("_", "-")
