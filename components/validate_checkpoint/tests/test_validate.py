"""Integrity validation on real checkpoints: a corruption gallery and no false alarms."""

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from resilient_training.gates.validate import UsageError, validate
from resilient_training.run import checkpoint_format as cf
from resilient_training.run import gate_records
from tests.support.gates import (
    chunk_entry,
    copy_run,
    forge_commit_record,
    record_file,
    rewrite_chunk,
    rewrite_manifest,
    rewrite_metadata,
    save_bytes,
)

STEP4 = Path("checkpoints/step_4")
R0, R1 = cf.shard_name(0), cf.shard_name(1)  # __0_0.distcp, __1_0.distcp
FIRST = "model.blocks.0.fc.bias"  # the first tensor (sorted by name) with a chunk in rank 1's file


@dataclasses.dataclass(frozen=True)
class Target:
    """A private copy of a run to corrupt: its latest checkpoint and an older one."""

    run: Path
    ckpt: Path  # the checkpoint `latest` names
    other: Path  # an older committed checkpoint

    @property
    def rel(self) -> str:
        return str(self.ckpt.relative_to(self.run))


class NotATensor:
    """Pickled by reference: weights_only loading must refuse it."""


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def set_value(value: float, index: int = 0) -> Callable[[object], None]:
    def edit(tensor) -> None:
        tensor.view(-1)[index] = value

    return edit


def drop_entries(t: Target, *prefixes: str) -> None:
    """Remove every entry whose name starts with one of ``prefixes`` from manifest and .metadata
    consistently (a forgery).
    """
    prefix = tuple(prefixes)
    def edit_metadata(md) -> None:
        for fqn in [k for k in md.state_dict_metadata if k.startswith(prefix)]:
            del md.state_dict_metadata[fqn]
        md.storage_data = {k: v for k, v in md.storage_data.items() if not k.fqn.startswith(prefix)}

    def edit_manifest(m: dict) -> None:
        m["tensors"] = {k: v for k, v in m["tensors"].items() if not k.startswith(prefix)}

    rewrite_metadata(t.ckpt, edit_metadata)
    rewrite_manifest(t.ckpt, edit_manifest)


def forge_without_rank_1(t: Target) -> None:
    """Issue #14's attack: delete rank 1's files, then rewrite manifest and .metadata as a
    consistent 1-rank checkpoint of what is left (every remaining byte and checksum is right).
    """
    (t.ckpt / R1).unlink()
    (t.ckpt / cf.data_name(1)).unlink()

    def edit_metadata(md) -> None:
        for meta in md.state_dict_metadata.values():
            if hasattr(meta, "chunks"):
                kept = [c for c in meta.chunks if md.storage_data[_index(md, c)].relative_path != R1]
                meta.chunks[:] = kept
        md.storage_data = {k: v for k, v in md.storage_data.items() if v.relative_path != R1}

    def edit_manifest(m: dict) -> None:
        m["world_size"] = 1
        for name in (R1, cf.data_name(1)):
            m["files"].pop(name)
        for entry in m["tensors"].values():
            entry["chunks"] = [c for c in entry["chunks"] if c["rank"] != 1]
        m["data_state"].pop("1")

    rewrite_metadata(t.ckpt, edit_metadata)
    rewrite_manifest(t.ckpt, edit_manifest)


def _index(md, chunk):
    return next(k for k in md.storage_data if k.offset == chunk.offsets and md.state_dict_metadata.get(k.fqn) is not None
                and chunk in getattr(md.state_dict_metadata[k.fqn], "chunks", []))


