"""The on-disk format: DCP directories with our manifest, the commit protocol, plain-torch readability."""

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.runtime.checkpointing import state_dict
from tests.support.gates import TINY, rank_jobs, train_state, write_checkpoint


def test_commit_writes_manifest_and_moves_latest(tmp_path):
    root = tmp_path / "checkpoints"
    assert fmt.read_latest(root) is None
    first = write_checkpoint(tmp_path, step=1, keep_last=2)
    assert fmt.read_latest(root) == first
    manifest = fmt.read_manifest(first)
    assert manifest["step"] == 1 and manifest["checksum_algorithm"] == "xxh3_128"
    assert manifest["format_version"] == 2 and manifest["world_size"] == 2
    # DCP's files, our manifest and the data state; no sidecars left
    assert sorted(os.listdir(first)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "data_rank_0.pt",
                                         "data_rank_1.pt", "manifest.json"]
    for name, entry in manifest["files"].items():
        assert fmt.checksum_file(first / name) == (entry["bytes"], entry["checksum"])
    # every chunk of a 2-rank save: rank 0 and rank 1 each hold their rows of the embedding
    assert [c["rank"] for c in manifest["tensors"]["model.tok.weight"]["chunks"]] == [0, 1]
    assert manifest["data_state"]["0"]["state"] == {"position": 4}
    write_checkpoint(tmp_path, step=2, keep_last=2, train_steps=1)
    write_checkpoint(tmp_path, step=3, keep_last=2, train_steps=1)
    assert fmt.committed_steps(root) == [2, 3]  # keep_last=2 pruned step 1
    assert fmt.read_latest(root).name == "step_3"


def test_prune_moves_a_step_aside_before_it_is_deleted(tmp_path):
    """A pruned step is renamed out of the step namespace at once (a deletion that is slow or
    interrupted never leaves a half-deleted directory that carries a step name and a manifest);
    deleting it is the remover's job, and what a remover left behind is handed over again.
    """
    from resilient_training.gates.validate import validate
    from resilient_training.runtime.checkpointing import Remover

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step=step, train_steps=1)
    handed = []
    fmt.prune(root, keep_last=1, remove=handed.append)  # a remover that never gets to it
    assert fmt.committed_steps(root) == [3] and fmt.read_latest(root).name == "step_3"
    assert sorted(p.name.rsplit("-", 1)[0] for p in handed) == [".tmp-pruned-step_1", ".tmp-pruned-step_2"]
    assert all((p / fmt.MANIFEST_NAME).is_file() for p in handed)  # still there: the remover did nothing
    report = validate(tmp_path, all_checkpoints=True, load=False)  # --all: the moved steps are not among them
    assert report.valid and [c.to_dict()["path"].split("/")[-1] for c in report.checkpoints] == ["step_3"]
    assert {i["path"].split("/")[-1] for i in report.ignored} >= {p.name for p in handed}
    again = []
    fmt.prune(root, keep_last=1, remove=again.append)
    assert sorted(again) == sorted(handed)
    remover = Remover()
    for path in handed + handed:  # each deleted once, off this thread
        remover(path)
    remover.wait()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3"]


