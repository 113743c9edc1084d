"""validate-checkpoint on a promoted model directory (found by a stranger trial: it said INVALID for
every promotion, ``promotion.json`` being an "unknown file", and could not tell the world size).

Outside its run the promotion record stands in for the event log: it must name this very manifest,
with the run's passed validation and convergence of it. Each way to make it say VALID wrongly is a
case here.
"""

import json
import shutil
from pathlib import Path

import pytest

from resilient_training.gates.promote import PROMOTION_NAME, promote
from resilient_training.gates.validate import validate
from tests.support.gates import rewrite_manifest

CKPT = "checkpoints/step_4"


@pytest.fixture
def promoted(gated_run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "models" / "gpt"
    promote(gated_run / CKPT, str(dest))
    return dest


def _codes(path: Path) -> list[str]:
    return sorted(f.code for f in validate(path, load=False).all_findings)


def test_a_promoted_model_validates_with_its_exports_beside_it(gated_run: Path, promoted: Path) -> None:
    from resilient_training.gates.export import export_promoted

    for fmt in ("safetensors", "torch"):
        export_promoted(str(gated_run / CKPT), str(promoted), fmt)
    report = validate(promoted)  # the full check: bytes, contents, a strict load
    assert report.valid, [f.message for f in report.all_findings]
    checks = report.checkpoints[0].checks
    assert any("before promotion (promotion.json records this manifest's digest" in c for c in checks)
    assert any("nothing else; exports model.pt, model.safetensors (safetensors and hf record" in c for c in checks)
    assert sorted(p.name for p in promoted.iterdir()) == sorted(
        ["__0_0.distcp", "__1_0.distcp", ".metadata", "data_rank_0.pt", "data_rank_1.pt", "manifest.json",
         PROMOTION_NAME, "model.safetensors", "model.pt"])  # validation wrote nothing into it


def test_a_changed_weight_in_a_promoted_export_is_a_finding(gated_run: Path, promoted: Path) -> None:
    """Found by a third stranger trial: one byte of model.safetensors' tensor data flipped (its
    record still names this manifest) was VALID, while promote refused the same directory. The
    full check makes the export again and compares."""
    from resilient_training.gates.export import export_promoted

    export_promoted(str(gated_run / CKPT), str(promoted), "safetensors")
    data = bytearray((promoted / "model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (promoted / "model.safetensors").write_bytes(bytes(data))
    assert _codes(promoted) == []  # the layout stage reads its record only
    findings = validate(promoted).all_findings
    assert [(f.code, f.file) for f in findings] == [("export_invalid", "gpt/model.safetensors")]
    assert "not byte for byte what exporting this checkpoint makes" in findings[0].message
    assert not [p for p in promoted.parent.iterdir() if p != promoted]  # nothing written beside it


@pytest.mark.parametrize("plant", ["auto-map", "link-out", "link-loop"])
def test_an_hf_folder_that_would_run_or_read_other_code_is_a_finding(promoted: Path, plant: str) -> None:
    """Third stranger trial: an hf/ whose record names this manifest, with config.json's auto_map
    naming a Hub repository's class (trust_remote_code fetches and runs it), or symbolic links
    inside (to /etc/passwd, to ..), was VALID."""
    from resilient_training.gates.validate import validate as full

    digest = json.loads((promoted / PROMOTION_NAME).read_text())["source"]["manifest_checksum"]
    hf = promoted / "hf"
    hf.mkdir()
    (hf / "export.json").write_text(json.dumps({"format": "hf", "source": {"manifest_checksum": digest}}))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if plant == "auto-map":
        (hf / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "attacker/repo--m.Evil"}}))
        said = "hf/config.json names code to run (auto_map)"
    elif plant == "link-out":
        (hf / "model.safetensors").symlink_to("/etc/passwd")
        said = "holds symbolic links (hf/model.safetensors)"
    else:
        (hf / "loop").symlink_to("..", target_is_directory=True)
        said = "holds symbolic links (hf/loop)"
    findings = full(promoted, load=False).all_findings
    assert [(f.code, f.file) for f in findings] == [("export_invalid", "gpt/hf")], [f.message for f in findings]
    assert said in findings[0].message, findings[0].message


