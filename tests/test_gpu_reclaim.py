"""A restarted worker waits for its GPU's previous worker itself (runtime/gpu_reclaim.py), with
real processes: one that takes its time to exit, one that will not, a zombie, a reused pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient_training.run import config as cfg
from resilient_training.runtime import gpu_reclaim, nvrx_adapter
from resilient_training.runtime.gpu_reclaim import Predecessor

# A worker of the GPU: records itself, says so, and on SIGTERM takes EXIT_S seconds to exit
# (a killed worker's exit unpins gigabytes of host memory first) or never exits (EXIT_S < 0).
OLD_WORKER = """
import signal, sys, time
from pathlib import Path
from resilient_training.runtime import gpu_reclaim
exit_s = float(sys.argv[2])
def on_term(*_):
    if exit_s < 0:
        return
    time.sleep(exit_s)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
gpu_reclaim.claim(Path(sys.argv[1]))
print("claimed", flush=True)
while True:
    time.sleep(0.05)
"""


def old_worker(record: Path, exit_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", OLD_WORKER, str(record), str(exit_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_the_first_worker_of_a_gpu_has_no_predecessor(tmp_path: Path) -> None:
    record = tmp_path / "gpu-workers" / "0-all-0.pid"
    assert gpu_reclaim.claim(record) is None
    pid, start = record.read_text().split()
    assert int(pid) == os.getpid() and start == gpu_reclaim._start_time(os.getpid())
    assert gpu_reclaim.claim(record) is None  # the same process again: not its own predecessor


def test_a_new_worker_waits_until_the_old_one_has_exited(tmp_path: Path) -> None:
    record = tmp_path / "gpu.pid"
    proc = old_worker(record, exit_s=0.6)
    try:
        predecessor = gpu_reclaim.claim(record)
        assert predecessor == Predecessor(proc.pid, gpu_reclaim._start_time(proc.pid))
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert gpu_reclaim.wait_gone(predecessor, timeout=30)
        waited = time.monotonic() - began
        assert 0.4 < waited < 10, waited
        # Not reaped yet (a zombie): gone all the same, it holds no GPU memory.
        assert Path(f"/proc/{proc.pid}").exists() and not gpu_reclaim.alive(predecessor)
    finally:
        proc.kill()
        proc.wait()


# The main thread ends (pthread_exit, the GIL released by ctypes) while another thread goes on
# for a second: the process's own state is then Z, like a SIGKILLed worker's main thread while
# its other threads still tear down its memory.
LEADER_GONE_FIRST = """
import ctypes, os, sys, threading, time
from pathlib import Path
from resilient_training.runtime import gpu_reclaim
gpu_reclaim.claim(Path(sys.argv[1]))
def last_thread():
    time.sleep(1.0)
    os._exit(0)
threading.Thread(target=last_thread).start()
print("claimed", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_is_a_zombie_is_alive_until_its_last_thread_ends(tmp_path: Path) -> None:
    record = tmp_path / "gpu.pid"
    proc = subprocess.Popen([sys.executable, "-c", LEADER_GONE_FIRST, str(record)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        predecessor = gpu_reclaim.claim(record)
        assert predecessor is not None
        deadline = time.monotonic() + 5
        while gpu_reclaim._stat(proc.pid)[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gpu_reclaim.alive(predecessor)  # the main thread is a zombie, the other one runs
        began = time.monotonic()
        assert gpu_reclaim.wait_gone(predecessor, timeout=30)
        assert time.monotonic() - began > 0.3
    finally:
        proc.kill()
        proc.wait()


def test_the_wait_is_bounded_by_the_reclaim_timeout(tmp_path: Path) -> None:
    record = tmp_path / "gpu.pid"
    proc = old_worker(record, exit_s=-1)  # ignores SIGTERM
    try:
        predecessor = gpu_reclaim.claim(record)
        assert predecessor is not None
        proc.send_signal(signal.SIGTERM)
        began, pings = time.monotonic(), []
        assert not gpu_reclaim.wait_gone(predecessor, timeout=0.35, on_wait=lambda: pings.append(1), every=0.1)
        assert 0.35 <= time.monotonic() - began < 5
        assert 2 <= len(pings) <= 4  # the progress guard hears of the wait: a bounded wait is no hang
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("record_text", ["{ppid} 1\n", "999999999 1\n", "garbage", ""])
def test_a_reused_pid_a_gone_one_or_a_torn_record_is_no_predecessor(tmp_path: Path, record_text: str) -> None:
    record = tmp_path / "gpu.pid"
    record.write_text(record_text.format(ppid=os.getppid()))  # the parent is alive, with another start time
    assert gpu_reclaim.claim(record) is None
    assert record.read_text().split()[0] == str(os.getpid())


def test_records_are_per_agent_and_device() -> None:
    a = gpu_reclaim.record_path(Path("/x"), "host:100:5000", 1)
    assert a.parent == Path("/x") and a.name.startswith("agent-") and a.name.endswith("-1.pid")
    assert gpu_reclaim.record_path(Path("/x"), "host:100:5000", 0) != a  # another device
    # Another agent (a simulated pod on the same machine, a new pod, another run): never a predecessor.
    assert gpu_reclaim.record_path(Path("/x"), "host:101:5000", 1) != a
    assert gpu_reclaim.record_path(Path("/x"), "host:100:5001", 1) != a


def test_a_worker_releases_only_its_own_record_and_leaves_no_folder(tmp_path: Path) -> None:
    record = tmp_path / "run-folder" / "w.pid"
    record.parent.mkdir()
    record.write_text(f"{os.getppid()} 1\n")
    gpu_reclaim.release(record)
    assert record.exists()  # another process's
    gpu_reclaim.claim(record)
    gpu_reclaim.release(record)
    assert not record.parent.exists()  # claim() made it even when the node-local tier is off


def test_a_record_that_cannot_be_written_is_no_failure(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert gpu_reclaim.claim(tmp_path / "file" / "w.pid") is None  # its folder cannot be made
    assert "could not record this worker" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "launcher_wait"), [([], "0"), (["--no-worker-gpu-reclaim"], "7")])
def test_ft_launcher_waits_only_when_the_workers_do_not(flags: list[str], launcher_wait: str) -> None:
    config = cfg.from_argv(["--run-dir", "r", "--gpu-reclaim-timeout", "7", *flags])
    launcher = nvrx_adapter.ft_launcher_flags(config, version="0.7.0")
    assert f"--ft-gpu-memory-reclaim-timeout={launcher_wait}" in launcher
