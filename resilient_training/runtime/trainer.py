"""The training function each worker runs (once per in-process restart iteration).

``Trainer.run`` reads top to bottom: join the process group, build the task's model and shard
it, restore the latest committed checkpoint, then step until the target step, saving every N
steps. The task (:mod:`resilient_training.runtime.task`) supplies model, optimizer, data and loss;
everything else here is the same for every task. Any
failure is logged with its cause before it propagates to the restart layers (in-process
wrapper, then ft_launcher).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.run import layout
from resilient_training.run.config import TrainConfig
from resilient_training.run.paths import low_space
from resilient_training.runtime import gpu_reclaim, nvrx_adapter
from resilient_training.runtime import task as tk
from resilient_training.runtime.checkpointing import (
    Checkpointer,
    CollectiveWarmUp,
    CommitStuck,
    Committer,
    HostSnapshot,
    Lineage,
    MemorySnapshot,
    Remover,
    RestoreCheck,
    StagingBuffers,
    StoreGather,
    local_tensors,
    local_tier_root,
    state_dict,
    warm_up_writer,
)
from resilient_training.runtime.progress import ProgressGuard

# Calibrated heartbeat timeouts never go below this: observed gaps on a quiet machine can be
# milliseconds, and a loaded one must not be mistaken for a hang.
CALIBRATED_TIMEOUT_FLOOR = 3.0
# The hang allowance is this many times the slowest step (or phase) measured, never below the floor.
PROGRESS_MARGIN = 5.0
# Failures after which this process cannot train again (a new one can): cause -> why.
HANDED_OVER = {
    "interrupted_import": "a module import was interrupted (an in-process restart during a lazy import?) and "
                          "left half-initialized",
    "commit_stuck": "a checkpoint commit is stuck (storage not answering?) and this process would wait on it",
}


class NonFiniteLoss(FloatingPointError):
    """The NaN guard: a non-finite global loss is a failure that rolls back to a checkpoint."""


class Trainer:
    """State that outlives one restart iteration: identity, event log, heartbeats, writer."""

    def __init__(self, config: TrainConfig, *, events: ev.EventLog, heartbeats: nvrx_adapter.Heartbeats) -> None:
        self.config = config
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.agent: str | None = None  # the launcher agent that (re)starts this worker: host:pid:start
        self.attempt = events.attempt
        self.events = events
        self.heartbeats = heartbeats
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if self.on_gpu else torch.device("cpu")
        self.writer = nvrx_adapter.AsyncWriter(on_ready=self._writer_ready, on_died=self._writer_died,
                                               spare=self.config.checkpoint.spare_writer)
        self.staging = StagingBuffers()
        self.remover = Remover()  # kept across in-process restarts: deletions still running are not repeated
        self.committer = Committer()  # likewise: a restore waits for the commit still running
        self.restore_check = RestoreCheck()  # likewise: a restore from memory carries a check's state
        self.snapshot = MemorySnapshot()  # the state every --memory-snapshot-every steps, for in-process restarts
        # ... and in host shared memory (--host-snapshot), for a process the launcher restarts
        self.host_snapshot = HostSnapshot(local_tier_root(config, self.rank)) if config.checkpoint.host_snapshot else None
        self.lineage = Lineage()  # which history the state belongs to (set by each restore; see Lineage)
        self._host_snapshot_off = False  # logged (see _report_pinning)
        self._owed: int | None = None  # a persistent save owed when the last iteration ended
        self._carried: Any = None  # the save in flight when the last iteration failed (Checkpointer.carry)
        self.faults = flt.parse(config.faults)
        self.task = tk.task_from_config(config)
        self.task_args = tk.effective_args(config)
        self.grad_clip = tk.option(self.task, "grad_clip", float, 0.0)
        self.grad_accumulation = tk.option(self.task, "grad_accumulation", int, 1)
        self.injector: flt.Injector | None = None
        # How long the training thread may go without progress before it counts as hung
        # (calibrated from measured steps and phases); owns the pings to both monitors.
        self.guard = ProgressGuard(
            initial=config.timeouts.soft, phase_default=config.timeouts.initial_heartbeat,
            floor=CALIBRATED_TIMEOUT_FLOOR, margin=PROGRESS_MARGIN, beat=heartbeats.beat,
        )
        self._call_wrapper: Any = None
        self._save_phase: tuple[Any, int] | None = None  # (phase token, step saved) until the next step ends
        self.last_cause: str | None = None
        self.last_kind: str | None = None  # classify() of the last failure
        self._same_failures = 0  # tries in a row in this process that failed the same way (see _on_failure)
        self._last_failure: tuple[int, str] | None = None
        self.completed = False
        self.step = 0  # the step being trained (after a restore: the step restored)
        self.iteration = 0  # in-process restart iteration last entered
        self._store: Any = None
        self._round: str | None = None

    # ------------------------------------------------------------------ one iteration

    def run(self, call_wrapper: Any = None) -> None:
        iteration = self.iteration = call_wrapper.iteration if call_wrapper is not None else 0
        self.events.iteration = iteration
        if iteration > 0:
            self.events.emit("restart_done", None, layer="inprocess")
        self.injector = flt.Injector(
            self.faults, rank=self.rank, emit=self.events.emit, memory_limit_mb=self.config.memory_limit_mb,
            already_injected=flt.injected_counts(ev.read_events(self.config.run_dir), self.rank),
            node=flt.this_node(), local_rank=self.local_rank,
        )
        self.step = 0
        laps = _Laps()  # where the time to the first step goes, logged with load_done
        if iteration > 0:  # NVRx's part of this in-process restart, before this call
            laps.phases.update(nvrx_adapter.restart_phases(call_wrapper))
        self._call_wrapper = call_wrapper
        self._save_phase = None
        self.snapshot.release()  # the last iteration's model and optimizer are gone
        self.guard.arm(ping=call_wrapper.ping if call_wrapper is not None else None, on_expire=self._on_hang)
        start_phase = self.guard.begin_phase("start")
        checkpointer: Checkpointer | None = None
        try:
            self._drop_stale_write()
            if call_wrapper is not None and self._store is None:
                self._store = nvrx_adapter.wrapper_store(call_wrapper)
            predecessor = None
            record = self._worker_record() if iteration == 0 else None
            if record is not None:
                predecessor = gpu_reclaim.claim(record)
            if self.on_gpu and iteration == 0:
                torch.cuda.set_device(self.local_rank)
                torch.empty(1, device=self.device)  # create the CUDA context now: its own phase
                laps.lap("cuda_context")
            self._init_process_group(iteration)
            laps.lap("process_group")
            if self.config.checkpoint.async_save and not self.writer.started:
                # Started in the background (it imports torch in a process of its own: seconds)
                # while the restore and the first steps go on; `writer_ready` is logged when it
                # is up, and a save before that waits for it. NVRx 0.7's has no CUDA context.
                self.writer.start(warm_up_writer)
                laps.lap("writer_start")  # what starting it held this thread
            checkpointer = Checkpointer(
                self.config, rank=self.rank, world_size=self.world_size, tag=f"{self._round_tag()}i{iteration}",
                writer=self.writer, staging=self.staging, emit=self.events.emit,
                on_wait=self.guard.progress, remover=self.remover, snapshot=self.snapshot, committer=self.committer,
                host=self.host_snapshot, lineage=self.lineage, restore_check=self.restore_check, carried=self._carried,
                gather=StoreGather(torch.distributed.PrefixStore("ckpt", self._iteration_store), self.rank,
                                   self.world_size, collective_timeout(self.config.timeouts, nccl=self.on_gpu),
                                   on_wait=self.guard.progress),
            )
            started = time.time()
            # After an in-process restart a step staged on every rank (a save in flight) is newer
            # than any commit; not after a NaN, whose cause may already be in that state.
            path, manifest = checkpointer.find_restorable(in_memory=iteration > 0, after_nan=self.last_kind == "nan",
                                                          lap=laps.lap)
            laps.lap("find_checkpoint")
            if predecessor is not None:  # the worker this one replaces, still exiting: its GPU memory
                if not gpu_reclaim.wait_gone(predecessor, self.config.restart.gpu_reclaim_timeout,
                                             on_wait=self.guard.progress):
                    print(f"resilient-training: the GPU's previous worker (pid {predecessor.pid}) still runs "
                          f"after {self.config.restart.gpu_reclaim_timeout:g} s; going on", file=sys.stderr)
                laps.lap("previous_worker_exit")
            # Weights that a checkpoint will overwrite need no initialisation (launcher restarts).
            model, optimizer, scheduler = self._build(from_storage=path is not None or manifest.get("memory") == "host")
            laps.lap("build_model")
            reseed(self.config.seed, self.rank, 0)  # a loader that shuffles with the global generator
            data = tk.build_data(self.task, self.rank, self.world_size, self.config.seed)
            # No collective before this (agreements went through the store): the communicator is
            # built while the checkpoint loads; _restore joins it before its first collective.
            warm_up = CollectiveWarmUp(self.device)
            self.guard.end_phase(start_phase, warm_up=True)
            self._restore(checkpointer, path, manifest, model, optimizer, scheduler, data, started, laps, warm_up)
            checkpointer.carry_owed(self._owed, self.step)
            if self.step == self.config.steps and manifest.get("memory") == "snapshot":
                # Restored at the final step, whose save failed (find_restorable): nothing to
                # train; its checkpoint is written again from the restored state.
                self._save(self.step, model, optimizer, scheduler, data, checkpointer)
            self._train(model, optimizer, scheduler, data, checkpointer, call_wrapper)
            self._wind_down(checkpointer)
            self.events.emit("end", self.config.steps, status="completed", reason="target step reached")
            self.completed = True
        except BaseException as exc:
            self.guard.disarm()
            self._on_failure(exc, self.step)
            raise
        finally:
            self.guard.disarm()
            if checkpointer is not None:  # a persistent save still owed (see Checkpointer.carry_owed)
                self._owed = checkpointer.owed
            # The save in flight, for the next iteration (see Checkpointer.carry); kept as it was
            # when this iteration failed before its checkpointer existed.
            if self.completed:
                self._carried = None
            elif checkpointer is not None:
                self._carried = checkpointer.carry()
            # In `finally`: the in-process wrapper may interrupt the handler above with an
            # exception of its own, and a group left behind fails the next iteration's init.
            if self.completed:
                self._destroy_process_group()
            else:
                self._release_process_group_after_failure()

    def _wind_down(self, checkpointer: Checkpointer) -> None:
        """After the last step: the last save's commit, pruning, the node-local tier's removal.

        In a phase of its own: the save phase begun at the last step ends only at a next step, and
        its allowance (a few × the slowest staging) is no budget for this. On one H200 a 1.3B run
        with --host-snapshot spent over 6 s here after its last commit, and its guard reported a
        hang "in save" once the run was done (benchmarks call42).
        """
        if self._save_phase is not None:
            self.guard.end_phase(self._save_phase[0], measure=False)  # no next step: not a save's length
            self._save_phase = None
        with self.guard.phase("finish"):
            checkpointer.finish()
            self.remover.wait()
            record = self._worker_record()
            if record is not None:
                gpu_reclaim.release(record)
            checkpointer.drop_local_tier()

    def _train(self, model: Any, optimizer: Any, scheduler: Any, data: Any, checkpointer: Checkpointer,
               call_wrapper: Any) -> None:
        step = self.step
        calibrate_at = step + self.config.checkpoint.every + 1 if self.config.timeouts.calibrate else None
        batches = iter(data)
        accumulate = self.grad_accumulation
        toggles_sync = accumulate > 1 and hasattr(model, "set_requires_gradient_sync")
        while step < self.config.steps:
            step = self.step = step + 1
            started = time.perf_counter()
            reseed(self.config.seed, self.rank, step)
            poison = self.injector.maybe_inject_in_step(step)
            total: torch.Tensor | None = None
            # Forward, backward and the loss all-reduce hold FSDP's collectives: a rank stalled in
            # there is most likely waiting for a peer (the hang report says so).
            self.guard.in_collective = True
            for micro in range(accumulate):
                last = micro == accumulate - 1
                if toggles_sync:  # FSDP2 reduces gradients only on the last micro-batch
                    model.set_requires_gradient_sync(last)
                batch, batches = self._next_batch(data, batches)
                with self._autocast():
                    loss = tk.check_loss(self.task.loss(model, batch))
                if poison:
                    loss = loss * float("nan")
                part = loss.detach().float()
                total = part if total is None else total + part
                if last:
                    # One all-reduce per step carries the loss for logging and the checkpoint flag
                    # (torch.full: no host-to-device copy, which would wait for the GPU).
                    flag = torch.full((), checkpointer.local_done(), device=self.device)
                    stats = torch.stack([total / accumulate, flag])
                    torch.distributed.all_reduce(stats)
                (loss / accumulate if accumulate > 1 else loss).backward()
            # Read the loss only now: the backward pass is already queued, so the GPU keeps
            # working while the host waits (the step's one synchronisation).
            total_loss, done_count = stats.tolist()
            self.guard.in_collective = False
            global_loss = total_loss / self.world_size
            if self.config.restart.nan_guard and not math.isfinite(global_loss):
                raise NonFiniteLoss(f"non-finite loss {global_loss} at step {step}")
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
            self.staging.fence()  # a save's (and a snapshot's) copies may still be reading these tensors
            self.snapshot.fence()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(global_loss)  # the one scheduler that needs a metric: the step's loss
            elif scheduler is not None:
                scheduler.step()
            if not self.staging.prepared:
                self.staging.prepare(local_tensors(state_dict(model, optimizer, scheduler)))
            self._pad_step(started)
            self.events.emit("step", step, loss=global_loss, seconds=time.perf_counter() - started)
            if self._save_phase is not None and self._save_phase[1] < step:
                self.guard.end_phase(self._save_phase[0])
                self._save_phase = None
            self.guard.progress()
            self.heartbeats.cover(0)
            if self.host_snapshot is not None:
                self.host_snapshot.poll()  # commits a copy to host memory once it is done
            self._report_pinning(step)
            # Always called: a negative count abandons a save lost with a dead writer.
            committing = checkpointer.will_commit(done_count)
            if committing:  # reading a checkpoint back costs about what writing it did: the first load's budget
                self.guard.observe("load", checkpointer.in_flight_seconds() or 0.0)
            with self.guard.phase("commit") if committing else contextlib.nullcontext():
                checkpointer.maybe_commit(done_count)
            saving = bool(checkpointer.tier_for(step))
            # An async save stages from a snapshot of its own step, taken first (on GPUs a copy
            # within the device): the next optimizer step then does not wait for the copy to the host.
            snapshot_first = (self.config.checkpoint.async_save and saving and not checkpointer.will_defer(step)
                              and self._snapshot_due(step, staged=False))
            if snapshot_first:
                self._take_snapshot(step, model, optimizer, scheduler, data, host=False)
            if saving:
                self._save(step, model, optimizer, scheduler, data, checkpointer)
            if not snapshot_first and self._snapshot_due(step, staged=saving and not checkpointer.will_defer(step)):
                self._take_snapshot(step, model, optimizer, scheduler, data)
            if step == calibrate_at:
                with self.guard.phase("calibrate"):
                    timeouts = self.heartbeats.calibrate(floor=self._heartbeat_floor()) or {}
                self.events.emit("calibrated", step, timeouts={**timeouts, "progress": self.guard.calibrated()})

    def _report_pinning(self, step: int) -> None:
        """Log each background page-locking once it is over (GPUs only): memory CUDA refused to
        lock makes its copies synchronous, which a save's stall would show.
        """
        for what, holder in (("staging", self.staging), ("host_snapshot", self.host_snapshot)):
            report = holder.pin_report.take() if holder is not None else None
            if report is not None:
                self.events.emit("host_memory_locked", step, what=what, **report)
        host = self.host_snapshot
        if host is not None and host.failed and not self._host_snapshot_off:
            self._host_snapshot_off = True
            self.events.emit("host_snapshot_off", step, reason=host.failed)

    def _take_snapshot(self, step: int, model: Any, optimizer: Any, scheduler: Any, data: Any, *,
                       host: bool = True) -> None:
        """``host``: also copy it to host memory (--host-snapshot). Not when a save stages from
        it at the same step: both would copy the whole state to the host, and the save already
        holds that step.
        """
        self.snapshot.take(step, model, optimizer, scheduler, data.state_dict(), world=(self.rank, self.world_size))
        if self.snapshot.disabled:
            self.events.emit("memory_snapshot_off", step, reason=self.snapshot.disabled)
        elif self.host_snapshot is not None and host:
            self.host_snapshot.write(self.snapshot, step, self.lineage)

    def _snapshot_due(self, step: int, *, staged: bool) -> bool:
        """A memory snapshot at ``step``: every ``memory_every`` steps, unless a save staged this
        very step (restorable from memory already) or snapshots were turned off for lack of memory.
        """
        every = self.config.checkpoint.memory_every
        return bool(every) and step % every == 0 and not staged and self.snapshot.disabled is None

    def _next_batch(self, data: Any, batches: Any) -> tuple[Any, Any]:
        """The next batch on this device; a new epoch (``iter`` again) when the data runs out."""
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(data)
            try:
                batch = next(batches)
            except StopIteration:
                raise tk.TaskError(f"task build_data() ran out of batches on rank {self.rank} and iter() on it again "
                                   "yields none: return an iterable that starts a new epoch on iter(), like a "
                                   "DataLoader, not a one-pass iterator") from None
        return self._to_device(batch), batches

    def _to_device(self, batch: Any) -> Any:
        if not self.on_gpu:
            return batch
        if isinstance(batch, torch.Tensor):  # through page-locked memory: the copy does not wait for the GPU
            return batch.pin_memory().to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 compute on GPUs (weights, optimizer and checkpoints stay fp32); fp32 on CPU."""
        if self.on_gpu:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _heartbeat_floor(self) -> float:
        """With in-process restart on, a hang must reach that layer (soft timeout) before
        ft_launcher's heartbeat timeout; once it restarts, Heartbeats.cover takes over.
        """
        if self.config.restart.inprocess:
            # The guard feeds the heartbeats on the training thread's behalf up to its allowance,
            # then the in-process layer has to take over before ft_launcher gives up.
            return max(CALIBRATED_TIMEOUT_FLOOR, self.guard.step_allowance + self.config.timeouts.soft)
        return CALIBRATED_TIMEOUT_FLOOR

    def _on_hang(self, reason: str) -> None:
        """The progress guard's allowance ran out (called from its thread): report a soft timeout
        to NVRx's in-process layer now, instead of after its fixed ``soft_timeout``. Its monitor
        thread on every rank then aborts the NCCL communicators (a rank blocked in a collective
        with the hung one is released) and restarts the training function, as for its own timeout.
        """
        self.events.emit("hang_detected", self.step or None, reason=reason, where=self.guard.where())
        if self._call_wrapper is not None:
            nvrx_adapter.report_hang(self._call_wrapper, self.rank)

    def _save(self, step: int, model: Any, optimizer: Any, scheduler: Any, data: Any,
              checkpointer: Checkpointer) -> None:
        # A checkpoint fault acts at the first save that really writes at or after its step.
        fault = None if checkpointer.will_defer(step) else self.injector.due_checkpoint(step)
        if fault is not None:
            self.injector.mark(fault, step)
        kill_self = None
        if fault is not None and fault.type == "ckpt-kill" and self.config.checkpoint.async_save:
            kill_self = _sigkill_self  # the writer is busy with this rank's shard right now
        torn = fault is not None and (fault.type == "writer-kill" or
                                      (fault.type == "ckpt-kill" and not self.config.checkpoint.async_save))
        # A phase from here to the end of the next step: the first save waits for its pinned
        # buffers, and the next optimizer step for the copies (seen on 2 GPUs with 8 GB shards:
        # a 3.3 s step, which would have made every later allowance five times that).
        deferred = checkpointer.will_defer(step)
        if not deferred:
            self._save_phase = (self.guard.begin_phase("save"), step)
        if fault is not None and fault.type == "ckpt-hang":
            self.injector.hang()  # the training thread stops inside the save (sync: its write)
        save_started = time.monotonic()
        checkpointer.save(step, state_dict(model, optimizer, scheduler), data.state_dict(),
                          self._manifest_fields(optimizer), torn_write=torn, kill_after_submit=kill_self)
        if not deferred and not self.config.checkpoint.async_save:
            # Reading a checkpoint back costs about what writing it did: the first load's budget.
            self.guard.observe("load", time.monotonic() - save_started)

    def _manifest_fields(self, optimizer: Any) -> dict[str, Any]:
        import resilient_training
        from resilient_training.run.config import DEFAULT_TASK

        fields: dict[str, Any] = {}
        if self.config.task == DEFAULT_TASK:
            fields["model_config"] = {k: getattr(self.config.model, k) for k in self.config.model.__slots__}
        return {
            **fields,
            "task": self.config.task,
            "task_args": self.task_args,
            "seed": self.config.seed,
            "optimizer": {"type": type(optimizer).__name__, "lr": optimizer.param_groups[0].get("lr")},
            "versions": {
                "torch": torch.__version__,
                "nvidia-resiliency-ext": nvrx_adapter.installed_version(),
                "resilient-training": resilient_training.__version__,
            },
            "ft_state": self.heartbeats.state_dict(),
            "progress": self.guard.state_dict(),
            "run_dir": os.path.abspath(self.config.run_dir),
            # Which run directory's history this is: a restore refuses another's (check_compatible).
            "run_uid": fmt.run_uid(self.config.run_dir),
        }

    def _pad_step(self, started: float) -> None:
        remaining = self.config.step_seconds - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)

    # ------------------------------------------------------------------ set-up

    def _init_process_group(self, iteration: int) -> None:
        if self.on_gpu and self.config.restart.inprocess:
            nvrx_adapter.set_inprocess_nccl_env(os.environ)
        if torch.distributed.is_initialized():  # left by an interrupted iteration: never reuse it
            self._abort_process_group()
            self._destroy_process_group()
        backend = "nccl" if self.on_gpu else "gloo"
        if self.on_gpu:
            torch.cuda.set_device(self.local_rank)
            torch.backends.cuda.matmul.allow_tf32 = True
        # The base store is new with every worker group (see _base_store); inside it, each
        # in-process restart iteration gets its own namespace.
        store = torch.distributed.PrefixStore(f"rt/i{iteration}", self._base_store())
        self._iteration_store = store
        torch.distributed.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=collective_timeout(self.config.timeouts, nccl=self.on_gpu)),
        )

    def _worker_record(self) -> Path | None:
        """Where this worker of its device records itself (runtime/gpu_reclaim.py); None when off
        or when the agent that would restart it is not known.
        """
        if not (self.config.restart.worker_gpu_reclaim and self.agent and "?" not in self.agent):
            return None
        run_folder = layout.worker_records(self.config)
        return gpu_reclaim.record_path(run_folder, self.agent, self.local_rank)

    def _round_tag(self) -> str:
        """A name all ranks of this launcher round agree on, for the checkpoint's temporary directory
        (every rank writes its shard into it); rank 0 draws it, through the store.

        Not the restart count: with several nodes each agent counts its own restarts (a
        replacement pod starts at 0; membership changes are not counted), so the ranks of one
        round can disagree on it, and would write into different directories.
        """
        if self._round is None:
            store = self._base_store()
            # Fresh per round: each round's rank 0 hosts a new store (and the agent's store, used
            # only by static rendezvous, serves one fixed world).
            key = "rt/round"
            if self.rank == 0:
                store.set(key, uuid.uuid4().hex[:8])
            self._round = store.get(key).decode()
        return self._round

    def _base_store(self) -> Any:
        """The store ranks meet through: new with every worker group, shared by nothing else.

        With in-process restart on, that is the NVRx wrapper's own store (set in :meth:`run`).
        Otherwise rank 0 hosts one on the port the launcher chose for the workers
        (:func:`worker_store_port`). Never the launcher agent's store: torchrun keeps it across
        restart rounds, where its keys mislead the next round, and the restart count that could
        namespace them is per agent and differs between nodes.
        """
        if self._store is None:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            self._store = torch.distributed.TCPStore(host, worker_store_port(), self.world_size, self.rank == 0,
                                                     timeout=datetime.timedelta(seconds=60), multi_tenant=True)
        return self._store

    def _release_process_group_after_failure(self) -> None:
        """After a failure, never wait for peers: on NCCL, destroying the group from this thread
        blocks while a peer still has collectives queued (seen on 2 H200s: both ranks stuck
        until the NCCL watchdog fired). With in-process restart on, the wrapper's
        ``AbortTorchDistributed`` aborts every group for all ranks; without it the group is
        aborted here and the process exits for ft_launcher to restart.
        """
        if not torch.distributed.is_initialized():
            return
        if not self.on_gpu:
            self._destroy_process_group()
        elif not self.config.restart.inprocess:
            self._abort_process_group()

    def _abort_process_group(self) -> None:
        """Abort (NCCL: ncclCommAbort) rather than wait for peers; a no-op where unsupported."""
        abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
        if abort is not None and self.on_gpu:
            with contextlib.suppress(Exception):
                abort()

    def _destroy_process_group(self) -> None:
        # On gloo this does not close the sockets of an FSDP2 process group (DTensor caches keep
        # it alive, torch 2.13), so peers blocked on a failed rank are released by the
        # collective timeout (pg_timeout); on NCCL the wrapper's abort releases them.
        if torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()

    def _build(self, *, from_storage: bool = False) -> tuple[Any, Any, Any]:
        """The task's model, sharded, with its optimizer and scheduler: FSDP binds to the process
        group it was built with, so every iteration builds anew.

        Built under the run's seed (the same initial weights on every rank and every restart,
        also for a task that does not seed). On a GPU with room for the whole unsharded model it
        is built there directly; otherwise on the CPU, and ``fully_shard`` moves each rank's
        shards to the device. When a checkpoint will be loaded into it (``from_storage``) and
        the checkpoint holds every tensor the model has (no non-persistent buffers), it is built
        on the meta device, sharded there, and only each rank's shards are allocated, without
        initialising them (torchtitan's way): no full-size model on any device, no init kernels.
        """
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        if from_storage:
            with torch.device("meta"):
                model = tk.build_model(self.task)
            if not any(m._non_persistent_buffers_set for m in model.modules()):
                self._shard(model, mesh)
                model.to_empty(device=self.device)
                optimizer = tk.build_optimizer(self.task, model)
                return model, optimizer, tk.lr_scheduler(self.task, optimizer)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(self.config.seed)
        try:
            if self.on_gpu and self._fits_unsharded():
                with torch.device(self.device):
                    model = tk.build_model(self.task)
            else:
                model = tk.build_model(self.task)
        finally:
            torch.random.set_rng_state(generator_state)
        self._shard(model, mesh)
        optimizer = tk.build_optimizer(self.task, model)
        return model, optimizer, tk.lr_scheduler(self.task, optimizer)

    def _shard(self, model: Any, mesh: Any) -> None:
        shard(self.task, model, mesh)

    def _fits_unsharded(self) -> bool:
        """The unsharded fp32 weights take under a quarter of this GPU's memory (counted on the meta device)."""
        with torch.device("meta"):
            count = sum(p.numel() for p in tk.build_model(self.task).parameters())
        return 4 * count < torch.cuda.get_device_properties(self.device).total_memory / 4

    def _restore(self, checkpointer: Checkpointer, path: Any, manifest: dict[str, Any], model: Any,
                 optimizer: Any, scheduler: Any, data: Any, started: float, laps: _Laps,
                 warm_up: CollectiveWarmUp) -> None:
        step = manifest.get("step", 0)
        source = None
        if manifest.get("progress"):
            self.guard.load_state_dict(manifest["progress"])
        # One phase up to the agreement below: a rank that restores from memory waits there for
        # a peer still reading storage (seen on 2 GPUs: taken for a hang at the step allowance).
        # Every rank restores from the device's memory or none does (find_restorable agrees): such a
        # restore is a copy within the GPU and has its own budget, soft_timeout until measured (a
        # hang in one waited out the storage load's 16.7 s on one H200, 2026-12-02).
        in_device = manifest.get("memory") in ("snapshot", "staged")
        outer = (self.guard.begin_phase("restore_memory", default=self.config.timeouts.soft) if in_device
                 else self.guard.begin_phase("load"))
        if (manifest.get("memory") or path is not None) and any(f.type in flt.LOAD_FAULTS for f in self.faults):
            # Any restore, a memory snapshot's too: with snapshots an in-process restore never reads
            # storage, and a load-hang never fired (fault matrix on one H200, 2026-12-02).
            self.injector.hang_in_restore(flt.reached_step(ev.read_events(self.config.run_dir), self.rank), step)
        data_state = None
        if manifest.get("memory"):
            source, data_state = checkpointer.load_memory(manifest, model, optimizer, scheduler)
        elif path is not None:
            source, data_state = checkpointer.load(path, manifest, model, optimizer, scheduler, lap=laps.lap)
        laps.lap("load_checkpoint")
        warm_up.join()  # before the task's code (it may make collectives) and the agreement below
        laps.lap("first_collective")  # what of the communicator's set-up the load did not cover
        if source is not None:
            tk.call(data, "load_state_dict", data_state)
        # Every rank must restore the same step; a disagreement would silently mix states.
        agreed = torch.tensor([step, -step], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        agreed_steps = int(agreed[0]), int(-agreed[1])  # reads the result: waits for every rank
        # A memory restore says nothing of storage; it is measured under its own name.
        self.guard.end_phase(outer, measure=source == "storage" or in_device)
        if agreed_steps != (step, step):
            raise fmt.CheckpointError(f"ranks restored different steps (max {agreed_steps[0]}, min {agreed_steps[1]})")
        if manifest.get("ft_state"):
            self.heartbeats.load_state_dict(manifest["ft_state"])
        laps.lap("agree_step")
        where = str(path) if path else ("memory" if manifest.get("memory") else None)
        self.events.emit("load_done", step, path=where, source=source,
                         seconds=time.time() - started, phases=laps.phases)
        self.guard.progress()
        self.step = step

    # ------------------------------------------------------------------ failure

    def _on_failure(self, exc: BaseException, step: int) -> None:
        cause = self.last_kind = self.classify(exc)
        self.last_cause = f"{cause}: {exc}" if str(exc) else cause
        message = f"{type(exc).__name__}: {exc}"[:500]
        self.events.emit("failure_detected", step or None, cause=cause, message=message)
        if self._repeats(step, cause, message, exc) >= SAME_FAILURE_TRIES:
            # A bug in the task's code (a KeyError in loss()): each in-process restart replays
            # to it and meets it again (a stranger trial watched it retried up to the limit).
            exc = tk.TaskError(f"the same failure at step {step} in {SAME_FAILURE_TRIES} tries in a row ({message}): "
                               "a bug in the task's code or data, not a fault")
        if cause in HANDED_OVER and self.config.restart.inprocess:
            # This process cannot train again: every later iteration finds the same half-imported
            # module, or waits on the same stuck commit. A new one can, so hand over to the
            # launcher (as a killed rank would); the checkpoint writer follows its worker
            # (warm_up_writer), and peers see a lost rank.
            reason = f"{HANDED_OVER[cause]}; this process cannot be reused: handing over to the launcher"
            self.events.emit("end", step or None, status="failed", reason=f"{reason} ({exc})"[:500])
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if retrying_cannot_help(exc):
            # The task's own code broke its contract (a loss that is not a scalar...), or the
            # checkpoint to restore is another model's, another run's or damaged: every retry
            # fails the same way (a stranger trial watched 8 in-process restarts). Stop the run.
            why = "the task's code" if isinstance(exc, tk.TaskError) else "the checkpoint"
            # Cut the message, not the marker the launcher's summary looks for (a damaged
            # checkpoint's message, two paths long, lost it: "gave up after 1 restart").
            said = str(exc) if len(str(exc)) <= 1000 else str(exc)[:999] + "…"
            reason = f"{said} ({why}: retrying cannot help)"
            self.events.emit("end", step or None, status="failed", reason=reason)
            print(f"resilient-training worker rank {self.rank}: {reason}", file=sys.stderr)
            self.heartbeats.stop_workload(reason)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(nvrx_adapter.EXIT_DO_NOT_RESTART)
        if self.config.restart.inprocess:
            # Keep ft_launcher's heartbeat monitor satisfied while the in-process layer restarts;
            # a restart that overruns this is caught by ft_launcher.
            self.heartbeats.cover(self.config.timeouts.hard + 30.0)
            self.events.emit("restart_begin", step or None, layer="inprocess", cause=cause)

    def _repeats(self, step: int, cause: str, message: str, exc: BaseException) -> int:
        """How many tries in a row, this one included, failed with this exception at this step. Only
        an exception of the task's own (cause: its type's name): an injected fault, an OOM, a NaN, a
        hang or a peer's failure may well pass on the next try.
        """
        if cause != type(exc).__name__ or isinstance(exc, flt.InjectedFault):
            self._last_failure, self._same_failures = None, 0
            return 0
        same = self._last_failure == (step, message)
        self._last_failure, self._same_failures = (step, message), (self._same_failures + 1 if same else 1)
        return self._same_failures

    def _drop_stale_write(self) -> None:
        """Recovery does not wait for a write left running by a failed iteration: the next
        iteration commits it once written when every rank carries it (:meth:`Checkpointer.carry`),
        else its temporary directory is abandoned. A dead writer is given up here (its save is
        not carried) and started again in :meth:`run`.
        """
        try:
            self.writer.poll()
        except nvrx_adapter.CheckpointWriterDied:
            pass
        if self.writer.death is not None:
            if self._carried is not None:  # the save it was writing died with it (see Checkpointer.carry)
                self._carried.abandoned, self._carried.reason = True, self.writer.death.describe()
            self.writer.abandon()

    def _writer_died(self, death: nvrx_adapter.WriterDeath) -> None:
        """Called on the writer's watch thread the moment its process exits unasked: logged now;
        the training thread replaces it at its next step (:meth:`Checkpointer.local_done`).
        """
        roots = [layout.checkpoints_dir(self.config.run_dir)]
        if self.config.checkpoint.local_every:
            roots.append(local_tier_root(self.config, self.rank))
        message = death.describe() + ("" if death.signal else low_space([p for p in roots if p.is_dir()]))
        self.events.emit("failure_detected", self.step or None, cause="writer_died", message=message,
                         pid=death.pid, exitcode=death.exitcode, signal=death.signal)

    def _writer_ready(self, seconds: float, pid: int | None, replacements: int) -> None:
        """Called on the writer's start-up thread once its warm-up job ran (seconds since asked)."""
        if replacements:
            self.events.emit("writer_restarted", self.step or None, seconds=round(seconds, 3), pid=pid,
                             restarts=replacements)
        else:
            self.events.emit("writer_ready", self.step or None, seconds=round(seconds, 3), pid=pid)

    def classify(self, exc: BaseException) -> str:
        if half_imported(exc):
            return "interrupted_import"
        if isinstance(exc, CommitStuck):
            return "commit_stuck"
        if (self.injector is not None and self.injector.hanging) or self.guard.expiry is not None:
            return "hang"
        if isinstance(exc, flt.InjectedFault):
            return "exception"
        if isinstance(exc, (MemoryError, flt.InjectedOOM)) or "out of memory" in str(exc).lower():
            return "oom"
        if isinstance(exc, NonFiniteLoss):
            return "nan"
        if isinstance(exc, nvrx_adapter.CheckpointWriterDied):
            return "writer_died"
        if isinstance(exc, fmt.CheckpointError):
            return "checkpoint"
        text = f"{type(exc).__name__}: {exc}"
        if "RankShouldRestart" in text:
            return "restart_requested"
        if any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")):
            return "peer_failure"
        return type(exc).__name__

    def close(self) -> None:
        """Finish the background writer: gracefully after success, at once after a failure
        (a restart should not wait for a write that will never be committed).
        """
        self.guard.close()
        with contextlib.suppress(Exception):
            if self.completed:
                self.writer.close(timeout=120)
            else:
                self.writer.abandon(spare=True)
        self.heartbeats.close()


def half_imported(exc: BaseException) -> bool:
    """An exception (or one it came from) that says a module was left half-initialized: an
    import was interrupted in this process (Python's message for a circular import).
    """
    seen: BaseException | None = exc
    for _ in range(16):  # a chain, not a cycle
        if seen is None:
            return False
        if isinstance(seen, ImportError | AttributeError) and "partially initialized module" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# Tries in a row that fail with the same exception of the task's at the same step before the run
# stops (retrying cannot help): the first and two in-process restarts.
SAME_FAILURE_TRIES = 3


def retrying_cannot_help(exc: BaseException) -> bool:
    """A failure every restart would meet again: the task cannot be loaded or broke its contract,
    or the checkpoint to restore is another model's, another run's or damaged. The worker then
    exits with NVRx's "do not restart" and the reason, instead of restarting into it again.
    """
    return isinstance(exc, (tk.TaskError, fmt.CheckpointRefused)) or (
        isinstance(exc, fmt.CheckpointError) and "different model" in str(exc))


def shard(task: Any, model: Any, mesh: Any) -> None:
    """The task's own ``shard(model, mesh)``, else :func:`default_shard`."""
    if callable(getattr(task, "shard", None)):
        tk.call(task, "shard", model, mesh)
    else:
        default_shard(model, mesh)


def reseed(seed: int, rank: int, step: int) -> None:
    """Seed the global generators (torch's on every device, Python's, NumPy's when imported) from
    (``--seed``, rank, step), at every step: what a task draws from them (dropout, a loader's
    unseeded shuffle) is then the same whenever that step runs, so a restore replays it exactly
    (a stranger trial's dropout differed after every restart, and even between two clean runs,
    and the convergence gate failed the run). About 0.1 ms a step (CPU machine, while a test suite
    ran; not measured on a GPU).
    """
    import random

    value = (((seed * 1_000_003) + rank) * 1_000_003 + step) % (2**63)
    torch.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (2**32))


