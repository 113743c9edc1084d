"""Page-locked host memory is page-unlocked before it goes.

On GPUs the host snapshot's slot files and the save's staging buffers are page-locked
(``cudaHostRegister``). A range left registered after its mapping was gone made a later
allocation on one H200 fail with "CUDA error: resource already mapped"
(``benchmarks/host_snapshot_read.py``, call9). This machine has no GPU, so the two CUDA calls are
replaced by recorders: what is tested is which ranges are unlocked, and when.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from resilient_training.runtime import checkpointing
from resilient_training.runtime.checkpointing import HostSnapshot, StagingBuffers

GPU = torch.device("cuda", 1)  # a rank's own GPU, not cuda:0 (no GPU needed: only the name is passed)


class Driver:
    """Stands in for cudaHostRegister / cudaHostUnregister: which ranges are locked now."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse_every: int = 0) -> None:
        self.refuse_every = refuse_every  # CUDA refuses every n-th call (0: none)
        self.calls = 0
        self.locked: dict[int, int] = {}
        self.pauses: list[bool] = []
        self.log: list[tuple[str, int]] = []
        monkeypatch.setattr(checkpointing, "page_lock", self.lock)
        monkeypatch.setattr(checkpointing, "page_unlock", self.unlock)

    def lock(self, ptr: int, nbytes: int, *, device: torch.device | None = None, pause: bool = False,
             direct: bool = False) -> bool:
        assert device == GPU, "locked with no device or another one current"
        assert ptr not in self.locked, "registered twice (CUDA: resource already mapped)"
        self.calls += 1
        if self.refuse_every and self.calls % self.refuse_every == 0:
            return False
        self.locked[ptr] = nbytes
        self.log.append(("lock", ptr))
        self.pauses.append(pause)
        return True

    def unlock(self, ptr: int, *, device: torch.device | None = None) -> bool:
        assert device == GPU, "unlocked with no device or another one current"
        assert ptr in self.locked, "unregistering a range never registered"
        del self.locked[ptr]
        self.log.append(("unlock", ptr))
        return True


def _prepare(host: HostSnapshot, layout: list, size: int) -> None:
    host._prepare(layout, size, device=GPU)
    assert host._preparing is not None
    host._preparing.join(30)


