"""Built-in task: a Hugging Face ``LlamaForCausalLM`` on real text, byte-level tokens.

Use it as ``--task resilient_training.tasks.llama:LlamaTask`` with ``--task-arg KEY=VALUE``:

- ``preset``: ``tiny`` (0.5M parameters, seconds on a CPU), ``20m`` (19.5M, CPU tests),
  ``150m`` (142M), ``1b`` (1.1B, GPUs). ``hidden_size``, ``intermediate_size``, ``num_layers``,
  ``num_heads``, ``num_kv_heads`` override the preset's sizes.
- ``data``: a glob of the user's text files (``/fsx/corpus/**/*.txt``); by default the running
  interpreter's standard-library sources, which every machine has and no one here wrote.
- ``seq_len``, ``batch_size`` (samples per rank per step), ``lr``, ``weight_decay``.

The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded; the trainer seeds
torch's generator with the run's seed, so every rank and every restart builds the same one). Token ids are those of
``transformers.ByT5Tokenizer(extra_ids=0)``: an exported model carries that tokenizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from resilient_training.runtime.task import parse_arg
from resilient_training.tasks import text

# name: (hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 352, 2, 4, 4),
    "20m": (512, 1408, 6, 8, 8),
    "150m": (1024, 2816, 12, 16, 8),
    "1b": (2048, 8192, 18, 32, 8),
}
_SIZES = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def _arg(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(kw_only=True)
class LlamaTask:
    """Settings of the Llama task; every field is a ``--task-arg`` (strings are converted)."""

    preset: str = _arg("20m", f"model size: {', '.join(PRESETS)}")
    data: str = _arg("", "glob of text files (default: this interpreter's standard library)")
    seq_len: int = _arg(128, "tokens per sample")
    batch_size: int = _arg(8, "samples per rank per step")
    lr: float = _arg(1e-3, "AdamW learning rate")
    weight_decay: float = _arg(0.0, "AdamW weight decay")
    hidden_size: int = _arg(0, "override the preset's hidden size (0 = preset)")
    intermediate_size: int = _arg(0, "override the preset's MLP size (0 = preset)")
    num_layers: int = _arg(0, "override the preset's decoder layers (0 = preset)")
    num_heads: int = _arg(0, "override the preset's attention heads (0 = preset)")
    num_kv_heads: int = _arg(0, "override the preset's key/value heads (0 = preset)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            if isinstance(value, str) and kind is not str:
                try:
                    value = parse_arg(value, kind)
                except ValueError:
                    raise ValueError(f"llama task arg {f.name}={value!r} is not a{'n int' if kind is int else ' float'}"
                                     ) from None
                setattr(self, f.name, value)
        if self.preset not in PRESETS:
            raise ValueError(f"llama task arg preset={self.preset!r}: choose one of {', '.join(PRESETS)}")
        for name in ("seq_len", "batch_size", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"llama task arg {name} must be positive, got {getattr(self, name)}")
        if any(getattr(self, name) < 0 for name in _SIZES) or self.weight_decay < 0:
            raise ValueError("llama task size overrides and weight_decay must be >= 0")
        sizes = self.sizes()
        if sizes["hidden_size"] % sizes["num_heads"] or sizes["num_heads"] % sizes["num_kv_heads"]:
            raise ValueError(f"llama: hidden_size ({sizes['hidden_size']}) must be divisible by num_heads "
                             f"({sizes['num_heads']}), and num_heads by num_kv_heads ({sizes['num_kv_heads']})")

    def sizes(self) -> dict[str, int]:
        preset = dict(zip(_SIZES, PRESETS[self.preset], strict=True))
        return {name: getattr(self, name) or preset[name] for name in _SIZES}

    def model_config(self) -> Any:
        from transformers import LlamaConfig

        sizes = self.sizes()
        return LlamaConfig(
            vocab_size=text.VOCAB_SIZE,
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            num_hidden_layers=sizes["num_layers"],
            num_attention_heads=sizes["num_heads"],
            num_key_value_heads=sizes["num_kv_heads"],
            max_position_embeddings=max(self.seq_len, 2048),
            # Separate input and output embeddings: every state-dict entry is its own tensor, which
            # safetensors and DCP both want.
            tie_word_embeddings=False,
            pad_token_id=text.PAD_ID,
            bos_token_id=text.EOS_ID,
            eos_token_id=text.EOS_ID,
        )

    def build_model(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        # Random weights from torch's generator, which the trainer seeds with the run's seed.
        return LlamaForCausalLM(self.model_config())

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay)

    def build_data(self, rank: int, world_size: int, seed: int) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        windows = text.TokenWindows(text.ByteCorpus.from_spec(self.data), seq_len=self.seq_len,
                                    batch_size=self.batch_size, rank=rank, world_size=world_size, seed=seed)
        # The dataset yields whole batches; no worker processes, so the state is exactly what was consumed.
        return StatefulDataLoader(windows, batch_size=None, num_workers=0)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        batch = batch.to(device, non_blocking=True)
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def shard(self, model: nn.Module, mesh: Any) -> nn.Module:
        """One FSDP2 unit per decoder layer, then the rest: only one layer's full weights at a time."""
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of these token ids (byte-level; built locally, no download)."""
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)


def task(**task_args: str) -> LlamaTask:
    """``--task resilient_training.tasks.llama:task``: the task from its ``--task-arg`` values."""
    unknown = sorted(set(task_args) - {f.name for f in dataclasses.fields(LlamaTask)})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(LlamaTask))
        raise ValueError(f"llama task: unknown task arg {', '.join(unknown)} (known: {known})")
    return LlamaTask(**task_args)
