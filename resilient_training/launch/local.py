"""The local launcher: ``resilient-training train`` starts ft_launcher with gloo workers here.

Checks everything it can before starting (fault schedule, run directory), writes the run's
config, runs ft_launcher (or torchrun with ``--no-ft-launcher``) in its own process group,
prints progress from the event log while it runs, and exits non-zero with the cause taken
from the event log when recovery gave up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from resilient_training.launch import cancel
from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import config as cfg
from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.run import gate_records, layout, paths

# Causes a rank reports when a peer failed or a restart was requested of it: never a root cause.
SECONDARY_CAUSES = ("peer_failure", "restart_requested")
# Every process a local launch starts inherits this label (one value per launch), ft_launcher's
# agent and what it starts in sessions of their own alike (workers, their checkpoint writers,
# NVRx's rank monitors, a spare pool): how the launcher finds them all once the agent is gone.
LAUNCH_LABEL_ENV = "RT_LAUNCH_LABEL"


class LaunchError(ValueError):
    """Bad input found before anything started."""


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    exit_code: int
    reason: str
    run_dir: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def max_local_procs() -> int:
    """The most workers one machine is asked to start: 8 per CPU (a stranger trial's --nproc 100000
    started spawning them, about 7 a second).
    """
    return max(8, 8 * (os.cpu_count() or 1))


def preflight(config: cfg.TrainConfig, *, world_size: int, nodes: int = 0) -> list[flt.Fault]:
    """Everything that can be wrong before a worker starts, as one clear LaunchError."""
    if world_size < 1:
        raise LaunchError(f"world size must be at least 1, got {world_size}")
    if world_size > max_local_procs():
        raise LaunchError(f"world size {world_size} is more workers than this machine's {os.cpu_count()} CPUs "
                          f"can run (at most {max_local_procs()})")
    try:
        schedule = flt.parse(config.faults)
        flt.validate(schedule, world_size=world_size, steps=config.steps,
                     async_checkpoint=config.checkpoint.async_save, checkpoint_every=config.checkpoint.every,
                     nodes=nodes, local_checkpoint_every=config.checkpoint.local_every)
    except flt.FaultSpecError as exc:
        raise LaunchError(str(exc)) from None
    if config.restart.min_world_size > world_size:
        raise LaunchError(f"min world size {config.restart.min_world_size} exceeds the world size {world_size}")
    try:
        run_dir = paths.check_writable(config.run_dir, "run directory", directory=True)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if (outer := layout.run_dir_around(Path(os.path.abspath(run_dir)).parent)) is not None:
        # A stranger trial's --run-dir RUN/checkpoints/step_20 trained into a committed checkpoint
        # (validation then found it damaged), outside the lock of the run around it.
        raise LaunchError(f"run directory {config.run_dir} lies inside the run {outer}: train in a directory of "
                          "its own")
    check_not_in_use(config)  # first: what follows reads what a running training writes
    check_same_task(config, run_dir)
    try:
        latest = fmt.read_latest(layout.checkpoints_dir(run_dir))
        if latest is not None:
            from resilient_training.runtime.checkpointing import check_compatible

            manifest = fmt.read_manifest(latest)
            check_compatible(manifest, config)
            # A resume reads what it restores without checking it (a restart's seconds): the
            # bytes are checked here, once, before any worker starts (a stranger trial's damaged
            # chunk was restored and trained on, and every gate passed).
            damaged = fmt.damaged_files(latest, manifest)
            if damaged:
                raise fmt.CheckpointRefused(
                    f"{latest} is damaged: {'; '.join(damaged[:3])}{' …' if len(damaged) > 3 else ''}. "
                    f"{fmt.rewind_advice(latest)}")
            check_same_task_args(manifest, config)
            check_committed_by_run(run_dir, latest, manifest)
    except fmt.CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    check_task(config, world_size=world_size)
    check_local_dir(config)
    return schedule


def check_committed_by_run(run_dir: Path, latest: Path, manifest: dict) -> None:
    """The latest checkpoint is one this run committed: rank 0 logged its commit with the digest
    of this very manifest (what validation checks of the checkpoint a run ends with). The
    manifest's ``run_uid`` alone proves nothing: a stranger trial deleted it from another run's
    step planted here, which was then resumed, trained on, validated, judged converged and
    promoted. A step whose commit rank 0 did not live to log is refused too (it cannot be told
    from a planted one); the refusal says how to resume from the step before.
    """
    step = manifest.get("step")
    commit, _, why = gate_records.recorded_commit(run_dir, step) if isinstance(step, int) else (None, None, "")
    if commit is None:
        raise fmt.CheckpointRefused(
            f"{latest} is not known to be this run's: {why or 'its manifest has no step'} (put there from "
            f"elsewhere, or rank 0 stopped between its commit and the log line). {fmt.rewind_advice(latest)}")
    logged = commit.get("manifest_checksum")
    if isinstance(logged, str) and logged != gate_records.manifest_digest(latest):
        raise fmt.CheckpointRefused(
            f"{latest} is not the checkpoint this run committed at step {step}: its manifest's digest is not "
            f"the one the run's event log records (copied from another run, or rewritten after its commit). "
            f"{fmt.rewind_advice(latest)}")


def check_local_dir(config: cfg.TrainConfig) -> None:
    """The node-local tier's directory (on this machine) can be created and written, before any
    worker starts. A stranger trial gave a regular file: each rank failed on its own, the
    in-process layer retried 8 times and the run ended after 40 s on a store timeout that hid
    the cause (and `run` trained 30 s into the same, after `train` had been fixed alone).
    """
    if not config.checkpoint.local_every:
        return
    given = config.checkpoint.local_dir
    if given and given != given.strip():  # as every other path: "/tmp/lc " made a directory ending in a space
        raise LaunchError(f"--local-checkpoint-dir {given!r} has leading or trailing whitespace: remove it")
    path = Path(given or "/dev/shm/resilient-training")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise LaunchError(f"--local-checkpoint-dir {path} cannot hold the node-local tier: "
                          f"{exc.strerror or exc}") from None


def check_same_task(config: cfg.TrainConfig, run_dir: Path) -> None:
    """A run directory that already holds a run (its config.json) is resumed only with the task and task
    arguments it was made with. The checkpoint check covers the built-in model's flags only: a task
    argument that changes a shape (``--task-arg d=32`` on a ``d=64`` run) passed it, and every rank
    then failed all its in-process restarts on a size mismatch. Other settings (``--nproc``,
    ``--steps``, fault schedules) may change between the runs of one directory.
    """
    import json

    try:
        recorded = json.loads(layout.config_path(run_dir).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):  # unreadable: the checkpoint's own compatibility check still applies
        return
    if not isinstance(recorded, dict):
        return
    differ = []
    task = recorded.get("task", cfg.DEFAULT_TASK)  # a config.json from before tasks: the built-in one
    if isinstance(task, str) and cfg.absolute_task(task) != cfg.absolute_task(config.task):
        differ.append(f"task {task!r} (now {config.task!r})")
    args = recorded.get("task_args") or {}
    if isinstance(args, dict):
        from resilient_training.runtime import task as tk

        same_was, same_now = tk.comparable_args(config.task, args), tk.comparable_args(config.task, config.task_args)
        for key in sorted(set(args) | set(config.task_args)):
            was, now = args.get(key), config.task_args.get(key)
            if same_was.get(key) != same_now.get(key):
                differ.append(f"task arg {key}: {'unset' if was is None else repr(was)} "
                              f"(now {'unset' if now is None else repr(now)})")
    builtin = cfg.absolute_task(config.task) == cfg.absolute_task(cfg.DEFAULT_TASK)
    if builtin:
        # Its --lr and --batch-size too: a restore brings back the optimizer's learning rate, so
        # a changed --lr was recorded in config.json and the manifest but never used (stranger trial).
        data = recorded.get("data") if isinstance(recorded.get("data"), dict) else {}
        for name, was, now in (("lr", recorded.get("lr"), config.lr),
                               ("batch_size", data.get("batch_size"), config.data.batch_size)):
            # (A --task-arg of the same name wins over the flag: compared with the task args above.)
            if isinstance(was, (int, float)) and not isinstance(was, bool) and was != now \
                    and name not in config.task_args:
                differ.append(f"--{name.replace('_', '-')} {was} (now {now})")
    differ += _changed_seed(recorded, config)
    model = recorded.get("model")
    if builtin and isinstance(model, dict):
        # The built-in model's shape flags, checked before any checkpoint exists too (the
        # checkpoint's own check finds them only once one does).
        for name in config.model.__slots__:
            was, now = model.get(name), getattr(config.model, name)
            if was is not None and was != now:
                differ.append(f"--model-{name.replace('_', '-')} {was} (now {now})")
    if differ:
        raise LaunchError(f"{config.run_dir} holds a run made with other task settings: {'; '.join(differ)}. "
                          "Resume it with its own settings, or use a new --run-dir")


def _changed_seed(recorded: dict, config: cfg.TrainConfig) -> list[str]:
    """The ``--seed`` a run was made with (config.json's or a manifest's), when this one differs: it
    makes the data and the per-step generators (a changed one resumed silently, the record rewritten
    to it: stranger trial).
    """
    seed = recorded.get("seed")
    changed = isinstance(seed, int) and not isinstance(seed, bool) and seed != config.seed
    return [f"--seed {seed} (now {config.seed})"] if changed else []


def check_same_task_args(manifest: dict, config: cfg.TrainConfig) -> None:
    """The task settings the latest checkpoint was saved with (its manifest's ``task_args``: the
    built-in task's model, batch size and learning rate, or another task's ``--task-arg``s) are
    this run's: config.json says so too, but a deleted one let a changed ``--lr`` resume unused
    (second stranger trial).
    """
    from resilient_training.runtime import task as tk

    saved = manifest.get("task_args")
    if not isinstance(saved, dict):
        return  # written before task_args were recorded: check_same_task's config.json still applies
    now = tk.effective_args(config)
    same_saved, same_now = tk.comparable_args(config.task, saved), tk.comparable_args(config.task, now)
    differ = [f"{key} {saved.get(key)!r} (now {now.get(key)!r})" for key in sorted(set(saved) | set(now))
              if same_saved.get(key) != same_now.get(key)]
    differ += _changed_seed(manifest, config)
    if differ:
        raise fmt.CheckpointRefused(
            f"{config.run_dir}'s latest checkpoint (step {manifest.get('step')}) was saved with other task "
            f"settings: {'; '.join(differ[:4])}. Resume it with its own settings, or use a new --run-dir")


def check_not_in_use(config: cfg.TrainConfig) -> None:
    """The run directory's lock is free now (:func:`claim_run_dir` takes it): another training in
    it is named before its settings or checkpoints are compared with this one's.
    """
    try:
        fd = layout.open_lock(config.run_dir, create=False)
    except layout.LockFileError as exc:
        raise LaunchError(str(exc)) from None
    except OSError:
        fd = None
    if fd is None:
        return  # no lock file yet (or none that can be read): claim_run_dir decides
    try:
        if layout.held_exclusively(fd):
            raise LaunchError(_in_use(config, fd))
    finally:
        os.close(fd)


def _in_use(config: cfg.TrainConfig, fd: int) -> str:
    import fcntl

    try:  # only gates hold it shared (gate_records.reading_run): one is reading the run
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return (f"run directory {config.run_dir} is being read by a gate (validate-checkpoint, check-convergence, "
                "promote or export): wait for it to end, or train in another --run-dir")
    except OSError:
        pass
    return (f"run directory {config.run_dir} is in use by another training (pid {layout.lock_holder(fd)}): "
            "wait for it to end, or train in another --run-dir")


@contextlib.contextmanager
def claim_run_dir(config: cfg.TrainConfig) -> Iterator[RunDirClaim]:
    """Create the run directory (with logs/), lock it for this training, and write its
    config.json, after :func:`preflight`; the lock is held until the block ends.

    Two trainings in one run directory interleave their event logs and checkpoints: a stranger
    trial started a second ``train`` (learning rate 0) 0.05 s after a first, and the gates passed
    and promoted the untrained model. The second now gets a LaunchError naming the first's pid,
    before it writes anything. (A job on a cluster does not come through here: each pipeline run
    trains in a ``runs/<run id>`` of its own unless ``run_subdir`` names one.)

    check_writable's access() test says yes to root on /proc, where nothing can be created: a file
    is made there (and removed) first, and a failure is a LaunchError with the directories this
    call made removed again, so bad input still leaves nothing behind.
    """
    import fcntl

    run_dir = Path(config.run_dir)
    made = [p for p in (layout.logs_dir(run_dir), run_dir, *run_dir.absolute().parents) if not p.exists()]
    try:
        layout.logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
        paths.probe_writable(layout.config_path(run_dir), "run directory")
        fd = layout.open_lock(run_dir, create=True)
    except layout.LockFileError as exc:
        raise LaunchError(str(exc)) from None
    except (OSError, ValueError) as exc:
        for path in made:  # deepest first
            try:
                path.rmdir()
            except OSError:
                pass
        raise LaunchError(f"run directory {config.run_dir} cannot be created or written: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(_in_use(config, fd)) from None
        except OSError as exc:  # a file system without flock: train on, unguarded
            print(f"warning: run directory {config.run_dir} cannot be locked ({exc.strerror or exc}); "
                  "nothing stops a second training from using it at the same time", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        # The gates' verdicts were on the run before this training: promote went on from them while
        # a resume trained, or after it was cancelled (a stranger trial). Gate it again once done.
        try:
            for gate in gate_records.GATES:
                gate_records.withdraw(run_dir, gate)
        except gate_records.RecordError as exc:
            raise LaunchError(str(exc)) from None
        layout.config_path(run_dir).write_text(cfg.dumps(config))
        keeper = LockKeeper(run_dir, fd)
        keeper.start()
        try:
            yield RunDirClaim(run_dir, fd)
        finally:
            keeper.stop()
    finally:
        os.close(fd)


class LockKeeper(threading.Thread):
    """Makes ``RUN/.lock`` again, locked, when it is removed or replaced while the training holds
    it: a lock on a file no longer at that path kept nobody out (a stranger trial deleted it and
    the gates read the run mid-training). A gate that locked a file since replaced notices before
    it records a verdict (``gate_records.write_record``). Another training that took a new lock
    file meanwhile is named, not fought over.
    """

    INTERVAL_S = 0.5

    def __init__(self, run_dir: Path, fd: int) -> None:
        super().__init__(name="run-lock", daemon=True)
        self.run_dir, self.fds = run_dir, [fd]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.INTERVAL_S):
            if not layout.names_lock(self.run_dir, self.fds[-1]) and not self._relock():
                return

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)
        for fd in self.fds[1:]:
            os.close(fd)

    def _relock(self) -> bool:
        """Put a new locked file in place; False to stop keeping (another training holds the path)."""
        import fcntl

        path = layout.lock_path(self.run_dir)
        try:
            other = layout.open_lock(self.run_dir, create=False)
        except (layout.LockFileError, OSError):
            other = None  # not a regular file: replaced below (a directory cannot be, and is said)
        if other is not None:
            try:
                if layout.held_exclusively(other):
                    print(f"warning: {path} was replaced while this training ran, and another training (pid "
                          f"{layout.lock_holder(other)}) holds it now: two trainings use {self.run_dir}",
                          file=sys.stderr)
                    return False
            finally:
                os.close(other)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = None
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.replace(tmp, path)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            print(f"warning: {path} was removed or replaced while this training ran and cannot be made again "
                  f"({exc.strerror or exc}): nothing keeps the gates out of the run until it ends", file=sys.stderr)
            return False
        self.fds.append(fd)
        print(f"warning: {path} was removed or replaced while this training ran: made again (it keeps the gates "
              "and other trainings out of the run)", file=sys.stderr)
        return True


@dataclasses.dataclass(frozen=True)
class RunDirClaim:
    path: Path
    lock_fd: int  # passed to the launcher too: the lock lasts until its workers are stopped


def check_task(config: cfg.TrainConfig, *, world_size: int) -> None:
    """Import the task and run its ``build_*`` once (model on the meta device): a broken task is
    one LaunchError naming the method, before any worker starts.

    Not for the built-in task made from the run's own flags: TrainConfig's validation already
    rejects every value it would (sizes, divisibility, batch size), and the check would cost a
    torch import in this process (2.4-2.7 s on a 2-core machine) before every run.
    """
    if given := cfg.builtin_task_flags(config):
        # Found by a stranger trial: --lr with its own task was accepted, recorded in config.json
        # as if used, and ignored (the task's optimizer made its own).
        raise LaunchError(f"{', '.join(given)} {'is a setting' if len(given) == 1 else 'are settings'} of the "
                          f"built-in task, which task {config.task} never reads: pass what your task takes as "
                          "--task-arg KEY=VALUE")
    if config.task == cfg.DEFAULT_TASK and not config.task_args:
        if config.export_format == "hf":  # as the pipelines say it, without building the model
            raise LaunchError("export_format hf writes a transformers model, and the built-in GPT task's is not one: "
                              "export it with safetensors or torch")
        return
    from resilient_training.runtime import task as tk

    try:
        tk.preflight(config, world_size=world_size)
    except tk.TaskError as exc:
        raise LaunchError(str(exc)) from None


# Tasks shipped in this package: the trainer image holds the same release, so making one here
# says what its workers would say.
SHIPPED_TASKS = "resilient_training.tasks."


def check_shipped_task(config: cfg.TrainConfig) -> None:
    """For a cluster run, before it exists: a task shipped in this package is made with the run's
    task arguments (no model, no data), so a misspelt or out-of-range ``task_args`` value is one
    LaunchError now, not every worker's failure minutes (or, scheduled, nights) later. A user's own
    task lives in the user's image, whose version this process may not have: its workers check it.
    """
    if not config.task.startswith(SHIPPED_TASKS) or (config.task == cfg.DEFAULT_TASK and not config.task_args):
        return
    import importlib.util

    if importlib.util.find_spec("torch") is None:  # the components image (no torch): the workers check it
        return
    from resilient_training.runtime import task as tk

    try:
        tk.load_task(config.task, tk.effective_args(config))
    except tk.TaskError as exc:
        raise LaunchError(str(exc)) from None


def run_local(
    config: cfg.TrainConfig,
    *,
    nproc: int = 2,
    progress: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run the workers on this machine under ft_launcher until done; never raises on failure."""
    preflight(config, world_size=nproc)
    with claim_run_dir(config) as claim:
        return _run_local(config, claim, nproc=nproc, progress=progress, env=env)


