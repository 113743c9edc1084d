"""The checkpoint contract: layout on storage, the DCP files, the manifest, and the commit protocol.

Layout::

    RUN/checkpoints/
      latest                    # one line, "step_40": replaced atomically after each commit
      step_40/                  # a PyTorch Distributed Checkpoint (DCP) directory, plus manifest.json
        manifest.json           # written last; its presence inside step_N/ marks the commit
        .metadata               # DCP's metadata: every tensor's global size and chunks, where each lies
        __0_0.distcp            # rank 0's chunks (DCP's file format: torch.save per chunk); with
        __1_0.distcp            #   N write threads a rank writes N files, __R_0 ... __R_{N-1}
        data_rank_0.pt          # rank 0's data-loader state (torch.save; loads with weights_only=True)
        data_rank_1.pt
      .tmp-step_45-a1i0/        # a save in flight (or abandoned by a crash): never loaded

The DCP state dict is ``{"model": ..., "optim": ..., ["lr_scheduler": ...]}`` as
``torch.distributed.checkpoint.state_dict.get_state_dict`` returns it (so any optimizer and any
FSDP2 layout), so ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(step_dir, out)``
gives a plain ``{"model": model.state_dict(), ...}`` without this package. Each rank writes its
own chunks (and, rank 0 only, the replicated values) through DCP's ``FileSystemWriter`` into the
temporary directory and reports them in a sidecar ``rank_R.json``: every chunk's offsets, sizes
and xxh3_128 checksum, every file's bytes and checksum. No collective is needed: at the commit,
rank 0 builds DCP's ``.metadata`` from the sidecars.

``manifest.json`` (this product's, on top of DCP): format version, step, world size, every
file's bytes and checksum, every tensor's chunks with their checksums, the per-rank data state,
the task and versions. Validation proves the files against it and it against ``.metadata``.

Commit protocol (rank 0, after every rank reported its files durable): write ``.metadata`` and
the manifest into the temporary directory, fsync them, rename the directory to ``step_N``, fsync
``checkpoints/``, then replace ``latest`` through a fsynced temporary file. A crash at any moment
leaves ``latest`` naming a directory whose manifest and files are complete.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

FORMAT_VERSION = 2
LATEST_NAME = "latest"
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_128"
METADATA_NAME = ".metadata"  # DCP's
TMP_PREFIX = ".tmp-"
PRUNED_PREFIX = f"{TMP_PREFIX}pruned-"  # a pruned checkpoint, moved aside before it is deleted
_SHARD_FILE = re.compile(r"__(0|[1-9][0-9]*)_(0|[1-9][0-9]*)\.distcp")
# The name step_dirname gives (no leading zero, ASCII digits): step_040 or step_٤٠ would be read as
# step 40 by some readers and be no step to others (a stranger trial passed the gates with one).
_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]*)")
_READ_CHUNK = 8 << 20
READ_BLOCK = 16 << 20  # the views a file is hashed in (hash_files)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match what is being loaded."""


class CheckpointRefused(CheckpointError):
    """A checkpoint this run must not resume from, whatever it retries: another model's, another
    run's, or damaged. A worker stops with this line instead of restarting into it again.
    """


def shard_name(rank: int, index: int = 0) -> str:
    """DCP data file ``index`` of rank ``rank`` (``FileSystemWriter(single_file_per_rank=True)``
    writes ``thread_count`` of them per rank, numbered from 0).
    """
    return f"__{rank}_{index}.distcp"


