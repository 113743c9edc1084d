"""The async checkpoint writer with NVRx's real persistent queue and real processes on CPU.

A writer killed with SIGKILL, idle or mid-write, is noticed by its watch thread within a
second, reported with its signal, and replaced; one that keeps dying is given up on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from resilient_training.runtime import nvrx_adapter
from resilient_training.runtime.nvrx_adapter import AsyncWriter, CheckpointWriterDied, WriterDeath

pytestmark = pytest.mark.slow


def write_marker(path: str) -> None:
    """A write job (module-level: it is pickled to the writer process)."""
    Path(path).write_text("durable")


def sleep_then_write(path: str, seconds: float) -> None:
    time.sleep(seconds)
    Path(path).write_text("durable")


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    # NVRx's queue asks torch.distributed for the rank when it starts its process.
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


class Recorder:
    def __init__(self) -> None:
        self.deaths: list[WriterDeath] = []
        self.ready: list[tuple[float, int | None, int]] = []
        self.died = threading.Event()

    def on_died(self, death: WriterDeath) -> None:
        self.deaths.append(death)
        self.died.set()

    def on_ready(self, seconds: float, pid: int | None, replacements: int) -> None:
        self.ready.append((seconds, pid, replacements))


def wait_until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_start_does_not_wait_for_the_process(tmp_path: Path) -> None:
    seen = Recorder()
    writer = AsyncWriter(on_ready=seen.on_ready, on_died=seen.on_died)
    began = time.perf_counter()
    writer.start()
    held = time.perf_counter() - began
    try:
        assert writer.started and not writer.ready
        assert held < 0.5, held  # the spawn and the child's imports happen on another thread
        wait_until(lambda: writer.ready)
        (seconds, pid, replacements), = seen.ready
        assert seconds > held and pid == writer.pid and replacements == 0
        writer.submit(write_marker, (str(tmp_path / "a"),))
        writer.wait(60)
        assert (tmp_path / "a").read_text() == "durable"
    finally:
        writer.close(timeout=60)
    assert not seen.deaths  # a writer closed on purpose did not die


def test_a_writer_killed_while_idle_is_noticed_within_a_second_and_replaced(tmp_path: Path) -> None:
    seen = Recorder()
    writer = AsyncWriter(on_ready=seen.on_ready, on_died=seen.on_died)
    writer.warm_up()
    first = writer.pid
    try:
        killed = time.time()
        os.kill(first, signal.SIGKILL)
        assert seen.died.wait(5.0), "death not noticed"
        (death,) = seen.deaths
        detection = death.noticed - killed
        print(f"writer death noticed {detection * 1000:.1f} ms after SIGKILL")
        assert 0 <= detection < 1.0, detection
        assert (death.pid, death.exitcode, death.signal) == (first, -signal.SIGKILL, "SIGKILL")
        assert "killed by SIGKILL" in death.describe()
        assert writer.death is death and not writer.ready
        assert writer.poll()  # nothing was in flight: nothing lost
        assert writer.replace() is death
        assert writer.death is None
        wait_until(lambda: writer.ready)
        assert writer.pid != first and seen.ready[-1][2] == 1  # logged as a replacement
        writer.submit(write_marker, (str(tmp_path / "b"),))
        writer.wait(60)
        assert (tmp_path / "b").read_text() == "durable"
    finally:
        writer.close(timeout=60)
    assert len(seen.deaths) == 1


def test_a_writer_killed_mid_write_loses_that_write_and_says_so(tmp_path: Path) -> None:
    seen = Recorder()
    writer = AsyncWriter(on_died=seen.on_died)
    writer.warm_up()
    try:
        writer.submit(sleep_then_write, (str(tmp_path / "c"), 30.0))
        assert not writer.poll() and writer.in_flight
        killed = time.time()
        os.kill(writer.pid, signal.SIGKILL)
        assert seen.died.wait(5.0)
        assert seen.deaths[0].noticed - killed < 1.0
        with pytest.raises(CheckpointWriterDied, match="killed by SIGKILL.*1 write"):
            writer.poll()
        assert not writer.in_flight and not (tmp_path / "c").exists()
    finally:
        writer.abandon()


def test_a_dead_writer_is_dropped_without_a_collective(tmp_path: Path, monkeypatch) -> None:
    """NVRx's queue finalizes what it still lists with an all-reduce when it is closed, and NVRx
    0.7 closes a dropped queue in ``__del__``, on whichever thread collects it: one rank alone
    issuing that all-reduce hung both ranks on 2 GPUs after every writer death. A dead writer's
    queue must be left with nothing to finalize (closed here as 0.7's ``__del__`` would).
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    collectives = []  # NVRx's one collective (on a CUDA tensor: on this machine it could only raise)
    monkeypatch.setattr(PersistentAsyncCaller, "sync_all_async_calls",
                        lambda self, is_alive: collectives.append(threading.current_thread().name) or True)
    seen = Recorder()
    writer = AsyncWriter(on_died=seen.on_died)
    writer.warm_up()
    writer.submit(sleep_then_write, (str(tmp_path / "d"), 30.0))
    dead_queue = writer._writer.queue
    os.kill(writer.pid, signal.SIGKILL)
    assert seen.died.wait(5.0)
    with pytest.raises(CheckpointWriterDied):
        writer.poll()
    writer.replace()  # the dead one is retired on a thread of its own, a new one starts
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "ckpt-writer-retire"])
    try:
        dead_queue.close()
    finally:  # before anything else it raises: 0.4.1 finalizes on a CUDA device
        assert collectives == []
    writer.abandon()


