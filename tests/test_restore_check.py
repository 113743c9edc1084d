"""What a restart restores from storage is hashed against its manifest behind it (RestoreCheck).

A restart reads the checkpoint without checking it (its seconds are the point); before this,
bytes changed on storage during a run (or read by a cluster worker's first restore, which no
preflight sees) were restored and trained on unchecked. Real checkpoints, real DCP loads, real
hashing; only the check's pace is held back where a test needs it still running.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import config as cfg
from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers, state_dict
from tests.support.gates import TINY, flip_tensor_byte, train_state, write_checkpoint


class _DurableWriter:
    """NVRx's writer process, at its edge: writes each shard at once (real files), durable at once."""

    ready = True
    death = None

    def submit(self, fn, job) -> None:
        fn(*job)

    def poll(self) -> bool:
        return True

    def replace(self) -> None:
        pass


def _restarted(run_dir: Path, events: list) -> tuple[Checkpointer, Path, dict, tuple]:
    """A new process's checkpointer with the latest checkpoint found (what a launcher restart does)."""
    config = cfg.from_argv(["--run-dir", str(run_dir), "--steps", "20", "--checkpoint-every", "5"])
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="r1i0", writer=_DurableWriter(),
                                staging=StagingBuffers(), emit=lambda event, step, **kw: events.append((event, step, kw)))
    path = fmt.read_latest(checkpointer.root)
    return checkpointer, path, fmt.read_manifest(path), train_state(TINY, seed=99, steps=1)


def test_the_ranks_shares_cover_every_file_once_and_only_rank_0_looks_for_unlisted_ones(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "run", step=4, world_size=2, threads=2)
    manifest = fmt.read_manifest(ckpt)
    for name in manifest["files"]:  # every listed file damaged: each problem names its file
        path = ckpt / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    (ckpt / "__2_0.distcp").write_bytes(b"planted")
    shares = [fmt.damaged_files(ckpt, manifest, part=(i, 2)) for i in range(2)]
    named = [{line.split(" ")[0] for line in share} for share in shares]
    assert named[0] | named[1] == set(manifest["files"]) | {"__2_0.distcp"}
    assert not named[0] & named[1]
    assert "__2_0.distcp is not in the manifest" in shares[0]
    assert all(len(share) >= 3 for share in shares)  # 7 listed files: 4 and 3, both ranks work
    whole = fmt.damaged_files(ckpt, manifest)
    assert sorted(whole) == sorted(shares[0] + shares[1])


def test_a_restart_logs_its_restore_checked_whole_and_commits_after_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "run", step=4, world_size=1)
    events: list = []
    checkpointer, path, manifest, (model, optimizer, data) = _restarted(tmp_path / "run", events)
    source, _ = checkpointer.load(path, manifest, model, optimizer)
    assert source == "storage"
    checkpointer.restore_check.wait(30)
    assert checkpointer.local_done() == 1.0
    checked = [kw for event, step, kw in events if event == "restore_checked" and step == 4]
    assert checked == [{"path": str(path), "bytes": sum(e["bytes"] for e in manifest["files"].values()),
                        "seconds": checked[0]["seconds"], "problems": []}]


def test_bytes_changed_after_the_commit_load_silently_and_the_check_stops_the_run(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "run", step=4, world_size=1)
    write_checkpoint(tmp_path / "run", step=8, world_size=1)
    latest = fmt.read_latest(ckpt.parent)
    name = flip_tensor_byte(latest)
    events: list = []
    checkpointer, path, manifest, (model, optimizer, data) = _restarted(tmp_path / "run", events)
    checkpointer.load(path, manifest, model, optimizer)  # DCP reads the changed value without a word
    checkpointer.restore_check.wait(30)
    with pytest.raises(fmt.CheckpointRefused) as refused:
        checkpointer.local_done()
    said = str(refused.value)
    assert f"{latest}, restored at step 8, is damaged (changed since it was committed): {name} differs" in said
    assert f"echo step_4 > {ckpt.parent / 'latest'}" in said
    assert fmt.read_latest(ckpt.parent) == latest  # nothing rewound behind the user's back
    checked = [kw for event, _, kw in events if event == "restore_checked"]
    assert len(checked) == 1 and checked[0]["problems"][0].startswith(f"{name} differs from what was committed")


@pytest.mark.parametrize("how", ["run_uid-deleted", "unlogged-run_uid-deleted", "unlogged-own-run_uid",
                                 "unlogged-own-run_uid-abandoned", "unlogged-own-run_uid-begun"])