def shard_rank_index(name: str) -> tuple[int, int] | None:
    """(rank, index) of a DCP data file name, or None for any other name."""
    match = _SHARD_FILE.fullmatch(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def torn_files(tmp_dir: str | os.PathLike[str], rank: int) -> list[Path]:
    """The truncated data files a write of rank ``rank`` killed halfway left in ``tmp_dir``."""
    return sorted(Path(tmp_dir).glob(f"__{rank}_*.distcp.partial"))


def data_name(rank: int) -> str:
    return f"data_rank_{rank}.pt"


def data_rank_index(name: str) -> int | None:
    """The rank of a :func:`data_name`, or None for any other name."""
    match = re.fullmatch(r"data_rank_([0-9]+)\.pt", name)
    return int(match.group(1)) if match else None


def sidecar_name(rank: int) -> str:
    return f"rank_{rank}.json"


def error_name(rank: int) -> str:
    """Why rank ``rank``'s write failed (one line), left in the temporary directory by its writer."""
    return f"rank_{rank}.error"


def step_dirname(step: int) -> str:
    return f"step_{step}"


def write_dirname(step: int, tag: str) -> str:
    """The temporary directory a save of ``step`` is written into before its commit renames it."""
    return f"{TMP_PREFIX}{step_dirname(step)}-{tag}"


def stale_writes(root: str | os.PathLike[str], *, live_tag_prefix: str) -> list[Path]:
    """Temporary directories no process will commit: saves whose tag does not start with
    ``live_tag_prefix`` (a process killed while it wrote, or a save abandoned by an earlier round),
    and the ``replaced-`` leftovers of a commit killed while it deleted. Each can be a whole
    checkpoint's size: on one H200 a 1.3B run's killed saves (16 GB each) filled the 64 GB disk
    and the writer died of ENOSPC (2026-12-02). An empty ``live_tag_prefix`` names none.

    Also ``.tmp-latest.<pid>``: a commit killed between writing ``latest``'s temporary file and
    renaming it (CI, a rank stopped by the launcher while it committed). Only the rank that commits
    this root writes it, and callers ask once that rank's commits are settled, so whatever pid
    (of whichever node) is in the name, no process will rename it.
    """
    if not live_tag_prefix:
        return []
    found = []
    for child in Path(root).iterdir():
        name = child.name
        if name.startswith(f"{TMP_PREFIX}replaced-"):
            found.append(child)
        elif name.startswith(f"{TMP_PREFIX}{LATEST_NAME}.") and name.rpartition(".")[2].isdigit() \
                and child.is_file() and not child.is_symlink():
            found.append(child)
        elif name.startswith(f"{TMP_PREFIX}step_") and child.is_dir():
            tag = name.partition("-")[2].partition("-")[2]  # ".tmp-step_N-<tag>"
            if not tag.startswith(live_tag_prefix):
                found.append(child)
    return sorted(found)


def earlier_iterations(root: str | os.PathLike[str], tag: str) -> list[Path]:
    """Temporary directories of saves that earlier in-process iterations of ``tag``'s round left
    ("<round>i<k>", k below ``tag``'s own): abandoned by their restart, never to be committed.
    Never a later iteration's (it may be writing now) nor another round's (``stale_writes``).
    """
    round_tag, sep, current = tag.rpartition("i")
    if not sep or not current.isdigit():
        return []
    found = []
    for child in Path(root).iterdir():
        if child.name.startswith(f"{TMP_PREFIX}step_") and child.is_dir():
            other = child.name.partition("-")[2].partition("-")[2]  # ".tmp-step_N-<tag>"
            other_round, sep, k = other.rpartition("i")
            if sep and other_round == round_tag and k.isdigit() and int(k) < int(current):
                found.append(child)
    return sorted(found)


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


def _read_and_hash(path: Path) -> tuple[int, str, float]:
    """(bytes, xxh3_128 hex, seconds) of one file.

    Hashes a read-only memory map in 16 MiB views: no copy out of the page cache, so hashing
    runs faster than a plain read() of the same file (measured: benchmarks/). Empty files
    and files that cannot be mapped fall back to large reads into a reused buffer.
    """
    hasher = new_hasher()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            # MAP_POPULATE: the kernel faults the whole file in up front with large reads
            # (page faults one by one read ahead too little when the file is not cached).
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                               prot=mmap.PROT_READ) if size else None
        except (OSError, ValueError):
            mapped = None
        if mapped is not None:
            with mapped:
                view = memoryview(mapped)
                try:
                    for offset in range(0, size, READ_BLOCK):
                        hasher.update(view[offset:offset + READ_BLOCK])
                finally:
                    view.release()
            return size, hasher.hexdigest(), time.perf_counter() - start
        buffer = bytearray(READ_BLOCK)
        block = memoryview(buffer)
        size = 0
        while n := handle.readinto(buffer):
            hasher.update(block[:n])
            size += n
    return size, hasher.hexdigest(), time.perf_counter() - start


