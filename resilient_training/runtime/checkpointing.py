"""Saving and restoring FSDP2 training state under the checkpoint contract (PyTorch DCP).

The state is ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` (any
optimizer, any FSDP2 layout), plus the task's lr scheduler and the data loader's state. Each rank
stages its own chunks (a copy to host memory: the only time training blocks) and writes them
through DCP's file writer, either in NVRx's persistent background writer (async) or inline
(sync); a restore is ``torch.distributed.checkpoint.load`` (which reshards to any world size)
and ``set_state_dict``. A save is committed only when every rank's shard is durable. Ranks learn that
together from a flag that rides on the loss all-reduce of every step, so all ranks reach the
same decision at the same step without an extra collective; rank 0 then commits. One save is
in flight at a time; when the writer is still busy at the next interval the save is deferred,
never waited for.

When a rank's writer process dies with its shard, that rank's contribution to the flag is
:data:`ABANDONED` (a large negative number), so the sum tells every rank at the same step: the
save is abandoned (never committed), stays "in flight" until every rank's writer is idle again
(later saves defer meanwhile, on every rank alike), and its temporary directory is then removed.
The dead writer is replaced without stopping training; a save that comes before the new one is
ready waits for it without blocking (its shard stays staged).

A save still in flight when an in-process restart begins was staged before the fault: the next
iteration's checkpointer takes it over and commits it once written, when every rank carries the
same one and the restore lands at or past its step (:meth:`Checkpointer.carry`); else that step
is saved again when training reaches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import gate_records, layout
from resilient_training.run.config import DEFAULT_TASK, TrainConfig
from resilient_training.run.layout import local_tier_base, run_key
from resilient_training.run.paths import low_space
from resilient_training.run.tensor_read import read_into
from resilient_training.runtime.nvrx_adapter import CheckpointWriterDied

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def _cuda_call(device: torch.device | None, call: Callable[[], Any]) -> int:
    """Run one CUDA runtime call on a thread of its own, with ``device`` current, and return its
    error code. A refused call leaves its error pending on the thread that made it, where the next
    kernel launch's check would raise it as its own: not on the training thread, then. A new
    thread's current device is cuda:0, where a call would create a context on a rank's
    neighbour's GPU.
    """
    result: list[int] = []

    def run() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        result.append(int(call()))

    thread = threading.Thread(target=run, name="cuda-host-register", daemon=True)
    thread.start()
    thread.join()
    return result[0] if result else -1


def page_lock(ptr: int, nbytes: int, *, device: torch.device | None = None, pause: bool = False,
              direct: bool = False) -> bool:
    """Page-lock host memory in place (``cudaHostRegister``, portable) with ``device`` current;
    False when CUDA refused it (the copies to and from it then still work, only slower and
    synchronously).

    ``pause``: then sleep as long as the call took. Called back to back from a background
    thread, the registrations kept the training thread's CUDA calls waiting: on one H200,
    page-locking 6.4 GB in 64 MB calls held one step for more than 3 s, which the progress guard
    took for a hang (``benchmarks/pin_contention.py`` measures both ways).

    ``direct``: call from this thread, a background thread whose current device is ``device``
    already and that launches no kernels (a refused call's pending error stays there): no thread
    started per call, for the ~900 buffers of a 1.3B model's state.
    """
    start = time.perf_counter()
    register = lambda: torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE)  # noqa: E731
    ok = (int(register()) if direct else _cuda_call(device, register)) == 0
    if pause:
        time.sleep(min(0.1, time.perf_counter() - start))
    return ok


def shared_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor in shared memory (passed to the writer process by handle).

    Made there directly: ``torch.empty(...).share_memory_()`` makes a private tensor and copies it
    into new shared memory, which beside training took 10.6-13.2 s for the 1.3B model's 16 GB on
    one H200 (``host_memory_locked``'s ``allocate_seconds``; with :func:`populate` now 2.3-3.4 s).
    And its memory is allocated here, outside the GIL (a memfd, ``posix_fallocate``), then mapped
    as the storage torch's own sharing makes of a received handle: ``UntypedStorage._new_shared``
    allocates it holding the GIL (1 s for 2 GiB on a CPU machine), and the 1.3B's 16 GB held the
    step after a restored process's first for 1.0-3.2 s on one H200 (benchmarks/staging_prepare.py,
    call66/67).
    """
    numel = math.prod(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype).share_memory_()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        fd = os.memfd_create("staging", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux: torch's own (under the GIL)
        storage = torch.UntypedStorage._new_shared(nbytes)
    else:
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)  # the pages, now: ENOSPC here, not SIGBUS at a copy
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory; sharing it dups the storage's own fd
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def populate(buffers: list[torch.Tensor], threads: int | None = None, piece_bytes: int = 256 << 20) -> None:
    """Write every page of ``buffers`` from several threads at once, each piece by one thread.

    Page-locking memory whose pages are not there yet faults them in under the CUDA driver's lock
    (2.8 GB/s on one H200, training's CUDA calls waiting meanwhile); written first, 16 GB lock in
    0.6 s. Written from one thread beside training, the 1.3B model's 16 GB took 9-12 s (call34).
    Each piece is one ``memset`` (ctypes lets go of the GIL): ``Tensor.zero_`` also spread each
    piece over PyTorch's intra-op threads (eight pieces at once, 16 threads each on one H200), and
    steps meanwhile had a median of 0.017-0.019 s against 0.015-0.017 s (benchmarks/staging_prepare.py, call66).
    """
    import ctypes

    pieces = [(buffer.data_ptr() + offset, min(piece_bytes, size - offset))
              for buffer in buffers for size in [buffer.numel() * buffer.element_size()]
              for offset in range(0, size, piece_bytes)]
    if not pieces:
        return
    from concurrent.futures import ThreadPoolExecutor

    count = threads or max(1, min(8, (os.cpu_count() or 2) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    with ThreadPoolExecutor(max_workers=min(count, len(pieces)), thread_name_prefix="staging-populate") as pool:
        list(pool.map(lambda piece: ctypes.memset(piece[0], 0, piece[1]), pieces))


def page_unlock(ptr: int, *, device: torch.device | None = None) -> bool:
    """Undo :func:`page_lock` before the memory is unmapped or freed: a range left registered
    after its mapping is gone makes a later registration or allocation at that address fail
    ("resource already mapped"). False when CUDA refused it.
    """
    return _cuda_call(device, lambda: torch.cuda.cudart().cudaHostUnregister(ptr)) == 0


class PinReport:
    """What a background page-locking did: bytes locked, bytes CUDA refused (their copies are
    synchronous: the training thread waits for them), seconds. Taken once (:meth:`take`).
    """

    def __init__(self) -> None:
        self.bytes = self.failed_bytes = self.buffers = 0
        self.seconds = self.allocate_seconds = 0.0
        self._done = self._taken = False

    def add(self, nbytes: int, ok: bool) -> None:
        self.buffers += 1
        if ok:
            self.bytes += nbytes
        else:
            self.failed_bytes += nbytes

    def finish(self, seconds: float) -> None:
        self.seconds, self._done = seconds, True

    def take(self) -> dict[str, Any] | None:
        """The figures once, when the page-locking is over and locked anything; else None."""
        if not self._done or self._taken or not (self.bytes or self.failed_bytes):
            return None
        self._taken = True
        return {"bytes": self.bytes, "failed_bytes": self.failed_bytes, "seconds": round(self.seconds, 3),
                "buffers": self.buffers, "allocate_seconds": round(self.allocate_seconds, 3)}


def write_rank_job(tmp_dir: str, rank: int, job: dict[str, Any], torn_write: bool) -> None:
    """Runs in the background writer process (module-level so it pickles). A failed write leaves
    its reason beside the shard (the process then dies, and only its exit code reaches the trainer).
    """
    try:
        fmt.write_rank(tmp_dir, rank, job, torn_write=torn_write)
    except BaseException as exc:
        cause = exc.__context__ if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError) else exc
        with contextlib.suppress(OSError):
            (Path(tmp_dir) / fmt.error_name(rank)).write_text(f"{type(cause).__name__}: {cause}"[:300])
        raise


def warm_up_writer() -> None:
    """Runs first in the background writer process: import DCP's writer there now (seconds on
    a loaded machine), not during the first save; and tie the writer's life to its worker's.
    """
    import torch.distributed.checkpoint.filesystem  # noqa: F401

    _exit_with_parent()


_PARENT_WATCHED = False


def _exit_with_parent() -> None:
    """In a writer process: exit once the worker that started it is gone. A SIGKILLed worker
    cannot stop its writer, and under torchrun nothing else did (found after the test suite: a
    killed rank's writer, 340 MB, alive long after its run). Its writes die with the worker's
    save anyway: only the worker commits. (Not PR_SET_PDEATHSIG: it fires when the *thread*
    that started the writer ends, and the worker starts it from a thread of its own.)

    Watches multiprocessing's parent sentinel (a pipe whose write end only the parent holds),
    not ``os.getppid()``: this runs once the writer has imported torch, seconds after its start,
    and a worker killed in between had already been replaced by the reaper as the parent, so
    the writer watched the reaper and outlived the run (a two-worker test suite run).
    """
    global _PARENT_WATCHED
    import multiprocessing

    parent = multiprocessing.parent_process()
    if _PARENT_WATCHED or parent is None:
        return  # not a child process (or already watching)
    _PARENT_WATCHED = True

    def watch() -> None:
        parent.join()  # returns when the sentinel reads end-of-file: the parent is gone
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> dict[str, Any]:
    """What a checkpoint holds (besides the data state): DCP's view of model, optimizer, scheduler.

    Keys are the plain model's (``get_state_dict`` strips FSDP's wrapping), values DTensors
    that share storage with the live parameters and optimizer state.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    init_optimizer_state(optimizer)  # before a restore: no step taken to make the state (see there)
    model_state, optim_state = get_state_dict(model, optimizer)
    out: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if scheduler is not None:
        out["lr_scheduler"] = scheduler.state_dict()
    return out


_ADAM_INIT_GROUP = ("group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Make an empty Adam or AdamW state as its first step would, without taking the step.

    DCP loads only into state that exists; its ``get_state_dict`` makes it with zero gradients
    and a step at lr 0 (a gradient-sized allocation and the step's kernels). Here the optimizer's
    own lazy set-up (``_init_group``, whatever it makes in this torch version) runs once per
    group, each parameter standing in as its own gradient (no allocation, nothing computed).
    Other optimizers, or one with state already: False, and DCP's way applies.
    """
    import inspect

    if optimizer.state or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    # A private method: only the signature known here (torch 2.11, 2.13; an older AdamW took a bool
    # `amsgrad` among these lists), else DCP's way.
    if list(inspect.signature(optimizer._init_group).parameters) != list(_ADAM_INIT_GROUP):
        return False
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad and p.grad is None]
        try:
            for p in params:
                p.grad = p.detach()
            optimizer._init_group(group, *([] for _ in _ADAM_INIT_GROUP[1:]))
        finally:
            for p in params:
                p.grad = None
    return True


def flat_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flat name -> value, flat name -> nested key path): DCP's own flattening, so names match its files."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def _local(value: Any) -> Any:
    # DTensor's own attribute: ``to_local()`` goes through an autograd Function, ~20 µs each, which
    # for ~800 tensors was a fifth of a save's time on the training thread.
    local = getattr(value, "_local_tensor", None)
    if local is not None:
        return local
    return value.to_local() if hasattr(value, "to_local") else value