def test_a_restored_step_the_runs_event_log_does_not_vouch_for_stops_the_run(tmp_path: Path, how: str) -> None:
    """A third stranger trial planted another run's step with ``run_uid`` deleted from its manifest:
    `train`'s pre-flight now refuses it, and a cluster's workers (no pre-flight) must too: rank 0's
    check behind the restore reads the run's event log for that commit. A step whose commit line
    rank 0 did not live to write still restores when its manifest names this run and rank 0 logged
    beginning its save; this run's ``run_uid`` copied into a step it never began saving, or whose
    save it logged abandoned (a writer death), does not."""
    import shutil

    from resilient_training.run.events import EventLog
    from tests.support.gates import rewrite_manifest

    ckpt = write_checkpoint(tmp_path / "run", step=4, world_size=1)
    theirs = write_checkpoint(tmp_path / "theirs", step=4 if how == "run_uid-deleted" else 6, world_size=1, seed=7)
    planted = ckpt.parent / theirs.name
    shutil.rmtree(planted, ignore_errors=True)
    shutil.copytree(theirs, planted)
    uid = fmt.read_run_uid(tmp_path / "run")
    rewrite_manifest(planted, lambda m: m.update(run_uid=uid) if "own-run_uid" in how else m.pop("run_uid"))
    (ckpt.parent / "latest").write_text(planted.name)
    log = EventLog(tmp_path / "run", rank=0, attempt=0)
    log.emit("ckpt_begin", 6 if how.endswith(("-begun", "-abandoned")) else 5, mode="async", tier="persistent")
    if how.endswith("-abandoned"):
        log.emit("ckpt_abandoned", 6, reason="a peer's checkpoint writer died", tier="persistent")
    log.close()
    events: list = []
    checkpointer, path, manifest, (model, optimizer, data) = _restarted(tmp_path / "run", events)
    assert path == planted
    checkpointer.load(path, manifest, model, optimizer)
    checkpointer.restore_check.wait(30)
    if how == "unlogged-own-run_uid-begun":
        assert checkpointer.local_done() == 1.0
        return
    with pytest.raises(fmt.CheckpointRefused) as refused:
        checkpointer.local_done()
    said = str(refused.value)
    assert f"{planted}, restored at step {manifest['step']}, is not this run's: " in said, said
    assert {"run_uid-deleted": "the event log records another digest",
            "unlogged-run_uid-deleted": "records no commit of step 6 and its manifest names no run_uid",
            "unlogged-own-run_uid": "no commit of step 6, nor a save of it begun and not abandoned",
            "unlogged-own-run_uid-abandoned": "no commit of step 6, nor a save of it begun and not abandoned",
            }[how] in said, said
    (checked,) = [kw for event, _, kw in events if event == "restore_checked"]
    assert len(checked["problems"]) == 1 and checked["problems"][0] in said


def test_nothing_is_committed_on_a_restore_the_check_has_not_found_whole(tmp_path: Path, monkeypatch) -> None:
    write_checkpoint(tmp_path / "run", step=4, world_size=1)
    release = threading.Event()
    real = fmt.damaged_files

    def held(*args, **kwargs):
        release.wait(30)  # slow storage, still being read
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt, "damaged_files", held)
    events: list = []
    checkpointer, path, manifest, (model, optimizer, data) = _restarted(tmp_path / "run", events)
    checkpointer.load(path, manifest, model, optimizer)
    checkpointer.save(5, state_dict(model, optimizer), data.state_dict(), {})  # durable at once
    for _ in range(3):
        done = checkpointer.local_done()
        assert done == 0.0 and not checkpointer.will_commit(done)
        checkpointer.maybe_commit(done)
    assert fmt.read_manifest(fmt.read_latest(checkpointer.root))["step"] == 4
    release.set()
    checkpointer.restore_check.wait(30)
    done = checkpointer.local_done()
    assert done == 1.0
    checkpointer.maybe_commit(done)
    checkpointer.committer.settle(30)
    assert fmt.read_manifest(fmt.read_latest(checkpointer.root))["step"] == 5
    assert [e for e, _, _ in events if e in ("restore_checked", "ckpt_committed")] == ["restore_checked", "ckpt_committed"]


