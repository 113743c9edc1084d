"""A rank's part of a checkpoint written as several DCP files in parallel (--checkpoint-write-threads):
the same checkpoint to torch and to validation, and no way to drop one of the files unnoticed.
"""

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch

from resilient_training.gates.validate import validate_checkpoint_dir
from resilient_training.run import checkpoint_format as cf
from resilient_training.runtime.checkpointing import state_dict
from tests.support.gates import TINY, rank_jobs, rewrite_manifest, train_state, write_checkpoint


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