def hash_files(paths: list[Path], threads: int | None = None) -> dict[Path, tuple[int, str, float] | OSError]:
    """Checksum files in parallel threads; an unreadable file maps to its OSError."""
    workers = max(1, min(len(paths), threads or os.cpu_count() or 1))

    def one(path: Path) -> tuple[int, str, float] | OSError:
        try:
            return _read_and_hash(path)
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))


def file_mismatch(outcome: tuple[int, str, float] | OSError, entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(finding code, what) when a file hashed by :func:`hash_files` is not what ``entry`` (its
    manifest entry) records; None when it is. The one comparison of a file's bytes with its
    commit, for a resume's check and for ``validate-checkpoint`` alike.
    """
    if isinstance(outcome, OSError):
        return "shard_unreadable", f"cannot be read: {outcome.strerror or outcome}"
    if outcome[0] != entry.get("bytes"):
        return "size_mismatch", f"holds {outcome[0]} bytes, the manifest records {entry.get('bytes')!r}"
    if outcome[1] != entry.get("checksum"):
        return "checksum_mismatch", "differs from what was committed (its checksum)"
    return None


def share_of(files: Mapping[Any, Any], part: tuple[int, int] | None) -> list[tuple[Any, Any]]:
    """The manifest's ``files`` entries that rank ``i`` of ``n`` checks (``part=(i, n)``): those
    whose place in name order is ``i`` modulo ``n``; all of them for None.
    """
    index, count = part or (0, 1)
    return [item for place, item in enumerate(sorted(files.items(), key=lambda item: str(item[0])))
            if place % count == index]


def damaged_files(ckpt_dir: str | os.PathLike[str], manifest: Mapping[str, Any], threads: int | None = None,
                  *, part: tuple[int, int] | None = None) -> list[str]:
    """What is wrong with the files of ``ckpt_dir`` against ``manifest`` (listed and missing,
    unreadable, another size or checksum; a checkpoint file on disk the manifest does not list),
    one line each; empty when every byte is as committed. Reads every file (seconds for
    gigabytes): for a resume at a session's start, or behind a restart (:class:`RestoreCheck`).

    ``part=(i, n)``: only the listed files whose place in name order is ``i`` modulo ``n`` (each
    of ``n`` ranks checks its share), and the unlisted ones only for ``i == 0``.
    """
    root = Path(ckpt_dir)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return [f"{root / MANIFEST_NAME} lists no files"]
    index = part[0] if part else 0
    problems: list[str] = []
    present: dict[Path, str] = {}
    for name, entry in share_of(files, part):
        if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
            problems.append(f"the manifest names {str(name)[:80]!r}, which is no file of a checkpoint directory")
            continue
        path = root / name
        if not isinstance(entry, dict) or not path.is_file() or path.is_symlink():
            problems.append(f"{name} is missing (or not a plain file)")
        else:
            present[path] = name
    # DCP's data, its .metadata and the data-loader states: each one the manifest must vouch for.
    for path in sorted(root.iterdir()) if root.is_dir() and index == 0 else []:
        if path.name not in files and (path.name == METADATA_NAME or shard_rank_index(path.name) is not None
                                       or data_rank_index(path.name) is not None):
            problems.append(f"{path.name} is not in the manifest")
    for path, outcome in hash_files(list(present), threads).items():
        found = file_mismatch(outcome, files[present[path]])
        if found is not None:
            problems.append(f"{present[path]} {found[1]}")
    return problems


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class _StagedPlanner:
    """DCP's writer asks the planner for each item's data: here, the staged copies."""

    def __init__(self, tensors: Mapping[str, Any], blobs: Mapping[str, bytes]) -> None:
        self.tensors, self.blobs = tensors, blobs

    def resolve_data(self, item: Any) -> Any:
        import io

        from torch.distributed.checkpoint.planner import WriteItemType

        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[item.index.fqn])
        return self.tensors[item.index.fqn]


def write_rank(tmp_dir: str | os.PathLike[str], rank: int, job: Mapping[str, Any], *,
               torn_write: bool = False) -> dict[str, Any]:
    """Write rank ``rank``'s part of a checkpoint durably into ``tmp_dir`` and report it in a sidecar.

    ``job``: ``items`` (DCP ``WriteItem``s: this rank's chunks, and on rank 0 the replicated
    values), ``tensors``/``blobs`` (their staged data by flat name), ``paths`` (flat name -> nested
    key path, DCP's ``planner_data``), ``data_state`` (the data loader's state), ``meta`` (step,
    optimizer step, data position), ``threads`` (files written in parallel, default 1). Written
    through DCP's ``FileSystemWriter`` (fsynced), then each file is checksummed from the page
    cache. With ``torn_write`` the process kills itself with SIGKILL halfway through (the
    ``ckpt-kill``/``writer-kill`` faults): a truncated ``.partial`` file is left, and no sidecar.
    """
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    tmp_dir = Path(tmp_dir)
    threads = max(1, int(job.get("threads", 1)))
    # per_thread_copy_ahead=0: the staged tensors are in host memory already; DCP's overlapping
    # loader would otherwise start CUDA in the writer process just to get a stream.
    writer = FileSystemWriter(str(tmp_dir), single_file_per_rank=True, sync_files=True, thread_count=threads,
                              per_thread_copy_ahead=0)
    plan = SavePlan(list(job["items"]), storage_data=_StoragePrefix(f"__{rank}_"))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        # xxh3 lets go of the GIL: the chunks are hashed while DCP writes them.
        digests = {name: pool.submit(tensor_checksum, data) for name, data in job["tensors"].items()}
        results = writer.write_data(plan, _StagedPlanner(job["tensors"], job["blobs"])).wait()
        # DCP opens one file per thread, also one left empty (fewer chunks than threads).
        dcp_files = [path for path in (tmp_dir / shard_name(rank, i) for i in range(threads)) if path.exists()]
        assert {r.storage_data.relative_path for r in results} <= {path.name for path in dcp_files}
        if torn_write:
            torn = dcp_files[0]
            with open(torn, "r+b") as handle:
                handle.truncate(max(1, torn.stat().st_size // 2))
                os.fsync(handle.fileno())
            torn.rename(torn.with_name(torn.name + ".partial"))
            os.kill(os.getpid(), signal.SIGKILL)
        data_file = tmp_dir / data_name(rank)
        with open(data_file, "wb") as handle:
            torch.save(job["data_state"], handle)
            handle.flush()
            os.fsync(handle.fileno())
        sums = {path: pool.submit(checksum_file, path) for path in (*dcp_files, data_file)}
        files = {}
        for path, digest_of in sums.items():
            size, digest = digest_of.result()
            files[path.name] = {"rank": rank, "bytes": size, "checksum": digest}
        checksums = {name: digest.result() for name, digest in digests.items()}
    stored = {(r.index.fqn, tuple(r.index.offset) if r.index.offset is not None else None): r.storage_data
              for r in results}
    items = []
    for item in job["items"]:
        key = (item.index.fqn, tuple(item.index.offset) if item.index.offset is not None else None)
        info = stored[key]
        entry: dict[str, Any] = {"fqn": item.index.fqn, "path": list(job["paths"][item.index.fqn]),
                                 "file": info.relative_path, "offset": info.offset, "length": info.length}
        if item.type == WriteItemType.BYTE_IO:
            entry["kind"] = "bytes"
        else:
            data = job["tensors"][item.index.fqn]
            entry.update(kind="tensor", size=list(item.tensor_data.size), dtype=dtype_name(data.dtype),
                         offsets=list(item.tensor_data.chunk.offsets), sizes=list(item.tensor_data.chunk.sizes),
                         checksum=checksums[item.index.fqn])
        items.append(entry)
    record = {"rank": rank, "files": files, "items": items, "meta": dict(job["meta"]),
              "data_state": jsonable(job["data_state"])}
    sidecar = tmp_dir / sidecar_name(rank)
    sidecar_tmp = sidecar.with_suffix(".json.partial")
    sidecar_tmp.write_text(json.dumps(record))
    os.replace(sidecar_tmp, sidecar)
    return record


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    """The torch dtype a manifest names; CheckpointError for anything that is not one."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{name!r} is not a torch dtype")
    return dtype


