"""`export`: a validated checkpoint of a real run in formats other tools load, and every way to be refused.

The runs are real: the Llama task (2 gloo workers, so DCP reshards 2 -> 1 on export) and the
built-in GPT task (a model that is not a transformers model), trained by the real trainer and
validated by the real `validate-checkpoint`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from resilient_training.cli.main import main
from resilient_training.run import gate_records
from resilient_training.runtime import task as tk
from tests.support.runs import gated_llama_run, two_rank_gpt_run

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gated_llama_run(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's shared 8-step GPT run (2 ranks), this module's validated copy."""
    from tests.support.gates import copy_run

    run_dir = copy_run(two_rank_gpt_run(tmp_path_factory.getbasetemp()), tmp_path_factory.mktemp("gpt") / "run")
    assert main(["validate-checkpoint", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def run_copy(llama_run: Path, tmp_path: Path) -> Path:
    """A private copy to tamper with (the gate record names checkpoints relative to the run)."""
    return Path(shutil.copytree(llama_run, tmp_path / "run", symlinks=True))


def reference(run: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model state as someone without this package reads it: DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"reference-{step}.pt"
    dcp_to_torch_save(str(run / "checkpoints" / f"step_{step}"), str(out))
    return torch.load(out, weights_only=True)["model"]


def task_of(run: Path, step: int = 12):
    manifest = json.loads((run / "checkpoints" / f"step_{step}" / "manifest.json").read_text())
    torch.manual_seed(0)
    return tk.load_task(manifest["task"], manifest["task_args"])


def test_safetensors_holds_the_full_model_and_loads_strictly_into_the_task_s_model(llama_run, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert main(["export", str(llama_run), "--format", "safetensors", "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"exported: step 12 as safetensors -> {out} (")
    tensors = load_file(str(out))
    expected = reference(llama_run, 12, tmp_path)
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    model = task_of(llama_run).build_model()
    assert tuple(model.load_state_dict(tensors, strict=True)) == ([], [])
    assert out.stat().st_mode & 0o777 != 0o600  # not left private by safetensors' writer
    # The same export again is a no-op; nothing beside OUT was left behind.
    assert main(["export", str(llama_run), "--format", "safetensors", "-o", str(out)]) == 0
    assert "already exported (no-op)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "reference-12.pt"]


def test_hf_is_a_transformers_model_directory_that_loads_and_generates_text(llama_run, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main(["export", str(llama_run), "--format", "hf", "-o", str(out)]) == 0
    assert capsys.readouterr().err.count("\n") <= 2  # no progress bars
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    prompt = tokenizer("def main(", return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 12) or generated[0, -1] == tokenizer.eos_token_id
    assert tokenizer.decode(generated[0]).startswith("def main(")
    # The weights are the checkpoint's: the same logits as the task's own model holding them.
    task_model = task_of(llama_run).build_model()
    task_model.load_state_dict(reference(llama_run, 12, tmp_path), strict=True)
    with torch.no_grad():
        assert torch.allclose(model(prompt).logits, task_model(prompt).logits, atol=1e-5)
    assert load_file(str(out / "model.safetensors")).keys() == task_model.state_dict().keys()
    record = json.loads((out / "export.json").read_text())
    assert record["source"]["manifest_checksum"] == gate_records.manifest_digest(llama_run / "checkpoints/step_12")


def test_torch_is_dcp_to_torch_save_and_dcp_is_a_copy_that_dcp_reads(llama_run, tmp_path):
    assert main(["export", str(llama_run), "--format", "torch", "-o", str(tmp_path / "state.pt")]) == 0
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert {"model", "optim"} <= state.keys()
    expected = reference(llama_run, 12, tmp_path)
    assert all(torch.equal(state["model"][k], expected[k]) for k in expected)
    assert main(["export", str(llama_run), "--step", "4", "--format", "dcp", "-o", str(tmp_path / "dcp")]) == 0
    source = llama_run / "checkpoints/step_4"
    for path in source.iterdir():
        assert (tmp_path / "dcp" / path.name).read_bytes() == path.read_bytes()
    copied = torch.load(_dcp_copy_to_torch(tmp_path / "dcp", tmp_path), weights_only=True)["model"]
    expected = reference(llama_run, 4, tmp_path)
    assert copied.keys() == expected.keys() and all(torch.equal(copied[k], expected[k]) for k in expected)


def _dcp_copy_to_torch(directory: Path, tmp_path: Path) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "from-copy.pt"
    dcp_to_torch_save(str(directory), str(out))
    return out


def test_a_model_that_is_not_a_transformers_model_exports_as_safetensors_but_not_hf(gpt_run, tmp_path, capsys):
    from safetensors.torch import load_file

    assert main(["export", str(gpt_run), "--format", "hf", "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the run's task (resilient_training.tasks.gpt:task) builds a GPT, not a transformers")
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()
    assert main(["export", str(gpt_run), "--format", "safetensors", "-o", str(tmp_path / "gpt.safetensors")]) == 0
    model = task_of(gpt_run, 8).build_model()
    model.load_state_dict(load_file(str(tmp_path / "gpt.safetensors")), strict=True)


def refused(args: list[str], capsys, message: str, out: Path) -> None:
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused: ") and message in err and err.count("\n") == 1, err
    assert not out.exists() and not list(out.parent.glob(".tmp-export-*"))


def edit_record(run: Path, edit) -> None:
    path = run / "gates" / "validation.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(("tamper", "message"), [
    (lambda run: (run / "gates" / "validation.json").unlink(), "was never validated"),
    (lambda run: edit_record(run, lambda r: r.update(passed=False)), "did not pass validation"),
    (lambda run: edit_record(run, lambda r: r["checkpoints"]["checkpoints/step_12"].update(valid=False)),
     "did not pass validation"),
    (lambda run: edit_record(run, lambda r: r["checkpoints"].pop("checkpoints/step_12")), "did not pass validation"),
    (lambda run: edit_record(run, lambda r: r["checkpoints"]["checkpoints/step_12"].update(valid="yes")),
     "did not pass validation"),
    (lambda run: edit_record(run, lambda r: r["checkpoints"]["checkpoints/step_12"].update(manifest_checksum="0" * 32)),
     "changed since it was validated"),
    (lambda run: edit_record(run, lambda r: r.update(checkpoints=["checkpoints/step_12"])), "did not pass validation"),
    (lambda run: (run / "gates" / "validation.json").write_text("{not json"), "is not valid JSON"),
], ids=["absent", "failed", "entry-invalid", "entry-missing", "valid-not-true", "other-digest", "wrong-shape",
        "not-json"])
def test_an_absent_failed_or_tampered_validation_record_is_refused(run_copy, tmp_path, capsys, tamper, message):
    tamper(run_copy)
    for fmt in ("safetensors", "hf", "torch", "dcp"):
        refused(["export", str(run_copy), "--format", fmt, "-o", str(tmp_path / f"out-{fmt}")], capsys, message,
                tmp_path / f"out-{fmt}")


def test_a_checkpoint_changed_after_validation_is_refused(run_copy, tmp_path, capsys):
    step = run_copy / "checkpoints" / "step_12"
    shard = step / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in rank 1's chunks
    shard.write_bytes(bytes(data))
    refused(["export", str(run_copy), "--format", "safetensors", "-o", str(tmp_path / "m.safetensors")], capsys,
            "__1_0.distcp no longer matches its manifest", tmp_path / "m.safetensors")
    # Re-recording the damage in the manifest changes the manifest's digest: still refused.
    manifest = json.loads((step / "manifest.json").read_text())
    from resilient_training.run import checkpoint_format as cf

    manifest["files"]["__1_0.distcp"].update(zip(("bytes", "checksum"), cf.checksum_file(shard), strict=True))
    (step / "manifest.json").write_text(json.dumps(manifest))
    refused(["export", str(run_copy), "--format", "hf", "-o", str(tmp_path / "hf")], capsys,
            "changed since it was validated", tmp_path / "hf")


def test_a_manifest_and_record_forged_together_to_reach_outside_the_checkpoint_are_refused(run_copy, tmp_path,
                                                                                            capsys):
    from resilient_training.run import checkpoint_format as cf

    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    step = run_copy / "checkpoints" / "step_12"
    manifest = json.loads((step / "manifest.json").read_text())
    size, digest = cf.checksum_file(secret)
    manifest["files"]["../../../secret.txt"] = {"rank": 0, "bytes": size, "checksum": digest}
    (step / "manifest.json").write_text(json.dumps(manifest))
    new_digest = gate_records.manifest_digest(step)
    edit_record(run_copy, lambda r: r["checkpoints"]["checkpoints/step_12"].update(manifest_checksum=new_digest))
    refused(["export", str(run_copy), "--format", "dcp", "-o", str(tmp_path / "d")], capsys,
            "which is not a file inside the checkpoint", tmp_path / "d")


def test_a_step_not_validated_is_refused_even_when_another_step_was(run_copy, tmp_path, capsys):
    assert main(["validate-checkpoint", str(run_copy)]) == 0  # latest only: the record now names step_12 alone
    capsys.readouterr()
    refused(["export", str(run_copy), "--step", "4", "--format", "dcp", "-o", str(tmp_path / "d")], capsys,
            "checkpoints/step_4 did not pass validation", tmp_path / "d")


def usage(args: list[str], capsys, message: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_bad_input_exits_2_with_one_line_and_writes_nothing(llama_run, tmp_path, capsys):
    out = str(tmp_path / "o")
    usage(["export", str(tmp_path / "nope"), "--format", "dcp", "-o", out], capsys, "does not exist")
    usage(["export", str(tmp_path), "--format", "dcp", "-o", out], capsys, "is not a run (no checkpoints/)")
    usage(["export", str(llama_run), "--step", "5", "--format", "dcp", "-o", out], capsys,
          "no committed checkpoint at step 5 (committed steps: 4, 8, 12)")
    usage(["export", str(llama_run / "checkpoints/step_4"), "--step", "12", "--format", "dcp", "-o", out], capsys,
          "is step 4, not --step 12")
    usage(["export", str(llama_run), "--format", "dcp", "-o", str(tmp_path / "missing" / "o")], capsys,
          f"{tmp_path / 'missing'} does not exist")
    usage(["export", str(llama_run), "--format", "dcp", "-o", " "], capsys, "the output path is empty")
    usage(["export", str(llama_run), "--format", "onnx", "-o", out], capsys,
          "format 'onnx': choose one of dcp, torch, safetensors, hf")
    usage(["export", str(llama_run), "-o", out], capsys, "give --format dcp|torch|safetensors|hf and -o PATH")
    usage(["export", str(llama_run), "--format", "hf"], capsys, "give --format")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # Never overwrites: another file, another export, a dangling symlink (a planted redirect).
    (tmp_path / "taken").write_text("mine")
    usage(["export", str(llama_run), "--format", "safetensors", "-o", str(tmp_path / "taken")], capsys,
          "already exists")
    assert (tmp_path / "taken").read_text() == "mine"
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    usage(["export", str(llama_run), "--format", "torch", "-o", str(tmp_path / "link")], capsys, "is a symbolic link (to ")
    assert not (tmp_path / "elsewhere").exists()
    assert main(["export", str(llama_run), "--step", "4", "--format", "dcp", "-o", str(tmp_path / "d")]) == 0
    usage(["export", str(llama_run), "--step", "12", "--format", "dcp", "-o", str(tmp_path / "d")], capsys,
          "already exists (and is not this export of this checkpoint)")
    usage(["export", str(llama_run), "--step", "4", "--format", "hf", "-o", str(tmp_path / "d")], capsys,
          "already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "link", "taken"]
    # Not into the run's checkpoints (validation would then find a stranger there).
    inside = llama_run / "checkpoints" / "step_12" / "model.safetensors"
    usage(["export", str(llama_run), "--format", "safetensors", "-o", str(inside)], capsys, "lies inside the run's")
    assert not inside.exists()


def test_promote_then_export_to_s3_uploads_the_hf_directory_under_dest(llama_run, tmp_path):
    import boto3
    from moto import mock_aws

    from resilient_training.gates.export import export_promoted
    from resilient_training.gates.promote import promote

    run = Path(shutil.copytree(llama_run, tmp_path / "run", symlinks=True))
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="models")
        promote(run, "s3://models/llama/v1", s3_client=client)
        outcome = export_promoted(run, "s3://models/llama/v1", "hf", s3_client=client)
        keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="models")["Contents"])
        hf = [k for k in keys if k.startswith("llama/v1/hf/")]
        assert {"llama/v1/hf/config.json", "llama/v1/hf/model.safetensors", "llama/v1/hf/tokenizer_config.json",
                "llama/v1/hf/export.json"} <= set(hf)
        assert "llama/v1/promotion.json" in keys and outcome["out"] == "s3://models/llama/v1/hf"
        body = client.get_object(Bucket="models", Key="llama/v1/hf/export.json")["Body"].read()
        assert json.loads(body)["source"]["checkpoint"] == "checkpoints/step_12"


def test_a_repeat_is_a_no_op_only_for_the_same_bytes(llama_run, tmp_path, capsys):
    """Found by a stranger trial: repeating a torch export was refused (no record to recognise it),
    and a safetensors export with a flipped weight byte, or another run's, was "already exported"
    (only its header's source was read). A repeat now compares with a fresh export, byte for byte."""
    for fmt, name in (("torch", "m.pt"), ("safetensors", "m.st"), ("dcp", "dcp"), ("hf", "hf")):
        out = tmp_path / name
        assert main(["export", str(llama_run), "--format", fmt, "-o", str(out)]) == 0, fmt
        capsys.readouterr()
        assert main(["export", str(llama_run), "--format", fmt, "-o", str(out), "--json"]) == 0, fmt
        assert json.loads(capsys.readouterr().out)["already_exported"] is True, fmt
        target = out if out.is_file() else max((p for p in out.rglob("*") if p.is_file() and p.name != "export.json"),
                                               key=lambda p: p.stat().st_size)
        data = bytearray(target.read_bytes())
        data[-100] ^= 0x01  # inside the tensor data of every format's largest file
        target.write_bytes(bytes(data))
        assert main(["export", str(llama_run), "--format", fmt, "-o", str(out)]) == 2, fmt
        err = capsys.readouterr().err
        assert "is not byte for byte this checkpoint's" in err and err.count("\n") == 1, (fmt, err)
        assert target.read_bytes() == bytes(data), fmt  # refused, never overwritten
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-export-")]  # no verification left behind


def test_a_torch_export_to_a_name_without_a_suffix_works_and_is_recognised_again(gpt_run, tmp_path, capsys):
    """Stranger trial: `-o model_noext` gave torch's RuntimeError (its archive named after the
    staging file, whose only dot led it), and so did exporting again onto the same file."""
    out = tmp_path / "model_noext"
    assert main(["export", str(gpt_run), "--format", "torch", "-o", str(out)]) == 0
    assert "model" in torch.load(out, weights_only=True)
    assert main(["export", str(gpt_run), "--format", "torch", "-o", str(out)]) == 0  # the same export: done
    assert not list(tmp_path.glob(".tmp-export-*"))
    other = tmp_path / "existing"
    other.write_text("hi")
    capsys.readouterr()
    assert main(["export", str(gpt_run), "--format", "torch", "-o", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err and other.read_text() == "hi"


def test_an_export_to_where_another_export_or_promotion_is_writing_is_refused(gpt_run, tmp_path, capsys):
    """A fourth stranger trial: two exports to one file both said "exported" while one replaced the
    other; two to one directory left the winner missing files, "exported": true. One destination
    lock for promotions and exports alike."""
    from resilient_training.gates import promote

    out = tmp_path / "model.safetensors"
    holder = {"source": {"step": 1, "run_dir": "other", "manifest_checksum": "x"}}
    with promote.destination_lock(out, holder):
        refused(["export", str(gpt_run), "--format", "safetensors", "-o", str(out)], capsys,
                f"another promotion or export to {out} is in progress", out)
    assert main(["export", str(gpt_run), "--format", "safetensors", "-o", str(out)]) == 0
    capsys.readouterr()


def test_a_file_put_at_the_output_meanwhile_is_not_replaced(gpt_run, tmp_path, capsys, monkeypatch):
    from resilient_training.gates import export as ex

    out = tmp_path / "model.pt"
    write = ex.WRITERS["torch"]

    def racing(ckpt_dir, staging, record):  # something else writes OUT while the export is written
        write(ckpt_dir, staging, record)
        out.write_bytes(b"someone else's")

    monkeypatch.setitem(ex.WRITERS, "torch", racing)
    assert main(["export", str(gpt_run), "--format", "torch", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"refused: {out} appeared while this export was written") and err.count("\n") == 1, err
    assert out.read_bytes() == b"someone else's" and not list(tmp_path.glob(".tmp-export-*"))


def test_a_checkpoint_removed_while_it_is_exported_is_one_line(gpt_run, tmp_path, capsys, monkeypatch):
    from resilient_training.gates import export as ex

    run = Path(shutil.copytree(gpt_run, tmp_path / "run", symlinks=True))
    out = tmp_path / "copy"
    write = ex.WRITERS["dcp"]

    def pruned(ckpt_dir, staging, record):  # the step pruned (a resume's --keep-last) mid-copy
        shutil.rmtree(ckpt_dir)
        write(ckpt_dir, staging, record)

    monkeypatch.setitem(ex.WRITERS, "dcp", pruned)
    assert main(["export", str(run), "--format", "dcp", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused: ") and "changed while it was exported" in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))