@pytest.mark.parametrize("plant", ["safetensors", "hf-code", "hf-empty", "other-export"])
def test_an_export_planted_in_a_promoted_model_is_a_finding(promoted: Path, plant: str) -> None:
    """Stranger trial: `evil` as model.safetensors and an hf/ holding modeling_evil.py read VALID,
    "nothing else" (promotion.json records no export; each export records its own source)."""
    if plant == "safetensors":
        (promoted / "model.safetensors").write_bytes(b"evil")
    elif plant == "hf-code":
        (promoted / "hf").mkdir()
        (promoted / "hf" / "modeling_evil.py").write_text("import os\n")
    elif plant == "hf-empty":
        (promoted / "hf").mkdir()
    else:  # a safetensors file whose own record names another checkpoint's manifest
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(promoted / "model.safetensors"),
                  metadata={"format": "pt", "source": json.dumps({"manifest_checksum": "0" * 32})})
    findings = validate(promoted, load=False).all_findings
    assert {f.code for f in findings} == {"export_invalid"}, [f.message for f in findings]
    if plant == "other-export":
        assert "records the manifest digest 000" in findings[0].message
    if plant == "hf-code":
        assert "modeling_evil.py" in findings[0].message and "trust_remote_code" in findings[0].message


def test_a_foreign_file_is_still_unexpected(promoted: Path) -> None:
    (promoted / "notes.txt").write_text("x")
    assert _codes(promoted) == ["unexpected_file"]


@pytest.mark.parametrize("edit", [{"run_id": "someone-else"}, {"ranks": [0, 1]}])
def test_a_manifest_rewritten_after_promotion_is_caught(promoted: Path, edit: dict) -> None:
    # ranks: a node-local tier checkpoint's key, which had switched the check of the record off
    rewrite_manifest(promoted, lambda m: m.update(edit))  # every checksum still holds
    assert _codes(promoted) == ["not_the_promoted_checkpoint"]


def test_a_record_rewritten_to_match_still_needs_the_gates_of_that_manifest(promoted: Path) -> None:
    """The attacker rewrites the manifest and the record's source digest consistently: the
    validation and convergence recorded in it were of the old manifest, so it is refused."""
    from resilient_training.run.gate_records import manifest_digest

    rewrite_manifest(promoted, lambda m: m.update(run_id="someone-else"))
    record = json.loads((promoted / PROMOTION_NAME).read_text())
    record["source"]["manifest_checksum"] = manifest_digest(promoted)
    (promoted / PROMOTION_NAME).write_text(json.dumps(record))
    assert _codes(promoted) == ["promotion_invalid"]
    assert "does not record a passed validation and convergence" in validate(promoted, load=False).all_findings[0].message


@pytest.mark.parametrize("gate", ["validation", "convergence"])
def test_a_record_whose_gate_did_not_pass_is_refused(promoted: Path, gate: str) -> None:
    record = json.loads((promoted / PROMOTION_NAME).read_text())
    if gate == "validation":
        record["validation"]["checkpoints"][CKPT]["valid"] = "true"  # not the JSON true
    else:
        record["convergence"]["passed"] = False
    (promoted / PROMOTION_NAME).write_text(json.dumps(record))
    findings = validate(promoted, load=False).all_findings
    assert [f.code for f in findings] == ["promotion_invalid"] and gate in findings[0].message


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"source": {}}'])
def test_an_unreadable_record_is_a_finding(promoted: Path, text: str) -> None:
    (promoted / PROMOTION_NAME).write_text(text)
    assert _codes(promoted) == ["promotion_invalid"]