def jsonable(value: Any) -> Any:
    """``value`` if it survives JSON unchanged (the data state shown in the manifest), else None."""
    try:
        return value if json.loads(json.dumps(value)) == value else None
    except (TypeError, ValueError):
        return None


def build_metadata(records: list[Mapping[str, Any]]) -> tuple[Any, list[Any]]:
    """DCP ``Metadata`` and ``WriteResult``s from the ranks' sidecars (ascending rank).

    A chunk or value several ranks wrote (a replicated DTensor) is kept once: the lowest rank's.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    md: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    results: list[Any] = []
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for record in records:
        for item in record["items"]:
            fqn = item["fqn"]
            paths[fqn] = tuple(item["path"])
            offsets = tuple(item["offsets"]) if item["kind"] == "tensor" else None
            if (fqn, offsets) in seen:
                continue
            seen.add((fqn, offsets))
            if item["kind"] == "bytes":
                md[fqn] = BytesStorageMetadata()
                index = MetadataIndex(fqn)
            else:
                tmd = md.setdefault(fqn, TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(item["dtype"])), size=torch.Size(item["size"]),
                    chunks=[]))
                index = MetadataIndex(fqn, torch.Size(item["offsets"]), len(tmd.chunks))
                tmd.chunks.append(ChunkStorageMetadata(offsets=torch.Size(item["offsets"]),
                                                       sizes=torch.Size(item["sizes"])))
            results.append(WriteResult(index=index, size_in_bytes=item["length"],
                                       storage_data=_StorageInfo(item["file"], item["offset"], item["length"])))
    return Metadata(state_dict_metadata=md, planner_data=paths), results


# Threads reading at once for :func:`reader` (a rank's part of a save is one file per write thread).
READ_THREADS = 8


def reader(ckpt_dir: str | os.PathLike[str], threads: int = READ_THREADS, *, pipelined: bool = True) -> Any:
    """DCP's ``FileSystemReader`` for ``ckpt_dir`` that reads chunks straight into their targets,
    on up to ``threads`` threads.

    DCP's own reader goes through the files one after another and, for each chunk, reads its
    bytes, ``torch.load``-s them into a new CPU tensor and copies that into the target (from
    pageable memory, one at a time, on GPUs): a killed 1.3B rank restored its 16 GB at 2.5-3 GB/s
    whether the files were on disk or in ``/dev/shm``. Here each chunk's place in its file comes
    from ``torch.load(..., map_location="meta")`` (the layout, no data), and
    :class:`tensor_read.Reads` reads the bytes into the targets, through page-locked buffers on
    GPUs, each file's as soon as its layout is known (``pipelined``; else every file's layout
    first, as before 2026-12-04: ``benchmarks/dcp_read.py`` compares them). A chunk that is
    not a plain byte range of the target's dtype (a transform such as compression, a stored
    layout the request would cut across, another byte order or dtype), and every non-tensor
    value, goes through DCP's own ``read_data`` unchanged.
    """
    import dataclasses
    import sys
    from concurrent.futures import ThreadPoolExecutor, as_completed

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP's reader uses
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _create_file_view
    from torch.distributed.checkpoint.planner import LoadItemType

    from resilient_training.run import tensor_read

    class _Reader(FileSystemReader):
        def _place(self, relative: str, items: list[Any], planner: Any) -> tuple[list[Any], list[Any]]:
            """(``[(target, offset, item)]`` read directly, items left to DCP) for one file."""
            placed: list[Any] = []
            rest: list[Any] = []
            with open(Path(self.path) / relative, "rb") as stream:
                native: bool | None = None
                for item in items:
                    info = self.storage_data[item.storage_index]
                    if item.type != LoadItemType.TENSOR or info.transform_descriptors:
                        rest.append(item)
                        continue
                    view = _create_file_view(stream, info.offset, info.length)
                    if native is None:  # one writer process per file: one byte order
                        archive = torch._C.PyTorchFileReader(view)
                        native = (not archive.has_record("byteorder")
                                  or archive.get_record("byteorder").decode() == sys.byteorder)
                        view.seek(0)
                    if not native:  # (torch.load would "swap" the bytes of a meta storage, and crash)
                        rest.append(item)
                        continue
                    stored = narrow_tensor_by_index(torch.load(view, map_location="meta", weights_only=True),
                                                    item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if not stored.is_contiguous() or stored.dtype != target.dtype:
                        rest.append(item)
                        continue
                    if target.size() != stored.size():  # DCP's own check, in DCP's words
                        raise AssertionError(
                            f"req {item.storage_index} mismatch sizes {target.size()} vs {stored.size()}")
                    start = stored.untyped_storage()._checkpoint_offset + stored.storage_offset() * stored.element_size()
                    placed.append((target, info.offset + start, item))
            return placed, rest

        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            with ThreadPoolExecutor(max(1, min(threads, len(per_file))), thread_name_prefix="dcp-place") as pool:
                places = {pool.submit(self._place, relative, items, planner): relative
                          for relative, items in per_file.items()}
                if pipelined and threads > 1:
                    # A file's bytes are read as soon as its chunks are placed, while the other
                    # files' layouts are still being worked out (Python, under the GIL).
                    share = sum(self.storage_data[item.storage_index].length for item in plan.items
                                if item.type == LoadItemType.TENSOR) / threads
                    placed = {}
                    failure: BaseException | None = None
                    with tensor_read.Reads(threads, share) as reads:
                        for future in as_completed(places):
                            try:
                                placed[places[future]] = future.result()
                            except BaseException as exc:  # noqa: BLE001 - raised once the reads are done
                                failure = failure or exc
                                continue
                            reads.submit(Path(self.path) / places[future], _in_file_order(placed[places[future]][0]))
                        try:
                            reads.wait()
                        except BaseException as exc:  # noqa: BLE001 - a file's layout failing comes first
                            failure = failure or exc
                    if failure is not None:
                        raise failure
                else:
                    placed = {places[future]: future.result() for future in places}
                    tensor_read.read_files([(Path(self.path) / relative, _in_file_order(direct))
                                            for relative, (direct, _) in placed.items()], threads=threads)
                for direct, _ in placed.values():
                    for target, _, item in direct:
                        planner.commit_tensor(item, target)
                read = super().read_data
                rests = [pool.submit(read, dataclasses.replace(plan, items=rest), planner)
                         for _, rest in placed.values() if rest]
                for future in rests:
                    future.result().wait()  # DCP's own (completed) torch future: raises what the read raised
            done: Any = torch.futures.Future()
            done.set_result(None)
            return done

    def _in_file_order(direct: list[Any]) -> list[Any]:
        return sorted(((target, offset) for target, offset, _ in direct), key=lambda pair: pair[1])

    return _Reader(str(ckpt_dir))


def dcp_load(state: dict[str, Any], ckpt_dir: str | os.PathLike[str], *, threads: int = READ_THREADS,
             pipelined: bool = True) -> None:
    """``torch.distributed.checkpoint.load(state)`` from ``ckpt_dir`` in this process (no
    collective: every rank plans its own reads from ``.metadata``), through :func:`reader`.

    DCP reports a failure as ``CheckpointException``, a ``BaseException`` (``except Exception``
    does not catch it) whose text is every rank's traceback: it is raised here as
    :class:`CheckpointError` naming each error.
    """
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader(ckpt_dir, threads, pipelined=pipelined), no_dist=True)
    except CheckpointException as exc:
        causes = []
        for failure in exc.failures.values():
            error = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"{type(error).__name__}: {error}")
        raise CheckpointError("; ".join(dict.fromkeys(causes)) or str(exc).splitlines()[0]) from None


def write_metadata(tmp_dir: str | os.PathLike[str], records: list[Mapping[str, Any]]) -> None:
    """DCP's ``.metadata`` for the ranks' sidecars, written (and fsynced) by DCP's own writer."""
    from torch.distributed.checkpoint import FileSystemWriter

    metadata, results = build_metadata(records)
    FileSystemWriter(str(tmp_dir), sync_files=True).finish(metadata, [results])


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
    remove: Callable[[Path], Any] | None = None,
    on_committed: Callable[[Path], Any] | None = None,
) -> Path:
    """Turn a temporary directory holding every rank's files into committed ``step_N``.

    Called by rank 0 only (on the node-local tier: by each rank for its own files), once all
    ranks reported their files durable. Returns the path of the committed checkpoint. ``ranks``
    names the ranks a partial (node-local tier) checkpoint holds; by default all ``world_size``.
    ``remove`` deletes what pruning moved aside (see :func:`prune`). ``on_committed`` is called
    with the committed path the moment ``latest`` names it (the commit point: what a restart
    loads), before the last fsync and pruning, so a process killed during those (the launcher
    stopping a rank after a peer died) has already recorded it. Called at the rename instead, a
    rank 0 killed before ``latest`` moved logged a commit that the restart did not load (CI,
    2026-12-02: step 4 logged, step 0 restored).
    """
    tmp_dir = Path(tmp_dir)
    root = tmp_dir.parent
    ranks = list(range(world_size)) if ranks is None else ranks
    records = []
    for rank in ranks:
        sidecar = tmp_dir / sidecar_name(rank)
        if not sidecar.exists():
            raise CheckpointError(f"cannot commit step {step}: rank {rank} reported no shard in {tmp_dir}")
        records.append(json.loads(sidecar.read_text()))
    shared = _agreed_meta(records, step=step, tmp_dir=tmp_dir)
    write_metadata(tmp_dir, records)
    files = {name: entry for r in records for name, entry in r["files"].items()}
    size, digest = checksum_file(tmp_dir / METADATA_NAME)
    files[METADATA_NAME] = {"rank": ranks[0], "bytes": size, "checksum": digest}
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for record in records:
        for item in record["items"]:
            where = {"rank": record["rank"], "file": item["file"], "offset": item["offset"], "length": item["length"]}
            if item["kind"] == "bytes":
                objects.setdefault(item["fqn"], where)
                continue
            entry = tensors.setdefault(item["fqn"], {"size": item["size"], "dtype": item["dtype"], "chunks": []})
            if all(c["offsets"] != item["offsets"] for c in entry["chunks"]):
                entry["chunks"].append({"offsets": item["offsets"], "sizes": item["sizes"],
                                        "checksum": item["checksum"], **where})
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "created": time.time(),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
        "objects": dict(sorted(objects.items())),
        "data_state": {str(r["rank"]): {"file": data_name(r["rank"]), "state": r.get("data_state")} for r in records},
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
    fsync_dir(root)  # the rename is durable before `latest` names it
    _atomic_write_text(root / LATEST_NAME, final.name + "\n")
    try:
        if on_committed is not None:
            on_committed(final)
    finally:  # a callback that failed (the event log's disk full) still leaves the commit durable and pruned
        fsync_dir(root)
        prune(root, keep_last=keep_last, remove=remove)
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
    uid = read_run_uid(run_dir)
    if not uid:
        raise CheckpointError(f"{path} is empty: this run directory's identity is lost")
    return uid


