"""checkpoint_format.reader: DCP's chunks read straight into their targets, DCP's own read for the rest.

The restore path of every launcher restart and of validation: what it loads must be exactly what
DCP's own ``FileSystemReader`` loads, for our files and for DCP directories other tools wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from resilient_training.run import checkpoint_format as fmt
from resilient_training.runtime.checkpointing import state_dict
from tests.support.gates import TINY, train_state, write_checkpoint


@pytest.fixture
def dcp_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, LoadItemType]]:
    """(key, type) of every item that went through DCP's own ``read_data``."""
    seen: list[tuple[str, LoadItemType]] = []
    own = FileSystemReader.read_data

    def spy(self: Any, plan: Any, planner: Any) -> Any:
        seen.extend((item.dest_index.fqn, item.type) for item in plan.items)
        return own(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    return seen


def _dcp_own_load(state: dict[str, Any], path: Path) -> None:
    with pytest.warns(UserWarning):  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)


@pytest.mark.parametrize("threads", [1, 3], ids=["one-file-per-rank", "three-files-per-rank"])
def test_our_checkpoints_chunks_are_all_read_directly_and_load_what_dcp_loads(
        tmp_path: Path, dcp_reads: list[tuple[str, LoadItemType]], threads: int) -> None:
    # Three ranks' row chunks, loaded at world size 1: each chunk lands in its rows of the target.
    ckpt = write_checkpoint(tmp_path, step=3, world_size=3, threads=threads)
    fresh = [train_state(TINY, seed=9, steps=1) for _ in range(2)]
    ours, theirs = (state_dict(model, optimizer) for model, optimizer, _ in fresh)
    fmt.dcp_load(ours, ckpt, threads=4)
    assert all(kind == LoadItemType.BYTE_IO for _, kind in dcp_reads), dcp_reads  # no tensor went through DCP
    dcp_reads.clear()
    _dcp_own_load(theirs, ckpt)
    assert any(kind == LoadItemType.TENSOR for _, kind in dcp_reads)
    flat_ours, flat_theirs = fmt_flat(ours), fmt_flat(theirs)
    assert flat_ours.keys() == flat_theirs.keys()
    for key, value in flat_theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flat_ours[key], value), key
        else:
            assert flat_ours[key] == value, key
    trained, _, _ = train_state(TINY, seed=1234, steps=3)  # what was saved: not the fresh model's values
    assert torch.equal(ours["model"]["head.weight"], trained.head.weight.detach())


def fmt_flat(state: dict[str, Any]) -> dict[str, Any]:
    from resilient_training.runtime.checkpointing import flat_state

    tensors, objects = flat_state(state)
    return {**tensors, **objects}


def test_chunks_that_are_not_a_plain_byte_range_of_the_targets_dtype_go_through_dcp(
        tmp_path: Path, dcp_reads: list[tuple[str, LoadItemType]], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    saved = {
        "plain": torch.randn(40, 30),
        "transposed": torch.randn(30, 40).t(),  # stored with its strides: rows are not byte ranges
        "cast": torch.randn(5, 6),  # loaded into float64: DCP's copy converts
        "halves": torch.randn(7, 3).to(torch.bfloat16),
        "ints": torch.arange(300, dtype=torch.int64)[100:200],  # a view: DCP stores the 100 values
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "value": 7,
    }
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
    with monkeypatch.context() as patched:  # a file another machine wrote: the other byte order
        patched.setattr(sys, "byteorder", "big")
        dcp.save({"swapped": torch.arange(6, dtype=torch.float32)},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "swapped")), no_dist=True)

    def targets() -> dict[str, Any]:
        shaped = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}
        shaped["transposed"] = torch.zeros(40, 30)
        shaped["cast"] = torch.zeros(5, 6, dtype=torch.float64)
        return shaped

    ours, theirs = targets(), targets()
    fmt.dcp_load(ours, tmp_path / "plain")
    assert sorted(dcp_reads) == [("cast", LoadItemType.TENSOR), ("transposed", LoadItemType.TENSOR),
                                 ("value", LoadItemType.BYTE_IO)]
    _dcp_own_load(theirs, tmp_path / "plain")
    for key, value in saved.items():
        assert (torch.equal(ours[key], theirs[key]) if isinstance(value, torch.Tensor)
                else ours[key] == theirs[key] == value), key
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value.to(ours[key].dtype)), key

    dcp_reads.clear()
    swapped_ours, swapped_theirs = {"swapped": torch.zeros(6)}, {"swapped": torch.zeros(6)}
    fmt.dcp_load(swapped_ours, tmp_path / "swapped")
    assert dcp_reads == [("swapped", LoadItemType.TENSOR)]
    _dcp_own_load(swapped_theirs, tmp_path / "swapped")
    assert torch.equal(swapped_ours["swapped"], swapped_theirs["swapped"])
    assert not torch.equal(swapped_ours["swapped"], torch.arange(6, dtype=torch.float32))  # DCP swapped them