def test_a_node_local_restore_checks_every_file_its_rank_holds(tmp_path: Path) -> None:
    """A node-local checkpoint lists one rank's files: that rank checks them all, not a share."""
    from resilient_training.runtime.checkpointing import RestoreCheck

    ckpt = write_checkpoint(tmp_path / "run", step=4, world_size=2)
    manifest = fmt.read_manifest(ckpt)
    manifest["ranks"] = [1]  # what rank 1's node-local directory holds: its own files and .metadata
    for name in list(manifest["files"]):
        if name in (fmt.shard_name(0), fmt.data_name(0)):
            del manifest["files"][name]
            (ckpt / name).unlink()
    flip = ckpt / fmt.shard_name(1)
    data = bytearray(flip.read_bytes())
    data[10] ^= 1
    flip.write_bytes(bytes(data))
    check, events = RestoreCheck(), []
    check.start(ckpt, manifest, 4, None)
    check.wait(30)
    with pytest.raises(fmt.CheckpointRefused, match="__1_0.distcp differs"):
        check.poll(lambda event, step, **kw: events.append(kw))
    assert len(events[0]["problems"]) == 1
    assert events[0]["bytes"] == sum(e["bytes"] for e in manifest["files"].values())


def test_the_hashing_begins_after_the_first_step_not_during_it(tmp_path: Path) -> None:
    """Begun at the restore, the hashing held a killed 1.3B rank's first step back (one H200):
    it begins at the trainer's second poll (one a step), and commits wait for it from the start."""
    from resilient_training.runtime.checkpointing import RestoreCheck

    ckpt = write_checkpoint(tmp_path / "run", step=4, world_size=1)
    check, events = RestoreCheck(), []
    check.start(ckpt, fmt.read_manifest(ckpt), 4, (0, 1))
    check.poll(lambda event, step, **kw: events.append(event))  # the first step's poll
    assert check.pending and not [t for t in threading.enumerate() if t.name == "restore-check"]
    check.poll(lambda event, step, **kw: events.append(event))  # the second step's: begun
    check.wait(30)
    assert check.pending is False and events == []
    check.poll(lambda event, step, **kw: events.append(event))
    assert events == ["restore_checked"]


@pytest.mark.slow
def test_bytes_changed_on_storage_during_a_run_stop_it_at_the_next_restart(tmp_path: Path) -> None:
    """The whole path: `train` checked the (absent) checkpoint at its start; step 8 is committed,
    then one value in it changes on storage; rank 1 is killed at step 11 and the new processes
    restore step 8 from storage. The check behind that restore stops the run, with nothing
    committed on top of it, and says how to rewind.
    """
    import time

    from resilient_training.run import events as ev
    from tests.support.runs import train

    run_dir = tmp_path / "run"
    stop, flipped = threading.Event(), []

    def bit_rot() -> None:
        while not stop.is_set():
            with contextlib.suppress(fmt.CheckpointError, OSError):
                latest = fmt.read_latest(run_dir / "checkpoints")
                if latest is not None and latest.name == fmt.step_dirname(8):
                    flipped.append(flip_tensor_byte(latest))
                    return
            time.sleep(0.01)

    rot = threading.Thread(target=bit_rot, daemon=True)
    rot.start()
    try:  # synchronous saves: step 8 is committed at step 8, 3 steps (0.9 s) before the kill
        run = train(run_dir, "--nproc", "2", "--steps", "30", "--checkpoint-every", "4", "--no-async-checkpoint",
                    "--step-seconds", "0.3", "--faults", "sigkill@11:1")
    finally:
        stop.set()
        rot.join(5)
    assert flipped == [fmt.shard_name(0)], run.output[-2000:]
    assert run.returncode != 0, run.output[-2000:]
    ckpt = run_dir / "checkpoints" / fmt.step_dirname(8)
    said = (f"FAILED: stopped without a restart: {ckpt}, restored at step 8, is damaged (changed since it was "
            "committed): __0_0.distcp differs from what was committed (its checksum)")
    assert said in run.output, run.output[-3000:]
    assert f"echo step_4 > {run_dir / 'checkpoints' / 'latest'}" in run.output
    events = ev.read_events(run_dir)
    checked = [e for e in events if e.event == "restore_checked"]
    # Rank 1's share holds __0_0.distcp (the files in name order, every second one).
    assert [(e.rank, e.attempt, bool(e["problems"])) for e in checked] in (
        [(0, 1, False), (1, 1, True)], [(1, 1, True), (0, 1, False)], [(1, 1, True)])
    assert fmt.read_latest(run_dir / "checkpoints") == ckpt  # nothing committed on top, nothing rewound
    assert not [e for e in events if e.event == "ckpt_committed" and e.attempt == 1]
    assert max(e.attempt for e in events) == 1  # stopped: no launcher restart into the same damage