def test_a_writer_that_keeps_dying_is_given_up_on(tmp_path: Path) -> None:
    seen = Recorder()
    writer = AsyncWriter(on_died=seen.on_died, max_deaths=2)
    writer.warm_up()
    try:
        os.kill(writer.pid, signal.SIGKILL)
        wait_until(lambda: writer.death is not None, 5.0)
        writer.replace()  # the first death: replaced
        wait_until(lambda: writer.ready)
        os.kill(writer.pid, signal.SIGKILL)
        wait_until(lambda: writer.death is not None, 5.0)
        with pytest.raises(CheckpointWriterDied, match="2 writer deaths without a durable write"):
            writer.replace()
        assert not writer.started  # left for the restart layers, which start a new one
    finally:
        writer.abandon()
    assert len(seen.deaths) == 2


@pytest.mark.parametrize(("window", "given_up"), [(0.5, False), (300.0, True)])
def test_a_durable_write_resets_the_death_count_but_not_the_window(tmp_path: Path, window: float,
                                                                   given_up: bool) -> None:
    writer = AsyncWriter(max_deaths=2, death_window=window)
    writer.warm_up()
    try:
        os.kill(writer.pid, signal.SIGKILL)
        wait_until(lambda: writer.death is not None, 5.0)
        writer.replace()
        wait_until(lambda: writer.ready)  # seconds: the next death is outside a 0.5 s window
        writer.submit(write_marker, (str(tmp_path / "d"),))
        writer.wait(60)
        os.kill(writer.pid, signal.SIGKILL)
        wait_until(lambda: writer.death is not None, 5.0)
        if given_up:  # 2 deaths within 300 s, even with a durable write in between
            with pytest.raises(CheckpointWriterDied, match="2 writer deaths within 300 s"):
                writer.replace()
        else:
            writer.replace()  # a write succeeded since the last death, and it is long ago
            wait_until(lambda: writer.ready)
    finally:
        writer.close(timeout=60)


def test_death_descriptions() -> None:
    assert nvrx_adapter.WriterDeath(0.0, 7, 1).describe().endswith("exited with code 1")
    assert nvrx_adapter.WriterDeath(0.0, 7, None).signal is None
    assert "could not be started" in nvrx_adapter.WriterDeath(0.0, None, None, "could not be started").describe()


@pytest.mark.parametrize(("argv", "code"), [(["-c", "import time; time.sleep(60)"], -signal.SIGKILL),
                                             (["-c", "raise SystemExit(3)"], 3)])
def test_an_exit_seen_before_it_can_be_reaped_still_has_its_code(argv: list[str], code: int) -> None:
    # A killed writer's pipe closes before the kernel lets it be reaped: the training thread saw
    # that on a loaded CPU machine and logged "exit code unknown" for a SIGKILL (flaky CI).
    child = subprocess.Popen([sys.executable, *argv])
    if code < 0:
        child.kill()
    wait_until(lambda: not _running(child.pid), 30)  # exited, not reaped
    not_reaped_yet = types.SimpleNamespace(pid=child.pid, exitcode=None)  # what multiprocessing says then
    assert nvrx_adapter._exit_code(not_reaped_yet) == code
    assert child.wait() == code
    assert nvrx_adapter._exit_code(types.SimpleNamespace(pid=child.pid, exitcode=None)) is None  # gone: unknown


