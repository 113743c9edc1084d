"""The host snapshot (``--host-snapshot``): the memory snapshot kept in host shared memory in two
slots, so that a process killed at any moment, even in the middle of a copy, leaves one whole
slot behind, and nothing taken by another rank, world size or model is ever restored.

Real models and AdamW on the CPU; the end-to-end launcher restart is in test_recovery.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.runtime.checkpointing import HostSnapshot, Lineage, MemorySnapshot
from tests.support.gates import TINY, train_state


def _ready(host: HostSnapshot, snapshot: MemorySnapshot, step: int, lineage: Lineage | None = None) -> None:
    """Write ``step``, the first time after the slots' files are prepared (in the background)."""
    host.write(snapshot, step, lineage)
    deadline = time.monotonic() + 30
    while host._preparing is not None and host._preparing.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    host.write(snapshot, step, lineage)
    host.wait()


def _snapshot_at(step: int) -> tuple[MemorySnapshot, object, object, object]:
    model, optimizer, data = train_state(TINY, seed=1234, steps=step)
    snapshot = MemorySnapshot()
    snapshot.take(step, model, optimizer, None, data.state_dict(), world=(0, 1))
    return snapshot, model, optimizer, data


def test_two_slots_hold_the_last_two_snapshots_and_restore_exactly(tmp_path: Path) -> None:
    host = HostSnapshot(tmp_path)
    snapshot, model, optimizer, data = _snapshot_at(2)
    _ready(host, snapshot, 2)
    snapshot, model, optimizer, data = _snapshot_at(3)
    host.write(snapshot, 3)
    host.wait()
    assert sorted(host.held((0, 1))) == [2, 3]

    fresh_model, fresh_optimizer, _ = train_state(TINY, seed=99, steps=0)
    data_state = HostSnapshot(tmp_path).restore(host.held((0, 1))[3][0], fresh_model, fresh_optimizer, None)
    assert data_state == data.state_dict()
    for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_copy_killed_midway_leaves_the_other_slot_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_training.runtime import checkpointing

    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    snapshot, *_ = _snapshot_at(3)
    host.write(snapshot, 3)
    host.wait()
    held = host.held((0, 1))
    copy = checkpointing._copy

    def dies_midway(pairs, **kwargs):  # the process dies once half the tensors are copied
        copy(pairs[: len(pairs) // 2], **kwargs)
        raise SystemExit("killed")

    snapshot, *_ = _snapshot_at(4)
    monkeypatch.setattr(checkpointing, "_copy", dies_midway)
    with pytest.raises(SystemExit):
        host.write(snapshot, 4)  # into step 2's slot, the older one
    assert host.held((0, 1)) == {3: held[3]}


class _CopyInFlight:
    """Stands for the CUDA event of a device-to-host copy that is still running."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def test_a_device_copy_is_committed_once_done_without_waiting_for_the_next_steps_poll(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs the copy into a slot runs on a side stream. It used to be committed at the next step's
    poll: a peer that died in that step left this rank (stopped while it waited in the step's
    collective) without the snapshot. A thread commits it once the copy is done; until then the
    slot holds no step, and the next snapshot is skipped, never written over a copy in flight.
    """
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    copies: list[_CopyInFlight] = []
    start_copy = host._start_copy

    def device_copy(snapshot, pairs):  # the copy itself is done; its event says so only when set
        start_copy(snapshot, pairs)
        copies.append(_CopyInFlight())
        return copies[-1]

    monkeypatch.setattr(host, "_start_copy", device_copy)
    snapshot, *_ = _snapshot_at(3)
    host.write(snapshot, 3)
    time.sleep(0.2)
    assert sorted(host.held((0, 1))) == [2]  # the copy of step 3 is not done
    later, *_ = _snapshot_at(4)
    host.write(later, 4)  # skipped: step 3's copy is in flight
    assert len(copies) == 1
    copies[0].done.set()  # no poll() from here on: the commit thread alone
    deadline = time.monotonic() + 10
    while sorted(host.held((0, 1))) != [2, 3] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(host.held((0, 1))) == [2, 3]
    host.write(later, 4)  # into step 2's slot, the older one
    copies[1].done.set()
    host.wait()
    assert sorted(host.held((0, 1))) == [3, 4]


@pytest.mark.parametrize("world", [(1, 2), (0, 2)], ids=["other rank", "other world size"])
def test_another_rank_or_world_size_holds_nothing(tmp_path: Path, world: tuple[int, int]) -> None:
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    assert host.held((0, 1)) and host.held(world) == {}


def test_a_truncated_data_file_or_a_torn_meta_holds_nothing(tmp_path: Path) -> None:
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    ((slot, _),) = host.held((0, 1)).values()
    with open(host._data_path(slot), "r+b") as f:
        f.truncate(16)
    assert host.held((0, 1)) == {}
    host._meta_path(slot).write_bytes(b"\x80\x04torn")
    assert host.held((0, 1)) == {}


def test_a_data_file_cut_inside_its_last_tensor_holds_nothing(tmp_path: Path) -> None:
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    ((slot, _),) = host.held((0, 1)).values()
    last_offset = max(offset for _, offset, _, _ in torch.load(host._meta_path(slot), weights_only=True)["layout"])
    with open(host._data_path(slot), "r+b") as f:
        f.truncate(last_offset + 1)  # the last tensor starts inside the file, and ends past it
    assert host.held((0, 1)) == {}


@pytest.mark.parametrize("threads", [1, 4], ids=["one-thread", "four-threads"])
@pytest.mark.parametrize("stage", [None, True], ids=["direct", "staged"])
def test_read_back_fills_every_target_with_its_bytes_across_buffer_boundaries(tmp_path: Path, stage: bool | None,
                                                                              threads: int) -> None:
    from resilient_training.run.tensor_read import read_into

    torch.manual_seed(0)
    sources = [torch.randn(1000), torch.randn(7, 3).to(torch.bfloat16), torch.empty(0), torch.randn(5, 4),
               torch.arange(300, dtype=torch.int64), torch.randn(())]
    path, blob, offsets = tmp_path / "data.bin", bytearray(), []
    for t in sources:
        blob += b"\xff" * 13  # what lies between the tensors is never read into one
        offsets.append(len(blob))
        blob += t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(blob))
    targets = [torch.zeros_like(t) for t in sources]
    targets[3] = torch.zeros(4, 5).t()  # not contiguous: read whole, then copied
    # chunk 64: a tensor spans many buffers, and buffers turn over between and inside tensors
    # (four threads: the 6 targets split by bytes, so threads hold one tensor, several, or none that is empty)
    read_into(path, list(zip(targets, offsets, strict=True)), chunk=64, stage=stage, threads=threads)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(source, target)

    with pytest.raises(fmt.CheckpointError, match="shorter than its layout"):  # a thread's failure reaches the caller
        read_into(path, [(torch.zeros(300), offsets[0]), (torch.zeros(10), len(blob) - 8)], chunk=64, stage=stage,
                   threads=threads)


def test_a_snapshot_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2)
    wider = TINY.__class__(**{**{k: getattr(TINY, k) for k in TINY.__slots__}, "d_model": TINY.d_model * 2})
    model, optimizer, _ = train_state(wider, seed=1, steps=0)
    with pytest.raises(fmt.CheckpointError, match="does not fit the rebuilt model"):
        host.restore(next(iter(host.held((0, 1)).values()))[0], model, optimizer, None)


