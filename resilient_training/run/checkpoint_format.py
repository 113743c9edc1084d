"""The checkpoint contract: layout on storage, shard files, manifest, and the commit protocol.

Layout::

    RUN/checkpoints/
      latest                    # one line, "step_40": replaced atomically after each commit
      step_40/
        manifest.json           # written last; its presence inside step_N/ marks the commit
        rank_0.pt               # one shard per rank (torch.save, loadable with weights_only=True)
        rank_1.pt
      .tmp-step_45-a1i0/        # a save in flight (or abandoned by a crash): never loaded

A shard is ``{"meta": {...plain values...}, "tensors": {flat_name: Tensor}}`` where the flat
names are ``model/<fqn>`` and ``optim/<fqn>/<state>``. Tensors are the rank's dim-0 slice of
the global tensor (what FSDP2 ``Shard(0)`` holds); ``meta["layout"][name]`` records the
global shape and the slice's offset, which is all that resharding to another world size needs.

Commit protocol (rank 0, after every rank reported its shard durable): write the manifest into
the temporary directory, fsync it, rename the directory to ``step_N``, fsync ``checkpoints/``,
then replace ``latest`` through a fsynced temporary file. A crash at any moment leaves
``latest`` naming a directory whose manifest and shards are complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

FORMAT_VERSION = 1
LATEST_NAME = "latest"
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_128"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")
_READ_CHUNK = 8 << 20


# Shard metadata every rank must agree on; commit() lifts it into the manifest.
SHARED_META = ("step", "optimizer_step", "data_position")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what is being loaded."""


def shard_name(rank: int) -> str:
    return f"rank_{rank}.pt"


def sidecar_name(rank: int) -> str:
    return f"rank_{rank}.json"


def step_dirname(step: int) -> str:
    return f"step_{step}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def checksum_file(path: str | os.PathLike[str], chunk: int = _READ_CHUNK) -> tuple[int, str]:
    """(bytes, hex digest) of a file, read in large chunks."""
    hasher = new_hasher()
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            block = handle.read(chunk)
            if not block:
                break
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