def halve_chunk(t: Target, fqn: str = "model.tok.weight") -> None:
    """A consistent manifest over a truncated chunk: rank 1's rows of ``fqn`` cut to half, the file,
    .metadata and manifest all rewritten to match (sizes, offsets, lengths, checksums).
    """
    import io

    import torch

    entry = chunk_entry(t.ckpt, fqn, 1)
    data = (t.ckpt / entry["file"]).read_bytes()
    tensor = torch.load(io.BytesIO(data[entry["offset"]:entry["offset"] + entry["length"]]), weights_only=True)
    half = tensor[: tensor.shape[0] // 2].clone()
    blob = io.BytesIO()
    torch.save(half, blob)
    new = blob.getvalue()
    # Appended at the end of the file: every other chunk keeps its offset.
    save_bytes(data + new, t.ckpt / entry["file"])
    sizes = [half.shape[0], *entry["sizes"][1:]]

    def edit_metadata(md) -> None:
        for chunk in md.state_dict_metadata[fqn].chunks:
            if list(chunk.offsets) == entry["offsets"]:
                chunk.sizes = torch.Size(sizes)
        for index, info in md.storage_data.items():
            if index.fqn == fqn and list(index.offset) == entry["offsets"]:
                info.offset, info.length = len(data), len(new)

    def edit_manifest(m: dict) -> None:
        for chunk in m["tensors"][fqn]["chunks"]:
            if chunk["rank"] == 1:
                chunk.update(sizes=sizes, offset=len(data), length=len(new), checksum=cf.tensor_checksum(half))

    rewrite_metadata(t.ckpt, edit_metadata)
    rewrite_manifest(t.ckpt, edit_manifest)
    record_file(t.ckpt, entry["file"])


def overlap_chunk(t: Target, fqn: str = "model.head.weight") -> None:
    """Rank 1's chunk of ``fqn`` claims to start one row early (manifest and .metadata agree): it
    overlaps rank 0's rows and the last row is in no file.
    """
    second = chunk_entry(t.ckpt, fqn, 1)
    moved = [second["offsets"][0] - 1, *second["offsets"][1:]]

    def edit_metadata(md) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for chunk in md.state_dict_metadata[fqn].chunks:
            if list(chunk.offsets) == second["offsets"]:
                chunk.offsets = torch.Size(moved)
        for index in [k for k in md.storage_data if k.fqn == fqn and list(k.offset) == second["offsets"]]:
            md.storage_data[MetadataIndex(fqn, torch.Size(moved))] = md.storage_data.pop(index)

    def edit_manifest(m: dict) -> None:
        for chunk in m["tensors"][fqn]["chunks"]:
            if chunk["rank"] == 1:
                chunk.update(offsets=moved)

    rewrite_metadata(t.ckpt, edit_metadata)
    rewrite_manifest(t.ckpt, edit_manifest)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/rt-validate-pwned",))


def evil_metadata(t: Target) -> None:
    import pickle

    (t.ckpt / cf.METADATA_NAME).write_bytes(pickle.dumps({"state_dict_metadata": _Evil()}))
    record_file(t.ckpt, cf.METADATA_NAME)


def step_behind(manifest: dict) -> None:
    manifest["optimizer_step"] = manifest["step"] - 1


def shard_from_other_step(t: Target) -> None:
    shutil.copy(t.other / R1, t.ckpt / R1)
    record_file(t.ckpt, R1)


def write_random(t: Target) -> None:
    (t.ckpt / R1).write_bytes(os.urandom((t.ckpt / R1).stat().st_size))
    record_file(t.ckpt, R1)


def pickle_object_as_data_state(t: Target) -> None:
    import torch

    torch.save({"position": NotATensor()}, t.ckpt / cf.data_name(1))
    record_file(t.ckpt, cf.data_name(1))


def truncate(t: Target) -> None:
    os.truncate(t.ckpt / R0, (t.ckpt / R0).stat().st_size // 2)


def log_commit_as(t: Target, world_size: int) -> None:
    from tests.support.gates import log_commit

    log_commit(t.run, cf.read_manifest(t.ckpt)["step"], world_size)


# id -> (corrupt(target), [(code, file, tensor or None), ...]): exactly these findings.
# In file names "{ckpt}" stands for the checkpoint `latest` names, relative to the run.
GALLERY: dict[str, tuple[Callable[[Target], object], list[tuple[str, str, str | None]]]] = {
    "shard-deleted": (lambda t: (t.ckpt / R1).unlink(), [("shard_missing", f"{{ckpt}}/{R1}", None)]),
    "shard-truncated": (truncate, [("size_mismatch", f"{{ckpt}}/{R0}", None)]),
    "bit-flip": (lambda t: flip_byte(t.ckpt / R1), [("checksum_mismatch", f"{{ckpt}}/{R1}", None)]),
    "metadata-bit-flip": (lambda t: flip_byte(t.ckpt / cf.METADATA_NAME),
                          [("checksum_mismatch", "{ckpt}/.metadata", None)]),
    "data-state-deleted": (lambda t: (t.ckpt / cf.data_name(0)).unlink(),
                           [("shard_missing", "{ckpt}/data_rank_0.pt", None)]),
    "manifest-not-json": (lambda t: (t.ckpt / "manifest.json").write_text('{"step": 4, "files": '),
                          [("manifest_invalid", "{ckpt}/manifest.json", None)]),
    "manifest-deleted": (lambda t: (t.ckpt / "manifest.json").unlink(), [("latest_uncommitted", "{ckpt}", None)]),
    "latest-dangling": (lambda t: (t.run / "checkpoints/latest").write_text("step_99\n"),
                        [("latest_dangling", "checkpoints/latest", None)]),
    "latest-garbage": (lambda t: (t.run / "checkpoints/latest").write_bytes(b"\x00\xffgarbage"),
                       [("latest_invalid", "checkpoints/latest", None)]),
    "unknown-file": (lambda t: (t.ckpt / "notes.txt").write_text("hi"),
                     [("unexpected_file", "{ckpt}/notes.txt", None)]),
    "partial-inside-commit": (lambda t: shutil.copy(t.ckpt / R0, t.ckpt / (R0 + ".partial")),
                              [("unexpected_file", f"{{ckpt}}/{R0}.partial", None)]),
    "shard-from-other-step": (shard_from_other_step, [("tensor_checksum_mismatch", f"{{ckpt}}/{R1}",
                                                       FIRST)]),
    "nan-saved": (lambda t: rewrite_chunk(t.ckpt, "model.blocks.0.fc.weight", 0, set_value(float("nan"))),
                  [("non_finite", f"{{ckpt}}/{R0}", "model.blocks.0.fc.weight")]),
    "inf-in-optimizer": (lambda t: rewrite_chunk(t.ckpt, "optim.state.pos.weight.exp_avg", 1, set_value(float("inf"))),
                         [("non_finite", f"{{ckpt}}/{R1}", "optim.state.pos.weight.exp_avg")]),
    "values-altered-checksum-rewritten": (
        lambda t: rewrite_chunk(t.ckpt, "model.head.weight", 1, set_value(0.5), rerecord="file"),
        [("tensor_checksum_mismatch", f"{{ckpt}}/{R1}", "model.head.weight")]),
    "manifest-optimizer-step-behind": (lambda t: rewrite_manifest(t.ckpt, step_behind),
                                       [("optimizer_step_mismatch", "{ckpt}/manifest.json", None)]),
    "data-position-behind": (lambda t: rewrite_manifest(t.ckpt, lambda m: m.update(data_position=2)),
                             [("data_position_mismatch", "{ckpt}/manifest.json", None)]),
    "not-a-pickle": (write_random, [("chunk_unreadable", f"{{ckpt}}/{R1}", FIRST)]),
    "arbitrary-object-as-data-state": (pickle_object_as_data_state,
                                       [("data_state_invalid", "{ckpt}/data_rank_1.pt", None)]),
    "arbitrary-code-in-metadata": (evil_metadata, [("metadata_invalid", "{ckpt}/.metadata", None)]),
    "parameter-missing": (lambda t: drop_entries(t, "model.head.weight", "optim.state.head.weight."),
                          [("load_failed", "{ckpt}/manifest.json", None)]),
    "optimizer-state-orphaned": (lambda t: drop_entries(t, "model.head.weight"), [
        ("optimizer_state_mismatch", "{ckpt}/.metadata", "optim.state.head.weight.exp_avg")]),
    "optimizer-state-missing": (lambda t: drop_entries(t, "optim.state.ln_f.bias.exp_avg_sq"),
                                [("load_failed", "{ckpt}/manifest.json", None)]),
    "manifest-shape-wrong": (
        lambda t: rewrite_manifest(t.ckpt, lambda m: m["tensors"]["model.ln_f.bias"].update(size=[3])),
        [("metadata_mismatch", "{ckpt}/.metadata", "model.ln_f.bias")]),
    # Issue #14: one rank's files deleted, manifest and .metadata rewritten consistently.
    "rank-deleted-manifest-rewritten": (forge_without_rank_1, [
        ("coverage_incomplete", "{ckpt}/.metadata", FIRST),
        ("world_size_mismatch", "{ckpt}/manifest.json", None)]),
    # ... and the event log forged too: coverage alone still proves the model incomplete.
    "rank-deleted-log-forged": (lambda t: (forge_without_rank_1(t), log_commit_as(t, 1)), [
        ("coverage_incomplete", "{ckpt}/.metadata", FIRST)]),
    "chunk-truncated-consistently": (halve_chunk, [("coverage_incomplete", "{ckpt}/.metadata", "model.tok.weight")]),
    "chunks-overlap-consistently": (overlap_chunk, [("coverage_invalid", "{ckpt}/.metadata", "model.head.weight")]),
    "world-size-shrunk": (lambda t: rewrite_manifest(t.ckpt, lambda m: m.update(world_size=1)), [
        ("manifest_incomplete", "{ckpt}/manifest.json", None),
        ("manifest_incomplete", "{ckpt}/manifest.json", None),
        ("unexpected_file", f"{{ckpt}}/{R1}", None),
        ("unexpected_file", "{ckpt}/data_rank_1.pt", None),
        ("world_size_mismatch", "{ckpt}/manifest.json", None),
        ("chunk_unreadable", "{ckpt}/manifest.json", FIRST),
        ("data_state_invalid", "{ckpt}/manifest.json", None)]),
}


def test_gallery_is_large_and_distinct() -> None:
    assert len(GALLERY) >= 10
    assert len({expected[0][0] for _, expected in GALLERY.values()}) >= 15


@pytest.fixture(params=["synthetic", "trainer"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """A private copy of a synthetic run, or of a real faulted trainer run (latest step_30, older step_25)."""
    if request.param == "synthetic":
        run = copy_run(request.getfixturevalue("synthetic_run"), tmp_path / "run")
        return Target(run, run / "checkpoints/step_4", run / "checkpoints/step_2")
    run = copy_run(request.getfixturevalue("trainer_runs") / "faulted", tmp_path / "run")
    return Target(run, run / "checkpoints/step_30", run / "checkpoints/step_25")


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_corruption_is_caught_with_the_right_finding(name: str, target: Target) -> None:
    corrupt, expected = GALLERY[name]
    assert validate(target.run).valid, "fixture must start healthy"
    corrupt(target)
    forge_commit_record(target.ckpt)  # each check below the commit record holds on its own
    report = validate(target.run)
    assert not report.valid
    got = sorted((f.code, f.file, f.tensor) for f in report.all_findings)
    want = sorted((code, file.format(ckpt=target.rel), tensor) for code, file, tensor in expected)
    assert got == want, [str(f) for f in report.all_findings]


def test_a_metadata_pickle_that_runs_a_command_is_refused_not_run(run_copy: Path, tmp_path: Path) -> None:
    marker = Path("/tmp/rt-validate-pwned")
    marker.unlink(missing_ok=True)
    evil_metadata(Target(run_copy, run_copy / STEP4, run_copy / "checkpoints/step_2"))
    forge_commit_record(run_copy / STEP4)
    report = validate(run_copy)
    assert [f.code for f in report.all_findings] == ["metadata_invalid"]
    assert "posix.system is not part of DCP metadata" in report.all_findings[0].message
    assert not marker.exists()


class _Reader:
    def __reduce__(self):
        from torch.distributed.checkpoint import FileSystemReader

        return (FileSystemReader, ("/",))


def test_metadata_naming_a_dcp_class_that_is_no_metadata_is_refused(run_copy: Path) -> None:
    import pickle

    (run_copy / STEP4 / cf.METADATA_NAME).write_bytes(pickle.dumps({"x": _Reader()}))
    record_file(run_copy / STEP4, cf.METADATA_NAME)
    forge_commit_record(run_copy / STEP4)
    report = validate(run_copy)
    assert [f.code for f in report.all_findings] == ["metadata_invalid"]
    assert "FileSystemReader is not part of DCP metadata" in report.all_findings[0].message


def test_a_task_that_cannot_be_imported_here_is_a_finding_not_a_skip(run_copy: Path) -> None:
    rewrite_manifest(run_copy / STEP4, lambda m: m.update(task="team_a.not_installed_here:task"))
    forge_commit_record(run_copy / STEP4)
    report = validate(run_copy)
    assert [f.code for f in report.all_findings] == ["load_failed"]
    assert "the run's task builds no model here: task module team_a.not_installed_here failed to import" in \
        report.all_findings[0].message


def test_a_checkpoint_swapped_in_from_another_run_is_not_the_one_this_run_committed(
        synthetic_run: Path, tmp_path: Path) -> None:
    """Every byte and checksum of the other run's checkpoint is right: only this run's event log
    says it is not the checkpoint this run committed at that step.
    """
    from tests.support.gates import TINY, write_checkpoint

    other = tmp_path / "other"
    write_checkpoint(other, cfg=TINY, step=4, seed=999, world_size=2)
    assert validate(other).valid
    run = copy_run(synthetic_run, tmp_path / "run")
    shutil.rmtree(run / STEP4)
    shutil.copytree(other / STEP4, run / STEP4)
    report = validate(run)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    assert "this is not the checkpoint the run saved" in report.all_findings[0].message


def _first(entries: dict) -> str:
    return sorted(entries)[0]


@pytest.mark.parametrize(("edit", "said"), [
    (lambda m: m["tensors"].update({_first(m["tensors"]): "x"}), "is a str, not an object"),
    (lambda m: m["tensors"][_first(m["tensors"])].update(chunks=["x"]), "has chunks that are not a list of objects"),
    (lambda m: m["tensors"][_first(m["tensors"])].update(chunks=5), "has chunks that are not a list of objects"),
    (lambda m: m["tensors"][_first(m["tensors"])]["chunks"][0].update(offsets="0"), "has chunks that are not"),
    (lambda m: m["tensors"][_first(m["tensors"])].update(size=None), "lacks its size"),
    (lambda m: m["objects"].update({_first(m["objects"]): "x"}), "objects entry"),
    (lambda m: m["objects"][_first(m["objects"])].update(length=True), "lacks its file, offset or length"),
    (lambda m: m.update(world_size=10**12), "world_size 1000000000000 but it lists"),
    (lambda m: m.update(world_size=10**6), "every rank holds at least its data state"),
    # A third stranger trial: past 2**63 (a C ssize_t) the world size was an OverflowError traceback.
    (lambda m: m.update(world_size=10**30), f"world_size {10**30} but it lists"),
    (lambda m: m.update(world_size=2**63), f"world_size {2**63} but it lists"),
    (lambda m: m.update(step=10**30), f"step {10**30} is not an integer from 0 to"),
    (lambda m: m.update(step=-1), "step -1 is not an integer from 0 to"),
    (lambda m: m.update(step="4"), "step '4' is not an integer from 0 to"),
    (lambda m: m.update(seed=10**30), "is not an integer torch takes as a seed"),
    (lambda m: m.update(seed=None), "seed None is not an integer torch takes as a seed"),
    (lambda m: m["files"].update({"__" + "1" * 5000 + "_0.distcp": {"bytes": 1, "checksum": "0", "rank": 0}}),
     "lists a file name of 5011 bytes"),
], ids=["tensor-str", "chunk-str", "chunks-int", "offsets-str", "size-none", "object-str", "length-bool",
        "world-1e12", "world-1e6", "world-1e30", "world-2**63", "step-1e30", "step-negative", "step-str",
        "seed-1e30", "seed-none", "name-5000-digits"])
def test_a_manifest_of_the_wrong_shape_is_one_finding_not_a_traceback(run_copy: Path, edit, said: str) -> None:
    """Found by a stranger trial: a string in place of a tensor's entry or chunk was an
    AttributeError or TypeError, a world size of 10**12 a MemoryError, 10**6 two million findings."""
    rewrite_manifest(run_copy / STEP4, edit)
    report = validate(run_copy)
    assert [(f.code, f.file) for f in report.all_findings] == [("manifest_invalid", "checkpoints/step_4/manifest.json")]
    assert said in report.all_findings[0].message, report.all_findings[0].message


@pytest.mark.parametrize("key", ["world_size", "step", "seed"])
def test_an_integer_past_python_s_digit_limit_in_a_manifest_is_one_finding(run_copy: Path, key: str) -> None:
    """json.loads refuses an integer of more than 4300 digits with a ValueError that is no
    JSONDecodeError: it was a traceback (exit 1), as 10**30 ranks were."""
    import re

    path = run_copy / STEP4 / cf.MANIFEST_NAME
    text, count = re.subn(rf'"{key}": -?\d+\b', f'"{key}": {"9" * 5000}', path.read_text())
    assert count == 1
    path.write_text(text)
    report = validate(run_copy)
    assert [(f.code, f.file) for f in report.all_findings] == [("manifest_invalid", "checkpoints/step_4/manifest.json")]
    assert "not valid JSON: Exceeds the limit (4300 digits)" in report.all_findings[0].message


@pytest.mark.parametrize("seed", [10**30, -(2**63) - 1, None, "7"], ids=repr)
def test_a_seed_torch_cannot_take_is_a_finding_even_with_the_commit_logged(run_copy: Path, seed) -> None:
    """The load seeds torch with the manifest's seed: 10**30 was a ValueError traceback (and None a
    TypeError) once the rest of the manifest held, its commit logged; "7" was taken for 7."""
    rewrite_manifest(run_copy / STEP4, lambda m: m.update(seed=seed))
    forge_commit_record(run_copy / STEP4)
    report = validate(run_copy)
    assert [(f.code, f.file) for f in report.all_findings] == [("manifest_invalid", "checkpoints/step_4/manifest.json")]
    assert f"seed {seed!r} is not an integer torch takes as a seed" in report.all_findings[0].message


def test_a_world_size_of_ten_to_the_thirty_is_a_finding_on_the_command_line(run_copy: Path, capsys) -> None:
    """The stranger's command: `validate-checkpoint RUN` exited 1 with an OverflowError traceback."""
    from resilient_training.cli.main import main

    rewrite_manifest(run_copy / STEP4, lambda m: m.update(world_size=10**30))
    assert main(["validate-checkpoint", str(run_copy), "--no-record"]) == 1
    out, err = capsys.readouterr()
    assert f"FINDING manifest_invalid: checkpoints/step_4/manifest.json: world_size {10**30} but it lists" in out
    assert "Traceback" not in out + err, err


def test_a_checkpoint_saved_by_another_run_is_not_this_runs_even_with_its_commit_logged(
        synthetic_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial (promote's attack): another run's step copied in. With the run's
    event log logging that manifest's commit too, the manifest's run_uid still names the other run
    (what `train` refuses to resume): one finding, as the commit's."""
    from tests.support.gates import TINY, write_checkpoint

    other = tmp_path / "other"
    write_checkpoint(other, cfg=TINY, step=4, seed=999, world_size=2)
    run = copy_run(synthetic_run, tmp_path / "run")
    shutil.rmtree(run / STEP4)
    shutil.copytree(other / STEP4, run / STEP4)
    forge_commit_record(run / STEP4)
    report = validate(run, load=False)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    theirs, ours = cf.read_run_uid(other), cf.read_run_uid(run)
    assert f"the checkpoint was saved by another run (run uid {theirs!r}, this run's {ours!r})" in \
        report.all_findings[0].message
    (run / cf.RUN_UID_FILENAME).unlink()  # the run's own lost: cannot tell, and says so
    findings = validate(run, load=False).all_findings
    assert [(f.code, f.message.split(" (")[0]) for f in findings] == [
        ("commit_unverified", f"the checkpoint names run uid {theirs!r}, but {run / cf.RUN_UID_FILENAME} is missing "
                              "or empty")]
    shutil.copy(other / cf.RUN_UID_FILENAME, run / cf.RUN_UID_FILENAME)  # a copy of the whole run keeps it
    assert validate(run, load=False).valid


def test_a_swapped_in_checkpoint_marked_node_local_is_still_not_this_runs(synthetic_run: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: ``"ranks"`` added to the swapped-in manifest (what a node-local
    tier checkpoint has) switched the event-log check off; the step was VALID, passed convergence
    and was promoted. A run commits only full checkpoints under checkpoints/."""
    from tests.support.gates import TINY, rewrite_manifest, write_checkpoint

    other = tmp_path / "other"
    write_checkpoint(other, cfg=TINY, step=4, seed=999, world_size=2)
    run = copy_run(synthetic_run, tmp_path / "run")
    shutil.rmtree(run / STEP4)
    shutil.copytree(other / STEP4, run / STEP4)
    rewrite_manifest(run / STEP4, lambda m: m.update(ranks=[0, 1]))
    report = validate(run)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    assert "lists ranks [0, 1]" in report.all_findings[0].message
    # Outside a run, as the node-local tier keeps it: checked on its own, as before.
    rewrite_manifest(other / STEP4, lambda m: m.update(ranks=[0, 1]))
    shutil.copytree(other / STEP4, tmp_path / "local" / "step_4")
    assert validate(tmp_path / "local" / "step_4").valid


@pytest.mark.parametrize("link", ["step", "checkpoints"])
def test_a_link_to_another_runs_checkpoint_is_not_this_runs(synthetic_run: Path, tmp_path: Path, link: str) -> None:
    """Found by a stranger trial: ``step_N`` replaced by a symbolic link to another run's was VALID,
    judged by the *target's* event log (the run was taken from where the link led)."""
    from tests.support.gates import TINY, write_checkpoint

    other = tmp_path / "other"
    write_checkpoint(other, cfg=TINY, step=4, seed=999, world_size=2)
    run = copy_run(synthetic_run, tmp_path / "run")
    if link == "step":
        shutil.rmtree(run / STEP4)
        (run / STEP4).symlink_to(other / STEP4, target_is_directory=True)
        expected = [("not_a_regular_file", "checkpoints/step_4"),
                    ("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    else:
        shutil.rmtree(run / "checkpoints")
        (run / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
        expected = [("not_committed_by_run", "checkpoints/step_4/manifest.json")]
    report = validate(run, load=False)
    assert [(f.code, f.file) for f in report.all_findings] == expected
    from resilient_training.gates.validate import write_validation_record

    write_validation_record(run, report)  # recorded in the run named, not in the link's target
    assert not (other / "gates").exists() and (run / "gates" / "validation.json").is_file()


def test_checkpoints_kept_elsewhere_behind_a_link_are_still_the_runs(synthetic_run: Path, tmp_path: Path) -> None:
    """A run whose checkpoints/ is a link to another volume (its own checkpoints moved there) validates."""
    run = copy_run(synthetic_run, tmp_path / "run")
    (run / "checkpoints").rename(tmp_path / "fast-volume")
    (run / "checkpoints").symlink_to(tmp_path / "fast-volume", target_is_directory=True)
    report = validate(run, load=False)
    assert report.valid
    from resilient_training.gates.validate import write_validation_record

    write_validation_record(run, report)  # under the name promotion looks for, not ../fast-volume/...
    record = json.loads((run / "gates" / "validation.json").read_text())
    assert list(record["checkpoints"]) == ["checkpoints/step_4"]
    assert record["checkpoints"]["checkpoints/step_4"]["run_id"]  # never null


def test_values_rewritten_with_every_checksum_re_recorded_are_not_the_committed_checkpoint(run_copy: Path) -> None:
    rewrite_chunk(run_copy / STEP4, "model.head.weight", 1, set_value(0.5), rerecord="all")
    report = validate(run_copy)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_committed_by_run", "checkpoints/step_4/manifest.json")]


def test_a_commit_logged_without_its_manifest_digest_is_a_finding_not_a_pass(run_copy: Path) -> None:
    import re

    log = run_copy / "events" / "rank0.jsonl"
    log.write_text(re.sub(r',"manifest_checksum":"[0-9a-f]+"', "", log.read_text()))
    report = validate(run_copy)
    assert [f.code for f in report.all_findings] == ["commit_unverified"]


def test_a_step_whose_commit_never_reached_the_log_is_refused(run_copy: Path) -> None:
    # Rank 0 killed between the rename that made step_4 restorable and its ckpt_committed line.
    log = run_copy / "events" / "rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not ('"ckpt_committed"' in line and '"step":4,' in line)]
    assert len(kept) == len(lines) - 1
    log.write_text("".join(kept))
    report = validate(run_copy)
    assert not report.valid
    assert [f.code for f in report.all_findings] == ["world_size_unverified"]
    assert "records no commit of step 4" in report.all_findings[0].message


def test_a_file_replaced_by_a_symlink_to_identical_bytes_outside_the_run_is_refused(run_copy: Path,
                                                                                     tmp_path: Path) -> None:
    outside = tmp_path / "outside.distcp"
    shutil.copy(run_copy / STEP4 / R1, outside)
    (run_copy / STEP4 / R1).unlink()
    (run_copy / STEP4 / R1).symlink_to(outside)
    report = validate(run_copy)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_a_regular_file", f"checkpoints/step_4/{R1}")]
    (run_copy / STEP4 / R1).unlink()
    shutil.copy(outside, run_copy / STEP4 / R1)
    shutil.move(run_copy / STEP4 / "manifest.json", tmp_path / "manifest.json")
    (run_copy / STEP4 / "manifest.json").symlink_to(tmp_path / "manifest.json")
    assert [f.code for f in validate(run_copy).all_findings] == ["not_a_regular_file"]


def test_an_event_log_with_a_line_that_is_no_event_witnesses_nothing(run_copy: Path) -> None:
    with open(run_copy / "events" / "rank0.jsonl", "a") as log:
        log.write('{"ts": 1, "rank": 0, "attempt": 0, "event": "step", "step": 3, "loss": [0.1]}\n')
    report = validate(run_copy)
    assert [f.code for f in report.all_findings] == ["world_size_unverified"]
    assert "rank0.jsonl:" in report.all_findings[0].message


def test_healthy_run_has_no_findings(synthetic_run: Path) -> None:
    report = validate(synthetic_run, all_checkpoints=True)
    assert report.valid, [str(f) for f in report.all_findings]
    assert [c.step for c in report.checkpoints] == [2, 4]
    assert all(len(c.checks) == 11 for c in report.checkpoints)
    assert report.checkpoints[-1].bytes == sum(
        e["bytes"] for e in cf.read_manifest(synthetic_run / STEP4)["files"].values())


def test_leftovers_of_a_killed_save_are_ignored_not_corruption(run_copy: Path) -> None:
    root = run_copy / "checkpoints"
    tmp = root / ".tmp-step_6-a1i0"
    tmp.mkdir()
    data = (root / "step_4" / R0).read_bytes()
    (tmp / (R0 + ".partial")).write_bytes(data[: len(data) // 2])
    shutil.copy(root / "step_4" / R1, tmp / R1)
    (tmp / "rank_1.json").write_text("{}")
    (root / ".tmp-latest.4242").write_text("step_6\n")
    (root / "step_8").mkdir()  # renamed but manifest never written: cannot happen via commit(), still harmless
    report = validate(run_copy)
    assert report.valid, [str(f) for f in report.all_findings]
    ignored = {i["path"]: i["reason"] for i in report.ignored}
    assert R0 + ".partial" in ignored["checkpoints/.tmp-step_6-a1i0"]
    assert "checkpoints/.tmp-latest.4242" in ignored
    assert ignored["checkpoints/step_8"].startswith("uncommitted")
    assert "older committed" in ignored["checkpoints/step_2"]


def test_a_checkpoint_directory_validates_on_its_own(synthetic_run: Path) -> None:
    report = validate(synthetic_run / "checkpoints/step_2")
    assert report.kind == "checkpoint" and report.valid
    assert report.checkpoints[0].path == "step_2"


def test_findings_in_an_older_checkpoint_need_all(run_copy: Path) -> None:
    flip_byte(run_copy / "checkpoints/step_2" / R0)
    assert validate(run_copy).valid  # latest is whole: the run can resume and ship
    report = validate(run_copy, all_checkpoints=True)
    assert [str(f) for f in report.all_findings] == [
        next(str(f) for f in report.all_findings if f.file == f"checkpoints/step_2/{R0}")]


def test_a_run_without_checkpoints_is_invalid(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    report = validate(tmp_path)
    assert not report.valid
    assert [(f.code, f.file) for f in report.all_findings] == [("no_checkpoint", "checkpoints/latest")]


@pytest.mark.parametrize("make", ["missing", "file", "not-a-run"])
def test_bad_paths_are_usage_errors(tmp_path: Path, make: str) -> None:
    target = tmp_path / "x"
    if make == "file":
        target.write_text("hello")
    elif make == "not-a-run":
        (target / "events").mkdir(parents=True)
    with pytest.raises(UsageError, match=str(target)):
        validate(target)


def test_validation_record_names_the_checkpoint(run_copy: Path) -> None:
    from resilient_training.gates.validate import write_validation_record

    report = validate(run_copy)
    write_validation_record(run_copy, report)
    record = gate_records.read_record(run_copy, gate_records.VALIDATION)
    assert record["passed"] is True
    entry = record["checkpoints"]["checkpoints/step_4"]
    assert entry["step"] == 4 and entry["valid"]
    assert entry["manifest_checksum"] == gate_records.manifest_digest(run_copy / STEP4)
    flip_byte(run_copy / STEP4 / R0)
    write_validation_record(run_copy, validate(run_copy))
    record = gate_records.read_record(run_copy, gate_records.VALIDATION)
    assert record["passed"] is False and "checksum_mismatch" in record["findings"][0]
    assert json.loads((run_copy / "gates/validation.json").read_text())["gate"] == "validation"


def test_a_checkpoint_that_changes_between_validation_and_record_is_not_recorded_as_valid(run_copy: Path) -> None:
    from resilient_training.gates.validate import write_validation_record

    report = validate(run_copy)
    assert report.valid
    manifest = run_copy / STEP4 / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")  # another digest, as a swapped-in checkpoint has
    with pytest.raises(cf.CheckpointError, match="changed while it was validated"):
        write_validation_record(run_copy, report)
    assert gate_records.read_record(run_copy, gate_records.VALIDATION) is None


def test_a_checkpoint_pruned_while_validated_is_one_line_not_a_traceback(run_copy: Path, monkeypatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Found by a stranger trial: validate-checkpoint on a run still training, whose pruning removed
    # the checkpoint before the record was written (a CheckpointError traceback).
    from resilient_training.cli.main import main
    from resilient_training.gates import validate as validate_module

    real = validate_module.validate

    def then_pruned(*args, **kwargs):
        report = real(*args, **kwargs)
        shutil.rmtree(run_copy / STEP4)
        return report

    monkeypatch.setattr(validate_module, "validate", then_pruned)
    assert main(["validate-checkpoint", str(run_copy)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the validation cannot be recorded:") and "step_4" in err[0], err
    assert gate_records.read_record(run_copy, gate_records.VALIDATION) is None