def _layout(n: int, numel: int) -> tuple[list, int]:
    layout, offset = [], 0
    for i in range(n):
        layout.append((f"t{i}", offset, (numel,), torch.float32))
        offset += -(-numel * 4 // HostSnapshot._ALIGN) * HostSnapshot._ALIGN
    return layout, offset


def test_host_snapshot_slots_are_unlocked_when_remade_and_on_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = Driver(monkeypatch)
    host = HostSnapshot(tmp_path)
    monkeypatch.setattr(HostSnapshot, "_PIN_RUN", 1 << 20)
    layout, size = _layout(6, 100_000)  # 6 x 400 kB: several runs per slot
    _prepare(host, layout, size)
    first = dict(driver.locked)
    assert len(first) > 2 and all(driver.pauses)  # from the background thread, paused
    mapped = {slot: (t.data_ptr(), t.numel()) for slot, t in host._data.items()}
    for ptr in first:  # every locked range lies in this process's slot mappings
        assert any(start <= ptr < start + n for start, n in mapped.values())

    bigger, bigger_size = _layout(8, 100_000)  # the model changed: the slots are made again
    before = len(driver.log)
    _prepare(host, bigger, bigger_size)
    remade = driver.log[before:]
    # Every old range unlocked before any new one is locked (the new mappings may reuse the addresses).
    assert sorted(remade[:len(first)]) == sorted(("unlock", ptr) for ptr in first)
    assert {what for what, _ in remade[len(first):]} == {"lock"} and len(driver.locked) > len(first)

    host.close()
    assert driver.locked == {}
    assert host._data == {}


def test_staging_buffer_replaced_for_a_new_shape_is_unlocked(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = Driver(monkeypatch)
    staging = StagingBuffers()
    a = staging._allocate(torch.Size([1000]), torch.float32, GPU, pause=True)
    staging._replace("w", a)
    assert list(driver.locked) == [a.data_ptr()]
    b = staging._allocate(torch.Size([2000]), torch.float32, GPU)
    staging._replace("w", b)
    assert list(driver.locked) == [b.data_ptr()]
    assert driver.pauses == [True, False]  # the training thread (a new shape at a save) does not pause


def test_page_lock_pauses_as_long_as_the_call_took(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cudart:
        def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
            time.sleep(0.05)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    start = time.perf_counter()
    assert checkpointing.page_lock(1, 1, pause=False)
    plain = time.perf_counter() - start
    start = time.perf_counter()
    assert checkpointing.page_lock(1, 1, pause=True)
    paused = time.perf_counter() - start
    assert plain < 0.09 and paused >= 0.1


def test_memory_cuda_refused_to_lock_is_reported_once_and_never_unlocked(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from resilient_training.run import events as ev
    from resilient_training.runtime.trainer import Trainer

    driver = Driver(monkeypatch, refuse_every=3)
    monkeypatch.setattr(HostSnapshot, "_PIN_RUN", 1 << 20)
    host = HostSnapshot(tmp_path / "tier")
    layout, size = _layout(6, 100_000)
    assert host.pin_report.take() is None  # nothing prepared yet
    _prepare(host, layout, size)
    report = host.pin_report.take()
    runs = len(HostSnapshot._pin_runs(layout, size)) * len(HostSnapshot.SLOTS)
    assert driver.calls == runs and len(driver.locked) == runs - runs // 3
    assert report is not None and report["failed_bytes"] > 0
    assert report["bytes"] + report["failed_bytes"] == size * len(HostSnapshot.SLOTS)
    assert report["bytes"] == sum(driver.locked.values())
    host.close()  # unlocks only what was locked (the driver refuses to unlock anything else)
    assert driver.locked == {}

    # The trainer logs each once, as an event of the strict schema.
    staging = StagingBuffers()
    for name in ("a", "b", "c"):
        staging._replace(name, staging._allocate(torch.Size([1000]), torch.float32, GPU))
    staging.pin_report.finish(0.5)
    _prepare(host, layout, size)
    log = ev.EventLog(tmp_path / "run", rank=0)
    trainer = SimpleNamespace(staging=staging, host_snapshot=host, events=log)
    Trainer._report_pinning(trainer, 7)
    Trainer._report_pinning(trainer, 8)
    logged = [e for e in ev.read_events(tmp_path / "run") if e.event == "host_memory_locked"]
    assert [(e.step, e["what"]) for e in logged] == [(7, "staging"), (7, "host_snapshot")]
    assert logged[0]["bytes"] == 8000 and logged[0]["failed_bytes"] == 4000 and logged[0]["seconds"] == 0.5
    host.close()


def test_each_cuda_call_runs_on_a_thread_of_its_own_with_the_rank_s_gpu_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused cudaHostRegister leaves its error pending on the thread that called it, where the
    next kernel launch's check raises it: never the training thread. And a new thread's current
    device is cuda:0: the rank's own is made current first."""
    import threading

    calls: list[tuple[str, object]] = []

    class Cudart:
        def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
            calls.append(("register", threading.current_thread().name, flags))
            return 1  # refused

        def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
            calls.append(("unregister", threading.current_thread().name))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", threading.current_thread().name, d)))
    assert checkpointing.page_lock(1, 4096, device=GPU) is False
    assert checkpointing.page_unlock(1, device=GPU) is True
    me = threading.current_thread().name
    assert [c[0] for c in calls] == ["set_device", "register", "set_device", "unregister"]
    assert all(c[1] != me for c in calls)  # not on the calling thread
    assert calls[0][2] == GPU and calls[1][2] == 1  # the rank's GPU current; registered portable


def test_slots_that_cannot_be_made_leave_nothing_locked_and_turn_the_host_snapshot_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from resilient_training.run import events as ev
    from resilient_training.runtime.trainer import Trainer

    driver = Driver(monkeypatch)
    monkeypatch.setattr(HostSnapshot, "_PIN_RUN", 1 << 20)
    made = []
    real_from_file = torch.from_file

    def from_file(*args, **kwargs):  # the second slot's file cannot be mapped (a full /dev/shm, say)
        if made:
            raise RuntimeError("unable to mmap: No space left on device")
        made.append(args)
        return real_from_file(*args, **kwargs)

    monkeypatch.setattr(torch, "from_file", from_file)
    host = HostSnapshot(tmp_path / "tier")
    layout, size = _layout(6, 100_000)
    _prepare(host, layout, size)
    assert driver.log and driver.locked == {}  # the first slot was locked, then unlocked again
    assert host.failed == "RuntimeError: unable to mmap: No space left on device"
    assert host._data == {} and host._pinned == [] and host._layout is None

    log = ev.EventLog(tmp_path / "run", rank=0)
    trainer = SimpleNamespace(staging=StagingBuffers(), host_snapshot=host, events=log, _host_snapshot_off=False)
    Trainer._report_pinning(trainer, 5)
    Trainer._report_pinning(trainer, 6)
    off = [e for e in ev.read_events(tmp_path / "run") if e.event == "host_snapshot_off"]
    assert [(e.step, e["reason"]) for e in off] == [(5, host.failed)]
