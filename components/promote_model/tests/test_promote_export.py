"""promote_model's ``export`` option through the KFP local runner, on a real gated Llama run."""

import json
from pathlib import Path

import pytest
import torch

from resilient_training.components.promote_model import promote_model
from resilient_training.gates.promote import read_promotion
from tests.support.gates import copy_run
from tests.support.runs import gated_llama_run

pytestmark = pytest.mark.slow


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    return copy_run(gated_llama_run(tmp_path_factory.getbasetemp()), tmp_path / "run")


def test_promote_with_export_writes_the_model_inside_dest_and_a_repeat_is_a_noop(kfp_local, run, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dest = tmp_path / "models" / "llama"
    task = promote_model(checkpoint=str(run), dest=str(dest), export="safetensors")
    assert read_promotion(str(dest))["source"]["checkpoint"] == "checkpoints/step_12"
    assert task.outputs["model"].metadata["export"] == str(dest / "model.safetensors")
    dcp_to_torch_save(str(dest), str(tmp_path / "promoted.pt"))  # DEST itself stays a DCP checkpoint
    expected = torch.load(tmp_path / "promoted.pt", weights_only=True)["model"]
    tensors = load_file(str(dest / "model.safetensors"))
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
    again = promote_model(checkpoint=str(run), dest=str(dest), export="safetensors")
    record = json.loads(Path(again.outputs["promotion"].path).read_text())
    assert record["outcome"]["already_promoted"] and record["export"]["already_exported"]


def test_an_unknown_export_fails_before_anything_is_promoted(kfp_local, run, tmp_path):
    with pytest.raises(RuntimeError, match="promote-model"):
        promote_model(checkpoint=str(run), dest=str(tmp_path / "dest"), export="onnx")
    assert not (tmp_path / "dest").exists()