class _HashingWriter:
    """A write-only file object that hashes what passes through, so no re-read is needed."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.hasher = new_hasher()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.hasher.update(view)
        self.size += len(view)
        return self._handle.write(view)

    def flush(self) -> None:
        self._handle.flush()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """What rank ``rank`` wrote: reported through a sidecar, gathered into the manifest."""

    rank: int
    file: str
    bytes: int
    checksum: str
    tensors: dict[str, dict[str, Any]]
    # The shard's step, optimizer step and data position: commit() checks every rank agrees
    # and records them in the manifest, which restore and validation read.
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "bytes": self.bytes, "checksum": self.checksum,
                "tensors": self.tensors, "meta": self.meta}


def tensor_checksum(tensor: Any) -> str:
    """xxh3_128 of a tensor's bytes (C order): the same digest whoever holds the values.

    Recorded per tensor in the manifest at save time, so validation can prove that a tensor
    loaded into a fresh model is bit-identical to the one the trainer saved.
    """
    import torch

    flat = tensor.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return new_hasher().hexdigest()
    return xxhash.xxh3_128_hexdigest(memoryview(flat.view(torch.uint8).numpy()))


def tensor_entry(tensor: Any, layout: Mapping[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "checksum": tensor_checksum(tensor)}
    if layout:
        entry.update(layout)
    return entry


def write_shard(
    tmp_dir: str | os.PathLike[str],
    rank: int,
    shard: Mapping[str, Any],
    *,
    torn_write: bool = False,
) -> ShardRecord:
    """Write one rank's shard durably into ``tmp_dir`` and report it in a sidecar.

    The shard is streamed through a hasher (no second read), fsynced, then renamed from a
    ``.partial`` name so a shard file that exists is always whole. With ``torn_write`` the
    process kills itself with SIGKILL halfway through the bytes (fault injection: the
    ``ckpt-kill`` and ``writer-kill`` faults), leaving only the ``.partial`` file.
    """
    import io
    import signal

    import torch

    tmp_dir = Path(tmp_dir)
    final = tmp_dir / shard_name(rank)
    partial = final.with_suffix(".pt.partial")
    with open(partial, "wb") as handle:
        writer = _HashingWriter(handle)
        if torn_write:
            buffer = io.BytesIO()
            torch.save(dict(shard), buffer)
            data = buffer.getvalue()
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save(dict(shard), writer)
        writer.flush()
        os.fsync(handle.fileno())
    os.replace(partial, final)
    layout = shard["meta"].get("layout", {})
    record = ShardRecord(
        rank=rank,
        file=final.name,
        bytes=writer.size,
        checksum=writer.hasher.hexdigest(),
        tensors={name: tensor_entry(t, layout.get(name)) for name, t in shard["tensors"].items()},
        meta={k: shard["meta"][k] for k in SHARED_META if k in shard["meta"]},
    )
    sidecar = tmp_dir / sidecar_name(rank)
    sidecar_tmp = sidecar.with_suffix(".json.partial")
    sidecar_tmp.write_text(json.dumps(record.to_dict()))
    os.replace(sidecar_tmp, sidecar)
    return record


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def commit(
    tmp_dir: str | os.PathLike[str],
    *,
    step: int,
    world_size: int,
    manifest_fields: Mapping[str, Any],
    keep_last: int = 3,
    ranks: list[int] | None = None,
) -> Path:
    """Turn a temporary directory holding every rank's shard into committed ``step_N``.

    Called by rank 0 only, once all ranks reported their shard durable. Returns the path of
    the committed checkpoint. ``ranks`` names the shards a partial (node-local tier)
    checkpoint holds; by default all ``world_size`` of them.
    """
    tmp_dir = Path(tmp_dir)
    root = tmp_dir.parent
    ranks = list(range(world_size)) if ranks is None else ranks
    shards: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        sidecar = tmp_dir / sidecar_name(rank)
        if not sidecar.exists():
            raise CheckpointError(f"cannot commit step {step}: rank {rank} reported no shard in {tmp_dir}")
        record = json.loads(sidecar.read_text())
        shards[record["file"]] = record
    shared = _agreed_meta(shards.values(), step=step, tmp_dir=tmp_dir)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "created": time.time(),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": {name: {"rank": r["rank"], "bytes": r["bytes"], "checksum": r["checksum"]}
                  for name, r in sorted(shards.items())},
        "tensors": {name: r["tensors"] for name, r in sorted(shards.items())},
        **shared,
        **manifest_fields,
    }
    if ranks != list(range(world_size)):
        manifest["ranks"] = ranks
    for rank in ranks:
        (tmp_dir / sidecar_name(rank)).unlink()
    _atomic_write_text(tmp_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True))
    fsync_dir(tmp_dir)
    final = root / step_dirname(step)
    if final.exists():
        # Only reachable when a crash fell between this rename and the `latest` update of an
        # earlier attempt: `latest` does not name it, so it can be moved aside safely.
        shutil.rmtree(final.rename(root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"))
    tmp_dir.rename(final)
    fsync_dir(root)
    _atomic_write_text(root / LATEST_NAME, final.name + "\n")
    fsync_dir(root)
    prune(root, keep_last=keep_last)
    return final


RUN_UID_FILENAME = "run_uid"


def run_uid(run_dir: str | os.PathLike[str]) -> str:
    """The identity of this run directory's lineage, made once by whichever process asks first.

    A run directory deleted and created again gets a new one, so state kept outside it (the
    node-local tier in /dev/shm, which outlives the processes and the run directory) is never
    mistaken for this run's. Hard-linking a finished temporary file publishes it atomically and
    never overwrites, also on shared file systems, so every rank and node reads the same value.
    """
    import uuid

    path = Path(run_dir) / RUN_UID_FILENAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{TMP_PREFIX}{RUN_UID_FILENAME}.{uuid.uuid4().hex}")
        tmp.write_text(uuid.uuid4().hex)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank published it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def iteration_file(run_dir: str | os.PathLike[str]) -> str:
    """The file ft_launcher 0.6+ reads (``--ft-checkpoint-iteration-file``) to stop restart loops
    that make no progress: the last persistently committed step.
    """
    return os.path.join(str(run_dir), "ft_iteration")


def write_iteration_file(run_dir: str | os.PathLike[str], step: int) -> None:
    _atomic_write_text(Path(iteration_file(run_dir)), f"{step}\n")


def _agreed_meta(records: Any, *, step: int, tmp_dir: Path) -> dict[str, Any]:
    """optimizer_step / data_position all ranks recorded; refuses shards of mixed steps."""
    values: dict[str, set[Any]] = {}
    for record in records:
        for key, value in record.get("meta", {}).items():
            values.setdefault(key, set()).add(value)
    if values.get("step", {step}) != {step}:
        raise CheckpointError(f"cannot commit step {step}: shards in {tmp_dir} record steps {sorted(values['step'])}")
    for key, seen in values.items():
        if len(seen) > 1:
            raise CheckpointError(f"cannot commit step {step}: ranks disagree on {key} ({sorted(seen)})")
    return {key: seen.pop() for key, seen in values.items() if key != "step"}


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps of directories that carry a manifest (the commit marker), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        step = parse_step_dirname(child.name)
        if step is not None and (child / MANIFEST_NAME).is_file():
            steps.append(step)
    return sorted(steps)


def prune(root: Path, *, keep_last: int) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` (never the latest)."""
    if keep_last <= 0:
        return
    latest = read_latest(root)
    for step in committed_steps(root)[:-keep_last]:
        path = root / step_dirname(step)
        if latest is None or path.resolve() != latest.resolve():
            shutil.rmtree(path, ignore_errors=True)


