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
from tests.support.gates import copy_run, record_file, rewrite_manifest, rewrite_shard, save_replacing

STEP4 = Path("checkpoints/step_4")


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


def set_tensor(name: str, value: float, index: int = 0) -> Callable[[dict], None]:
    def edit(shard: dict) -> None:
        shard["tensors"][name].view(-1)[index] = value

    return edit


def set_meta(key: str, value: object) -> Callable[[dict], None]:
    def edit(shard: dict) -> None:
        shard["meta"][key] = value if not callable(value) else value(shard["meta"])

    return edit


def drop_head(t: Target) -> None:
    """Remove head.weight and its optimizer state consistently from shards and manifest."""
    names = ["model/head.weight", "optim/head.weight/exp_avg", "optim/head.weight/exp_avg_sq"]
    for rank in (0, 1):
        def edit(shard: dict) -> None:
            for n in names:
                shard["tensors"].pop(n)
                shard["meta"]["layout"].pop(n)

        rewrite_shard(t.ckpt, rank, edit)


def swap_ranks(t: Target) -> None:
    d = t.ckpt
    (d / "rank_0.pt").rename(d / "tmp")
    (d / "rank_1.pt").rename(d / "rank_0.pt")
    (d / "tmp").rename(d / "rank_1.pt")

    def edit(m: dict) -> None:
        m["tensors"]["rank_0.pt"], m["tensors"]["rank_1.pt"] = m["tensors"]["rank_1.pt"], m["tensors"]["rank_0.pt"]

    rewrite_manifest(d, edit)
    record_file(d, "rank_0.pt")
    record_file(d, "rank_1.pt")


def pickle_object(t: Target) -> None:
    path = t.ckpt / "rank_1.pt"
    shard = cf.load_shard(path)
    shard["meta"]["hook"] = NotATensor()
    save_replacing(shard, path)
    record_file(t.ckpt, "rank_1.pt")


def shift_offset(t: Target) -> None:
    def edit(shard: dict) -> None:
        shard["meta"]["layout"]["model/tok.weight"]["offset"] += 1

    rewrite_shard(t.ckpt, 1, edit)


def step_behind(manifest: dict) -> None:
    manifest["optimizer_step"] = manifest["step"] - 1


def shard_from_other_step(t: Target) -> None:
    shutil.copy(t.other / "rank_1.pt", t.ckpt / "rank_1.pt")
    record_file(t.ckpt, "rank_1.pt")


def write_random(t: Target) -> None:
    (t.ckpt / "rank_1.pt").write_bytes(os.urandom(4096))
    record_file(t.ckpt, "rank_1.pt")


