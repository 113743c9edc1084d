"""What a save copies to host memory (``Checkpointer.stage``): from the memory snapshot of its own
step when there is one (so on GPUs the next optimizer step does not wait for the copy), with the
write plan made once and reused while the layout stays the same.

Real models and AdamW on the CPU; the snapshot and staging copies are the same code that runs on
side streams on GPUs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from resilient_training.run import config as cfg
from resilient_training.runtime.checkpointing import (
    Checkpointer,
    MemorySnapshot,
    StagingBuffers,
    flat_state,
    state_dict,
)
from tests.support.gates import TINY, train_state


def _checkpointer(tmp_path: Path, snapshot: MemorySnapshot | None) -> Checkpointer:
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--memory-snapshot-every", "2"])
    return Checkpointer(config, rank=0, world_size=1, tag="t", writer=None, staging=StagingBuffers(),
                        emit=lambda *a, **k: None, snapshot=snapshot)


def _one_more_step(model, optimizer, data) -> None:
    from resilient_training.tasks.gpt import task
    from tests.support.gates import task_args

    loss = task(**task_args(TINY)).loss(model, next(data))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # in place: the tensors of the state dict below now hold step 3


def _tensors(state) -> dict[str, torch.Tensor]:
    flat, _ = flat_state(state)
    return {k: v.detach().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def test_a_save_of_the_snapshot_step_stages_the_snapshot_not_the_moved_on_state(tmp_path: Path) -> None:
    model, optimizer, data = train_state(TINY, seed=1234, steps=2)
    snapshot = MemorySnapshot()
    snapshot.take(2, model, optimizer, None, data.state_dict(), world=(0, 1))
    at_step_2 = _tensors(state_dict(model, optimizer))
    _one_more_step(model, optimizer, data)
    moved = _tensors(state_dict(model, optimizer))

    shard = _checkpointer(tmp_path, snapshot).stage(2, state_dict(model, optimizer), {}, replicated=True)
    assert shard["tensors"].keys() == at_step_2.keys()
    for name, staged in shard["tensors"].items():
        assert torch.equal(staged, at_step_2[name]), name  # weights, both Adam moments and its step count
    changed = [n for n in at_step_2 if not torch.equal(at_step_2[n], moved[n])]
    assert any(".exp_avg" in n for n in changed) and any(n.startswith("model.") for n in changed)


def test_a_save_of_another_step_stages_the_live_state(tmp_path: Path) -> None:
    model, optimizer, data = train_state(TINY, seed=1234, steps=2)
    snapshot = MemorySnapshot()
    snapshot.take(2, model, optimizer, None, data.state_dict(), world=(0, 1))
    _one_more_step(model, optimizer, data)
    shard = _checkpointer(tmp_path, snapshot).stage(3, state_dict(model, optimizer), {}, replicated=True)
    live = _tensors(state_dict(model, optimizer))
    assert all(torch.equal(staged, live[name]) for name, staged in shard["tensors"].items())


def test_the_reused_write_plan_equals_a_fresh_one_and_follows_a_new_layout(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    def fresh(state) -> list:
        flat, _ = flat_state(state)
        return [item for name, value in flat.items() for item in _create_write_items(name, value)]

    checkpointer = _checkpointer(tmp_path, None)
    model, optimizer, _ = train_state(TINY, seed=1234, steps=1)
    first = checkpointer.stage(1, state_dict(model, optimizer), {}, replicated=True)
    second = checkpointer.stage(2, state_dict(model, optimizer), {}, replicated=True)
    assert first["items"] == second["items"] == fresh(state_dict(model, optimizer))

    wider = TINY.__class__(**{**{k: getattr(TINY, k) for k in TINY.__slots__}, "d_model": TINY.d_model * 2})
    model2, optimizer2, _ = train_state(wider, seed=1234, steps=1)
    third = checkpointer.stage(3, state_dict(model2, optimizer2), {}, replicated=True)
    assert third["items"] == fresh(state_dict(model2, optimizer2)) != first["items"]
    assert all(s.shape == v.shape for s, v in zip(third["tensors"].values(),
                                                   _tensors(state_dict(model2, optimizer2)).values(), strict=True))


class _InlineWriter:
    """NVRx's writer process, at its edge: writes each shard at once (real files), and reports it
    durable only when the test says so (a slow node-local write)."""

    ready = True
    death = None

    def __init__(self) -> None:
        self.durable = False

    def submit(self, fn, job) -> None:
        fn(*job)

    def poll(self) -> bool:
        return self.durable

    def replace(self) -> None:
        pass


def test_a_persistent_save_deferred_by_a_node_local_write_is_made_once_that_write_is_done(tmp_path: Path) -> None:
    """Seen on one H200 with node-local saves every 10 steps: a persistent save (step 500) came
    while a node-local one was still writing and was skipped, doubling the persistent interval.
    """
    from resilient_training.run import checkpoint_format as fmt

    events: list[tuple[str, int, dict]] = []
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--steps", "20", "--checkpoint-every", "4",
                            "--local-checkpoint-every", "1", "--local-checkpoint-dir", str(tmp_path / "local")])
    writer = _InlineWriter()
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="t", writer=writer, staging=StagingBuffers(),
                                emit=lambda event, step, **kw: events.append((event, step, kw)))
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)

    def step(n: int) -> None:
        checkpointer.maybe_commit(checkpointer.local_done())
        if checkpointer.tier_for(n):
            checkpointer.save(n, state_dict(model, optimizer), data.state_dict(), {})

    step(3)  # node-local, still writing at ...
    step(4)  # ... the persistent save's step: deferred, owed
    step(5)  # node-local, deferred as before
    assert [(e, s) for e, s, _ in events] == [("ckpt_begin", 3), ("ckpt_staged", 3), ("ckpt_deferred", 4),
                                               ("ckpt_deferred", 5)]
    assert "owed" in events[2][2]["reason"] and "owed" not in events[3][2]["reason"]
    writer.durable = True
    step(6)  # step 3 commits; the owed persistent save is made now, not at step 8
    checkpointer.maybe_commit(checkpointer.local_done())  # ... and commits at the next step
    checkpointer.committer.settle(30)
    begun = [(s, kw["tier"]) for e, s, kw in events if e == "ckpt_begin"]
    assert begun == [(3, "local"), (6, "persistent")]
    assert fmt.read_manifest(fmt.read_latest(tmp_path / "run" / "checkpoints"))["step"] == 6
    assert checkpointer.tier_for(7) == "local" and checkpointer.tier_for(8) == "persistent"


def test_saves_wait_for_page_locked_staging_buffers_without_holding_training(tmp_path: Path, monkeypatch) -> None:
    """Found on one H200 with --host-snapshot: a process's first save waited 2.2-3.0 s for its
    staging buffers to be page-locked (paced, in the background), when a launcher restart resumed
    5 steps before a save. A save is deferred instead (a persistent one is owed), the same step on
    every rank: readiness travels in the step's done count like a commit.
    """
    import threading
    from types import SimpleNamespace

    from resilient_training.runtime import checkpointing

    release = threading.Event()

    def slow_page_lock(ptr: int, nbytes: int, *, device: torch.device | None = None, pause: bool = False,
                       direct: bool = False) -> bool:
        release.wait(30)  # the driver, still locking
        return False  # (refused: nothing to unlock afterwards)

    monkeypatch.setattr(checkpointing, "page_lock", slow_page_lock)
    events: list[tuple[str, int, dict]] = []
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--steps", "20", "--checkpoint-every", "4"])
    staging = StagingBuffers()
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="t", writer=_InlineWriter(), staging=staging,
                                emit=lambda event, step, **kw: events.append((event, step, kw)))
    model, optimizer, data = train_state(TINY, seed=1234, steps=1)
    staging.prepare([("w", SimpleNamespace(shape=torch.Size([8]), dtype=torch.float32, is_cuda=True,
                                                   device=torch.device("cuda", 0)))])
    assert staging.locking
    monkeypatch.setattr(StagingBuffers, "DEFER_SECONDS", 0.0)  # locking that never ends: saves wait after all
    assert not staging.locking and checkpointer.local_done() == 1.0
    monkeypatch.setattr(StagingBuffers, "DEFER_SECONDS", 120.0)

    def step(n: int) -> None:
        checkpointer.maybe_commit(checkpointer.local_done())
        if checkpointer.tier_for(n):
            checkpointer.save(n, state_dict(model, optimizer), data.state_dict(), {})

    step(4)  # persistent, but the buffers are still being locked: deferred, owed, training not held
    step(5)  # still locking: nothing (no deferral logged at every step)
    assert [(e, s) for e, s, _ in events] == [("ckpt_deferred", 4)]
    assert events[0][2]["reason"] == "staging buffers still being page-locked; owed: made once that is done"
    release.set()
    staging._preparing.join(30)
    assert not staging.locking
    step(6)  # ready everywhere: the owed persistent save is made now, not at step 8
    assert [(s, kw["tier"]) for e, s, kw in events if e == "ckpt_begin"] == [(6, "persistent")]

    # Two ranks: one still locking (its part of the count is 0) defers the save on both.
    other = Checkpointer(config, rank=0, world_size=2, tag="u", writer=_InlineWriter(), staging=StagingBuffers(),
                         emit=lambda *a, **k: None)
    other.maybe_commit(1.0)
    assert other.will_defer(8) and not other.will_defer(20)  # the final step always saves (and waits)
    other.maybe_commit(2.0)
    assert not other.will_defer(8)


def test_a_persistent_save_owed_at_an_inprocess_restart_is_made_after_it(tmp_path: Path) -> None:
    """Found in review: the owed step lived in the iteration's Checkpointer, so an in-process
    restart whose restore landed past it forgot it (the persistent interval doubled once)."""
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--steps", "20", "--checkpoint-every", "4"])

    def fresh() -> Checkpointer:  # what the trainer builds at each iteration
        return Checkpointer(config, rank=0, world_size=2, tag="t", writer=_InlineWriter(), staging=StagingBuffers(),
                            emit=lambda *a, **k: None)

    before = fresh()
    before.maybe_commit(1.0)  # a peer still page-locking: the save at step 4 is deferred and owed
    before.save(4, {}, None, {})
    assert before.owed == 4
    after = fresh()
    after.carry_owed(before.owed, restored=5)  # restored past step 4: owed still, made at once
    after.maybe_commit(2.0)
    assert after.tier_for(6) == "persistent"
    again = fresh()
    again.carry_owed(before.owed, restored=3)  # restored before it: step 4 comes again, on schedule
    again.maybe_commit(2.0)
    assert again.owed is None and again.tier_for(3) is None and again.tier_for(4) == "persistent"


def test_staging_buffers_are_made_in_shared_memory_and_populated_in_pieces() -> None:
    """The staging path of GPU machines (checkpointing.shared_empty, populate), on the CPU: buffers
    in shared memory directly, every page written (zeroed) from several threads, pieces of any size."""
    from resilient_training.runtime.checkpointing import populate, shared_empty

    shapes = [(3, 5), (0, 4), (), (70_000,)]  # the last is split into pieces (4 kB each here)
    buffers = [shared_empty(torch.Size(shape), dtype) for shape, dtype in
               zip(shapes, (torch.float32, torch.bfloat16, torch.int64, torch.float32), strict=True)]
    for buffer, shape in zip(buffers, shapes, strict=True):
        assert buffer.is_shared() and buffer.is_contiguous() and tuple(buffer.shape) == shape
        assert buffer.untyped_storage().nbytes() == buffer.numel() * buffer.element_size()
        if buffer.numel():
            buffer.fill_(7)
    populate(buffers, threads=3, piece_bytes=4096)
    assert all(not buffer.any() for buffer in buffers)


def test_a_staging_buffer_is_made_without_holding_the_gil_and_shared_with_another_process() -> None:
    """shared_empty allocates its memory outside the GIL (torch's _new_shared held it for the whole
    allocation: another thread stalled 1 s for 2 GiB, which on GPUs held a training step for seconds);
    the buffer is still shared memory that a writer process writes into by handle."""
    import multiprocessing
    import threading
    import time

    from resilient_training.runtime.checkpointing import shared_empty

    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.1)
    start = time.perf_counter()
    buffer = shared_empty((1 << 28,), torch.float32)  # 1 GiB
    took = time.perf_counter() - start
    stop.set()
    thread.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b > start and a < start + took]
    assert took > 0.05 and gaps and max(gaps) < took / 3, (took, max(gaps, default=None))
    assert buffer.is_shared() and buffer.untyped_storage().nbytes() == 1 << 30
    view = buffer[1000:2000]
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    child = context.Process(target=_write_into, args=(queue,))
    child.start()
    from torch.multiprocessing import reductions  # noqa: F401 - registers the tensor pickling by handle

    queue.put(view)
    child.join(60)
    assert child.exitcode == 0 and float(buffer[1005]) == 42.0


def _write_into(queue: object) -> None:
    import torch.multiprocessing  # noqa: F401

    view = queue.get()  # type: ignore[attr-defined]
    view[5] = 42.0