def _run_local(config: cfg.TrainConfig, claim: RunDirClaim, *, nproc: int, progress: Callable[[str], None] | None,
               env: dict[str, str] | None) -> LaunchResult:
    run_dir = claim.path
    from resilient_training.runtime import nvrx_adapter
    command = nvrx_adapter.worker_command(
        config, cfg.to_argv(config), python=sys.executable, standalone=True, nnodes="1",
        nproc_per_node=nproc, iteration_file=fmt.iteration_file(config.run_dir),
    )
    label = f"{os.getpid()}-{uuid.uuid4().hex}"
    worker_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {}),
                  # ft_launch stops the workers if this process dies without cleaning up (SIGKILL)
                  "RT_LAUNCHER_PARENT_PID": str(os.getpid()), LAUNCH_LABEL_ENV: label}
    agent = "ft_launcher" if config.restart.ft_launcher else "torchrun"
    log_path = layout.logs_dir(run_dir) / "launcher.log"
    started = time.time()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env,
                                start_new_session=True, pass_fds=(claim.lock_fd,))
        watcher = ProgressPrinter(run_dir, config.steps, since=started, emit=progress)
        watcher.start()
        stopped: BaseException | None = None
        try:
            with cancel.sigterm_raises():
                exit_code = proc.wait()
        except BaseException as exc:
            _kill_group(proc)
            stopped = exc
            raise
        finally:
            # Whatever the agent left, however it ended: a stranger trial SIGKILLed ft_launcher,
            # and its workers (sessions of their own) trained on for 94 s after this launcher had
            # logged the run's end, their rank monitors alive for good and holding the run's lock.
            # (In a pod, the container's end takes them all the same way.)
            pids = {proc.pid, *pids_with_env(LAUNCH_LABEL_ENV, label)}
            left = kill_with_env(LAUNCH_LABEL_ENV, label)
            if proc.returncode is not None and proc.returncode < 0:
                remove_sockets(worker_env.get("TMPDIR") or tempfile.gettempdir(), pids)
            watcher.stop()
            # The workers' pid records: a completed run's workers remove them, a stopped or failed
            # run's were left in /dev/shm (a stranger trial). Its workers are gone by now.
            shutil.rmtree(layout.worker_records(config), ignore_errors=True)
            if stopped is not None:  # after the workers: the end is the run's last event
                record_stopped(run_dir, stopped)
    if exit_code < 0:  # a signal nobody here sent: say so, not what the event log last said
        reason = agent_died(agent, proc.pid, exit_code, left)
    else:
        reason = outcome(run_dir, config.steps, exit_code, since=started, log=log_path)
        if reason.startswith("launcher exited "):  # which launcher, which process
            reason = f"{agent} (pid {proc.pid}) exited {reason.removeprefix('launcher exited ')}"
    if exit_code != 0:
        record_failure(run_dir, reason)
    return LaunchResult(exit_code, reason, str(run_dir))