def truncate(t: Target) -> None:
    os.truncate(t.ckpt / "rank_0.pt", (t.ckpt / "rank_0.pt").stat().st_size // 2)


# id -> (corrupt(target), [(code, file, tensor or None), ...]): exactly these findings.
# In file names "{ckpt}" stands for the checkpoint `latest` names, relative to the run.
GALLERY: dict[str, tuple[Callable[[Target], object], list[tuple[str, str, str | None]]]] = {
    "shard-deleted": (lambda t: (t.ckpt / "rank_1.pt").unlink(), [("shard_missing", "{ckpt}/rank_1.pt", None)]),
    "shard-truncated": (truncate, [("size_mismatch", "{ckpt}/rank_0.pt", None)]),
    "bit-flip": (lambda t: flip_byte(t.ckpt / "rank_1.pt"), [("checksum_mismatch", "{ckpt}/rank_1.pt", None)]),
    "manifest-not-json": (lambda t: (t.ckpt / "manifest.json").write_text('{"step": 4, "files": '),
                          [("manifest_invalid", "{ckpt}/manifest.json", None)]),
    "manifest-deleted": (lambda t: (t.ckpt / "manifest.json").unlink(), [("latest_uncommitted", "{ckpt}", None)]),
    "latest-dangling": (lambda t: (t.run / "checkpoints/latest").write_text("step_99\n"),
                        [("latest_dangling", "checkpoints/latest", None)]),
    "latest-garbage": (lambda t: (t.run / "checkpoints/latest").write_bytes(b"\x00\xffgarbage"),
                       [("latest_invalid", "checkpoints/latest", None)]),
    "unknown-file": (lambda t: (t.ckpt / "notes.txt").write_text("hi"),
                     [("unexpected_file", "{ckpt}/notes.txt", None)]),
    "partial-inside-commit": (lambda t: shutil.copy(t.ckpt / "rank_0.pt", t.ckpt / "rank_0.pt.partial"),
                              [("unexpected_file", "{ckpt}/rank_0.pt.partial", None)]),
    "shard-from-other-step": (shard_from_other_step, [("step_mismatch", "{ckpt}/rank_1.pt", None)]),
    "nan-saved": (lambda t: rewrite_shard(t.ckpt, 0, set_tensor("model/blocks.0.fc.weight", float("nan"))),
                  [("non_finite", "{ckpt}/rank_0.pt", "model/blocks.0.fc.weight")]),
    "inf-in-optimizer": (lambda t: rewrite_shard(t.ckpt, 1, set_tensor("optim/pos.weight/exp_avg", float("inf"))),
                         [("non_finite", "{ckpt}/rank_1.pt", "optim/pos.weight/exp_avg")]),
    "values-altered-checksum-rewritten": (
        lambda t: rewrite_shard(t.ckpt, 1, set_tensor("model/head.weight", 0.5), rerecord="file"),
        [("tensor_checksum_mismatch", "{ckpt}/rank_1.pt", "model/head.weight")]),
    "shard-optimizer-step-behind": (
        lambda t: rewrite_shard(t.ckpt, 0, set_meta("optimizer_step", lambda m: m["step"] - 1)),
        [("optimizer_step_mismatch", "{ckpt}/rank_0.pt", None)]),
    "manifest-optimizer-step-behind": (lambda t: rewrite_manifest(t.ckpt, step_behind),
                                       [("optimizer_step_mismatch", "{ckpt}/manifest.json", None)]),
    "data-position-behind": (lambda t: rewrite_shard(t.ckpt, 1, set_meta("data_position", 2)),
                             [("data_position_mismatch", "{ckpt}/rank_1.pt", None)]),
    "ranks-swapped": (swap_ranks, [("rank_mismatch", "{ckpt}/rank_0.pt", None),
                                   ("rank_mismatch", "{ckpt}/rank_1.pt", None)]),
    "not-a-pickle": (write_random, [("shard_unreadable", "{ckpt}/rank_1.pt", None)]),
    "arbitrary-object-pickled": (pickle_object, [("shard_unreadable", "{ckpt}/rank_1.pt", None)]),
    "negative-second-moment": (
        lambda t: rewrite_shard(t.ckpt, 0, set_tensor("optim/blocks.0.qkv.weight/exp_avg_sq", -1.0)),
        [("optimizer_state_invalid", "{ckpt}/rank_0.pt", "optim/blocks.0.qkv.weight/exp_avg_sq")]),
    "parameter-missing": (drop_head, [("load_failed", "{ckpt}/manifest.json", None)]),
    "layout-gap": (shift_offset, [("layout_invalid", "{ckpt}/rank_1.pt", "model/tok.weight")]),
    "manifest-shape-wrong": (
        lambda t: rewrite_manifest(t.ckpt, lambda m: m["tensors"]["rank_0.pt"]["model/ln_f.bias"].update(shape=[3])),
        [("tensor_mismatch", "{ckpt}/rank_0.pt", "model/ln_f.bias")]),
    "world-size-shrunk": (lambda t: rewrite_manifest(t.ckpt, lambda m: m.update(world_size=1)),
                          [("manifest_incomplete", "{ckpt}/manifest.json", None),
                           ("unexpected_file", "{ckpt}/rank_1.pt", None),
                           ("world_size_mismatch", "{ckpt}/rank_0.pt", None)]),
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
    report = validate(target.run)
    assert not report.valid
    got = sorted((f.code, f.file, f.tensor) for f in report.all_findings)
    want = sorted((code, file.format(ckpt=target.rel), tensor) for code, file, tensor in expected)
    assert got == want, [str(f) for f in report.all_findings]


def test_healthy_run_has_no_findings(synthetic_run: Path) -> None:
    report = validate(synthetic_run, all_checkpoints=True)
    assert report.valid, [str(f) for f in report.all_findings]
    assert [c.step for c in report.checkpoints] == [2, 4]
    assert all(len(c.checks) == 9 for c in report.checkpoints)
    assert report.checkpoints[-1].bytes == sum(
        e["bytes"] for e in cf.read_manifest(synthetic_run / STEP4)["files"].values())


def test_leftovers_of_a_killed_save_are_ignored_not_corruption(run_copy: Path) -> None:
    root = run_copy / "checkpoints"
    tmp = root / ".tmp-step_6-a1i0"
    tmp.mkdir()
    data = (root / "step_4/rank_0.pt").read_bytes()
    (tmp / "rank_0.pt.partial").write_bytes(data[: len(data) // 2])
    shutil.copy(root / "step_4/rank_1.pt", tmp / "rank_1.pt")
    (tmp / "rank_1.json").write_text("{}")
    (root / ".tmp-latest.4242").write_text("step_6\n")
    (root / "step_8").mkdir()  # renamed but manifest never written: cannot happen via commit(), still harmless
    report = validate(run_copy)
    assert report.valid, [str(f) for f in report.all_findings]
    ignored = {i["path"]: i["reason"] for i in report.ignored}
    assert "rank_0.pt.partial" in ignored["checkpoints/.tmp-step_6-a1i0"]
    assert "checkpoints/.tmp-latest.4242" in ignored
    assert ignored["checkpoints/step_8"].startswith("uncommitted")
    assert "older committed" in ignored["checkpoints/step_2"]


def test_a_checkpoint_directory_validates_on_its_own(synthetic_run: Path) -> None:
    report = validate(synthetic_run / "checkpoints/step_2")
    assert report.kind == "checkpoint" and report.valid
    assert report.checkpoints[0].path == "step_2"


def test_findings_in_an_older_checkpoint_need_all(run_copy: Path) -> None:
    flip_byte(run_copy / "checkpoints/step_2/rank_0.pt")
    assert validate(run_copy).valid  # latest is whole: the run can resume and ship
    report = validate(run_copy, all_checkpoints=True)
    assert [str(f) for f in report.all_findings] == [
        next(str(f) for f in report.all_findings if f.file == "checkpoints/step_2/rank_0.pt")]


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
    flip_byte(run_copy / STEP4 / "rank_0.pt")
    write_validation_record(run_copy, validate(run_copy))
    record = gate_records.read_record(run_copy, gate_records.VALIDATION)
    assert record["passed"] is False and "checksum_mismatch" in record["findings"][0]
    assert json.loads((run_copy / "gates/validation.json").read_text())["gate"] == "validation"