@pytest.mark.parametrize("cut", [100, 3000], ids=["last-chunk's-directory", "last-chunk's-data"])
def test_a_chunk_file_shorter_than_its_chunks_is_a_checkpoint_error(tmp_path: Path, cut: int) -> None:
    ckpt = write_checkpoint(tmp_path, step=3, world_size=2)
    shard = ckpt / "__1_0.distcp"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size - cut)  # each chunk is a zip archive: its directory comes last
    model, optimizer, _ = train_state(TINY, seed=9, steps=1)
    with pytest.raises(fmt.CheckpointError, match="failed reading zip archive"):
        fmt.dcp_load(state_dict(model, optimizer), ckpt)


def test_a_chunk_file_cut_after_it_was_placed_is_a_checkpoint_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The file shrinks between reading a chunk's layout and reading its bytes (another writer)."""
    from resilient_training.run import tensor_read

    ckpt = write_checkpoint(tmp_path, step=3, world_size=2)
    shard = ckpt / "__1_0.distcp"
    own = tensor_read._read_unit
    original = shard.read_bytes()

    def cut_then_read(path: Path, targets: Any, **kwargs: Any) -> None:
        if Path(path) == shard and shard.stat().st_size == len(original):  # placed: its bytes are read next
            with open(shard, "r+b") as handle:
                handle.truncate(len(original) // 2)
        own(path, targets, **kwargs)

    monkeypatch.setattr(tensor_read, "_read_unit", cut_then_read)
    for pipelined in (True, False):  # each file read as soon as it is placed, or after all are
        shard.write_bytes(original)
        model, optimizer, _ = train_state(TINY, seed=9, steps=1)
        with pytest.raises(fmt.CheckpointError, match="__1_0.distcp ends at byte .*shorter than its layout"):
            fmt.dcp_load(state_dict(model, optimizer), ckpt, pipelined=pipelined)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "every-layout-first"])
