"""A rank's part of a checkpoint written as several DCP files in parallel (--checkpoint-write-threads):
the same checkpoint to torch and to validation, and no way to drop one of the files unnoticed.
"""

import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from resilient_training.gates.validate import validate_checkpoint_dir
from resilient_training.run import checkpoint_format as cf
from resilient_training.runtime.checkpointing import state_dict
from tests.support.gates import TINY, forge_commit_record, rank_jobs, rewrite_manifest, train_state, write_checkpoint


@pytest.fixture(scope="module")
def three_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("threads"), step=4, threads=3)


def private(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / ckpt.name))


def codes(ckpt: Path) -> set[tuple[str, str]]:
    result = validate_checkpoint_dir(ckpt, display_base=ckpt, load=False)
    return {(f.code, f.file.rsplit("/", 1)[-1]) for f in result.findings}


def test_each_rank_writes_three_files_that_load_as_one_checkpoint(three_files: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert sorted(os.listdir(three_files)) == [".metadata", *(cf.shard_name(r, i) for r in (0, 1) for i in range(3)),
                                               "data_rank_0.pt", "data_rank_1.pt", "manifest.json"]
    manifest = cf.read_manifest(three_files)
    for name, entry in manifest["files"].items():
        assert cf.checksum_file(three_files / name) == (entry["bytes"], entry["checksum"])
    # every file holds chunks: the writer spread them over its threads
    used = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
    assert used == {cf.shard_name(r, i) for r in (0, 1) for i in range(3)}
    result = validate_checkpoint_dir(three_files, load=True)
    assert result.valid, result.findings
    dcp_to_torch_save(three_files, tmp_path / "plain.pt")
    model, _, _ = train_state(TINY, seed=1234, steps=4)
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)["model"]
    assert all(torch.equal(plain[k], v) for k, v in model.state_dict().items())


def test_a_missing_middle_file_is_named(three_files: Path, tmp_path: Path) -> None:
    ckpt = private(three_files, tmp_path)
    (ckpt / cf.shard_name(1, 1)).unlink()
    assert ("shard_missing", cf.shard_name(1, 1)) in codes(ckpt)


def test_a_file_dropped_from_disk_and_manifest_alike_is_still_caught(three_files: Path, tmp_path: Path) -> None:
    """The consistent forgery: the last file of rank 1 removed, and its manifest entry with it."""
    ckpt = private(three_files, tmp_path)
    last = cf.shard_name(1, 2)
    (ckpt / last).unlink()
    rewrite_manifest(ckpt, lambda m: m["files"].pop(last))
    found = {code for code, _ in codes(ckpt)}
    assert "chunk_unreadable" in found


def test_an_extra_file_and_a_far_index_are_refused_quickly(three_files: Path, tmp_path: Path) -> None:
    ckpt = private(three_files, tmp_path)
    shutil.copy(ckpt / cf.shard_name(0, 0), ckpt / cf.shard_name(0, 3))
    assert ("unexpected_file", cf.shard_name(0, 3)) in codes(ckpt)
    far = cf.shard_name(0, 10**12)
    rewrite_manifest(ckpt, lambda m: m["files"].__setitem__(far, {"rank": 0, "bytes": 1, "checksum": "0"}))
    found = codes(ckpt)  # a far index must not make validation list 10**12 expected files
    assert ("manifest_incomplete", cf.MANIFEST_NAME) in found
    assert len(json.dumps(sorted(found))) < 2000


def _torn_writer(tmp_dir: str) -> None:
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    job = rank_jobs(state_dict(model, optimizer), world_size=1, step=3, data_state=data.state_dict())[0]
    cf.write_rank(tmp_dir, 0, {**job, "threads": 2}, torn_write=True)