def default_shard(model: Any, mesh: Any) -> None:
    """FSDP2 as the trainer applies it unless the task shards itself: ``fully_shard`` on each
    block of every ``nn.ModuleList`` (its unit of all-gather), then on the whole model.
    """
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    sharded: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                if id(block) not in sharded:  # one block listed several times (shared layers) is one unit
                    sharded.add(id(block))
                    fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class _Laps:
    """Seconds spent in each named phase, in order (the restart profile in ``load_done``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self._mark, 3)
        self._mark = now


def _sigkill_self() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def worker_store_port() -> int:
    """The port a worker group hosts its store on.

    ft_launcher (like torchrun without an agent store) leaves ``MASTER_PORT`` to the workers: a
    port it found free. torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` serves its own store
    there, so the workers take the next one (which, unlike ``MASTER_PORT``, nobody checked).
    """
    port = int(os.environ.get("MASTER_PORT", "29500"))
    return port + 1 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else port


def collective_timeout(timeouts: Any, *, nccl: bool) -> float:
    """The process group's collective timeout. gloo cannot be interrupted mid-collective:
    ``pg_timeout`` bounds how long a peer waits for a failed rank before it joins the restart.

    NCCL is aborted by the in-process layer instead, and its watchdog tears the whole process
    down when a collective times out (seen on 2 H200s: pg 60 s < soft 90 s turned every hang into
    a launcher restart; pg 3 s kills ranks that wait for a peer's save). So there it must outlast
    the in-process hard timeout (NVRx's usage guide says the same) and ft_launcher's heartbeat
    timeout: hangs are theirs to catch.
    """
    if nccl:
        return max(timeouts.pg, max(timeouts.hard, timeouts.heartbeat) + 30.0)
    return timeouts.pg
