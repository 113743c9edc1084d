"""The launcher's restart path as ``ft_launch`` runs it. NVRx 0.6+'s barrier rendezvous sleeps a
fixed second between looks at its store while a round is closed (``quicken_rendezvous`` caps each
sleep at ``RENDEZVOUS_POLL_SECONDS``), and its worker teardown sleeps a fixed second between
SIGTERM and SIGKILL (``quicken_teardown`` ends the wait once the workers are gone).

NVRx 0.7.0 does not install on this machine's Python, so its rendezvous module is stood in for by
one with the same shape (a module-level ``time`` its polling loops call ``time.sleep(1.0)`` on);
the teardown runs on real process groups, and the wrapper runs the real ft_launcher in every
end-to-end test.
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


def _group(script: str) -> subprocess.Popen:
    """A process in a process group of its own, as ft_launcher starts each worker."""
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    time.sleep(0.3)  # its signal handlers are in place
    return proc


def test_teardown_returns_once_the_workers_have_left_not_after_a_fixed_second() -> None:
    proc = _group("import time; time.sleep(60)")  # SIGTERM ends it at once (a zombie until reaped below)
    started = time.monotonic()
    nvrx_adapter.terminate_process_groups({proc.pid})
    took = time.monotonic() - started
    assert proc.wait(timeout=5) == -15
    assert took < 0.5  # NVRx 0.7.0's waits 1.0 s whatever happens


def test_a_worker_that_ignores_sigterm_gets_the_whole_grace_then_sigkill() -> None:
    proc = _group("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    started = time.monotonic()
    nvrx_adapter.terminate_process_groups({proc.pid}, grace=0.6)
    assert time.monotonic() - started >= 0.6
    assert proc.wait(timeout=5) == -9


def test_the_log_names_the_process_that_held_the_teardown_up(caplog: pytest.LogCaptureFixture) -> None:
    proc = _group("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    with caplog.at_level("WARNING", logger=nvrx_adapter.__name__):
        nvrx_adapter.terminate_process_groups({proc.pid}, grace=0.3)
    assert proc.wait(timeout=5) == -9
    assert f"{proc.pid} python" in caplog.text and "SIGKILLed" in caplog.text


def _stat(pid: int, state: str, pgrp: int, flags: int, name: str = "python3") -> bytes:
    return f"{pid} ({name}) {state} 1 {pgrp} {pgrp} 0 -1 {flags} 0 0 0 0 5 3 0 0 20 0 4 0 100".encode()


def test_an_exiting_process_does_not_hold_the_teardown_up() -> None:
    # A SIGKILLed worker with 16 GB page-locked is in the kernel's exit for over a second (1 H200):
    # PF_EXITING (0x4) set, state R or D. It runs no more code: its group counts as gone.
    assert nvrx_adapter._still_running(_stat(7, "R", 42, 0x400000)) == 42
    assert nvrx_adapter._still_running(_stat(7, "D", 42, 0x400000 | 0x4)) is None
    assert nvrx_adapter._still_running(_stat(7, "R", 42, 0x4)) is None
    assert nvrx_adapter._still_running(_stat(7, "Z", 42, 0)) is None
    # a name with ") " in it does not shift the fields (the name is cut at the last ")")
    assert nvrx_adapter._still_running(_stat(7, "S", 42, 0, name="a) Z 1 9 9")) == 42


def test_the_teardown_replaces_only_nvrx_0_7_s_shape_of_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvidia_resiliency_ext.fault_tolerance import utils

    def nvrx_07(allowed_pgids):  # 0.7.0: SIGTERM, time.sleep(1.0), SIGKILL
        raise AssertionError("replaced: never called")

    monkeypatch.setattr(utils, "terminate_mp_processes", nvrx_07)
    assert nvrx_adapter.quicken_teardown() is True
    assert utils.terminate_mp_processes is nvrx_adapter.terminate_process_groups

    def nvrx_041(allowed_ppids, allowed_pgids):  # 0.4.1: no wait, other arguments
        pass

    monkeypatch.setattr(utils, "terminate_mp_processes", nvrx_041)
    assert nvrx_adapter.quicken_teardown() is False and utils.terminate_mp_processes is nvrx_041
