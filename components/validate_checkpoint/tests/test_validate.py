"""Integrity validation on real checkpoints: a corruption gallery and no false alarms."""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from resilient_training import checkpoint_format as cf
from resilient_training import gate_records
from resilient_training.components.validate_checkpoint.validate import UsageError, validate
from resilient_training.gates_testing import record_file, rewrite_manifest, rewrite_shard

STEP4 = Path("checkpoints/step_4")


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
        shard["meta"][key] = value

    return edit


def drop_head(run: Path) -> None:
    """Remove head.weight and its optimizer state consistently from shards and manifest."""
    names = ["model/head.weight", "optim/head.weight/exp_avg", "optim/head.weight/exp_avg_sq"]
    for rank in (0, 1):
        def edit(shard: dict) -> None:
            for n in names:
                shard["tensors"].pop(n)
                shard["meta"]["layout"].pop(n)

        rewrite_shard(run / STEP4, rank, edit)


def swap_ranks(run: Path) -> None:
    d = run / STEP4
    (d / "rank_0.pt").rename(d / "tmp")
    (d / "rank_1.pt").rename(d / "rank_0.pt")
    (d / "tmp").rename(d / "rank_1.pt")

    def edit(m: dict) -> None:
        m["tensors"]["rank_0.pt"], m["tensors"]["rank_1.pt"] = m["tensors"]["rank_1.pt"], m["tensors"]["rank_0.pt"]

    rewrite_manifest(d, edit)
    record_file(d, "rank_0.pt")
    record_file(d, "rank_1.pt")


def pickle_object(run: Path) -> None:
    path = run / STEP4 / "rank_1.pt"
    shard = cf.load_shard(path)
    shard["meta"]["hook"] = NotATensor()
    torch.save(shard, path)
    record_file(run / STEP4, "rank_1.pt")


def shift_offset(run: Path) -> None:
    name = "model/tok.weight"

    def edit(shard: dict) -> None:
        shard["meta"]["layout"][name]["offset"] += 1

    rewrite_shard(run / STEP4, 1, edit)