def pids_with_env(name: str, prefix: str) -> list[int]:
    """Processes (this one aside) whose environment sets ``name`` to a value starting with ``prefix``."""
    needle = f"{name}={prefix}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue  # gone, or a kernel thread
        if any(item.startswith(needle) for item in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def kill_with_env(name: str, prefix: str) -> int:
    """SIGKILL every process :func:`pids_with_env` finds, frozen first so none can fork away.
    Returns the count.

    Python's resource trackers are left: each ends by itself once the processes it serves are gone,
    unlinking the named semaphores they made. Killed with them, it left dozens of ``sem.mp-*`` in
    /dev/shm for every run stopped this way (38 per agent kill here).
    """
    stopped: set[int] = set()
    for _ in range(5):  # until a scan finds nothing new: children forked before the freeze
        fresh = [pid for pid in pids_with_env(name, prefix) if pid not in stopped and not _resource_tracker(pid)]
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(stopped)


def _resource_tracker(pid: int) -> bool:
    """``multiprocessing``'s resource tracker (``python -c 'from multiprocessing.resource_tracker import main;...'``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"multiprocessing.resource_tracker" in handle.read()
    except OSError:
        return False


def remove_sockets(tmpdir: str, pids: set[int]) -> None:
    """The unix sockets a killed agent and its workers left in ``tmpdir`` (NVRx's
    ``_ft_launcher<pid>*.socket``: its IPC and rank monitors', each worker's ``_to_rmon``).
    """
    for path in Path(tmpdir).glob("_ft_launcher*.socket"):
        digits = path.name.removeprefix("_ft_launcher").split("_")[0].split(".")[0]
        if digits.isdigit() and int(digits) in pids and path.is_socket():
            with contextlib.suppress(OSError):
                path.unlink()


def agent_died(name: str, pid: int, exit_code: int, left: int) -> str:
    """The run's end when its agent was killed by a signal nobody here sent: what happened, not a
    guess from the event log (a stranger trial's SIGKILLed ft_launcher was reported as "recovery
    gave up ... last failure seen by rank 1 at step 281", a failure recovered long before).
    """
    try:
        how = f"was killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        how = f"was killed by signal {-exit_code}"
    stopped = (f"stopped the {left} process(es) it left (workers, checkpoint writers, rank monitors)" if left
               else "none of its processes was left running")
    return f"{name} (pid {pid}) {how}; {stopped}: the same command resumes from the last committed checkpoint"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def outcome(run_dir: Path, steps: int, exit_code: int, *, since: float, log: Path) -> str:
    events = [e for e in ev.read_events(run_dir) if e.ts >= since]
    if exit_code == 0:
        done = [e for e in events if e.event == "end" and e.get("status") == "completed"]
        return f"completed: reached step {steps}" if done else "launcher exited 0 without a completed worker"
    ends = [e for e in events if e.event == "end" and e.get("status") == "failed"]
    # Only what the run did not train past: a stranger trial's summary named a writer death
    # recovered 350 steps before the failure that ended the run.
    unrecovered = not_trained_past(events)
    # The root cause is the failure a rank had itself, not a peer noticing it: the first one of
    # the last restart round. A peer held in a collective by the failed rank fails after it, and
    # not always with a peer's cause (its progress allowance may run out first: "hang").
    failures = [e for e in events if e.event == "failure_detected" and e.get("cause") not in SECONDARY_CAUSES
                and unrecovered(e)]
    root = ""
    if failures:
        final = failures[-1]
        last = min((e for e in failures if (e.attempt, e.iteration) == (final.attempt, final.iteration)),
                   key=lambda e: e.ts)
        root = f"last failure on rank {last.rank} {_at(last)}: {last['cause']} ({last.get('message', '')})"
    hopeless = [e for e in ends if "retrying cannot help" in e.get("reason", "")]
    if hopeless:  # stopped on purpose, not after exhausting the restarts
        return f"stopped without a restart: {hopeless[0]['reason']}"
    gave_up = [e for e in ends if "gave up" in e.get("reason", "")]
    if gave_up:
        return f"{gave_up[-1]['reason']}; {root}" if root else gave_up[-1]["reason"]
    if not root:  # a killed rank says nothing: what was injected, else what its peers saw
        injected = [e for e in events if e.event == "fault_injected" and unrecovered(e)]
        seen = [e for e in events if e.event == "failure_detected" and unrecovered(e)]
        if injected:
            last = injected[-1]
            root = f"last fault injected on rank {last.rank} {_at(last)}: {last.get('fault')}"
        elif seen:
            last = seen[-1]
            root = f"last failure seen by rank {last.rank} {_at(last)}: {last['cause']} ({last.get('message', '')})"
    restarts = len({e.attempt for e in events}) - 1
    if root:
        return f"recovery gave up after {restarts} launcher restart(s); {root}"
    if ends:
        return ends[-1]["reason"]
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.is_file() else []
    if any(e.event in ("failure_detected", "fault_injected") for e in events):
        # Failures were logged, and recovered from: what ended the run was not one of them.
        return (f"launcher exited {exit_code} after {restarts} launcher restart(s) with no unrecovered failure "
                f"logged by a worker; log tail: {' | '.join(tail)}")
    return f"launcher exited {exit_code} before any worker reported a failure; log tail: {' | '.join(tail)}"


def not_trained_past(events: list[ev.Event]) -> Callable[[ev.Event], bool]:
    """A test of whether the run did not train past an event: no rank logged a later step beyond
    the event's step (a failure at start-up counts as step 0). A failure the run recovered from
    (a dead writer replaced, an in-process or launcher restart that went on) is followed by one.
    """
    import bisect

    trained = sorted((e.ts, e.step) for e in events if e.event == "step" and isinstance(e.step, int))
    times = [ts for ts, _ in trained]
    furthest = [0] * (len(trained) + 1)  # furthest[i]: the highest step logged from trained[i] on
    for i in range(len(trained) - 1, -1, -1):
        furthest[i] = max(furthest[i + 1], trained[i][1])

    def unrecovered(event: ev.Event) -> bool:
        return furthest[bisect.bisect_right(times, event.ts)] <= (event.step or 0)

    return unrecovered


def _at(event: ev.Event) -> str:
    return f"at step {event.step}" if event.step else "at start-up"


def record_failure(run_dir: str | os.PathLike[str], reason: str) -> None:
    """The run's ``end`` (failed, with why) from its launcher: the workers of a run whose restarts ran
    out, or whose node 0 was lost, were stopped before they could write one, and the report then
    said status unknown (stranger trial).
    """
    _log_end(run_dir, "failed", reason)


def _log_end(run_dir: str | os.PathLike[str], status: str, reason: str) -> None:
    log = ev.EventLog(run_dir, rank=-1)
    try:
        log.emit("end", None, status=status, reason=reason[:1000])
    finally:
        log.close()


def record_stopped(run_dir: str | os.PathLike[str], exc: BaseException) -> None:
    """The run's ``end`` when its launcher was stopped (SIGTERM from KFP or Kubernetes, Ctrl-C) or
    failed itself, after its workers were stopped: the report said status unknown, as for a run
    still training (stranger trial). Never raises over ``exc``.
    """
    if (stopped := cancel.interruption(exc)) is not None:
        status, reason = "cancelled", f"cancelled ({stopped[0]})"
    else:
        status, reason = "failed", f"the launcher failed: {type(exc).__name__}: {exc}"
    reason += "; the workers were stopped: the same command resumes from the last committed checkpoint"
    try:
        _log_end(run_dir, status, reason)
    except Exception as err:  # the launcher's own error is the one to see
        print(f"could not log the run's end: {err}", file=sys.stderr)


class ProgressPrinter(threading.Thread):
    """Prints rank 0's progress and every fault, failure and restart as they are logged."""

    def __init__(self, run_dir: Path, steps: int, *, since: float, emit: Callable[[str], None] | None) -> None:
        super().__init__(name="progress", daemon=True)
        self._run_dir, self._steps, self._since, self._emit = run_dir, steps, since, emit
        self._done = threading.Event()
        self._seen = 0
        self._loaded = False  # rank 0 has loaded (its next load is a restart's)

    def run(self) -> None:
        while not self._done.wait(0.5):
            self._flush()
        self._flush()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def _flush(self) -> None:
        if self._emit is None:
            return
        try:
            events = [e for e in ev.read_events(self._run_dir) if e.ts >= self._since]
        except ev.EventLogError:  # the workers stop on it with one clear line: no progress lines, no traceback
            self._emit = None
            return
        for event in events[self._seen:]:
            line = describe(event, self._steps, restarted=self._loaded)
            if line:
                self._emit(line)
            self._loaded |= event.event == "load_done" and event.rank == 0
        self._seen = len(events)


def describe(event: ev.Event, steps: int, *, restarted: bool = False) -> str | None:
    """One progress line for an event worth showing, else None (``restarted``: rank 0 has loaded before)."""
    who = f"rank {event.rank}"
    if event.event == "step" and event.rank == 0 and (event.step % 5 == 0 or event.step == steps):
        return f"step {event.step:>5}/{steps}  loss {event['loss']:.4f}  ({event['seconds'] * 1000:.0f} ms)"
    if event.event == "fault_injected":
        return f"  ! fault {event['fault']} injected ({who}, step {event.step})"
    if event.event == "failure_detected" and event.get("cause") != "peer_failure":
        return f"  ! failure on {who}: {event['cause']}"
    if event.event == "restart_begin" and event.get("layer") == "pod" and event.get("cause") != "node-loss":
        return f"  ✗ node {event['node']} pod died ({event['cause']}): Kubernetes replaces it"
    if event.event == "restart_done" and event.get("layer") == "pod":
        return f"  ↻ node {event['node']} replaced (pod layer): rank {event.rank} rejoined"
    if event.event == "restart_done" and event.rank == 0:
        return f"  ↻ restarted ({event['layer']} layer, attempt {event.attempt}, iteration {event.iteration})"
    if event.event == "load_done" and event.rank == 0:
        if event.step:
            # Where from, unless plain storage: a memory restore replays nothing from disk, and a
            # stranger trial could not tell it from a commit's (its step may never be committed).
            source = event.get("source")
            return f"  ⤓ restored step {event.step}" + (f" from {source}" if source and source != "storage" else "")
        # A restart with nothing to restore (a fault before the first commit) loses every step so far:
        # say so, rather than show nothing as the first start does. A replaced pod counts its attempts
        # from 0 again: ``restarted`` (rank 0 loaded before) tells its start from the first one.
        if restarted or event.attempt or event.iteration:
            return "  ⤓ no checkpoint yet: starting again from step 1"
        return None
    if event.event == "ckpt_committed":
        tier = " (node-local)" if event.get("tier") == "local" else ""
        return (f"  ✓ checkpoint step {event.step} committed{tier} "
                f"({event['bytes'] / 1e6:.2f} MB, {event['seconds']:.2f} s)")
    if event.event == "writer_restarted":
        return f"  ↻ checkpoint writer replaced on {who} in {event['seconds']:.1f} s (writer layer: training went on)"
    if event.event == "ckpt_abandoned" and event.rank == 0:
        return f"  … checkpoint at step {event.step} abandoned: {event['reason']}"
    if event.event == "ckpt_deferred" and event.rank == 0:
        return f"  … checkpoint at step {event.step} deferred: {event['reason']}"
    return None