def test_another_promotions_record_does_not_vouch(promoted: Path, other_gated_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    promote(other_gated_run / CKPT, str(other))
    shutil.copy(other / PROMOTION_NAME, promoted / PROMOTION_NAME)
    assert _codes(promoted) == ["not_the_promoted_checkpoint"]


def test_without_a_record_it_stays_unverified(promoted: Path) -> None:
    (promoted / PROMOTION_NAME).unlink()
    assert _codes(promoted) == ["world_size_unverified"]


def test_what_a_killed_export_inside_dest_left_does_not_refuse_the_promotion_again(gated_run: Path,
                                                                                   promoted: Path) -> None:
    """An export into DEST holds DEST's lock for its file (`.tmp-promote-model.safetensors.lock`) and
    writes through `.tmp-export-model.safetensors-PID`: a SIGKILL leaves them, the next export
    removes them, and the promotion's repeat must not call them foreign content."""
    from resilient_training.gates.export import export_promoted

    export_promoted(str(gated_run / CKPT), str(promoted), "safetensors")
    (promoted / ".tmp-promote-model.safetensors.lock").write_text("{}")
    (promoted / ".tmp-export-model.safetensors-4242").write_bytes(b"torn")
    assert promote(gated_run / CKPT, str(promoted))["already_promoted"]
    (promoted / ".tmp-other").write_text("x")  # anything else still is
    with pytest.raises(Exception, match=r"also holds \.tmp-other"):
        promote(gated_run / CKPT, str(promoted))


def test_another_runs_model_pt_is_refused_by_export_and_found_by_validation(
        gated_run: Path, other_gated_run: Path, promoted: Path, tmp_path: Path) -> None:
    """Found by a stranger trial: `export runB --format torch -o DEST/model.pt` into runA's promoted
    model exited 0 (the name promote_model's export uses), and validate-checkpoint DEST then said
    VALID with runB's weights in model.pt (a torch file records nothing). Export now writes there
    only the checkpoint promoted there; the full validation makes model.pt again and compares."""
    from resilient_training.gates.export import ExportUsageError, export, export_promoted

    before = sorted(p.name for p in promoted.iterdir())
    with pytest.raises(ExportUsageError, match=r"lies inside the promoted model .* of another checkpoint"):
        export(other_gated_run, fmt="torch", out=promoted / "model.pt")
    assert sorted(p.name for p in promoted.iterdir()) == before
    export(other_gated_run, fmt="torch", out=tmp_path / "other.pt")  # placed by hand (cp), as `cp -a` would
    shutil.copy(tmp_path / "other.pt", promoted / "model.pt")
    assert _codes(promoted) == []  # the layout stage: model.pt records nothing to read
    findings = validate(promoted).all_findings
    assert [(f.code, f.file) for f in findings] == [("export_invalid", "gpt/model.pt")], [str(f) for f in findings]
    assert "torch export is not byte for byte what exporting this checkpoint makes" in findings[0].message
    (promoted / "model.pt").unlink()
    export_promoted(str(gated_run / CKPT), str(promoted), "torch")  # its own export: written, and VALID
    report = validate(promoted)
    assert report.valid, [str(f) for f in report.all_findings]
    assert any("model.pt byte for byte what exporting this checkpoint makes" in c for c in report.checkpoints[0].checks)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["hf/export.json", PROMOTION_NAME, "manifest.json"])
def test_a_fifo_in_a_promoted_model_is_a_finding_not_waited_on(promoted: Path, where: str) -> None:
    """As promote's FIFO (stranger trial): what validation reads is opened without waiting."""
    import os

    if where.startswith("hf/"):
        (promoted / "hf").mkdir()
    else:
        (promoted / where).unlink()
    os.mkfifo(promoted / where)
    findings = validate(promoted, load=False).all_findings
    codes = {"hf/export.json": ["export_invalid"], PROMOTION_NAME: ["unexpected_file", "world_size_unverified"],
             "manifest.json": ["manifest_missing"]}[where]
    assert sorted(f.code for f in findings) == codes, [str(f) for f in findings]