def local_tensors(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The local part (this rank's) of every tensor in ``state``: what staging buffers are sized for."""
    flat, _ = flat_state(state)
    return [(name, _local(value)) for name, value in flat.items() if isinstance(value, torch.Tensor)]


class StagingBuffers:
    """Host memory a save is staged into, allocated once and reused by every save.

    The buffers live in shared memory, so handing a shard to NVRx's writer process passes
    handles instead of copying bytes, and on GPU machines they are page-locked
    (``cudaHostRegister``) so the device-to-host copy runs at full speed. On GPUs the copy runs
    on a side stream while the next step's forward and backward run: training waits only where
    the next optimizer step would overwrite what is still being copied (:meth:`fence`), and the
    shard goes to the writer once the copy is done (:meth:`ready`). Reuse is safe because a save
    starts only once the previous one is durable.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: dict[int, torch.device] = {}  # data pointer -> GPU, of the buffers page-locked
        self.pin_report = PinReport()  # of the buffers' first allocation (prepare)
        self._locking = False  # the preparation page-locks (see locking)
        self._lock_started = 0.0
        self.objects: dict[str, Any] = {}  # the non-tensor values of the staged step (deep copies)
        self.data_state: Any = None  # the data loader's state at the staged step
        self._preparing: threading.Thread | None = None
        self._stream: Any = None  # the side stream of device-to-host copies (GPU only)
        self._copied: Any = None  # CUDA event: the copies of the save being staged are done
        self._staging_step: int | None = None  # every copy queued, not known to be done
        self.staged_step: int | None = None  # the step the buffers hold, once fully staged
        self._reads_live = False  # copies running read the live training state (see fence)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    @property
    def prepared(self) -> bool:
        return bool(self._buffers) or self._preparing is not None

    # Saves are deferred for the page-locking at most this long; then a save waits for it, inside
    # the save phase that the progress guard times (a driver call that never returns is a hang).
    DEFER_SECONDS = 120.0

    @property
    def locking(self) -> bool:
        """Still page-locking the buffers in the background (GPUs: seconds for gigabytes, paced so
        training runs meanwhile), for less than :attr:`DEFER_SECONDS`. A save now would wait for
        it (:meth:`begin`).
        """
        return (self._locking and self._preparing is not None and self._preparing.is_alive()
                and time.monotonic() - self._lock_started < self.DEFER_SECONDS)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype, device: torch.device | None, *,
                  pause: bool = False, direct: bool = False) -> torch.Tensor:
        """A shared-memory buffer, page-locked for copies from ``device`` (None: not locked)."""
        start = time.perf_counter()
        buffer = shared_empty(shape, dtype)
        if device is not None and buffer.numel():
            # Pages written here first: cudaHostRegister then locks resident pages (25 GB/s on one
            # H200) instead of faulting them in under the driver's lock (2.8 GB/s, and training's
            # CUDA calls wait meanwhile: median step 1.2 s instead of 0.014 s; pin_rate.py, call33).
            buffer.zero_()
            self.pin_report.allocate_seconds += time.perf_counter() - start
            self._lock(buffer, device, pause=pause, direct=direct)
        return buffer

    def _lock(self, buffer: torch.Tensor, device: torch.device, *, pause: bool, direct: bool) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        ok = page_lock(buffer.data_ptr(), nbytes, device=device, pause=pause, direct=direct)
        self.pin_report.add(nbytes, ok)
        if ok:
            self._pinned[buffer.data_ptr()] = device

    def _replace(self, name: str, buffer: torch.Tensor) -> None:
        old = self._buffers.get(name)
        if old is not None and old.data_ptr() in self._pinned:
            page_unlock(old.data_ptr(), device=self._pinned.pop(old.data_ptr()))
        self._buffers[name] = buffer

    def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Allocate (and page-lock) buffers for these tensors in a background thread.

        Allocating gigabytes of shared, pinned memory takes seconds; done ahead, the first
        save then stalls training only for the copy.
        """
        if self.prepared:
            return
        specs = [(name, t.shape, t.dtype, t.device if t.is_cuda else None) for name, t in tensors]
        self._locking = any(device is not None for *_, device in specs)
        self._lock_started = time.monotonic()

        def allocate() -> None:
            start = time.perf_counter()
            devices = {device for *_, device in specs if device is not None}
            # One device (a rank's): made current here once, every registration runs on this thread.
            direct = len(devices) == 1 and torch.cuda.is_available()
            if direct:
                torch.cuda.set_device(devices.pop())
            made = [(name, shared_empty(shape, dtype), device) for name, shape, dtype, device in specs]
            populate([buffer for _, buffer, device in made if device is not None])
            self.pin_report.allocate_seconds = time.perf_counter() - start
            for name, buffer, device in made:
                if device is not None and buffer.numel():
                    self._lock(buffer, device, pause=True, direct=direct)
                self._replace(name, buffer)
            self.pin_report.finish(time.perf_counter() - start)

        self._preparing = threading.Thread(target=allocate, name="staging-prepare", daemon=True)
        self._preparing.start()

    def begin(self, on_gpu: bool, *, after: Any = None) -> None:
        """Start overwriting the buffers: from here until :meth:`ready` they hold no step.
        ``after``: a CUDA event the copies must wait for (the memory snapshot they read from).
        """
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        self.staged_step = self._staging_step = None
        self._reads_live = False
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            # Copy what the step just computed: wait for everything queued so far.
            self._stream.wait_stream(torch.cuda.current_stream())
            if after is not None:
                self._stream.wait_event(after)

    def copy_all(self, sources: list[tuple[str, torch.Tensor]], *, live: bool = True) -> dict[str, torch.Tensor]:
        """Queue the copies of ``sources`` (name, tensor) into their buffers; returns name -> buffer.
        ``live``: the sources are the training state itself (not a snapshot of it), so the next
        optimizer step must wait for these copies (:meth:`fence`).
        """
        out: dict[str, torch.Tensor] = {}
        pairs: _Pairs = []
        for name, source in sources:
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = self._allocate(source.shape, source.dtype, source.device if source.is_cuda else None)
                self._replace(name, buffer)
            out[name] = buffer
            pairs.append((buffer, source))
            self._reads_live = self._reads_live or (live and source.is_cuda)
        on_device = [pair for pair in pairs if pair[1].is_cuda]
        if on_device:
            with torch.cuda.stream(self._stream):  # one context and one foreach copy per device
                _copy(on_device, non_blocking=True)
        _copy([pair for pair in pairs if not pair[1].is_cuda])
        return out

    def end(self, step: int) -> None:
        """Every copy of ``step`` is queued; on CPU it is already done."""
        self._staging_step = step
        if self._stream is not None:
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        self.ready()

    def ready(self) -> bool:
        """True once the step being staged is fully in host memory (never blocks)."""
        if self._copied is not None:
            if not self._copied.query():
                return False
            self._copied = None
        if self._staging_step is not None:
            self.staged_step, self._staging_step = self._staging_step, None
        return True

    def wait(self) -> None:
        """Block until the step being staged is fully in host memory."""
        if self._copied is not None:
            self._copied.synchronize()
        self.ready()

    def fence(self) -> None:
        """Make the current stream wait (on the GPU, not the host) for copies still reading the
        live tensors: call before anything overwrites them (the optimizer step). Copies from a
        memory snapshot do not hold training (the snapshot waits for them instead).
        """
        if self._copied is not None and self._reads_live:
            torch.cuda.current_stream().wait_event(self._copied)

    @property
    def copying(self) -> Any:
        """The CUDA event of copies still running, else None."""
        return self._copied


def _live_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of the training state as the module and optimizer hold it now (no copies):
    ``("model", name)`` and ``("optim", param_index, key)``. 2-3 ms for 800 tensors on a CPU,
    where DCP's ``get_state_dict`` takes ~20 ms: cheap enough to run every few steps.
    """
    with torch.no_grad():  # where ``to_local`` is cheap: no autograd bookkeeping
        live = {("model", name): _local(value) for name, value in model.state_dict().items()
                if isinstance(value, torch.Tensor)}
        for index, entry in optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    live[("optim", index, key)] = _local(value)
    return live


_Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's memory across two views of the same state (DCP's state dict and
    the module's own): the same bytes, read the same way.
    """
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _by_device(pairs: _Pairs) -> dict[torch.device, _Pairs]:
    groups: dict[torch.device, _Pairs] = {}
    for pair in pairs:
        groups.setdefault(pair[1].device, []).append(pair)
    return groups


def _copy(pairs: _Pairs, *, non_blocking: bool = False) -> None:
    """(destination, source) pairs, as few kernels as the devices allow (foreach copies)."""
    for group in _by_device(pairs).values():
        torch._foreach_copy_([d for d, _ in group], [s for _, s in group], non_blocking=non_blocking)


# Threads reading a host snapshot back onto GPUs. On the CPU one: on 2 cores four threads read
# 0.4 GB at 1.2 GB/s against 1.8 GB/s for one (benchmarks/host_snapshot_read.py).
_READ_THREADS = 4


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            groups.setdefault(t.device, []).append(t)
    for group in groups.values():
        norms = torch._foreach_norm(group)  # an overflow reads as not finite: the safe side
        if not bool(torch.stack(norms).isfinite().all()):
            return False
    return True


class MemorySnapshot:
    """The newest training state, copied every few steps within the memory of the device that
    holds it (GPU memory on GPUs): what an in-process restart resumes from, so a fault replays
    a few steps instead of everything since the last save.

    An in-process restart keeps the process, its CUDA context and this object; only the model,
    optimizer and process group are built anew. On GPUs the copy runs on a side stream as
    device-to-device copies (about a millisecond for 2 GB on an H200), while the next step's
    forward and backward run; :meth:`fence` holds the next optimizer step until it is done. The
    snapshot names nothing on storage and is never a checkpoint: the commit rule alone decides
    those.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._param_groups: list[dict[str, Any]] = []
        self._scheduler: Any = None
        self.data_state: Any = None
        self._stream: Any = None
        self._copied: Any = None
        self._pending: int | None = None
        self.step: int | None = None  # the step held, once every copy is done
        self.world: tuple[int, int] | None = None  # (rank, world size) of the processes that took it
        self.disabled: str | None = None  # why snapshots stopped (no memory for a second copy)
        self._plan: tuple[Any, ...] | None = None  # see _plan_for
        self._readers: list[Any] = []  # CUDA events of copies still reading the buffers (a save staging from them)

    def take(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             data_state: Any, *, world: tuple[int, int]) -> None:
        """Copy the state after ``step``'s optimizer step. A failed allocation turns snapshots
        off for the run (``disabled`` says why) instead of failing training.
        """
        import copy

        self.step = self._pending = None  # overwritten from here on
        readers, self._readers = self._readers, []
        try:
            on_gpu, on_host = self._plan_for(model, optimizer, readers)
        except torch.OutOfMemoryError as exc:
            self._buffers.clear()
            self._plan = None
            self.disabled = f"no memory for a second copy of the training state: {exc}"[:300]
            return
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # what the step just computed
            for event in readers:  # a save still copying the previous snapshot out
                self._stream.wait_event(event)
            with torch.cuda.stream(self._stream):
                _copy(on_gpu, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        _copy(on_host)
        self._param_groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                              for group in optimizer.param_groups]
        self._scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.data_state = copy.deepcopy(data_state)
        self.world = world
        self._pending = step
        self.ready()

    def _plan_for(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                  readers: list[Any] = ()) -> tuple[_Pairs, _Pairs]:
        """(device pairs, host pairs) of (buffer, live tensor) for these model and optimizer.

        Finding the live tensors (``state_dict`` of both, ``to_local`` of each) cost ~8 ms a
        snapshot on the GPU machine's host; they are found again only when the tensors are not
        the same objects on the same storage as last time: torch.optim and FSDP2 update them in
        place. The plan keeps the objects it was made from alive, so an ``id`` that matches is
        the same object, never a new one at a reused address.
        """
        params = [*model.parameters(), *model.buffers()]
        state = [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        identity = (id(model), id(optimizer), tuple(map(id, params)), tuple(map(id, state)),
                    tuple(getattr(p, "_local_tensor", p).data_ptr() for p in params))
        if self._plan is not None and self._plan[0] == identity:
            return self._plan[2], self._plan[3]
        for event in readers:  # buffers may be freed or replaced below: nothing may still read them
            event.synchronize()
        live = _live_state(model, optimizer)
        for key, source in live.items():
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype \
                    or buffer.device != source.device:
                self._buffers[key] = torch.empty_like(source, memory_format=torch.contiguous_format)
        for key in [k for k in self._buffers if k not in live]:
            del self._buffers[key]
        on_gpu = [(self._buffers[k], t) for k, t in live.items() if t.is_cuda]
        on_host = [(self._buffers[k], t) for k, t in live.items() if not t.is_cuda]
        self._plan = (identity, (params, state), on_gpu, on_host)
        return on_gpu, on_host

    def sources_for(self, step: int) -> tuple[dict[tuple[Any, ...], torch.Tensor], Any] | None:
        """(live tensor key -> the buffer holding its copy, the CUDA event of those copies) when
        this snapshot is of ``step`` (taken, its copies maybe still running), else None. The key
        is :func:`_tensor_key` of the live tensor: a save of the same step stages from the
        snapshot instead of the training state, so the next optimizer step need not wait for a
        device-to-host copy (see :meth:`Checkpointer.stage`); it must call :meth:`add_reader`.
        """
        if self._plan is None or step not in (self._pending, self.step):
            return None
        pairs = self._plan[2] + self._plan[3]
        return {_tensor_key(live): buffer for buffer, live in pairs}, self._copied

    def add_reader(self, event: Any) -> None:
        """A copy out of the buffers is running until ``event``: the next snapshot waits for it."""
        if event is not None:
            self._readers.append(event)

    def release(self) -> None:
        """Let go of the live tensors of a model and optimizer that are gone (an in-process restart
        built new ones); the copy itself is kept.
        """
        self._plan = None

    def ready(self) -> int | None:
        """The step held once its copies are done (never blocks), else None."""
        if self._copied is not None:
            if not self._copied.query():
                return None
            self._copied = None
        if self._pending is not None:
            self.step, self._pending = self._pending, None
        return self.step

    def fence(self) -> None:
        """Make the current stream wait (on the GPU) for copies still reading the live tensors:
        call before the optimizer step overwrites them.
        """
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def finite(self) -> bool:
        """Every floating-point value held is finite (a snapshot taken after a NaN's cause is refused)."""
        return _all_finite(list(self._buffers.values()))

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
        """Copy the held step into a freshly built ``model``/``optimizer``/``scheduler``; returns the
        data state. Raises :class:`fmt.CheckpointError` (and forgets the snapshot) when the new
        state does not have exactly the held tensors.
        """
        import copy

        self._plan = None
        state_dict(model, optimizer)  # DCP's get_state_dict creates the optimizer's state, as a load needs
        live = _live_state(model, optimizer)
        mismatch = sorted({str(k) for k in live.keys() ^ self._buffers.keys()} |
                          {str(k) for k in live.keys() & self._buffers.keys()
                           if live[k].shape != self._buffers[k].shape or live[k].dtype != self._buffers[k].dtype})
        if mismatch or len(self._param_groups) != len(optimizer.param_groups):
            self.step = None
            raise fmt.CheckpointError(
                f"the memory snapshot does not fit the rebuilt model and optimizer ({', '.join(mismatch[:5])})")
        with torch.no_grad():
            _copy([(live[k], self._buffers[k]) for k in live])
        for group, held in zip(optimizer.param_groups, self._param_groups, strict=True):
            group.update(copy.deepcopy(held))
        if scheduler is not None and self._scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self._scheduler))
        return copy.deepcopy(self.data_state)


class HostSnapshot:
    """Each memory snapshot, also copied into host shared memory (the node-local tier's directory),
    where a process that replaces this one after a launcher restart finds it: a killed rank then
    replays at most ``--memory-snapshot-every`` steps instead of everything since the last
    node-local save, and reads its state back at memory speed instead of through DCP.

    Two slots, written in turn. A slot's ``.meta`` file is removed before its data is overwritten
    and written again (atomically) only once the copy is complete, so a process killed at any
    moment leaves the other slot whole. The data is one file per slot, every tensor at a fixed
    offset (the layout is in the meta). The copies read the memory snapshot, not the training state
    (on GPUs a device-to-host copy on a side stream; the next snapshot waits for it): training does
    not wait. It is never a checkpoint: validation and promotion never see it, and the node-local
    tier's directory is keyed by the run's lineage (:func:`local_tier_root`), so no other run reads it.
    """

    SLOTS = ("a", "b")
    _ALIGN = 4096  # each tensor starts on a page of its own: the files are page-locked tensor by tensor
    # At most this much is page-locked per call: cudaHostRegister holds the GIL while it faults in
    # and locks the pages (2 x 3.2 GB at once stalled the training thread 4.2 s on one H200, which
    # the progress guard took for a hang).
    _PIN_RUN = 64 << 20

    def __init__(self, root: Path) -> None:
        self.root = root
        self._data: dict[str, torch.Tensor] = {}  # slot -> uint8 view of its file (mapped, shared)
        self._slot_views: dict[str, dict[Any, torch.Tensor]] = {}  # see _views
        self._layout: list[tuple[Any, int, tuple[int, ...], torch.dtype]] | None = None
        self._next = 0  # the slot written next
        self._pending: tuple[str, Any, dict[str, Any]] | None = None  # (slot, CUDA event, meta) until committed
        self._commit_lock = threading.Lock()  # the training thread's poll and the commit thread's
        self._stream: Any = None
        self._preparing: threading.Thread | None = None
        self._pinned: list[tuple[int, torch.device]] = []  # (start, GPU) of each page-locked run of the slots
        self.failed: str | None = None  # why the slots could not be made: no more host snapshots
        self.pin_report = PinReport()  # of the slots' latest preparation

    def _data_path(self, slot: str) -> Path:
        return self.root / f"host-snapshot-{slot}.bin"

    def _meta_path(self, slot: str) -> Path:
        return self.root / f"host-snapshot-{slot}.meta"

    # ------------------------------------------------------------------ write

    def write(self, snapshot: MemorySnapshot, step: int, lineage: Lineage | None = None) -> None:
        """Start copying ``snapshot`` (just taken at ``step``) into the next slot; returns at once.
        Skipped while the previous copy is still running or the files are still being prepared.
        """
        self.poll()
        if self._pending is not None or step not in (snapshot._pending, snapshot.step) or snapshot.disabled \
                or self.failed:
            return
        buffers = sorted(snapshot._buffers.items(), key=lambda kv: str(kv[0]))
        layout, offset = [], 0
        for key, buffer in buffers:
            layout.append((key, offset, tuple(buffer.shape), buffer.dtype))
            offset += -(-buffer.numel() * buffer.element_size() // self._ALIGN) * self._ALIGN
        if layout != self._layout:
            self._prepare(layout, offset, device=next((b.device for _, b in buffers if b.is_cuda), None))
            return
        if self._preparing is not None:
            if self._preparing.is_alive():
                return
            self._preparing = None
        slot = self.SLOTS[self._next]
        self._next = 1 - self._next
        self._meta_path(slot).unlink(missing_ok=True)  # from here on the slot holds no step
        views = self._views(slot)
        event = self._start_copy(snapshot, [(views[key], buffer) for key, buffer in buffers])
        meta = {"step": step, "world": snapshot.world, "layout": [(k, o, s, fmt.dtype_name(d)) for k, o, s, d in layout],
                "param_groups": snapshot._param_groups, "scheduler": snapshot._scheduler,
                "data_state": snapshot.data_state, "lineage": (lineage or Lineage()).record()}
        pending = self._pending = (slot, event, meta)
        if event is None:
            self.poll()
        else:
            # Committed by a thread of its own as soon as the copy is done, not at the next step's
            # poll: a peer that dies in the next step (the launcher then stops this rank while it
            # waits in that step's collective) no longer costs this snapshot.
            threading.Thread(target=self._commit_when_copied, args=(pending,), name="host-snapshot-commit",
                             daemon=True).start()

    def _start_copy(self, snapshot: MemorySnapshot, pairs: _Pairs) -> Any:
        """Start copying (slot view, buffer) ``pairs``: a GPU buffer's on a side stream; returns the
        CUDA event of those copies (None: all on the host, already done).
        """
        event = None
        on_device = [pair for pair in pairs if pair[1].is_cuda]
        if on_device:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            if snapshot._copied is not None:
                self._stream.wait_event(snapshot._copied)
            with torch.cuda.stream(self._stream):
                _copy(on_device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            snapshot.add_reader(event)
        _copy([pair for pair in pairs if not pair[1].is_cuda])
        return event

    def _commit_when_copied(self, pending: tuple[str, Any, dict[str, Any]]) -> None:
        try:
            pending[1].synchronize()  # (releases the GIL while it waits)
            self._commit(pending)
        except Exception:  # noqa: BLE001 - a slot whose meta is not written holds no step: never restored
            pass

    def _prepare(self, layout: list[Any], size: int, *, device: torch.device | None) -> None:
        """(Re)create both slots' files at ``size`` bytes, mapped and, on GPUs, page-locked for
        ``device``, in a background thread (seconds for gigabytes); the snapshots meanwhile are not
        copied. A failure turns the host snapshot off (:attr:`failed`), nothing left locked.
        """
        if self._preparing is not None and self._preparing.is_alive():
            return
        self._layout = None
        old, old_pinned = dict(self._data), self._pinned
        self._data.clear()
        self._pinned = []
        self._slot_views.clear()
        self.root.mkdir(parents=True, exist_ok=True)
        for slot in self.SLOTS:
            self._meta_path(slot).unlink(missing_ok=True)

        report = self.pin_report = PinReport()

        def prepare() -> None:
            began = time.perf_counter()
            self._unpin(old_pinned)  # before the old mappings (held by ``old`` until then) go
            old.clear()
            data: dict[str, torch.Tensor] = {}
            pinned: list[tuple[int, torch.device]] = []
            try:
                for slot in self.SLOTS:
                    path = self._data_path(slot)
                    with open(path, "wb") as f:
                        f.truncate(size)
                    data[slot] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
                    for start, length in self._pin_runs(layout, size) if device is not None and size else []:
                        ok = page_lock(data[slot].data_ptr() + start, length, device=device, pause=True)
                        report.add(length, ok)
                        if ok:
                            pinned.append((data[slot].data_ptr() + start, device))
            except BaseException as exc:  # a full /dev/shm, say: unlocked before the mappings go
                self._unpin(pinned)
                data.clear()
                self.failed = f"{type(exc).__name__}: {exc}"[:300]
                return
            self._data.update(data)
            self._pinned = pinned
            self._layout = layout
            report.finish(time.perf_counter() - began)

        self._preparing = threading.Thread(target=prepare, name="host-snapshot-prepare", daemon=True)
        self._preparing.start()

    @staticmethod
    def _unpin(pinned: list[tuple[int, torch.device]]) -> None:
        for pointer, device in pinned:
            page_unlock(pointer, device=device)

    def close(self) -> None:
        """Let go of the slots' mappings (the files stay): page-unlocked first (see page_unlock)."""
        self.wait()
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        self._slot_views.clear()
        self._unpin(self._pinned)
        self._pinned = []
        self._data.clear()
        self._layout = None

    @classmethod
    def _pin_runs(cls, layout: list[Any], size: int) -> list[tuple[int, int]]:
        """(offset, length) of the ranges to page-lock one by one: whole tensors (no copy spans
        two registrations), page-aligned, each run at most ``_PIN_RUN`` unless one tensor is larger.
        """
        runs: list[tuple[int, int]] = []
        starts = [offset for _, offset, _, _ in layout] + [size]
        run_start = 0
        for i in range(1, len(starts)):
            if starts[i] - run_start > cls._PIN_RUN and starts[i - 1] > run_start:
                runs.append((run_start, starts[i - 1] - run_start))
                run_start = starts[i - 1]
        if size > run_start:
            runs.append((run_start, size - run_start))
        return runs

    def _views(self, slot: str) -> dict[Any, torch.Tensor]:
        """Key -> the tensor view of the slot's file where that key's copy lies (made once per slot:
        a search per key made every write cost ~0.04 s of the training thread for ~800 tensors).
        """
        views = self._slot_views.get(slot)
        if views is None:
            assert self._layout is not None
            views = {}
            for key, offset, shape, dtype in self._layout:
                count = 1
                for n in shape:
                    count *= n
                size = count * torch.empty((), dtype=dtype).element_size()
                views[key] = self._data[slot][offset:offset + size].view(dtype).view(shape)
            self._slot_views[slot] = views
        return views

    def poll(self) -> None:
        """Commit the copy in flight once it is complete (never blocks): write its slot's meta."""
        pending = self._pending
        if pending is not None and (pending[1] is None or pending[1].query()):
            self._commit(pending)

    def _commit(self, pending: tuple[str, Any, dict[str, Any]]) -> None:
        """Write ``pending``'s meta, unless it is no longer the copy in flight (committed already)."""
        with self._commit_lock:
            if self._pending is not pending:
                return
            self._pending = None  # (a write that fails leaves the slot without a step: not held)
            slot, _, meta = pending
            tmp = self._meta_path(slot).with_suffix(".meta.tmp")
            torch.save(meta, tmp)
            os.replace(tmp, self._meta_path(slot))

    def wait(self) -> None:
        """Commit the copy in flight, waiting for it."""
        pending = self._pending
        if pending is not None and pending[1] is not None:
            pending[1].synchronize()
        self.poll()

    # ------------------------------------------------------------------ restore

    def held(self, world: tuple[int, int], *,
             base: tuple[int, str | None] | None = None) -> dict[int, tuple[str, dict[str, Any]]]:
        """Step -> (slot, lineage record) of the committed slots this rank holds, taken by the
        same rank of the same world size on top of the persistent checkpoint ``base`` (see
        :class:`Lineage`). A slot whose files do not match its meta counts as not held.
        """
        held: dict[int, tuple[str, dict[str, Any]]] = {}
        for slot in self.SLOTS:
            try:
                with warnings.catch_warnings():  # a torn file's pickle protocol, say
                    warnings.simplefilter("ignore")
                    meta = torch.load(self._meta_path(slot), weights_only=True)
                size = self._data_path(slot).stat().st_size
            except Exception:  # missing, torn or foreign: not held
                continue
            if tuple(meta.get("world") or ()) != tuple(world):
                continue
            if "lineage" not in meta or Lineage.base_of(meta["lineage"]) != base:
                continue
            try:
                end = max((offset + math.prod(shape) * fmt.torch_dtype(dtype).itemsize
                           for _, offset, shape, dtype in meta["layout"]), default=0)
            except Exception:  # a layout this version cannot read: not held
                continue
            if end > size:  # cut short (a full disk, a copy of the directory): not held
                continue
            held[int(meta["step"])] = (slot, meta["lineage"])
        return held

    def restore(self, slot: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
        """Copy the slot's state into a freshly built ``model``/``optimizer``/``scheduler``; returns
        the data state. Raises :class:`fmt.CheckpointError` when the state does not have exactly
        the held tensors.
        """
        import copy

        meta = torch.load(self._meta_path(slot), weights_only=True)
        state_dict(model, optimizer)  # DCP's get_state_dict creates the optimizer's state, as a load needs
        live = _live_state(model, optimizer)
        layout = {key: (offset, tuple(shape), fmt.torch_dtype(dtype)) for key, offset, shape, dtype in meta["layout"]}
        mismatch = sorted({str(k) for k in live.keys() ^ layout.keys()} |
                          {str(k) for k in live.keys() & layout.keys()
                           if tuple(live[k].shape) != layout[k][1] or live[k].dtype != layout[k][2]})
        if mismatch or len(meta["param_groups"]) != len(optimizer.param_groups):
            raise fmt.CheckpointError(
                f"the host snapshot of step {meta['step']} does not fit the rebuilt model and optimizer "
                f"({', '.join(mismatch[:5])})")
        with torch.no_grad():
            if slot in self._data:  # this process's own slot: mapped (and on GPUs page-locked) already
                data = self._data[slot]
                _copy([(t, data[layout[k][0]:layout[k][0] + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
                       for k, t in live.items()])
            else:  # a new process: read, not map (see tensor_read), in file order
                read_into(self._data_path(slot), sorted(((t, layout[k][0]) for k, t in live.items()),
                                                         key=lambda pair: pair[1]),
                           threads=_READ_THREADS if any(t.is_cuda for t in live.values()) else 1)
        for group, held in zip(optimizer.param_groups, meta["param_groups"], strict=True):
            group.update(copy.deepcopy(held))
        if scheduler is not None and meta["scheduler"] is not None:
            scheduler.load_state_dict(copy.deepcopy(meta["scheduler"]))
        return copy.deepcopy(meta["data_state"])


class Remover:
    """Deletes pruned checkpoints on threads of their own: freeing a node-local step (1.6 GB in
    /dev/shm per rank) held the training thread 0.22-0.46 s at every commit on 2 x H200, 15 s of a
    300 s run. Each path is deleted once, however often it is handed over.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Path, threading.Thread] = {}

    def __call__(self, path: Path) -> None:
        import shutil

        with self._lock:
            if path in self._running:
                return

            def remove() -> None:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:  # a file (a killed commit's temporary `latest`): rmtree would leave it
                    with contextlib.suppress(OSError):
                        path.unlink()
                with self._lock:
                    self._running.pop(path, None)

            thread = self._running[path] = threading.Thread(target=remove, name="ckpt-prune", daemon=True)
        thread.start()

    def wait(self, timeout: float = 120.0) -> None:
        """Until every deletion handed over so far is done (a finished run leaves no trash)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._running.values())
            if not threads:
                return
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                return


class CommitStuck(fmt.CheckpointError):
    """A commit did not finish in time (storage hung?): this process cannot wait for it."""


class RestoreCheck:
    """The bytes a restore read from storage, hashed against their manifest behind it.

    A restart reads what it restores without checking it (its seconds are the point), so bytes
    changed in place during a run, or a cluster worker's first restore (no preflight there),
    went unchecked. Here each rank hashes its share of the checkpoint's files on background
    threads (from the page cache the restore just filled) while training goes on; no commit
    happens before every rank's share is found whole (:meth:`Checkpointer.local_done` reports
    the save in flight not yet durable meanwhile), and damage stops the run with
    :class:`~resilient_training.run.checkpoint_format.CheckpointRefused`, its ``latest`` still
    naming the damaged step and the advice to rewind. Kept across in-process restarts: a
    restore from memory carries state the check has not vouched for yet.

    The hashing begins at the second :meth:`poll` after :meth:`start` (the trainer polls once a
    step): after the first step. Begun at once, on one H200, it held the first step after a
    killed rank's restore back by 0.1-0.3 s (benchmarks call63).
    """

    THREADS = 4  # hashing runs at several GB/s a thread: 16 GB in 1.2 s on one H200
    POLLS_BEFORE = 2  # the poll that begins the hashing (see above)

    @dataclass
    class _Check:
        path: Path
        manifest: dict[str, Any]
        step: int
        part: tuple[int, int] | None
        run_dir: Path | None = None  # also check the run's event log recorded this commit (rank 0)
        polls: int = 0
        thread: threading.Thread | None = None
        outcome: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(self) -> None:
        self._checks: list[RestoreCheck._Check] = []

    def start(self, path: Path, manifest: dict[str, Any], step: int, part: tuple[int, int] | None,
              run_dir: Path | None = None) -> None:
        """Check ``part`` (this rank's share, see :func:`fmt.damaged_files`) of ``path``, behind
        training; with ``run_dir``, also that the run's event log records committing it
        (:func:`~resilient_training.run.gate_records.commit_problem`).
        """
        self._checks.append(self._Check(path, manifest, step, part, run_dir))

    def _begin(self, check: RestoreCheck._Check) -> None:
        def run() -> None:
            started = time.perf_counter()
            try:
                check.outcome["problems"] = fmt.damaged_files(check.path, check.manifest, self.THREADS, part=check.part)
            except Exception as exc:  # noqa: BLE001 - said as the check's finding, on the training thread
                check.outcome["problems"] = [f"the check could not run: {type(exc).__name__}: {exc}"]
            if check.run_dir is not None:
                from resilient_training.run.gate_records import commit_problem

                try:
                    check.outcome["foreign"] = commit_problem(check.run_dir, check.path, check.manifest)
                except OSError as exc:  # the manifest unreadable now: the damage check says more
                    check.outcome["foreign"] = f"its manifest cannot be read: {exc.strerror or exc}"
            listed = check.manifest.get("files") if isinstance(check.manifest.get("files"), dict) else {}
            check.outcome["bytes"] = sum(entry["bytes"] for _, entry in fmt.share_of(listed, check.part)
                                         if isinstance(entry, dict) and isinstance(entry.get("bytes"), int))
            check.outcome["seconds"] = time.perf_counter() - started

        check.thread = threading.Thread(target=run, name="restore-check", daemon=True)
        check.thread.start()

    @property
    def pending(self) -> bool:
        """A check not yet done (begun or not)."""
        return any(check.thread is None or check.thread.is_alive() for check in self._checks)

    def poll(self, emit: Callable[..., Any]) -> None:
        """Begin the checks due; log each finished one (``restore_checked``); raise
        CheckpointRefused for damage.
        """
        for check in list(self._checks):
            if check.thread is None:
                check.polls += 1
                if check.polls >= self.POLLS_BEFORE:
                    self._begin(check)
                continue
            if check.thread.is_alive():
                continue
            self._checks.remove(check)
            problems = check.outcome.get("problems", ["the check ended without a result"])
            foreign = check.outcome.get("foreign")
            emit("restore_checked", check.step, path=str(check.path), bytes=check.outcome.get("bytes"),
                 seconds=round(check.outcome.get("seconds", 0.0), 3), problems=([foreign] if foreign else problems)[:3])
            if foreign:
                raise fmt.CheckpointRefused(
                    f"{check.path}, restored at step {check.step}, is not this run's: {foreign}. Nothing was "
                    f"committed since. {fmt.rewind_advice(check.path)}"[:1000])
            if problems:
                raise fmt.CheckpointRefused(
                    f"{check.path}, restored at step {check.step}, is damaged (changed since it was committed): "
                    f"{'; '.join(problems[:3])}{' …' if len(problems) > 3 else ''}. Nothing was committed "
                    f"since. {fmt.rewind_advice(check.path)}"[:1000])

    def wait(self, timeout: float | None = None) -> None:
        """Begin every check not yet begun and wait for them all (``timeout`` each)."""
        for check in list(self._checks):
            if check.thread is None:
                self._begin(check)
            check.thread.join(timeout)


class Committer:
    """Runs commits on a thread of their own, one at a time. A node-local commit (sidecar to
    DCP ``.metadata``, manifest, renames, ``latest``) held the training thread ~0.07 s each on
    2 x H200: 76 commits, 5.6 s of a 277 s run. Kept across in-process restarts: a restore
    first waits for the commit still running (:meth:`settle`), and a commit's error is raised
    there, on the training thread.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None

    def submit(self, step: int, commit: Callable[[], None], timeout: float) -> None:
        self.settle(timeout)

        def run() -> None:
            try:
                commit()
            except BaseException as exc:  # raised again on the training thread by settle()
                self._error = exc

        self._step = step
        self._thread = threading.Thread(target=run, name=f"ckpt-commit-{step}", daemon=True)
        self._thread.start()

    def settle(self, timeout: float) -> None:
        """Wait for the commit running, if any; raise what it failed with."""
        thread = self._thread
        if thread is not None:
            deadline = time.monotonic() + timeout
            while thread.is_alive():  # short joins: an in-process restart's exception still gets through
                if time.monotonic() > deadline:
                    raise CommitStuck(f"the commit of step {self._step} did not finish in {timeout:.0f} s")
                thread.join(0.05)
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


PERSISTENT, LOCAL = "persistent", "local"


def local_tier_root(config: TrainConfig, rank: int) -> Path:
    """The rank's directory of the node-local tier (one per rank: commits need no peer).

    Keyed by the run directory's path and its lineage (:func:`checkpoint_format.run_uid`): a
    node-local step left by an earlier run that used the same path is never restored.
    """
    lineage = f"{run_key(config.run_dir)}-{fmt.run_uid(config.run_dir)[:12]}"
    return local_tier_base(config) / lineage / f"rank_{rank}"


# A rank's done flag when its writer died with its shard: however many peers report done, the
# sum is negative, so every rank learns at the same step that the save is abandoned.
ABANDONED = -1.0e6
# Files (and threads) per rank and save on GPUs: one DCP writer thread moves ~1 GB/s into /dev/shm
# (benchmarks/probe_io.py), too slow for a save every few seconds of 1.6 GB per rank. Larger parts
# get a file per GB, up to 16: a 1.3B model's 16 GB as 4 files took 9-12 s to commit and 5.3 s to
# read back in a restart, as 16 files 6.6-7.0 s and 2.8 s (docs/benchmarks.md#sixteenth-round).
DEFAULT_GPU_WRITE_THREADS = 4
MAX_DEFAULT_WRITE_THREADS = 16


def default_write_threads(nbytes: int, *, on_gpu: bool) -> int:
    """Files a rank writes its ``nbytes`` of a save as, when ``--checkpoint-write-threads`` is 0."""
    if not on_gpu:
        return 1
    return max(DEFAULT_GPU_WRITE_THREADS, min(MAX_DEFAULT_WRITE_THREADS, -(-nbytes // 2**30)))


@dataclass(slots=True)
class Lineage:
    """Which history the training state belongs to, so that a node-local save or a host snapshot
    is restored only on top of the persistent checkpoint it descends from.

    ``branch``: a token agreed by every rank whenever training starts from scratch or from the
    persistent tier (two jobs resuming the same checkpoint get different tokens); a restore from
    the node-local tier or a host snapshot continues the branch it records. ``base``: (step,
    branch) of the newest persistent checkpoint in this history (None: none yet). Every save and
    host snapshot records both; one is usable only while its ``base`` is the persistent
    ``latest``. Found by a stranger trial: a job killed on node A (host snapshot at step 28 on top
    of step 20), resumed elsewhere with other data to a committed step 25, then started again on
    node A resumed from step 28, skipping step 25 and mixing the two histories.
    """

    branch: str | None = None
    base: tuple[int, str | None] | None = None

    def record(self) -> dict[str, Any]:
        return {"branch": self.branch, "base": list(self.base) if self.base is not None else None}

    @staticmethod
    def base_of(record: dict[str, Any] | None) -> tuple[int, str | None] | None:
        base = (record or {}).get("base")
        return (int(base[0]), base[1]) if base else None


@dataclass(slots=True)
class _InFlight:
    step: int
    tier: str
    tmp_dir: Path
    begin_ts: float
    manifest_fields: dict[str, Any]
    job: tuple[Any, ...] | None = None  # the writer's arguments, until handed over (staging still running)
    on_submit: Callable[[], None] | None = None
    retry_job: tuple[Any, ...] | None = None  # the final step's arguments, to write it again if abandoned
    abandoned: bool = False  # every rank agreed: never committed; cleared once every writer is idle
    writer_pid: int | None = None  # the writer process it was handed to (a carried save needs that one)
    reason: str = ""  # why it was abandoned
    carried: bool = False  # logged as carried (ckpt_carried): if then not committed, logged as abandoned
    said_abandoned: bool = False  # its ckpt_abandoned is logged (every begun save ends committed or abandoned)


class Checkpointer:
    """Stages, writes and commits checkpoints; restores the newest committed one.

    Two tiers share the writer and the format. The persistent tier (``RUN/checkpoints``, shared
    storage, every ``checkpoint_every`` steps) is what validation and promotion read. The
    optional node-local tier (``local_checkpoint_every``; /dev/shm by default) is cheap and
    frequent and survives a worker restart but not the loss of its node: it shortens the
    rollback after a fault. Each rank commits its own local shard, and a restore uses the local
    tier only when every rank holds the same newer step.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        rank: int,
        world_size: int,
        tag: str,
        writer: Any,
        staging: StagingBuffers,
        emit: Callable[..., Any],
        on_wait: Callable[[], None] = lambda: None,
        remover: Remover | None = None,
        snapshot: MemorySnapshot | None = None,
        committer: Committer | None = None,
        host: HostSnapshot | None = None,
        lineage: Lineage | None = None,
        gather: Callable[[Any, str], list[Any]] | None = None,
        restore_check: RestoreCheck | None = None,
        carried: _InFlight | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.root = layout.checkpoints_dir(config.run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.local_root = local_tier_root(config, rank) if config.checkpoint.local_every else None
        if self.local_root is not None:
            self.local_root.mkdir(parents=True, exist_ok=True)
        self._tag = tag  # unique per attempt/iteration: temporary directories never collide
        self._writer = writer  # nvrx_adapter.AsyncWriter (kept across in-process restarts)
        self._staging = staging  # reused by every save; one save in flight at a time
        self._emit = emit
        self._on_wait = on_wait  # keeps heartbeats and progress pings going while waiting
        self._in_flight: _InFlight | None = None
        self._lost: str | None = None  # why this rank's writer lost the shard in flight
        self.remover = remover or Remover()  # pruned checkpoints are deleted off the training thread
        self._snapshot = snapshot  # kept across in-process restarts, like the staging buffers
        self.committer = committer or Committer()  # likewise: a commit may still be running
        self._plan_cache: tuple[tuple[Any, ...], dict[str, list[Any]]] | None = None  # see _write_plan
        self._owed: int | None = None  # a persistent save's step deferred by a node-local write (see tier_for)
        # Every rank's staging buffers are page-locked (see local_done): saves wait for it, agreed
        # like commits, because the first save of a process used to wait for the page-locking:
        # 2.2-3.0 s on one H200 when a launcher restart resumed 5 steps before a save.
        self._staging_agreed = True
        self._host = host  # the memory snapshot in host shared memory (--host-snapshot)
        self._host_slot: str | None = None  # the slot find_restorable chose
        self.lineage = lineage if lineage is not None else Lineage()  # kept across in-process restarts
        # Agreements before a restore (StoreGather: not through the process group, see there).
        self._gather = gather or _collective_gather
        # What a restore from storage read, hashed behind it; kept across in-process restarts.
        self.restore_check = restore_check if restore_check is not None else RestoreCheck()
        # The save the iteration before an in-process restart had in flight (see carry): adopted
        # by find_restorable when every rank carries it and the restore lands at or past it.
        self._carried = carried

    # ------------------------------------------------------------------ restore

    def _remove_stale_writes(self) -> None:
        """Hand earlier rounds' uncommitted saves to the remover: called with every rank past its
        commits (find_restorable's barrier) and before this round's first save. The tag is
        "<round>i<iteration>" (the trainer's): an in-process restart's abandoned write is this
        round's, still being written by this process's writer, which removes it once idle.
        """
        live = self._tag[: self._tag.rfind("i") + 1]
        roots = ([self.root] if self.rank == 0 else []) + ([self.local_root] if self.local_root is not None else [])
        for root in roots:
            try:
                stale = fmt.stale_writes(root, live_tag_prefix=live)
            except OSError:
                continue  # a listing that failed frees nothing; the restore still goes on
            for path in stale:
                self.remover(path)

    def find_restorable(self, *, in_memory: bool = False, after_nan: bool = False,
                        lap: Callable[[str], None] | None = None) -> tuple[Path | None, dict[str, Any]]:
        """(checkpoint to restore, its manifest): the newest committed one every rank can load.

        With ``in_memory`` (an in-process restart: the same processes, the same world), a newer
        step that every rank holds in memory wins: the memory snapshot (``--memory-snapshot-every``)
        or a save in flight that every rank has fully staged. Its manifest says ``"memory":
        "snapshot"`` or ``"staged"`` (path None); nothing on storage changes, so the commit rule
        still decides what exists as a checkpoint. ``after_nan``: a staged save is not used (it
        may already hold the cause), a snapshot only when every value in it is finite. The final
        step's staged copy is never restored (its save is what failed, most likely); its snapshot
        is, until the final checkpoint is committed (the trainer then writes it again).

        Collective (through the store, see :class:`StoreGather`). Checks the model shape before
        anything is built. ``lap(name)`` marks the end of ``find_settle`` (rank 0's commit in
        flight, on every rank) and ``find_scan`` (stale writes handed over, the newest checkpoint
        on storage and the node-local one every rank holds) in the restart profile.
        """
        lap = lap or (lambda name: None)
        self.committer.settle(self._commit_timeout())
        # Rank 0 commits the persistent tier on its committer thread: no rank reads `latest`
        # before rank 0's commit in flight is done (rank 0 joins this only after settling).
        self._gather(None, "waiting for rank 0's commit before finding the checkpoint")
        lap("find_settle")
        self._remove_stale_writes()
        persistent = fmt.read_latest(self.root)
        persistent_id = None
        if persistent is not None:
            persistent_manifest = fmt.read_manifest(persistent)
            persistent_id = (persistent_manifest["step"], (persistent_manifest.get("lineage") or {}).get("branch"))
        latest = self._newest_restorable(persistent, persistent_id)
        lap("find_scan")
        manifest: dict[str, Any] = {}
        if latest is not None:
            manifest = fmt.read_manifest(latest)
            check_compatible(manifest, self.config)
        if in_memory:
            staged = self._staging.staged_step if self._staging.ready() and not after_nan else None
            snapshot = self._snapshot.ready() if self._snapshot is not None else None
            if snapshot is not None and (self._snapshot.world != (self.rank, self.world_size)
                                         or (after_nan and not self._snapshot.finite())):
                snapshot = None
            # Never the final step's staged copy (its save is what failed, most likely). Its snapshot,
            # taken before that save, is restorable while no final checkpoint is committed: the
            # trainer then writes it again from there (was: replayed from the last save, 50-100
            # steps of a 1.3B run on one H200 after a hang in the final save; benchmarks call74/75).
            final = self.config.steps
            final_committed = persistent_id is not None and persistent_id[0] >= final
            if staged is not None and staged >= final:
                staged = None
            if snapshot is not None and (snapshot > final or (snapshot == final and final_committed)):
                snapshot = None
            staged, snapshot, carried = self._held_on_every_rank(staged, snapshot, self._carried_step())
            # Decided here (kept or dropped); a failure before this passes it on (see carry).
            offered, self._carried = self._carried, None
            base = manifest.get("step", 0)
            kind, step = max((("snapshot", snapshot), ("staged", staged)), key=lambda c: c[1] or -1)
            from_memory = step is not None and (step > base or (kind == "snapshot" and step == base))
            # The same processes go on with the same history: the lineage stays as it is, and a
            # save of that history still in flight is committed once written (not when the
            # restore lands before it, or a rank does not carry it: that step comes again).
            if offered is not None and from_memory and carried is not None and base < carried <= step:
                self._in_flight, offered.carried = offered, True
                self._emit("ckpt_carried", carried, tier=offered.tier, restored=step)
            elif offered is not None and not offered.said_abandoned:
                # Never committed now: say so (on every rank: each decided the same from the same
                # gather). A save begun and dropped here unsaid left the log with neither outcome
                # (a writer-kill and an exception in one restart: stranger trial).
                restored = step if from_memory else base
                why = offered.reason or ("a rank no longer carries it" if carried is None
                                         else f"this restore landed at step {restored}, before it")
                self._say_abandoned(offered, ("carried save dropped: " if offered.carried
                                              else "save dropped at the in-process restart: ") + why)
            if from_memory:
                return None, {"step": step, "world_size": self.world_size, "memory": kind,
                              "ft_state": manifest.get("ft_state"), "progress": manifest.get("progress")}
        elif self._host is not None and not after_nan:
            # A new process (launcher restart): the newest step every rank holds in host memory.
            held = self._host.held((self.rank, self.world_size), base=persistent_id)
            step = self._held_by_every_rank({s: slot for s, (slot, _) in held.items()})
            if step is not None and step > manifest.get("step", 0):
                record = held[step][1]
                self.lineage.branch, self.lineage.base = record.get("branch"), Lineage.base_of(record)
                return None, {"step": step, "world_size": self.world_size, "memory": "host",
                              "ft_state": manifest.get("ft_state"), "progress": manifest.get("progress")}
        if latest is not None and latest != persistent:  # node-local: continues the history it records
            record = manifest.get("lineage") or {}
            self.lineage.branch, self.lineage.base = record.get("branch"), Lineage.base_of(record)
        elif not in_memory or latest is None:
            # From scratch or from the persistent tier: a branch of its own.
            self.lineage.branch, self.lineage.base = self._agreed_token(), persistent_id
        return latest, manifest

    def _agreed_token(self) -> str:
        """A new branch token, rank 0's, on every rank. Collective."""
        import uuid

        mine = uuid.uuid4().hex[:16] if self.rank == 0 else None
        return str(self._gather(mine, "agreeing on a new branch token")[0])

    def _held_by_every_rank(self, held: dict[int, str]) -> int | None:
        """The newest of these steps (this rank's host snapshot slots) that every rank holds too,
        never the final step (its checkpoint must be written again). Collective.
        """
        mine = sorted((s for s in held if s < self.config.steps), reverse=True)[:2]
        mine += [-1] * (2 - len(mine))
        gathered = self._gather(mine, "agreeing on the host snapshot's steps")
        common = set.intersection(*({int(v) for v in steps if v >= 0} for steps in gathered))
        if not common:
            return None
        step = max(common)
        self._host_slot = held[step]
        return step

    def _held_on_every_rank(self, *steps: int | None) -> list[int | None]:
        """For each step given (None: not held), that step if every rank gave the same one. Collective."""
        gathered = self._gather([step if step is not None else -1 for step in steps],
                                "agreeing on the steps held in memory")
        agreed: list[int | None] = []
        for i in range(len(steps)):
            held = {int(values[i]) for values in gathered}
            agreed.append(held.pop() if len(held) == 1 and min(held) > 0 else None)
        return agreed

    def load_memory(self, manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any = None) -> tuple[str, Any]:
        """Restore what :meth:`find_restorable` found in memory; returns (source, this rank's data state)."""
        if manifest["memory"] == "snapshot":
            assert self._snapshot is not None
            return "memory (snapshot)", self._snapshot.restore(model, optimizer, scheduler)
        if manifest["memory"] == "host":
            assert self._host is not None and self._host_slot is not None
            return "host memory (snapshot)", self._host.restore(self._host_slot, model, optimizer, scheduler)
        return "memory (staged, not yet committed)", self.load_staged(model, optimizer, scheduler)

    def load_staged(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> Any:
        """Restore the step held in the staging buffers (see :meth:`find_restorable`); returns this
        rank's data state.
        """
        import copy

        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
        from torch.distributed.checkpoint.state_dict import set_state_dict

        flat, paths = flat_state(state_dict(model, optimizer, scheduler))
        buffers = self._staging.tensors()
        with torch.no_grad():
            for name, value in flat.items():
                if isinstance(value, torch.Tensor):
                    _local(value).copy_(buffers[name])
                else:
                    flat[name] = copy.deepcopy(self._staging.objects[name])
        state = unflatten_state_dict(flat, paths)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
        return copy.deepcopy(self._staging.data_state)

    def load(self, path: Path, manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, *, lap: Callable[[str], None] | None = None) -> tuple[str, Any]:
        """Restore checkpoint ``path`` into sharded ``model``/``optimizer``/``scheduler``; returns
        (source, this rank's data state).

        After an in-process restart the staging buffers usually still hold exactly this step
        (host memory, page-locked on GPUs): then nothing is read from storage. Otherwise DCP
        reads what this rank's shards need, from any world size (no collective: every rank plans
        its own reads from ``.metadata``, so a slow reader never trips the short collective timeout).
        ``lap(name)`` marks the end of ``load_prepare`` (DCP's state dict, the optimizer's state
        made) and ``load_read`` (the files read into it) in the restart profile.
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        fmt.require_format(manifest, path)
        same_world = manifest["world_size"] == self.world_size or manifest.get("ranks") is not None
        if same_world and self._staging.staged_step == manifest["step"]:
            return "memory", self.load_staged(model, optimizer, scheduler)
        lap = lap or (lambda name: None)
        state = state_dict(model, optimizer, scheduler)
        lap("load_prepare")
        try:
            fmt.dcp_load(state, path)
        except Exception as exc:  # DCP names the key or shape that does not fit
            if _damaged(exc):
                raise fmt.CheckpointRefused(
                    f"{path} is damaged or incomplete ({str(exc)[:300]}); `validate-checkpoint` names every file "
                    f"that differs from what was committed. {fmt.rewind_advice(path)}"[:800]
                ) from exc
            raise fmt.CheckpointError(
                f"{path} holds a different model or optimizer state than this run's task builds: {exc}"[:800]
            ) from exc
        # A different world size splits the data differently: the task resumes from rank 0's
        # state (the built-in task's position is global, so that is exact).
        lap("load_read")  # (every reading thread waited for its copies to the device)
        source = "storage" if same_world else "storage (resharded)"
        data_state = fmt.load_data_state(path, self.rank if same_world else min(manifest.get("ranks") or [0]))
        # A node-local checkpoint lists this rank's files only; the persistent one is shared out.
        # Told by where it lies: at world size 1 a node-local manifest names no ``ranks`` either, and
        # was checked against the persistent tier's commits and refused (one H200, benchmarks call79).
        persistent = self.local_root is None or path.parent != self.local_root
        # Rank 0 also reads the run's event log for this commit (see RestoreCheck): one reader.
        self.restore_check.start(path, manifest, manifest["step"], (self.rank, self.world_size) if persistent else None,
                                 Path(self.config.run_dir) if persistent and self.rank == 0 else None)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
        return source, data_state

    def _newest_restorable(self, persistent: Path | None, persistent_id: tuple[int, str | None] | None) -> Path | None:
        """The persistent ``latest``, or a newer node-local step that every rank holds and that
        descends from that very checkpoint (see :class:`Lineage`).
        """
        if self.local_root is None:
            return persistent
        persistent_step = persistent_id[0] if persistent_id else 0
        local_steps = set()
        for s in fmt.committed_steps(self.local_root):
            # Each rank's local step holds only its own chunks: usable at the world size that wrote it.
            local = fmt.read_manifest(self.local_root / fmt.step_dirname(s))
            if local.get("world_size") == self.world_size and "lineage" in local \
                    and Lineage.base_of(local["lineage"]) == persistent_id:
                local_steps.add(s)
        # The newest step every rank holds: the lowest of each rank's newest, if all hold it.
        gathered = [set(steps) for steps in self._gather(sorted(local_steps), "agreeing on the node-local step")]
        step = min((max(steps, default=-1) for steps in gathered), default=-1)
        if step > persistent_step and all(step in steps for steps in gathered):
            return self.local_root / fmt.step_dirname(step)
        return persistent

    # ------------------------------------------------------------------ save

    def stage(self, step: int, state: dict[str, Any], data_state: Any, *, replicated: bool) -> dict[str, Any]:
        """Copy this rank's chunks to host memory: the job the writer persists.

        Every value is staged (an in-process restart restores from these buffers); the write
        plan holds this rank's DTensor chunks and, when ``replicated`` (rank 0, or any rank on the
        node-local tier, whose checkpoints must stand alone), the values every rank holds.

        When the memory snapshot holds this very step (the trainer takes it first for an async
        save), the copies read the snapshot, not the training state. On GPUs the next optimizer
        step then runs without waiting for gigabytes to cross to the host (the step after each
        save took ~0.09 s longer on 2 H200s, 1.6 GB per rank), and the next snapshot waits for
        them instead.
        """
        import copy
        import io

        from torch.distributed.tensor import DTensor

        flat, paths = flat_state(state)
        self._staging.objects = {}
        first = next((v for v in flat.values() if isinstance(v, torch.Tensor)), None)
        on_gpu = first is not None and _local(first).is_cuda
        held = self._snapshot.sources_for(step) if self._snapshot is not None else None
        self._staging.begin(on_gpu=on_gpu, after=held[1] if held else None)
        plan = self._write_plan(flat)
        names: list[str] = []  # what the writer writes, in the state's order
        live: list[tuple[str, torch.Tensor]] = []
        copied: list[tuple[str, torch.Tensor]] = []  # from the snapshot
        blobs: dict[str, bytes] = {}
        for name, value in flat.items():
            if isinstance(value, torch.Tensor):
                local = _local(value).detach()
                source = held[0].get(_tensor_key(local)) if held else None
                (live if source is None else copied).append((name, local if source is None else source))
                if replicated or isinstance(value, DTensor):
                    names.append(name)
            else:
                self._staging.objects[name] = copy.deepcopy(value)
                if replicated:
                    blob = io.BytesIO()
                    torch.save(value, blob)
                    blobs[name] = blob.getvalue()
                    names.append(name)
        buffers = {**self._staging.copy_all(copied, live=False), **self._staging.copy_all(live)}
        self._staging.data_state = copy.deepcopy(data_state)
        self._staging.end(step)  # on GPUs the copies are still running: see local_done()
        if held and copied:
            self._snapshot.add_reader(self._staging.copying)
        items = [item for name in names for item in plan[name]]
        tensors = {name: buffers[name] for name in names if name in buffers}
        meta = {"step": step, "optimizer_step": step, "data_position": step}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))
        return {"items": items, "tensors": tensors, "blobs": blobs, "paths": paths,
                "data_state": self._staging.data_state, "meta": meta,
                "threads": self.config.checkpoint.write_threads or default_write_threads(nbytes, on_gpu=on_gpu)}

    def _write_plan(self, flat: dict[str, Any]) -> dict[str, list[Any]]:
        """DCP's write items of every value, by flat name. Made once and reused while every value
        keeps its name, type, shape, dtype and sharding: DCP's planner helper took ~60 % of a
        save's time on the training thread for ~800 tensors, and it only describes the layout.
        """
        from torch.distributed.checkpoint.planner_helpers import _create_write_items
        from torch.distributed.tensor import DTensor

        def key(name: str, value: Any) -> tuple[Any, ...]:
            if isinstance(value, DTensor):
                return (name, tuple(value.shape), value.dtype, value.placements, id(value.device_mesh),
                        tuple(_local(value).shape))
            if isinstance(value, torch.Tensor):
                return (name, tuple(value.shape), value.dtype)
            return (name,)

        signature = tuple(key(name, value) for name, value in flat.items())
        if self._plan_cache is None or self._plan_cache[0] != signature:
            self._plan_cache = (signature, {name: _create_write_items(name, value) for name, value in flat.items()})
        return self._plan_cache[1]

    def tier_for(self, step: int) -> str | None:
        """Which tier (if any) saves at ``step``; persistent wins when both are due. A persistent
        save deferred by a node-local write still running is owed: it is made at the first step
        after that write is done (the same step on every rank: commits are agreed).
        """
        if step % self.config.checkpoint.every == 0 or step == self.config.steps:
            return PERSISTENT
        if self._owed is not None and self._in_flight is None and self._staging_agreed:
            return PERSISTENT
        if self.local_root is not None and step % self.config.checkpoint.local_every == 0:
            return LOCAL
        return None

    def _carried_step(self) -> int | None:
        """The carried save's step while it can still become durable: not yet handed over, or
        handed to the writer process that runs now. (A dead writer is given up between iterations
        and its successor holds no job: polling it says "durable" for a write that never happened.)
        """
        carried = self._carried
        if carried is None or carried.abandoned or self._writer.death is not None:
            return None
        alive = carried.job is not None or carried.writer_pid == getattr(self._writer, "pid", None)
        return carried.step if alive else None

    def carry(self) -> _InFlight | None:
        """The save in flight, for the next in-process iteration's checkpointer (called after a
        failure): its shard was staged before the fault, so once written it is as good a
        checkpoint as one the fault had come after. Dropped before, every in-process restart lost
        it; on one H200 a 1.3B run's launcher restarts then rolled back 109 and 201 steps
        (benchmarks call72). None when there is none, it was abandoned (a writer died), its
        copies to host memory may be unfinished, or it is the final step's (written again).
        """
        in_flight = self._in_flight or self._carried  # (one carried in, not yet decided: passed on)
        if in_flight is None:
            return None
        why = self._not_carried(in_flight)
        if why is None:
            return in_flight
        if not in_flight.said_abandoned:
            # Called in a failed iteration's `finally`: an error here (a full disk) must not take
            # the place of the failure being handled.
            with contextlib.suppress(OSError):
                self._say_abandoned(in_flight, f"save dropped at the in-process restart: {why}")
        return None

    def _not_carried(self, in_flight: _InFlight) -> str | None:
        """Why the save in flight cannot be carried into the next iteration, or None."""
        if in_flight.abandoned:
            return in_flight.reason or "its writer died"
        if in_flight.step >= self.config.steps:
            return "the final step's save, written again after the restore"
        if self._lost:
            return f"writer died on this rank ({self._lost})"
        if in_flight.job is not None and not self._staging.ready():
            return "its copies to host memory were unfinished at the failure"
        return None

    def _say_abandoned(self, in_flight: _InFlight, reason: str) -> None:
        in_flight.said_abandoned = True
        self._emit("ckpt_abandoned", in_flight.step, reason=reason[:300], tier=in_flight.tier)

    @property
    def owed(self) -> int | None:
        """The step of a deferred persistent save still owed (see :meth:`tier_for`)."""
        return self._owed

    def carry_owed(self, owed: int | None, restored: int) -> None:
        """Take over the persistent save the iteration before an in-process restart still owed:
        owed still when the restore landed at or past its step (every rank restores the same
        step); else that step comes again and is saved on schedule.
        """
        self._owed = owed if owed is not None and restored >= owed else None

    def will_defer(self, step: int) -> bool:
        """A save at ``step`` would be skipped: the previous one is still being written, or a
        rank's staging buffers are still being page-locked (agreed through the step's done count).
        """
        return (self._in_flight is not None or not self._staging_agreed) and step != self.config.steps

    def save(self, step: int, state: dict[str, Any], data_state: Any,
             manifest_fields: dict[str, Any], *, torn_write: bool = False,
             kill_after_submit: Callable[[], None] | None = None) -> None:
        """Start a save of ``step`` (async) or do it whole (sync). Call on every rank.

        Async: returns once the copies to host memory are queued; the shard goes to the writer
        once they are done and the commit happens at a later step (:meth:`local_done`,
        :meth:`maybe_commit`). If the previous save is still being written, this one is skipped
        (``ckpt_deferred``), except for the final step, which waits.
        """
        if self.will_defer(step):
            if self._in_flight is not None:
                owed = self.tier_for(step) == PERSISTENT and self._in_flight.tier == LOCAL
                reason = f"step {self._in_flight.step} still writing"
            else:
                owed = self.tier_for(step) == PERSISTENT
                reason = "staging buffers still being page-locked"
            self._emit("ckpt_deferred", step, reason=reason + ("; owed: made once that is done" if owed else ""))
            if owed:  # a node-local save never costs a persistent one (found on one H200, local every 10)
                self._owed = step
            return
        self.finish()  # the final step is always saved: wait for any previous write
        tier = self.tier_for(step) or PERSISTENT
        if tier == PERSISTENT:
            self._owed = None
        manifest_fields = {**manifest_fields, "lineage": self.lineage.record()}
        begin = time.time()
        self._emit("ckpt_begin", step, mode="async" if self.config.checkpoint.async_save else "sync", tier=tier)
        root = self.root if tier == PERSISTENT else self.local_root
        tmp_dir = root / fmt.write_dirname(step, self._tag)
        tmp_dir.mkdir(parents=True, exist_ok=True)
        shard = self.stage(step, state, data_state, replicated=self.rank == 0 or tier == LOCAL)
        job = (str(tmp_dir), self.rank, shard, torn_write)
        self._in_flight = _InFlight(step, tier, tmp_dir, begin, manifest_fields, job=job, on_submit=kill_after_submit,
                                    retry_job=job[:3] + (False,) if step == self.config.steps else None)
        if self.config.checkpoint.async_save:
            self._emit("ckpt_staged", step, seconds=time.time() - begin)  # how long training was held
            self._submit_if_staged()
        else:
            self._staging.wait()
            self._in_flight.job = None
            fmt.write_rank(tmp_dir, self.rank, shard, torn_write=torn_write)
            self.finish()
            self._emit("ckpt_staged", step, seconds=time.time() - begin)

    def _submit_if_staged(self) -> bool:
        """Hand the shard to the writer once its copy to host memory is complete."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.job is None:
            return True
        if not self._staging.ready() or not self._writer.ready:
            return False  # a writer still starting (or replaced): submitted at a later step
        self._writer.submit(write_rank_job, in_flight.job)
        in_flight.job = None  # handed over (not before: a save carried past a failed hand-over is handed over again)
        in_flight.writer_pid = getattr(self._writer, "pid", None)
        if in_flight.on_submit is not None:
            in_flight.on_submit()
        return True

    def local_done(self) -> float:
        """The rank's part of the step's done count: 1.0 when it has no write in flight (or it is
        durable), 0.0 while one is being written, :data:`ABANDONED` when the writer died with it.
        With nothing in flight, 0.0 while its staging buffers are still being page-locked; a
        durable write counts 0.0 while this rank's :class:`RestoreCheck` still runs.

        Also replaces a writer found dead (its watch thread saw it exit), in flight or idle;
        raises :class:`CheckpointWriterDied` when writers keep dying, and
        :class:`~resilient_training.run.checkpoint_format.CheckpointRefused` when what was
        restored turned out damaged.
        """
        self.restore_check.poll(self._emit)  # damage in what was restored stops the run here
        in_flight = self._in_flight
        durable, lost = False, None
        if in_flight is not None and in_flight.job is None:
            try:
                durable = self._writer.poll()
            except CheckpointWriterDied as exc:  # the rank's shard went with it
                durable, lost = True, str(exc)
                try:  # what the write itself failed with, if it could say (not on a full disk)
                    lost += f": {(in_flight.tmp_dir / fmt.error_name(self.rank)).read_text().strip()}"
                except OSError:
                    lost += low_space([in_flight.tmp_dir.parent])
        if self._writer.death is not None:
            self._writer.replace()
        if in_flight is None:
            return 0.0 if self._staging.locking else 1.0
        if in_flight.abandoned:
            if in_flight.job is not None:  # never handed over: nothing to wait for once staged
                if not self._staging.ready():
                    return 0.0
                in_flight.job = None
            return 1.0 if durable else 0.0  # the lost save's writes are over on this rank
        if lost is not None:
            self._lost = lost
            return ABANDONED
        if in_flight.job is not None:
            self._submit_if_staged()
            return 0.0
        # Nothing is committed on top of a restore not yet found whole (RestoreCheck).
        return 1.0 if durable and not self.restore_check.pending else 0.0

    def in_flight_seconds(self) -> float | None:
        """Seconds since the save in flight began (None when none is)."""
        return None if self._in_flight is None else time.time() - self._in_flight.begin_ts

    def will_commit(self, done_count: float) -> bool:
        """:meth:`maybe_commit` with this count would commit now."""
        return self._in_flight is not None and round(done_count) == self.world_size

    def maybe_commit(self, done_count: float) -> None:
        """Commit the save in flight once every rank reported it durable (same step everywhere);
        abandon it when a rank's writer died with it (a negative count, also the same step everywhere).
        """
        in_flight = self._in_flight
        if in_flight is None:
            # Nothing in flight: the count says whether every rank's staging buffers are ready.
            self._staging_agreed = round(done_count) == self.world_size
            return
        if done_count < 0 and not in_flight.abandoned:
            in_flight.abandoned = True
            reason = f"writer died on this rank ({self._lost})" if self._lost else "a peer's checkpoint writer died"
            in_flight.reason, self._lost = reason, None
            self._say_abandoned(in_flight, reason)
        elif round(done_count) == self.world_size:
            if in_flight.abandoned:
                self._drop_abandoned()
            else:
                self._commit()

    def _drop_abandoned(self) -> None:
        """Every rank's writer is done with the abandoned save: remove its temporary directory
        (rank 0, or each rank on the node-local tier) or, for the final step, write it again.
        """
        in_flight = self._in_flight
        assert in_flight is not None
        if in_flight.step == self.config.steps and in_flight.retry_job is None:
            # Written twice, lost twice: a run must not end "completed" without its final checkpoint.
            self._in_flight = None
            raise fmt.CheckpointError(f"the checkpoint of the final step {in_flight.step} could not be written "
                                      f"(twice): {in_flight.reason or 'its writer died'}")
        if in_flight.retry_job is not None:  # the final step must be saved: its shard is still staged
            in_flight.abandoned, in_flight.job, in_flight.retry_job = False, in_flight.retry_job, None
            in_flight.on_submit, in_flight.said_abandoned = None, False  # begun again (below)
            # The torn file of the lost write, if this rank's writer died.
            for torn in fmt.torn_files(in_flight.tmp_dir, self.rank):
                torn.unlink(missing_ok=True)
            self._emit("ckpt_begin", in_flight.step, mode="async", tier=in_flight.tier, retry=True)
            return
        self._in_flight = None
        if self.rank == 0 or in_flight.tier == LOCAL:
            # Off the training thread: a 1.3B rank's torn 16 GB took 3.3 s between two steps (call73).
            self.remover(Path(in_flight.tmp_dir))

    def _commit(self) -> None:
        """Commit the save every rank reported durable, on the committer's thread (one at a time:
        each waits for the one before, so ``latest`` only moves forward).
        """
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        local = in_flight.tier == LOCAL
        if not local:  # every rank, at the same step: later saves descend from this checkpoint
            self.lineage.base = (in_flight.step, in_flight.manifest_fields["lineage"]["branch"])
        if self.rank != 0 and not local:
            return

        def committed(path: Path) -> None:
            if self.rank != 0:
                return
            # Logged the moment `latest` names it, before the last fsync and pruning (CI once saw
            # rank 0 killed between `latest` and a log line written after those: a restore of a
            # step with no commit; and, logged at the rename, a commit logged but not restored).
            # The manifest's digest: validation proves the checkpoint it reads is the one this run
            # committed (not one copied in from another run, or rewritten consistently since).
            size = sum(f.stat().st_size for f in path.iterdir())
            self._emit("ckpt_committed", in_flight.step, bytes=size * (self.world_size if local else 1),
                       world_size=self.world_size, manifest_checksum=gate_records.manifest_digest(path),
                       seconds=time.time() - in_flight.begin_ts, path=str(path), tier=in_flight.tier)

        def commit() -> None:
            fmt.commit(in_flight.tmp_dir, step=in_flight.step, world_size=self.world_size,
                       manifest_fields=in_flight.manifest_fields, keep_last=2 if local else self.config.checkpoint.keep_last,
                       ranks=[self.rank] if local else None, remove=self.remover, on_committed=committed)
            if not local:
                fmt.write_iteration_file(self.config.run_dir, in_flight.step)
            # Each writer works in order: with this save durable on every rank, the saves earlier
            # in-process iterations abandoned are written out too, and only garbage (each one a
            # checkpoint's size; a stranger trial found one left beside a completed run).
            with contextlib.suppress(OSError):
                for path in fmt.earlier_iterations(in_flight.tmp_dir.parent, self._tag):
                    self.remover(path)

        self.committer.submit(in_flight.step, commit, self._commit_timeout())

    def _commit_timeout(self) -> float:
        """How long a commit may take before this process gives up on it: a few small files and
        renames (well under a second when storage is healthy), generous for slow shared storage.
        """
        return max(60.0, 4 * self.config.timeouts.hard)

    def finish(self, timeout: float = 600.0) -> None:
        """Wait for the write in flight and commit it, on every rank.

        No rank blocks on its own writer while a peer waits in a collective (which would hit
        the short collective timeout): all ranks poll their writer and agree on the result
        together, round after round, until every shard is durable.
        """
        deadline = time.monotonic() + timeout
        while self._in_flight is not None:
            flag = torch.tensor([self.local_done()], device=_flag_device())
            torch.distributed.all_reduce(flag)
            self.maybe_commit(flag.item())
            if self._in_flight is not None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"checkpoint of step {self._in_flight.step} not durable after {timeout:.0f} s")
                self._on_wait()
                time.sleep(0.05)
        self.committer.settle(self._commit_timeout())  # a finished save is a committed one
        # Every save is committed and the writer idle: what an in-process restart abandoned in this
        # round is garbage now, and no later round will remove it (a stranger trial found an empty
        # .tmp-step_5-… beside a completed run's checkpoints).
        if self.rank == 0:
            try:
                stale = fmt.stale_writes(self.root, live_tag_prefix=self._tag)
            except OSError:
                stale = []
            for path in stale:
                self.remover(path)

    def drop_local_tier(self) -> None:
        """After a completed run the node-local tier (often RAM-backed) is only garbage."""
        if self.local_root is not None:
            import shutil

            shutil.rmtree(self.local_root, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.local_root.parent.rmdir()  # the run's folder, once every rank's is gone



class PeersDidNotAgree(TimeoutError):
    """Some ranks did not reach an agreement in time (the message names them, and says "timed out"
    so that the trainer counts it as a peer's failure).
    """


class StoreGather:
    """An all-gather of small JSON values through the ranks' store, not the process group.

    What the ranks agree on before a restore (that rank 0's commit is settled, the newest node-local
    step, what each holds in memory, the new branch token) goes through here, so that the process
    group's first collective is the warm-up :class:`CollectiveWarmUp` makes while the checkpoint
    loads: on NCCL that first collective builds the communicator (0.4-0.9 s measured on H200s, on
    the critical path of every restart before). Waits in short slices, so an in-process restart's
    exception reaches this thread between them (a C++ wait on the store would ignore it) and
    ``on_wait`` keeps the progress pings going.
    """

    SLICE_S = 0.05

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float,
                 on_wait: Callable[[], None] = lambda: None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.on_wait = timeout, on_wait
        self._count = 0

    def __call__(self, value: Any, what: str) -> list[Any]:
        import datetime
        import json

        if self.world_size == 1:
            return [value]
        self._count += 1
        prefix = f"agree/{self._count}"
        self.store.set(f"{prefix}/{self.rank}", json.dumps(value))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys):  # the last rank to arrive does not wait at all
            try:
                self.store.wait(keys, datetime.timedelta(seconds=self.SLICE_S))
                continue
            except (RuntimeError, torch.distributed.DistError) as exc:  # DistStoreError: this slice's timeout
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
            self.on_wait()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
                raise PeersDidNotAgree(f"{what}: rank(s) {missing} did not arrive; timed out after "
                                       f"{self.timeout:g} s")
        multi_get = getattr(self.store, "multi_get", None)  # torch >= 2.4
        values = multi_get(keys) if multi_get is not None else [self.store.get(key) for key in keys]
        return [json.loads(v) for v in values]


class CollectiveWarmUp:
    """The process group's first collective, on a thread of its own while the checkpoint loads.

    On NCCL the first collective builds the communicator (measured on H200s: 0.4 s on one GPU,
    0.8-0.9 s on two), which was on every restart's critical path. Started once the task's model
    and data are built, joined before anything else can make a collective (the task's data
    state, the step agreement): every rank makes this one first, so the order of collectives is
    the same on every rank. The all-reduce runs on a stream of its own: GPU work the load queues
    meanwhile does not wait for the peers.
    """

    def __init__(self, device: torch.device) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(device,), name="collective-warm-up", daemon=True)
        self.thread.start()

    def _run(self, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on device 0
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    torch.distributed.all_reduce(torch.zeros(1, device=device))
                stream.synchronize()
            else:
                torch.distributed.all_reduce(torch.zeros(1, device=device))
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by join()
            self.error = exc

    def join(self) -> None:
        """Wait for it (in slices: an in-process restart's exception reaches this thread) and raise
        what it raised.
        """
        while self.thread.is_alive():
            self.thread.join(0.05)
        if self.error is not None:
            raise self.error


def _collective_gather(value: Any, what: str) -> list[Any]:
    """The same through the process group (a Checkpointer made without a store: tests, tools)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def _flag_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# What a file that is missing, cut short or not a zip archive makes DCP's read raise (a stranger
# trial's truncated and deleted files were reported as "a different model", after 19 restarts).
_DAMAGE_SIGNS = ("FileNotFoundError", "PytorchStreamReader failed", "shorter than its layout",
                 "No such file or directory", "failed finding central directory")


def _damaged(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or any(sign in str(exc) for sign in _DAMAGE_SIGNS)


def task_identity(spec: str) -> str:
    """A task name two runs can compare: a task file by its absolute path."""
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py") or "/" in module:
        module = os.path.abspath(os.path.expanduser(module))
    return f"{module}:{attr}"


def check_compatible(manifest: dict[str, Any], config: TrainConfig) -> None:
    """Refuse to resume from a checkpoint of another format, task or model shape, or one another
    run directory saved (its ``run_uid``: a step copied in from a run of the same shape passed
    every gate before, trained on as this run's; a manifest without one, written before
    2026-12-04, is not checked).
    """
    fmt.require_format(manifest, config.run_dir)
    step = manifest.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step > config.steps:
        # A resume trains on from its latest checkpoint: below it, "completed" was logged at the
        # lower target after restoring the higher step, and the gate blamed an edited log (stranger trial).
        raise fmt.CheckpointRefused(
            f"{config.run_dir}'s latest checkpoint is at step {step}, past the run's target step {config.steps} "
            f"(--steps): a resume trains on from that checkpoint; give --steps {step} or more, or a new --run-dir")
    saved_uid = manifest.get("run_uid")
    if saved_uid is not None:
        mine = fmt.read_run_uid(config.run_dir)  # never made here: a lost one would then never match
        if not mine:
            raise fmt.CheckpointRefused(
                f"{Path(config.run_dir) / fmt.RUN_UID_FILENAME} is missing or empty, and this run directory's "
                f"checkpoints record run uid {str(saved_uid)[:40]!r}: if they are this run's, write that uid "
                "into it to resume")
        if saved_uid != mine:
            raise fmt.CheckpointRefused(
                f"{config.run_dir}'s latest checkpoint (step {manifest.get('step')}) was saved by another run "
                f"(run uid {str(saved_uid)[:40]!r}, this run's {mine!r}): resuming it would train on another "
                "run's state as this one's. Point checkpoints/latest at a step of this run, or resume the run "
                "that saved it (a copy of a whole run directory keeps its run_uid)."
            )
    saved_task, saved = manifest.get("task"), manifest.get("model_config")
    if (saved_task is not None and not isinstance(saved_task, str)) or (saved is not None and not isinstance(saved, dict)):
        # (A stranger trial's task 5 and model_config [1] were tracebacks.)
        raise fmt.CheckpointRefused(
            f"{config.run_dir}'s latest checkpoint (step {manifest.get('step')}) has a damaged manifest: its task "
            f"{saved_task!r} or model_config {saved!r} is not what a checkpoint records. Point checkpoints/latest at "
            "an earlier step, or use a new --run-dir")
    if saved_task is not None and task_identity(saved_task) != task_identity(config.task):
        raise fmt.CheckpointRefused(
            f"{config.run_dir} holds checkpoints of a different model (task {saved_task}); this run's task is "
            f"{config.task}. Use a new --run-dir."
        )
    if config.task != DEFAULT_TASK:
        return
    wanted = {k: getattr(config.model, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")}
    if saved is not None and {k: saved.get(k) for k in wanted} != wanted:
        raise fmt.CheckpointRefused(
            f"{config.run_dir} holds checkpoints of a different model ({saved}); this run wants {wanted}. "
            "Use a new --run-dir."
        )
