"""Byte-level text data for the built-in tasks: real files, split deterministically across ranks.

The corpus is a sorted list of text files read as one token stream: each byte ``b`` is token
``b + 3`` and every file ends with an end-of-text token, the ids of Hugging Face's
``ByT5Tokenizer(extra_ids=0)`` (pad 0, eos 1, unk 2), so an exported model comes with a tokenizer
that needs no download. Nothing is loaded up front: only file sizes are read at start, and a
sample's bytes are read when it is drawn, so a corpus of any size on shared storage costs no memory.

Samples are non-overlapping windows of ``seq_len + 1`` tokens, visited in a seeded permutation per
epoch. Position ``g`` is global (samples consumed by all ranks together): at each step rank ``r`` of
``W`` reads samples ``g + r*B .. g + r*B + B - 1`` and every rank advances ``g`` by ``W*B``. The
state is that one number (the same on every rank), so a resume at another world size continues at
the very sample the interrupted run would have read next.
"""

from __future__ import annotations

import bisect
import glob
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.utils.data import IterableDataset

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET
# Not text, or another package's files rather than the standard library's own.
_SKIP_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts)
                   and p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def glob_files(pattern: str) -> list[Path]:
    """Regular files matching ``pattern`` (``**`` recurses), in a fixed order."""
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))


def encode(text: str | bytes) -> torch.Tensor:
    """Token ids of ``text`` (no end-of-text token)."""
    data = text.encode() if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + BYTE_OFFSET


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Text of token ids; special tokens are dropped, invalid UTF-8 is replaced."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(t - BYTE_OFFSET for t in ids if BYTE_OFFSET <= t < VOCAB_SIZE).decode(errors="replace")


class ByteCorpus:
    """Files read as one stream of byte tokens, each file followed by an end-of-text token."""

    def __init__(self, files: list[Path], *, source: str) -> None:
        if not files:
            raise ValueError(f"no text files in {source}")
        self.files = files
        self.source = source
        sizes = [f.stat().st_size for f in files]
        self._starts = [0]
        for size in sizes:
            self._starts.append(self._starts[-1] + size + 1)  # + the end-of-text token
        root = os.path.commonpath([str(f) for f in files]) if len(files) > 1 else str(files[0].parent)
        digest = xxhash.xxh3_64()
        for f, size in zip(files, sizes, strict=True):
            digest.update(f"{os.path.relpath(f, root)}\0{size}\n".encode())
        # Names and sizes: a resume onto other data (another interpreter's stdlib, edited files) is refused.
        self.fingerprint = f"{len(files)}:{self.num_tokens}:{digest.hexdigest()}"

    @classmethod
    def from_spec(cls, data: str = "") -> ByteCorpus:
        """The standard library of this interpreter (``data`` empty) or the files ``data`` globs."""
        if not data:
            return cls(stdlib_files(), source=f"the standard library ({sysconfig.get_paths()['stdlib']})")
        return cls(glob_files(data), source=f"data={data}")

    @property
    def num_tokens(self) -> int:
        return self._starts[-1]

    def tokens(self, start: int, length: int) -> torch.Tensor:
        """Tokens ``start .. start+length-1`` of the stream (int64)."""
        out = torch.full((length,), EOS_ID, dtype=torch.long)
        pos, end = start, start + length
        index = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            file_start, file_end = self._starts[index], self._starts[index + 1] - 1  # file_end: its EOS slot
            take = min(end, file_end) - pos
            if take > 0:
                with open(self.files[index], "rb") as handle:
                    handle.seek(pos - file_start)
                    data = handle.read(take)
                if len(data) != take:
                    raise RuntimeError(f"{self.files[index]} changed while training (read {len(data)} of {take} "
                                       "bytes): the data must stay fixed for a deterministic resume")
                out[pos - start: pos - start + take] = encode(data)
                pos += take
            pos += 1 if pos == file_end else 0  # the end-of-text token is already in ``out``
            index += 1
        return out


class TokenWindows(IterableDataset):
    """Batches ``[batch_size, seq_len + 1]`` of one rank; stateful at the global sample position."""

    def __init__(self, corpus: ByteCorpus, *, seq_len: int, batch_size: int, rank: int, world_size: int,
                 seed: int) -> None:
        super().__init__()
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_samples = (corpus.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{corpus.source} holds {corpus.num_tokens} tokens: fewer than one sample of "
                             f"seq_len+1 = {seq_len + 1}")
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def sample_index(self, position: int) -> int:
        """Window number of global sample ``position``: a fresh seeded permutation each epoch."""
        epoch, offset = divmod(position, self.num_samples)
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_samples, generator=generator))
        return int(self._order[1][offset])

    def sample(self, position: int) -> torch.Tensor:
        return self.corpus.tokens(self.sample_index(position) * self.seq_len, self.seq_len + 1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            first = self.position + self.rank * self.batch_size
            batch = torch.stack([self.sample(first + i) for i in range(self.batch_size)])
            # Advance before yielding: a state taken after this batch resumes at the next one.
            self.position += self.world_size * self.batch_size
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "corpus": self.corpus.fingerprint, "seq_len": self.seq_len,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("corpus", "seq_len", "seed"):
            if state.get(key) != mine[key]:
                raise ValueError(f"the checkpoint's data {key} is {state.get(key)!r} but this run's is {mine[key]!r} "
                                 f"({self.corpus.source}): resuming would not continue the same sample sequence")
        self.position = int(state["position"])