WORKER = """
import sys, time, torch
from resilient_training.runtime.checkpointing import warm_up_writer
from resilient_training.runtime.nvrx_adapter import AsyncWriter
torch.distributed.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
writer = AsyncWriter()
writer.start(warm_up_writer)
while writer.pid is None:
    time.sleep(0.001)
# The warm-up job reaches the writer's pipe through a feeder thread, within milliseconds of the
# spawn: a worker killed before that leaves the writer waiting for it (the process-group kill of
# the launcher or the spare pool is what stops that writer).
time.sleep(0.3)
if sys.argv[2] == "ready":
    while not writer.ready:
        time.sleep(0.01)
print(writer.pid, writer.ready, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_a_writer_exits_when_its_worker_is_sigkilled(tmp_path: Path, when: str) -> None:
    """Found after a two-worker suite run: a writer still importing torch when its worker was
    SIGKILLed (under torchrun nothing else stops it) lived on for hours. It watched
    ``os.getppid()`` from its warm-up job, which runs after those imports: by then its parent
    was the reaper. Killed while starting (importing torch, seconds) or once ready, it must exit
    on its own.
    """
    import subprocess
    import sys

    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "store"), when],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid_text, ready = worker.stdout.readline().split()
        writer_pid = int(pid_text)
        worker.kill()
        worker.wait()
        assert ready == ("True" if when == "ready" else "False")
        if when == "starting":  # still importing: it finds out only once it runs its warm-up job
            assert _running(writer_pid)
        wait_until(lambda: not _running(writer_pid), 60.0)
    finally:
        worker.kill()
        if "writer_pid" in locals() and _running(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)


def test_a_full_disk_is_named_where_a_dead_writer_could_not_say_why(tmp_path):
    """A writer that dies of ENOSPC often cannot write its reason file (the disk is full): the death
    is then described with the free space where it wrote (a 1.3B run on one H200 said only "exited
    with code 1"). On a real full file system: a 1 MiB tmpfs (needs mount permission)."""
    import subprocess

    from resilient_training.run.paths import low_space

    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with pytest.raises(OSError, match="No space left"), open(full / "fill", "wb") as handle:
            handle.write(b"\0" * (2 << 20))
            handle.flush()
        assert low_space([tmp_path, full]) == f" ({full} has 0 MiB free: a full disk?)"
    finally:
        subprocess.run(["umount", str(full)], check=False)
    assert low_space([tmp_path]) == ""  # this machine's /tmp has more than 1 GiB free


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_spare_writer_takes_a_dead_writer_s_place_at_once(tmp_path: Path) -> None:
    """--spare-writer: a second process warmed up and idle. On one H200 a dead writer's place took
    4.9-6.6 s (a new process importing torch); the spare is ready the moment it is asked."""
    seen = Recorder()
    writer = AsyncWriter(on_ready=seen.on_ready, on_died=seen.on_died, spare=True)
    writer.warm_up()
    try:
        wait_until(lambda: writer.spare_ready)  # started once the writer was ready, not beside it
        first, spare = writer.pid, writer.spare_pid
        assert spare not in (None, first)
        os.kill(first, signal.SIGKILL)
        assert seen.died.wait(5.0)
        asked = time.monotonic()
        assert writer.replace() is seen.deaths[0]
        assert writer.ready and writer.pid == spare  # no wait: the spare is the writer now
        assert time.monotonic() - asked < 0.5
        seconds, pid, replacements = seen.ready[-1]
        assert (pid, replacements) == (spare, 1) and seconds < 0.5
        writer.submit(write_marker, (str(tmp_path / "e"),))
        writer.wait(60)
        assert (tmp_path / "e").read_text() == "durable"
        wait_until(lambda: writer.spare_ready)  # another spare, for the next death
        second_spare = writer.spare_pid
        assert second_spare not in (first, spare)
        # A spare's own death is no writer death: nothing reported, another one started.
        os.kill(second_spare, signal.SIGKILL)
        wait_until(lambda: writer.spare_ready and writer.spare_pid != second_spare)
        assert len(seen.deaths) == 1 and writer.ready and writer.pid == spare
        last_spare = writer.spare_pid
    finally:
        writer.close(timeout=60)
    wait_until(lambda: _gone(spare) and _gone(last_spare), 10.0)  # close stops the spare too


def test_a_failing_worker_s_abandon_stops_the_spare_too(tmp_path: Path) -> None:
    writer = AsyncWriter(spare=True)
    writer.warm_up()
    wait_until(lambda: writer.spare_ready)
    first, spare = writer.pid, writer.spare_pid
    writer.abandon()  # between in-process iterations: the spare is kept for the next start
    assert writer.spare_pid == spare and not _gone(spare)
    writer.start()
    assert writer.pid == spare and writer.ready  # the spare is the writer at once
    wait_until(lambda: writer.spare_ready)
    last_spare = writer.spare_pid
    writer.abandon(spare=True)  # the worker is failing
    wait_until(lambda: _gone(first) and _gone(spare) and _gone(last_spare), 10.0)
    assert writer.spare_pid is None


def test_spares_that_keep_dying_are_given_up_without_touching_the_writer(tmp_path: Path) -> None:
    seen = Recorder()
    writer = AsyncWriter(on_ready=seen.on_ready, on_died=seen.on_died, spare=True, max_deaths=2)
    writer.warm_up()
    try:
        for _ in range(2):
            wait_until(lambda: writer.spare_ready)
            os.kill(writer.spare_pid, signal.SIGKILL)
            wait_until(lambda: writer.spare_pid is None or not writer.spare_ready, 5.0)
        time.sleep(1.0)
        assert writer.spare_pid is None  # no third spare
        assert writer.ready and not seen.deaths
        writer.submit(write_marker, (str(tmp_path / "f"),))
        writer.wait(60)
    finally:
        writer.close(timeout=60)