def test_a_write_of_two_files_killed_midway_leaves_one_torn_file_and_no_sidecar(tmp_path: Path) -> None:
    tmp = tmp_path / ".tmp-step_3-k"
    tmp.mkdir()
    proc = multiprocessing.get_context("spawn").Process(target=_torn_writer, args=(str(tmp),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9
    assert cf.torn_files(tmp, 0) == [tmp / f"{cf.shard_name(0, 0)}.partial"]
    assert not (tmp / cf.sidecar_name(0)).exists()


def test_more_threads_than_chunks_leave_empty_files_that_are_listed_and_valid(tmp_path: Path) -> None:
    """Rank 1 of a 2-rank save of one small tensor holds a single chunk; 4 threads open 4 files."""
    weight = torch.arange(6.0).reshape(3, 2)
    ckpt = write_checkpoint(tmp_path, step=1, state={"model": {"w": weight}}, threads=4)
    manifest = cf.read_manifest(ckpt)
    assert {cf.shard_name(1, i) for i in range(4)} <= set(manifest["files"])
    assert manifest["files"][cf.shard_name(1, 3)]["bytes"] == 0
    result = validate_checkpoint_dir(ckpt, load=False)
    assert result.valid, [str(f) for f in result.findings]


def test_a_rank_s_files_are_read_back_at_once_and_load_the_same(three_files: Path, monkeypatch) -> None:
    """A restore reads the files on threads of their own (DCP reads them one after another), and
    the state it loads is the one written; a read that fails fails the load.
    """
    import threading

    import torch.distributed.checkpoint as dcp

    from resilient_training.run import tensor_read

    original = tensor_read._read_unit
    seen: list[tuple[str, str]] = []

    def spy(path, targets, **kwargs):
        seen.append((threading.current_thread().name, Path(path).name))
        # A read as long as a real file's: a tiny one ended before the next was submitted, and
        # the pool's one idle thread took them all (a CI run: "at once" failed on one thread).
        time.sleep(0.05)
        return original(path, targets, **kwargs)

    monkeypatch.setattr(tensor_read, "_read_unit", spy)

    def load(threads: int, pipelined: bool = True) -> dict:
        model, optimizer, _ = train_state(TINY, seed=99, steps=0)
        state = state_dict(model, optimizer)
        dcp.load(state, storage_reader=cf.reader(three_files, threads, pipelined=pipelined), no_dist=True)
        return {k: v.clone() for k, v in model.state_dict().items()}

    one = load(1)
    assert {name for name, _ in seen} == {"MainThread"} and len({f for _, f in seen}) == 6, seen
    seen.clear()
    many = load(8, pipelined=False)  # every file's layout first, then all files' reads together
    assert all(name.startswith("tensor-read") for name, _ in seen) and len({f for _, f in seen}) == 6, seen
    assert len({name for name, _ in seen}) > 1  # at once
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    seen.clear()
    # Pipelined, each file is read once placed: on as many threads as the timing asks for (a tiny
    # file's read can end before the next file is placed; CI saw one thread do all six).
    pipelined = load(8)
    assert all(name.startswith("tensor-read") for name, _ in seen) and len({f for _, f in seen}) == 6, seen
    assert all(torch.equal(one[k], pipelined[k]) for k in one)
    written, _, _ = train_state(TINY, seed=1234, steps=4)
    assert all(torch.equal(many[k], v) for k, v in written.state_dict().items())

    def broken(fd, buffer, offset, path):
        raise OSError("read failed: input/output error")

    monkeypatch.setattr(tensor_read, "pread_exact", broken)
    with pytest.raises(BaseException, match="input/output error"):  # DCP wraps it in a BaseException
        load(8)


def test_another_shape_fails_a_restore_in_one_line_naming_the_tensor(three_files: Path, tmp_path: Path) -> None:
    """DCP raises a BaseException holding every rank's traceback; a restore raises CheckpointError
    naming the tensor and both shapes (the trainer's handling of it depends on that type).
    """
    from resilient_training.run import config as cfg
    from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers

    wider = TINY.__class__(**{**{k: getattr(TINY, k) for k in TINY.__slots__}, "d_model": TINY.d_model * 2})
    model, optimizer, _ = train_state(wider, seed=1, steps=1)
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run")])
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="t", writer=None, staging=StagingBuffers(),
                                emit=lambda *a, **k: None)
    with pytest.raises(cf.CheckpointError) as caught:
        checkpointer.load(three_files, cf.read_manifest(three_files), model, optimizer)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert "holds a different model" in message and "Size mismatch" in message and "model.tok.weight" in message


def test_a_manifest_rewritten_to_another_model_size_is_a_finding_not_a_crash(three_files: Path, tmp_path: Path) -> None:
    """The task arguments say which model to build: rewritten, DCP's load fails (it raised past
    ``except Exception`` before), and validation says so as a finding.
    """
    run = Path(shutil.copytree(three_files.parent.parent, tmp_path / "run"))  # with its event log
    ckpt = run / "checkpoints" / three_files.name
    rewrite_manifest(ckpt, lambda m: m["task_args"].update(d_model=str(int(m["task_args"]["d_model"]) * 2)))
    forge_commit_record(ckpt)  # the run's log rewritten too: the load must catch it on its own
    result = validate_checkpoint_dir(ckpt, display_base=ckpt, load=True)
    assert not result.valid
    assert any(f.code == "load_failed" and "Size mismatch" in f.message for f in result.findings), result.findings


def test_the_default_on_gpus_is_a_file_per_gb_of_the_ranks_part_from_4_to_16() -> None:
    from resilient_training.runtime.checkpointing import default_write_threads

    gb = 2**30
    assert default_write_threads(16 * gb, on_gpu=False) == 1
    assert [default_write_threads(n, on_gpu=True) for n in (0, int(3.2 * gb), 4 * gb, 4 * gb + 1, 16 * gb, 100 * gb)] \
        == [4, 4, 4, 5, 16, 16]