def test_a_step_directory_is_a_plain_dcp_checkpoint(tmp_path):
    """dcp_to_torch_save, torch alone, gives the task's plain state dicts: full tensors, same keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, optimizer, _ = train_state(TINY, seed=1234, steps=3)
    ckpt = write_checkpoint(tmp_path, step=3, world_size=3, state=state_dict(model, optimizer))
    dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    plain = torch.load(tmp_path / "out.pt", weights_only=True)
    expected = model.state_dict()
    assert set(plain["model"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(plain["model"][name], tensor), name
    exp_avg = optimizer.state[model.head.weight]["exp_avg"]
    assert torch.equal(plain["optim"]["state"]["head.weight"]["exp_avg"], exp_avg)


def test_a_save_that_never_committed_is_invisible(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(tmp_path, step=5, train_steps=1)
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    tmp = root / ".tmp-step_10-x"
    tmp.mkdir()
    job = rank_jobs(state_dict(model, optimizer), world_size=2, step=10, data_state=data.state_dict())[0]
    fmt.write_rank(tmp, 0, job)  # rank 1 never finished
    with pytest.raises(fmt.CheckpointError, match="rank 1 reported no shard"):
        fmt.commit(tmp, step=10, world_size=2, manifest_fields={})
    assert fmt.read_latest(root).name == "step_5"
    assert fmt.committed_steps(root) == [5]


def _torn_writer(tmp_dir: str) -> None:
    model, optimizer, data = train_state(TINY, seed=1, steps=1)
    job = rank_jobs(state_dict(model, optimizer), world_size=1, step=3, data_state=data.state_dict())[0]
    fmt.write_rank(tmp_dir, 0, job, torn_write=True)


def test_a_write_killed_midway_leaves_only_a_partial_file(tmp_path):
    tmp = tmp_path / ".tmp-step_3-k"
    tmp.mkdir()
    proc = multiprocessing.get_context("spawn").Process(target=_torn_writer, args=(str(tmp),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9  # SIGKILL, as the ckpt-kill / writer-kill faults do
    assert [p.name for p in tmp.iterdir()] == ["__0_0.distcp.partial"]


def test_data_state_loading_refuses_arbitrary_pickles(tmp_path):
    torch.save({"position": 1, "evil": multiprocessing.get_context}, tmp_path / fmt.data_name(0))
    with pytest.raises(Exception, match="Weights only load failed"):
        fmt.load_data_state(tmp_path, 0)


def test_a_checkpoint_of_the_old_format_is_refused_with_one_sentence(tmp_path):
    with pytest.raises(fmt.CheckpointError, match="format 1; this version reads format 2 .* Start a new run"):
        fmt.require_format({"format_version": 1}, tmp_path)


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


def test_training_into_a_run_of_the_old_format_is_refused_before_anything_starts(tmp_path):
    import json
    import subprocess
    import sys

    step = tmp_path / "run" / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format_version": 1, "step": 5, "world_size": 2}))
    (step.parent / "latest").write_text("step_5\n")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is in checkpoint format 1; this version reads format 2 (PyTorch DCP directories) only" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # nothing written


def test_stale_writes_are_earlier_rounds_uncommitted_saves_only(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step_8", ".tmp-step_12-aaaa0000i0", ".tmp-step_12-aaaa0000i3", ".tmp-step_16-bbbb1111i0",
                 ".tmp-replaced-step_4-77", ".tmp-pruned-step_4-1234abcd"):
        (root / name).mkdir(parents=True)
    # `latest`'s temporary file of a commit killed before its rename (seen in CI: left behind after a
    # ckpt-kill round); callers ask once this root's commits are settled, so no process renames it.
    (root / ".tmp-latest.99").write_text("step_8\n")
    (root / ".tmp-latest.x").write_text("step_8\n")  # not the atomic writer's name: not ours to remove
    (root / ".tmp-latest.5").mkdir()  # a directory of that name is no temporary `latest`
    (root / ".tmp-latest.6").symlink_to(tmp_path / "elsewhere")  # nor is a link (its target is not ours)
    # This round's (aaaa0000: an in-process restart's abandoned write is still written) stay; the
    # pruned one is prune's; a committed step is never touched.
    assert [p.name for p in fmt.stale_writes(root, live_tag_prefix="aaaa0000i")] == [
        ".tmp-latest.99", ".tmp-replaced-step_4-77", ".tmp-step_16-bbbb1111i0"]
    assert fmt.stale_writes(root, live_tag_prefix="") == []


def test_earlier_iterations_are_this_rounds_older_saves_only(tmp_path):
    """What a commit may remove: saves that earlier in-process iterations of its round abandoned;
    never a later iteration's (possibly being written) nor another round's."""
    for tag in ("ab12i0", "ab12i1", "ab12i2", "ab12i10", "cd34i0"):
        (tmp_path / fmt.write_dirname(4, tag)).mkdir()
    (tmp_path / f"{fmt.TMP_PREFIX}replaced-step_4").mkdir()
    (tmp_path / "step_4").mkdir()
    names = [p.name.rpartition("-")[2] for p in fmt.earlier_iterations(tmp_path, "ab12i2")]
    assert names == ["ab12i0", "ab12i1"]
    assert fmt.earlier_iterations(tmp_path, "ab12i0") == []
    assert fmt.earlier_iterations(tmp_path, "no-iteration") == []


@pytest.mark.parametrize(("name", "step"), [("step_40", 40), ("step_0", 0), ("step_040", None),
                                            ("step_\u0664\u0660", None), ("step_+4", None), ("step_4 ", None)])
def test_a_step_directory_is_named_exactly_as_step_dirname_names_it(name, step):
    """Stranger trial: `latest` -> step_040 (or Arabic-Indic digits) passed validate, convergence and
    promote, while `validate --all` found no step_40: one name per step, then."""
    assert fmt.parse_step_dirname(name) == step
    if step is not None:
        assert fmt.step_dirname(step) == name