def test_page_locking_goes_tensor_by_tensor_in_bounded_runs() -> None:
    """cudaHostRegister holds the GIL while it locks pages: the files are locked in runs of at most
    ``_PIN_RUN`` bytes (one tensor larger than that alone), each run whole tensors, so no copy
    spans two registrations.
    """
    run = HostSnapshot._PIN_RUN
    sizes = [4096, 4096, run - 8192, 4096, 2 * run, 4096, run, 8192]
    layout, offset = [], 0
    for i, size in enumerate(sizes):
        layout.append((("t", i), offset, (size,), torch.uint8))
        offset += size
    runs = HostSnapshot._pin_runs(layout, offset)
    starts = {o for _, o, _, _ in layout}
    assert runs[0][0] == 0 and sum(length for _, length in runs) == offset
    assert all(a + la == b for (a, la), (b, _) in zip(runs, runs[1:], strict=False))
    for start, length in runs:
        assert start in starts and start % 4096 == 0
        inside = [o for o in starts if start <= o < start + length]
        assert length <= run or len(inside) == 1
    assert runs[0] == (0, sum(sizes[:3]))  # the first three fill one run exactly


def test_a_snapshot_is_held_only_on_top_of_the_persistent_checkpoint_it_descends_from(tmp_path: Path) -> None:
    """A job killed on this node (snapshot of step 28 on top of step 20, branch a) that went on
    elsewhere to a committed step 25 (branch b): back here, step 28 must not be restored over 25.
    """
    host = HostSnapshot(tmp_path)
    snapshot, *_ = _snapshot_at(2)
    _ready(host, snapshot, 2, Lineage(branch="a", base=(20, "a")))
    assert set(host.held((0, 1), base=(20, "a"))) == {2}
    assert host.held((0, 1), base=(20, "a"))[2][1] == {"branch": "a", "base": [20, "a"]}
    assert host.held((0, 1), base=(25, "b")) == {}
    assert host.held((0, 1), base=(20, "b")) == {}  # the same step committed by another branch
    assert host.held((0, 1), base=None) == {}
