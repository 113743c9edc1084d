import multiprocessing
import os

import pytest
import torch

from resilient_training.run import checkpoint_format as fmt


def _shard(step: int, rank: int, world: int, full: dict[str, torch.Tensor]) -> dict:
    tensors, layout = {}, {}
    for name, tensor in full.items():
        offset, length = fmt.chunk_bounds(tensor.shape[0], world, rank)
        tensors[name] = tensor[offset : offset + length].clone()
        layout[name] = {"global_shape": list(tensor.shape), "offset": offset}
    meta = {"format_version": 1, "step": step, "rank": rank, "world_size": world, "optimizer_step": step,
            "data_position": step, "layout": layout}
    return {"meta": meta, "tensors": tensors}


FULL = {"model/w": torch.arange(15.0).reshape(5, 3), "model/b": torch.arange(3.0), "model/one": torch.ones(1, 2)}


def _save(root, step, world=2, full=FULL):
    tmp = root / f".tmp-step_{step}-t"
    tmp.mkdir(parents=True)
    for rank in range(world):
        fmt.write_shard(tmp, rank, _shard(step, rank, world, full))
    return fmt.commit(tmp, step=step, world_size=world, manifest_fields={"optimizer_step": step}, keep_last=2)


def test_commit_writes_manifest_and_moves_latest(tmp_path):
    root = tmp_path / "checkpoints"
    assert fmt.read_latest(root) is None
    first = _save(root, 5)
    assert fmt.read_latest(root) == first
    manifest = fmt.read_manifest(first)
    assert manifest["step"] == 5 and manifest["checksum_algorithm"] == "xxh3_128"
    assert sorted(os.listdir(first)) == ["manifest.json", "rank_0.pt", "rank_1.pt"]  # no sidecars left
    for name, entry in manifest["files"].items():
        assert fmt.checksum_file(first / name) == (entry["bytes"], entry["checksum"])
    _save(root, 10)
    _save(root, 15)
    assert fmt.committed_steps(root) == [10, 15]  # keep_last=2 pruned step 5
    assert fmt.read_latest(root).name == "step_15"


def test_assemble_full_inverts_sharding_for_any_world_size(tmp_path):
    for world in (1, 2, 3, 4, 7):
        shards = [_shard(1, r, world, FULL) for r in range(world)]
        full = fmt.assemble_full(shards)
        for name, tensor in FULL.items():
            assert torch.equal(full[name], tensor), (world, name)


def test_a_save_that_never_committed_is_invisible(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 5)
    tmp = root / ".tmp-step_10-x"
    tmp.mkdir()
    fmt.write_shard(tmp, 0, _shard(10, 0, 2, FULL))  # rank 1 never finished
    with pytest.raises(fmt.CheckpointError, match="rank 1 reported no shard"):
        fmt.commit(tmp, step=10, world_size=2, manifest_fields={})
    assert fmt.read_latest(root).name == "step_5"
    assert fmt.committed_steps(root) == [5]


def _torn_writer(tmp_dir: str) -> None:
    fmt.write_shard(tmp_dir, 0, _shard(3, 0, 1, FULL), torn_write=True)


def test_a_write_killed_midway_leaves_only_a_partial_file(tmp_path):
    tmp = tmp_path / ".tmp-step_3-k"
    tmp.mkdir()
    proc = multiprocessing.get_context("spawn").Process(target=_torn_writer, args=(str(tmp),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9  # SIGKILL, as the ckpt-kill / writer-kill faults do
    assert [p.name for p in tmp.iterdir()] == ["rank_0.pt.partial"]


def test_loading_refuses_arbitrary_pickles(tmp_path):
    path = tmp_path / "rank_0.pt"
    torch.save({"meta": {}, "tensors": {}, "evil": multiprocessing.get_context}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        fmt.load_shard(path)


def test_latest_naming_a_missing_or_broken_checkpoint_is_an_error(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step_9\n")
    with pytest.raises(fmt.CheckpointError, match="has no manifest.json"):
        fmt.read_latest(root)
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(fmt.CheckpointError, match="not a step directory"):
        fmt.read_latest(root)
    (root / "step_9").mkdir()
    (root / "step_9" / "manifest.json").write_text("{not json")
    with pytest.raises(fmt.CheckpointError, match="not valid JSON"):
        fmt.read_manifest(root / "step_9")


@pytest.mark.parametrize(("dim0", "world"), [(5, 2), (1, 2), (7, 3), (8, 4), (0, 2)])
def test_chunk_bounds_match_torch_chunk(dim0, world):
    chunks = torch.chunk(torch.arange(dim0), world) if dim0 else ()
    for rank in range(world):
        offset, length = fmt.chunk_bounds(dim0, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(offset, offset + length)) == expected