def read_latest(root: str | os.PathLike[str]) -> Path | None:
    """The committed checkpoint ``latest`` names, or None before the first commit."""
    root = Path(root)
    pointer = root / LATEST_NAME
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if parse_step_dirname(name) is None:
        raise CheckpointError(f"{pointer} names {name!r}, which is not a step directory")
    path = root / name
    if not (path / MANIFEST_NAME).is_file():
        raise CheckpointError(f"{pointer} names {name}, which has no {MANIFEST_NAME}")
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a committed checkpoint") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def load_shard(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load one shard without unpickling arbitrary objects (``weights_only=True``)."""
    import torch

    # mmap: tensors are read from the page cache on first use instead of copied up front.
    shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(shard, dict) or "meta" not in shard or "tensors" not in shard:
        raise CheckpointError(f"{path} is not a shard of format {FORMAT_VERSION}")
    return shard


def iter_shards(ckpt_dir: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for rank in range(manifest["world_size"]):
        yield load_shard(Path(ckpt_dir) / shard_name(rank))


def chunk_bounds(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s slice along dim 0: ``torch.chunk`` semantics, as FSDP2
    ``Shard(0)`` splits (ranks past the last chunk get an empty slice).
    """
    chunk = -(-dim0 // world_size) if dim0 else 0
    offset = min(rank * chunk, dim0)
    return offset, max(0, min(chunk, dim0 - offset))


def split_dim0(tensor: Any, world_size: int) -> list[tuple[int, Any]]:
    """(offset, slice) of each rank (see :func:`chunk_bounds`). The inverse of
    :func:`assemble_full`; resharding to another world size is ``assemble_full`` then this.
    """
    out = []
    for rank in range(world_size):
        offset, length = chunk_bounds(tensor.shape[0], world_size, rank)
        out.append((offset, tensor[offset : offset + length]))
    return out


def assemble_full(shards: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Global tensors from every rank's dim-0 slices (the inverse of ``Shard(0)``)."""
    import torch

    pieces: dict[str, list[tuple[int, Any]]] = {}
    global_shapes: dict[str, list[int]] = {}
    for shard in shards:
        layout = shard["meta"]["layout"]
        for name, tensor in shard["tensors"].items():
            pieces.setdefault(name, []).append((layout[name]["offset"], tensor))
            global_shapes[name] = layout[name]["global_shape"]
    full: dict[str, Any] = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        tensor = torch.cat([t for _, t in parts], dim=0) if len(parts) > 1 else parts[0][1]
        if list(tensor.shape) != global_shapes[name]:
            raise CheckpointError(
                f"tensor {name}: slices assemble to {list(tensor.shape)}, expected {global_shapes[name]}"
            )
        full[name] = tensor
    return full