def rewind_advice(ckpt_dir: str | os.PathLike[str]) -> str:
    """How to resume from the committed step before ``ckpt_dir`` (a damaged one): what to write
    into ``latest``, which a restore follows.
    """
    ckpt_dir = Path(ckpt_dir)
    step = parse_step_dirname(ckpt_dir.name)
    earlier = [s for s in committed_steps(ckpt_dir.parent) if step is None or s < step]
    latest = ckpt_dir.parent / LATEST_NAME
    if not earlier:
        return f"No committed step before it: remove {latest} to train from the start"
    return f"To resume from the step before: echo {step_dirname(max(earlier))} > {latest}"


def read_run_uid(run_dir: str | os.PathLike[str]) -> str | None:
    """The run directory's ``run_uid`` as it is (None: no such file), never made here."""
    path = Path(run_dir) / RUN_UID_FILENAME
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return read_regular_bytes(path).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as this run directory's identity: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None


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


def prune(root: Path, *, keep_last: int, remove: Callable[[Path], Any] | None = None) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` (never the latest).

    Each is first renamed to a temporary name (atomic: no half-deleted directory ever carries a
    step name and a manifest), then handed to ``remove`` (default: deleted here and now). Freeing
    gigabytes takes a while (0.2-0.5 s per node-local commit in /dev/shm on the GPU machines), so
    the trainer passes a remover that runs on a thread of its own. Leftovers of a remover that
    did not finish are ``.tmp-`` directories, which nothing loads; the next prune removes them.
    """
    if keep_last <= 0:
        return
    latest = read_latest(root)
    trash = [child for child in root.iterdir() if child.name.startswith(PRUNED_PREFIX)]
    for step in committed_steps(root)[:-keep_last]:
        path = root / step_dirname(step)
        if latest is None or path.resolve() != latest.resolve():
            aside = root / f"{PRUNED_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
            try:
                path.rename(aside)
            except OSError:
                continue  # moved or removed by someone else meanwhile
            trash.append(aside)
    for path in trash:
        if remove is None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            remove(path)


_LATEST_MAX_BYTES = 256


def read_latest(root: str | os.PathLike[str]) -> Path | None:
    """The committed checkpoint ``latest`` names, or None before the first commit."""
    root = Path(root)
    pointer = root / LATEST_NAME
    if not pointer.is_file():
        return None
    try:
        size = pointer.stat().st_size
        # `step_N` and a newline: a pointer of megabytes would be read whole and quoted whole in
        # every gate's message and record (a stranger trial's 20 MB one printed 80 MB).
        if size > _LATEST_MAX_BYTES:
            raise CheckpointError(f"{pointer} is {size} bytes, not the name of a step directory")
        name = _read_text(pointer).strip()
    except FileNotFoundError:  # pruned or replaced between the check and the read
        return None
    if parse_step_dirname(name) is None:
        shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}..."
        raise CheckpointError(f"{pointer} names {shown}, which is not a step directory")
    path = root / name
    if not (path / MANIFEST_NAME).is_file():
        raise CheckpointError(f"{pointer} names {name}, which has no {MANIFEST_NAME}")
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        return read_json_object(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a committed checkpoint") from None


NOT_REGULAR = "not a regular file (a FIFO, socket or device)"


def read_regular_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path`` (links followed). Opened without waiting: a FIFO in
    its place hung a promotion forever (stranger trial); it, a device or a socket is an OSError
    whose strerror is :data:`NOT_REGULAR`, a directory an IsADirectoryError, never waited on or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as handle:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, NOT_REGULAR, str(path))
        return handle.read()


def _read_text(path: Path) -> str:
    """UTF-8 text of ``path``; CheckpointError (one line) when it cannot be read or decoded, or is
    no regular file (:func:`read_regular_bytes`). FileNotFoundError passes through: the callers
    say what a missing file means.
    """
    try:
        return read_regular_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; CheckpointError (one line) for anything else in its place.
    FileNotFoundError passes through: the callers say what a missing file means.
    """
    text = _read_text(path)
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits (a traceback before)
        raise CheckpointError(f"{path} is not valid JSON: {exc}"[:400]) from None
    except RecursionError:  # '[' nested past the interpreter's limit (a stranger trial's traceback)
        raise CheckpointError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
        raise CheckpointError(f"{path} holds a JSON {kind}, not an object")
    return value


def load_data_state(ckpt_dir: str | os.PathLike[str], rank: int) -> Any:
    """Rank ``rank``'s data-loader state, loaded without unpickling arbitrary objects."""
    import torch

    path = Path(ckpt_dir) / data_name(rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint holds no data state for rank {rank}") from None


def require_format(manifest: Mapping[str, Any], where: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint of another format version with one clear sentence."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} is in checkpoint format {version!r}; this version reads format {FORMAT_VERSION} "
            "(PyTorch DCP directories) only. Start a new run directory."
        )
