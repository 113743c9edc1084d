"""What `train` does when its ft_launcher agent dies, and what a failed run's summary names.

Found by a stranger trial: ``kill -9`` of the agent made `train` print a stale failure (recovered
long before) and log the run's end, while both workers and their NVRx rank monitors carried on
with no parent, committing checkpoints; the monitors lived on for good and the gates refused the
run as still training. And after a rank's monitor was killed, then the rank, every new worker of
that rank failed at start-up with a bare ConnectionRefusedError and the summary said no worker
had reported a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from resilient_training.launch import local
from resilient_training.run import config as cfg
from resilient_training.run import events as ev
from resilient_training.run import layout

MARKER = "RT_TEST_KILLED_MARKER"  # inherited by everything `train` starts: how the test finds its tree
LONG = ["--nproc", "2", "--steps", "400", "--step-seconds", "0.2", "--checkpoint-every", "5"]


# --------------------------------------------------------------------------- summary (no processes)


def _write(run_dir: Path, records: list[ev.Event]) -> None:
    directory = ev.events_dir(run_dir)
    directory.mkdir(parents=True)
    for rank in {r.rank for r in records}:
        (directory / f"rank{rank}.jsonl").write_text("".join(r.to_json() + "\n" for r in records if r.rank == rank))


def _event(ts: float, rank: int, attempt: int, event: str, step: int | None, **fields) -> ev.Event:
    return ev.Event(ts=ts, rank=rank, attempt=attempt, iteration=0, event=event, step=step, fields=fields)


def test_the_summary_names_the_latest_failure_the_run_did_not_train_past(tmp_path: Path) -> None:
    """A stranger trial's summary blamed a writer death at step 281, recovered 350 steps before
    the failure that ended the run (only peers' symptoms were logged of that one).
    """
    records = [_event(100.0, 1, 1, "failure_detected", 281, cause="writer_died", message="writer (pid 6832) died"),
               _event(103.0, 1, 1, "writer_restarted", 295, seconds=3.0, pid=7610, restarts=1)]
    records += [_event(100.0 + i, r, 1, "step", 281 + i, loss=1.0, seconds=0.2) for i in range(1, 355) for r in (0, 1)]
    records += [_event(500.0, 1, 2, "failure_detected", 635, cause="peer_failure", message="Timed out send"),
                _event(510.0, 1, 3, "start", None), _event(520.0, 1, 4, "start", None)]
    _write(tmp_path, records)
    line = local.outcome(tmp_path, 800, 1, since=0.0, log=tmp_path / "log")
    assert "writer_died" not in line, line
    assert line == "recovery gave up after 3 launcher restart(s); last failure seen by rank 1 at step 635: " \
                   "peer_failure (Timed out send)"


def test_a_start_up_failure_is_said_to_be_one(tmp_path: Path) -> None:
    records = [_event(100.0, 0, 0, "step", 5, loss=1.0, seconds=0.2),
               _event(101.0, 1, 1, "failure_detected", None, cause="rank_monitor_unreachable", message="refused")]
    _write(tmp_path, records)
    line = local.outcome(tmp_path, 10, 1, since=0.0, log=tmp_path / "log")
    assert line == "recovery gave up after 1 launcher restart(s); last failure on rank 1 at start-up: " \
                   "rank_monitor_unreachable (refused)"


def test_a_worker_whose_rank_monitor_refuses_logs_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvidia_resiliency_ext.fault_tolerance.data import (
        FT_LAUNCHER_IPC_SOCKET_ENV_VAR,
        FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR,
    )

    from resilient_training.runtime import nvrx_adapter

    path = tmp_path / "rmon1.socket"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening: what a killed monitor's socket file gives
    dead.close()
    for name, value in ((FT_LAUNCHER_IPC_SOCKET_ENV_VAR, str(tmp_path / "launcher.socket")),
                        (FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, str(path)), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    log = ev.EventLog(tmp_path, rank=1)
    try:
        with pytest.raises(nvrx_adapter.RankMonitorUnreachable, match="rank monitor for local rank 1 refused"):
            nvrx_adapter.Heartbeats(True, events=log)
    finally:
        log.close()
    (failure,) = [e for e in ev.read_events(tmp_path) if e.event == "failure_detected"]
    assert failure["cause"] == "rank_monitor_unreachable" and failure.step is None
    assert "the launcher's rank monitor for local rank 1 refused the connection (killed?)" in failure["message"]


# --------------------------------------------------------------------------- real runs


def _marked(marker: str) -> list[psutil.Process]:
    """The live processes (not zombies) whose environment holds ``marker``."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _tree(marker: str) -> list[str]:
    found = []
    for proc in _marked(marker):
        try:
            found.append(f"{proc.pid} {' '.join(proc.cmdline())[:150]}")
        except psutil.Error:
            continue
    return found


class Runs(list):
    """The trainings a test started, their TMPDIR and run directories."""

    tmp: Path
    run_dirs: list[Path]


@pytest.fixture
def started() -> Iterator[Runs]:
    """The trainings a test starts; whatever is left of them is killed after it. Their TMPDIR is
    short (ft_launcher's unix socket paths must fit 108 bytes) and removed after.
    """
    runs = Runs()
    runs.tmp = Path(tempfile.mkdtemp(prefix="rtk-", dir="/tmp"))
    runs.run_dirs = []
    yield runs
    for proc, marker in runs:
        for _ in range(3):  # (frozen first: none forks away)
            left = _marked(marker)
            for each in left:
                with contextlib.suppress(psutil.Error):
                    each.send_signal(signal.SIGSTOP)
            for each in left:
                with contextlib.suppress(psutil.Error):
                    each.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    shutil.rmtree(runs.tmp, ignore_errors=True)
    # The workers' pid records in /dev/shm, which only a completed run or `train`'s own clean-up
    # removes (a test that froze `train` left them behind on the machine).
    for run_dir in runs.run_dirs:
        shutil.rmtree(layout.worker_records(cfg.TrainConfig(run_dir=str(run_dir))), ignore_errors=True)


def _start(runs: Runs, run_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    marker = uuid.uuid4().hex
    out = run_dir.parent / f"{run_dir.name}.out"
    env = {**os.environ, MARKER: marker, "TMPDIR": str(runs.tmp)}
    with open(out, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir),
                                 *args], stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    runs.append((proc, marker))
    runs.run_dirs.append(run_dir)
    return proc, marker, out


def _wait_for(run_dir: Path, proc: subprocess.Popen[bytes], out: Path, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"train ended early:\n{out.read_text()[-3000:]}"
        try:
            if any(e.event == what for e in ev.read_events(run_dir)):
                return
        except (OSError, ev.EventLogError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"no {what} in {timeout:.0f} s:\n{out.read_text()[-3000:]}")


def _agent(proc: subprocess.Popen[bytes]) -> psutil.Process:
    (agent,) = psutil.Process(proc.pid).children()
    assert "ft_launch" in " ".join(agent.cmdline()), agent.cmdline()
    return agent


def _gone_within(marker: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := _tree(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "left running:\n" + "\n".join(left)


@pytest.mark.slow
def test_sigkill_of_the_agent_stops_the_whole_run_and_says_so(tmp_path: Path, started: Runs) -> None:
    run_dir = tmp_path / "run"
    proc, marker, out = _start(started, run_dir, *LONG)
    _wait_for(run_dir, proc, out, "ckpt_committed")  # training, its writers and monitors up
    agent = _agent(proc)
    before = _tree(marker)
    assert len(before) >= 6, before  # train, the agent, 2 rank monitors, 2 workers (and their writers)
    agent.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert proc.wait(timeout=30) == 1
    _gone_within(marker, max(1.0, 5 - (time.monotonic() - killed)))
    output = out.read_text()
    assert f"FAILED: ft_launcher (pid {agent.pid}) was killed by SIGKILL; stopped the " in output, output[-2000:]
    # The launcher's end is the run's last event: no worker wrote anything after it.
    time.sleep(1.0)
    events = ev.read_events(run_dir)
    end = events[-1]
    assert (end.rank, end.event, end["status"]) == (-1, "end", "failed"), [(e.rank, e.event) for e in events[-5:]]
    assert f"ft_launcher (pid {agent.pid}) was killed by SIGKILL" in end["reason"]
    assert max(e.ts for e in events) == end.ts
    # NVRx's unix sockets of the dead agent (its own and its rank monitors') are not left behind.
    assert not list(started.tmp.glob("_ft_launcher*.socket"))
    # ... and nothing holds the run's lock any more (the gates refused it while the monitors lived).
    fd = layout.open_lock(run_dir, create=False)
    try:
        assert not layout.held_exclusively(fd)
    finally:
        os.close(fd)


def _rank_monitor(marker: str, local_rank: int) -> psutil.Process:
    """The NVRx rank monitor serving ``local_rank`` (it listens on ``..._rmon<local rank>.socket``)."""
    for proc in _marked(marker):
        try:
            if any(str(c.laddr).endswith(f"_rmon{local_rank}.socket") for c in proc.net_connections(kind="unix")):
                return proc
        except psutil.Error:
            continue
    raise AssertionError(f"no rank monitor for local rank {local_rank}: {_tree(marker)}")


def _worker(agent: psutil.Process, local_rank: int) -> psutil.Process:
    """The worker of ``local_rank``: a child of the agent (its in-process monitor, forked from it, has its command)."""
    for proc in agent.children():
        try:
            if "resilient_training.runtime.worker" in proc.cmdline() and proc.environ().get("LOCAL_RANK") == str(
                    local_rank):
                return proc
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of local rank {local_rank} under the agent {agent.pid}")


@pytest.mark.slow
def test_a_killed_rank_monitor_is_named_as_what_ended_the_run(tmp_path: Path, started: Runs) -> None:
    run_dir = tmp_path / "run"
    proc, marker, out = _start(started, run_dir, *LONG, "--max-restarts", "1")
    _wait_for(run_dir, proc, out, "ckpt_committed")
    _rank_monitor(marker, 1).send_signal(signal.SIGKILL)
    time.sleep(1.0)
    _worker(_agent(proc), 1).send_signal(signal.SIGKILL)
    assert proc.wait(timeout=180) == 1
    output = out.read_text()
    (failed,) = [line for line in output.splitlines() if line.startswith("FAILED: ")]
    assert "recovery gave up after 1 launcher restart(s); last failure on rank 1 at start-up: " \
           "rank_monitor_unreachable (the launcher's rank monitor for local rank 1 refused the connection (killed?)" \
           in failed, failed
    _gone_within(marker, 5)


@pytest.mark.slow
def test_with_no_launcher_left_to_stop_them_the_workers_and_monitors_stop_themselves(tmp_path: Path,
                                                                                      started: Runs) -> None:
    """The second line: `train` frozen (it cannot clean up), the agent SIGKILLed. Each worker sees
    its agent gone and ends (its checkpoint writer follows it), and each rank monitor too.
    """
    run_dir = tmp_path / "run"
    proc, marker, out = _start(started, run_dir, *LONG)
    _wait_for(run_dir, proc, out, "ckpt_committed")
    agent = _agent(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        agent.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (left := [p for p in _tree(marker) if not p.startswith(f"{proc.pid} ")]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, "left running:\n" + "\n".join(left)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    ends = [e for e in ev.read_events(run_dir) if e.event == "end" and e.rank >= 0]
    assert {e.rank for e in ends} == {0, 1} and all(e["status"] == "failed" for e in ends), ends
    # The first to see its agent gone says so; its peer may end first on the collective that rank left
    # (a race: 1 run in 4 here), which is its own true reason.
    assert any(f"ft_launcher (pid {agent.pid}), which started this worker, is gone" in e["reason"] for e in ends), ends


def test_killing_a_launch_leaves_no_named_semaphore_in_dev_shm(tmp_path: Path) -> None:
    """Each SIGKILLed agent left 38 ``/dev/shm/sem.mp-*`` (the suite: 39 a run): its resource
    tracker was killed with the processes it would have cleaned up after. It is left to end itself."""
    label = f"test-{uuid.uuid4().hex}"
    script = ("import multiprocessing as mp, sys, time\n"
              "lock = mp.get_context('spawn').Lock()\n"  # named, and registered with the resource tracker
              "print(lock._semlock.name, flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, local.LAUNCH_LABEL_ENV: label}, start_new_session=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        semaphore = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
        assert semaphore.exists(), semaphore
        assert local.kill_with_env(local.LAUNCH_LABEL_ENV, label) >= 1
        deadline = time.monotonic() + 10
        while semaphore.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not semaphore.exists(), f"{semaphore} left behind"
        # The tracker ends too, just after it unlinked (a race the suite met once: waited for).
        while local.pids_with_env(local.LAUNCH_LABEL_ENV, label) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
        assert not local.pids_with_env(local.LAUNCH_LABEL_ENV, label)
    finally:
        proc.kill()
        proc.wait()