def test_a_files_bytes_are_read_while_another_files_layout_is_still_worked_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipelined: bool) -> None:
    """Placing a file's chunks is Python (a ``torch.load`` of each chunk's layout); reading bytes
    lets go of the GIL. Rank 1's file is held in its placement until rank 0's file is being read:
    only a reader that reads each file once it is placed gets there.
    """
    import threading

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from resilient_training.run import tensor_read

    ckpt = write_checkpoint(tmp_path, step=3, world_size=2)
    files = {index: info.relative_path for index, info in FileSystemReader(str(ckpt)).read_metadata().storage_data.items()}
    reading_rank0 = threading.Event()
    waited: list[bool] = []
    own_read, own_resolve = tensor_read._read_unit, DefaultLoadPlanner.resolve_tensor

    def read(path: Path, targets: Any, **kwargs: Any) -> None:
        if Path(path).name == "__0_0.distcp":
            reading_rank0.set()
        own_read(path, targets, **kwargs)

    def resolve(self: Any, item: Any) -> Any:
        if files[item.storage_index] == "__1_0.distcp" and not waited:
            waited.append(reading_rank0.wait(timeout=10 if pipelined else 1))
        return own_resolve(self, item)

    monkeypatch.setattr(tensor_read, "_read_unit", read)
    monkeypatch.setattr(DefaultLoadPlanner, "resolve_tensor", resolve)
    model, optimizer, _ = train_state(TINY, seed=9, steps=1)
    fmt.dcp_load(state_dict(model, optimizer), ckpt, threads=4, pipelined=pipelined)
    assert waited == [pipelined]
    trained, _, _ = train_state(TINY, seed=1234, steps=3)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_a_restore_from_files_reports_where_its_time_went(tmp_path: Path) -> None:
    """The restart profile's load parts: a killed 1.3B rank's load took 3.5-5.7 s on an H200 where
    reading its 16 GB took 1.5 s, so the load is split to show where the rest goes."""
    from resilient_training.run import config as cfg
    from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers

    ckpt = write_checkpoint(tmp_path, step=3, world_size=2)
    config = cfg.from_argv(["--run-dir", str(tmp_path)])
    checkpointer = Checkpointer(config, rank=0, world_size=1, tag="t", writer=None, staging=StagingBuffers(),
                                emit=lambda *a, **k: None)
    model, optimizer, _ = train_state(TINY, seed=9, steps=0)
    laps: list[str] = []
    source, _ = checkpointer.load(ckpt, fmt.read_manifest(ckpt), model, optimizer, lap=laps.append)
    assert source == "storage (resharded)" and laps == ["load_prepare", "load_read"]
    trained, _, _ = train_state(TINY, seed=1234, steps=3)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_a_cpu_has_no_read_buffers_to_make_ahead() -> None:
    from resilient_training.run import tensor_read

    # Page-locked buffers exist only for copies to a GPU (benchmarks/first_step.py ``buffers``
    # measures the GPU side); a CPU read goes straight into its targets.
    assert tensor_read.warm_buffers(torch.device("cpu"), 8) == ""
    assert tensor_read.warm_buffers(None, 8) == ""


@pytest.mark.parametrize("damage", ["cut", "deleted"])
def test_a_restart_into_a_damaged_checkpoint_names_the_damage_and_stops(tmp_path: Path, damage: str) -> None:
    """A stranger trial's truncated (or deleted) chunk file ended, after 19 restarts and 65 s, in
    "holds a different model": the restore now says the checkpoint is damaged, as a
    CheckpointRefused (the worker stops instead of restarting into it again)."""
    from resilient_training.run import config as cfg
    from resilient_training.runtime.checkpointing import Checkpointer, StagingBuffers

    ckpt = write_checkpoint(tmp_path, step=3, world_size=2)
    shard = ckpt / "__1_0.distcp"
    if damage == "cut":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        shard.unlink()
    checkpointer = Checkpointer(cfg.from_argv(["--run-dir", str(tmp_path)]), rank=0, world_size=1, tag="t",
                                writer=None, staging=StagingBuffers(), emit=lambda *a, **k: None)
    model, optimizer, _ = train_state(TINY, seed=9, steps=0)
    with pytest.raises(fmt.CheckpointRefused, match=f"{ckpt} is damaged or incomplete .*validate-checkpoint"):
        checkpointer.load(ckpt, fmt.read_manifest(ckpt), model, optimizer)


def test_a_worker_stops_for_good_on_a_checkpoint_it_must_not_restore() -> None:
    from resilient_training.runtime.trainer import retrying_cannot_help

    assert retrying_cannot_help(fmt.CheckpointRefused("step_3 is damaged or incomplete"))
    assert retrying_cannot_help(fmt.CheckpointError("run holds checkpoints of a different model"))
    assert not retrying_cannot_help(fmt.CheckpointError("cannot commit step 4: rank 1 reported no shard"))
    assert not retrying_cannot_help(RuntimeError("NCCL error"))