# id -> (corrupt(run), [(code, file relative to the run, tensor or None), ...]): exactly these findings.
GALLERY: dict[str, tuple[Callable[[Path], None], list[tuple[str, str, str | None]]]] = {
    "shard-deleted": (lambda r: (r / STEP4 / "rank_1.pt").unlink(),
                      [("shard_missing", "checkpoints/step_4/rank_1.pt", None)]),
    "shard-truncated": (lambda r: os.truncate(r / STEP4 / "rank_0.pt", (r / STEP4 / "rank_0.pt").stat().st_size // 2),
                        [("size_mismatch", "checkpoints/step_4/rank_0.pt", None)]),
    "bit-flip": (lambda r: flip_byte(r / STEP4 / "rank_1.pt"),
                 [("checksum_mismatch", "checkpoints/step_4/rank_1.pt", None)]),
    "manifest-not-json": (lambda r: (r / STEP4 / "manifest.json").write_text('{"step": 4, "files": '),
                          [("manifest_invalid", "checkpoints/step_4/manifest.json", None)]),
    "manifest-deleted": (lambda r: (r / STEP4 / "manifest.json").unlink(),
                         [("latest_uncommitted", "checkpoints/step_4", None)]),
    "latest-dangling": (lambda r: (r / "checkpoints/latest").write_text("step_99\n"),
                        [("latest_dangling", "checkpoints/latest", None)]),
    "latest-garbage": (lambda r: (r / "checkpoints/latest").write_bytes(b"\x00\xffgarbage"),
                       [("latest_invalid", "checkpoints/latest", None)]),
    "unknown-file": (lambda r: (r / STEP4 / "notes.txt").write_text("hi"),
                     [("unexpected_file", "checkpoints/step_4/notes.txt", None)]),
    "partial-inside-commit": (lambda r: shutil.copy(r / STEP4 / "rank_0.pt", r / STEP4 / "rank_0.pt.partial"),
                              [("unexpected_file", "checkpoints/step_4/rank_0.pt.partial", None)]),
    "shard-from-other-step": (
        lambda r: (shutil.copy(r / "checkpoints/step_2/rank_1.pt", r / STEP4 / "rank_1.pt"),
                   record_file(r / STEP4, "rank_1.pt")),
        [("step_mismatch", "checkpoints/step_4/rank_1.pt", None)]),
    "nan-saved": (lambda r: rewrite_shard(r / STEP4, 0, set_tensor("model/blocks.0.fc.weight", float("nan"))),
                  [("non_finite", "checkpoints/step_4/rank_0.pt", "model/blocks.0.fc.weight")]),
    "inf-in-optimizer": (lambda r: rewrite_shard(r / STEP4, 1, set_tensor("optim/pos.weight/exp_avg", float("inf"))),
                         [("non_finite", "checkpoints/step_4/rank_1.pt", "optim/pos.weight/exp_avg")]),
    "values-altered-checksum-rewritten": (
        lambda r: rewrite_shard(r / STEP4, 1, set_tensor("model/head.weight", 0.5), rerecord="file"),
        [("tensor_checksum_mismatch", "checkpoints/step_4/rank_1.pt", "model/head.weight")]),
    "optimizer-step-behind": (lambda r: rewrite_shard(r / STEP4, 0, set_meta("optimizer_step", 3)),
                              [("optimizer_step_mismatch", "checkpoints/step_4/rank_0.pt", None)]),
    "data-position-behind": (lambda r: rewrite_shard(r / STEP4, 1, set_meta("data_position", 2)),
                             [("data_position_mismatch", "checkpoints/step_4/rank_1.pt", None)]),
    "ranks-swapped": (swap_ranks, [("rank_mismatch", "checkpoints/step_4/rank_0.pt", None),
                                   ("rank_mismatch", "checkpoints/step_4/rank_1.pt", None)]),
    "not-a-pickle": (lambda r: ((r / STEP4 / "rank_1.pt").write_bytes(os.urandom(4096)),
                                record_file(r / STEP4, "rank_1.pt")),
                     [("shard_unreadable", "checkpoints/step_4/rank_1.pt", None)]),
    "arbitrary-object-pickled": (pickle_object, [("shard_unreadable", "checkpoints/step_4/rank_1.pt", None)]),
    "negative-second-moment": (
        lambda r: rewrite_shard(r / STEP4, 0, set_tensor("optim/blocks.0.qkv.weight/exp_avg_sq", -1.0)),
        [("optimizer_state_invalid", "checkpoints/step_4/rank_0.pt", "optim/blocks.0.qkv.weight/exp_avg_sq")]),
    "parameter-missing": (drop_head, [("load_failed", "checkpoints/step_4/manifest.json", None)]),
    "layout-gap": (shift_offset, [("layout_invalid", "checkpoints/step_4/rank_1.pt", "model/tok.weight")]),
    "manifest-shape-wrong": (
        lambda r: rewrite_manifest(r / STEP4, lambda m: m["tensors"]["rank_0.pt"]["model/ln_f.bias"].update(shape=[3])),
        [("tensor_mismatch", "checkpoints/step_4/rank_0.pt", "model/ln_f.bias")]),
    "world-size-shrunk": (lambda r: rewrite_manifest(r / STEP4, lambda m: m.update(world_size=1)),
                          [("manifest_incomplete", "checkpoints/step_4/manifest.json", None),
                           ("unexpected_file", "checkpoints/step_4/rank_1.pt", None),
                           ("world_size_mismatch", "checkpoints/step_4/rank_0.pt", None)]),
}


def test_gallery_is_large_and_distinct() -> None:
    assert len(GALLERY) >= 10
    assert len({expected[0][0] for _, expected in GALLERY.values()}) >= 15


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_corruption_is_caught_with_the_right_finding(name: str, run_copy: Path) -> None:
    corrupt, expected = GALLERY[name]
    assert validate(run_copy).valid, "fixture must start healthy"
    corrupt(run_copy)
    report = validate(run_copy)
    assert not report.valid
    got = sorted((f.code, f.file, f.tensor) for f in report.all_findings)
    assert got == sorted(expected), [str(f) for f in report.all_findings]


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
    from resilient_training.components.validate_checkpoint.validate import write_validation_record

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
