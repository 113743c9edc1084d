"""Reading byte ranges of files into tensors on a CPU or a GPU: what a restore spends its time on.

A contiguous CPU target is read into directly (``os.preadv`` lets go of the GIL). Any other goes
through two staging buffers of the reading thread (page-locked when a target is on a GPU) in
turn, each thread on a CUDA stream of its own: the copy to the device of one buffer overlaps the
read into the other. On one H200, 3.2 GB came back in 0.39-0.43 s on four threads after their
first use (0.90 s), 0.87-1.57 s on one, and 0.70-1.03 s copied from the mapped file
(``benchmarks/host_snapshot_read.py``).

Used by the host snapshot's read-back and by :func:`checkpoint_format.reader`, which places DCP's
chunks with it instead of ``torch.load``-ing each one and copying it from pageable memory.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from resilient_training.run.checkpoint_format import CheckpointError

# Each reading thread's two staging buffers are this size.
CHUNK = 64 << 20

Targets = list[tuple[torch.Tensor, int]]


def pread_exact(fd: int, buffer: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buffer):  # one read returns at most ~2 GB on Linux
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{path} ends at byte {offset + done}: the file is shorter than its layout")
        done += n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def read_files(jobs: list[tuple[Path, Targets]], *, threads: int = 1, chunk: int = CHUNK,
               stage: bool | None = None) -> None:
    """Fill each ``(target, offset)`` of each ``(path, targets)`` with the target's byte size read
    from ``path`` at ``offset``.

    All the jobs' targets (each job's in file order) are cut into runs of about ``1/threads`` of
    the bytes, never across files, and read on up to ``threads`` threads at once. ``stage`` forces
    the staging path (tests). The first failure is raised once every thread is done.
    """
    jobs = [(Path(path), targets) for path, targets in jobs if targets]
    if not jobs:
        return
    threads = max(1, threads)
    share = sum(_nbytes(t) for _, targets in jobs for t, _ in targets) / threads
    units = [unit for path, targets in jobs for unit in _cut(path, targets, share)]
    if len(units) == 1 or threads == 1:
        after = _after(targets for _, targets in units)
        for path, targets in units:
            _read_unit(path, targets, chunk=chunk, stage=stage, after=after)
        return
    with Reads(min(threads, len(units)), share, chunk=chunk, stage=stage) as reads:
        for path, targets in jobs:
            reads.submit(path, targets)
        reads.wait()


class Reads:
    """:func:`read_files` for jobs that become known one by one (a restore learns where each
    file's chunks lie file by file): each job submitted is cut into runs of about ``share``
    bytes and read at once on up to ``threads`` threads. :meth:`wait` raises the first failure
    once every read submitted is done; leaving the ``with`` block waits for them all.
    """

    def __init__(self, threads: int, share: float, *, chunk: int = CHUNK, stage: bool | None = None) -> None:
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tensor-read")
        self._share, self._chunk, self._stage = share, chunk, stage
        self._futures: list[Any] = []

    def submit(self, path: Path, targets: Targets) -> None:
        """Read ``targets`` (in file order) from ``path``. Called on the thread whose CUDA streams
        the copies must come after (what it queued: the targets' initialization).
        """
        after = _after([targets])
        for unit_path, unit in _cut(Path(path), targets, self._share):
            self._futures.append(self._pool.submit(_read_unit, unit_path, unit, chunk=self._chunk,
                                                   stage=self._stage, after=after))

    def wait(self) -> None:
        failure: BaseException | None = None
        for future in self._futures:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> Reads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)


def _cut(path: Path, targets: Targets, share: float) -> list[tuple[Path, Targets]]:
    """``targets`` in runs of about ``share`` bytes (at least one target each), in file order."""
    units: list[tuple[Path, Targets]] = []
    held = share
    for target, offset in targets:
        if held >= share:
            units.append((path, []))
            held = 0
        units[-1][1].append((target, offset))
        held += _nbytes(target)
    return units


def _after(target_lists: Any) -> Any:
    """The calling thread's current stream on the first GPU target's device (None: none)."""
    return next((torch.cuda.current_stream(t.device) for targets in target_lists for t, _ in targets if t.is_cuda),
                None)


def warm_buffers(device: Any, threads: int) -> str:
    """Make the page-locked staging buffers of ``threads`` reading threads and free them into
    PyTorch's host allocator, which keeps them: a later :func:`read_files` onto ``device`` takes
    them from there instead of asking CUDA for page-locked memory on the restore's critical path.

    For a warm spare, idle (:mod:`resilient_training.runtime.spare_pool`): a fresh process's first
    read of 3.2 GB took 0.90 s against 0.39-0.43 s once its buffers existed
    (``benchmarks/host_snapshot_read.py``), and a killed rank's replacement allocates them while the
    dead process's memory is being released. Costs ``2 * threads * CHUNK`` of page-locked host
    memory for the process's life (1 GB for eight threads). Returns what it did; nothing on a CPU.
    """
    if getattr(device, "type", None) != "cuda" or threads < 1:
        return ""
    import time

    start = time.perf_counter()
    with torch.cuda.device(device):
        buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]
    nbytes = sum(_nbytes(b) for b in buffers)
    del buffers
    return f"read buffers made ({nbytes / 2**30:.2f} GiB page-locked, {time.perf_counter() - start:.2f} s)"


def read_into(path: Path, targets: Targets, *, chunk: int = CHUNK, stage: bool | None = None,
              threads: int = 1) -> None:
    """:func:`read_files` of one file."""
    read_files([(path, targets)], threads=threads, chunk=chunk, stage=stage)


def _read_unit(path: Path, targets: Targets, *, chunk: int, stage: bool | None, after: Any) -> None:
    device = next((t.device for t, _ in targets if t.is_cuda), None)
    stream = None
    if device is not None:
        # A new thread's current device is cuda:0, where a CUDA call would make a context on a
        # neighbour's GPU (leaving the stream context below switches back to the current device).
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(after)
    fd = os.open(path, os.O_RDONLY)
    try:
        _read_on(fd, path, targets, chunk=chunk, stage=stage, stream=stream, on_gpu=device is not None)
    finally:
        os.close(fd)
        if stream is not None:
            stream.synchronize()  # the buffers are reused or freed after this, failed or not


def _read_on(fd: int, path: Path, targets: Targets, *, chunk: int, stage: bool | None, stream: Any,
             on_gpu: bool) -> None:
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        buffers: list[torch.Tensor] = []
        events: list[Any] = [None, None]
        current, used = 0, 0
        for target, offset in targets:
            nbytes = _nbytes(target)
            if not nbytes:
                continue
            direct = not target.is_cuda and target.is_contiguous() if stage is None else not stage
            if direct:
                pread_exact(fd, memoryview(target.view(-1).view(torch.uint8).numpy()), offset, path)
                continue
            if not target.is_contiguous():  # not seen in module or optimizer state; kept correct anyway
                whole = torch.empty(target.shape, dtype=target.dtype)
                pread_exact(fd, memoryview(whole.view(-1).view(torch.uint8).numpy()), offset, path)
                target.copy_(whole)
                continue
            if not buffers:
                buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2)]
            flat = target.view(-1).view(torch.uint8)
            done = 0
            while done < nbytes:
                if used == chunk:  # this buffer is full: its copies go, the other one is reused
                    if on_gpu:
                        events[current] = torch.cuda.Event()
                        events[current].record()
                    current, used = 1 - current, 0
                    if events[current] is not None:
                        events[current].synchronize()
                n = min(chunk - used, nbytes - done)
                view = buffers[current][used:used + n]
                pread_exact(fd, memoryview(view.numpy()), offset + done, path)
                flat[done:done + n].copy_(view, non_blocking=on_gpu)
                used += n
                done += n
