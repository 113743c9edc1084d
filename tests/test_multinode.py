"""Simulated multi-node jobs: one real ft_launcher agent per node, real faults, real recovery.

The slow tests start the real ``resilient-training train --nodes N`` command and prove from the
event log that a worker SIGKILL on a non-zero node and the loss of a whole node (agent and all
its processes) are recovered: the restored step is the last commit at or before the fault, the
first loss after the restore equals the loss logged at that step before the fault, the lost
node's replacement reports the pod layer, and nothing of the simulated cluster outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilient_training.gates import metrics
from resilient_training.launch import simulated_cluster as sim
from resilient_training.run import config as cfg
from resilient_training.run import events as ev
from resilient_training.run import faults as flt
from resilient_training.run import layout
from resilient_training.runtime import nvrx_adapter
from tests.support.runs import Run, rank0_losses, train


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A run directory whose simulated cluster is torn down even if the launcher was killed.

    The "machine's" temporary directory is one of this test's own (TMPDIR for the train command,
    and for this process), so that another test's launcher running beside it (``pytest -n``) is
    not taken for a leak. Short: a socket's path stops at 107 bytes.
    """
    import shutil
    import tempfile

    machine_tmp = Path(tempfile.mkdtemp(prefix="rt-mt-"))
    monkeypatch.setenv("TMPDIR", str(machine_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    path = tmp_path / "run"
    yield path
    sim.clean_up(path)
    # Agents killed with their node leave NVRx's IPC socket behind: in the pod's own TMPDIR,
    # removed with the cluster, never in this machine's temporary directory.
    left = sorted(p.name for p in machine_tmp.iterdir())
    shutil.rmtree(machine_tmp, ignore_errors=True)
    assert not [name for name in left if name.startswith("_ft_launcher")], left


def _cluster_record(run_dir: Path) -> dict:
    import json

    return json.loads((run_dir / "cluster" / "cluster.json").read_text())


def check_restored(events: list[ev.Event], fault: str) -> ev.Event:
    """The first restore after ``fault``: the last commit at or before it, with the same loss."""
    injected = [e for e in events if e.event == "fault_injected" and e["fault"] == fault]
    assert len(injected) == 1, f"{fault} injected {len(injected)} times"
    fault_event = injected[0]
    load = next(e for e in events if e.event == "load_done" and e.ts > fault_event.ts)
    committed = [e.step for e in events
                 if e.event == "ckpt_committed" and e.ts < load.ts and e.step <= fault_event.step]
    assert load.step == max(committed, default=0), (fault, load.step, committed)
    losses = rank0_losses(events)
    resumed = next((ts, s, loss) for ts, s, loss in losses if ts > load.ts)
    assert resumed[1] == load.step + 1
    before = [loss for ts, s, loss in losses if ts < fault_event.ts and s == resumed[1]]
    assert before, f"no loss logged at step {resumed[1]} before {fault}: the continuity check would be empty"
    assert abs(before[-1] - resumed[2]) <= 1e-6 * max(1.0, abs(before[-1])), (before[-1], resumed)
    return load


def check_no_leftovers(run: Run) -> None:
    record = _cluster_record(run.run_dir)
    assert sim.pids_labelled(f"{record['cluster_id']}/") == [], "processes of the simulated cluster outlived it"
    assert not list(Path(record["tmp_base"]).glob(f"{sim.POD_TMP_PREFIX}{record['cluster_id']}-*"))
    assert not list(Path(record["shm_base"]).glob(f"{sim.POD_SHM_PREFIX}{record['cluster_id']}-*"))
    # Nor the workers' pid records in /dev/shm (a lost node's were left behind: a stranger trial).
    config = cfg.TrainConfig(run_dir=str(run.run_dir))
    assert not layout.worker_records(config).exists(), list(layout.worker_records(config).iterdir())
    if record["namespaces"]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert not set(record["namespaces"]) & {line.split()[0] for line in listed.splitlines() if line}


# --------------------------------------------------------------------------- fast: no training


def test_node_faults_parse_and_need_the_simulated_cluster():
    schedule = flt.parse("node-loss@12:2,sigkill@6:1")
    assert [(f.type, f.node_fault) for f in schedule] == [("sigkill", False), ("node-loss", True)]
    args = {"world_size": 3, "steps": 16, "async_checkpoint": True, "checkpoint_every": 4}
    with pytest.raises(flt.FaultSpecError, match="need the simulated cluster"):
        flt.validate(schedule, **args)
    with pytest.raises(flt.FaultSpecError, match="node 2 does not exist"):
        flt.validate(schedule, **args, nodes=2)
    # Node faults are checked against nodes, not ranks: node 2 of 3 nodes x 1 rank is fine...
    flt.validate(schedule, **args, nodes=3)
    # ...and a node fault announced by one rank is remembered for every rank (its replacement too).
    seen = [ev.Event(ts=0.0, rank=7, attempt=0, iteration=0, event="fault_injected", step=12,
                     fields={"fault": "node-loss@12:2", "type": "node-loss"}),
            ev.Event(ts=0.0, rank=7, attempt=0, iteration=0, event="fault_injected", step=6,
                     fields={"fault": "sigkill@6:7", "type": "sigkill"})]
    assert flt.injected_counts(seen, rank=0) == {"node-loss@12:2": 1}


def test_node_loss_without_nodes_is_rejected_before_anything_starts(tmp_path):
    run = train(tmp_path / "run", "--steps", "8", "--faults", "node-loss@4:0", timeout=60)
    assert run.returncode == 2
    assert "node faults need the simulated cluster (--nodes N)" in run.output
    assert not (tmp_path / "run" / "events").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"nodes": 0}, "nodes must be at least 1"), ({"nodes": 3, "min_nodes": 4}, "min_nodes must be 0"),
     ({"nodes": 2, "network": "wifi"}, "network must be one of"),
     ({"nodes": 2, "pod_restart_delay": -1}, "pod_restart_delay must be >= 0")],
)
def test_cluster_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sim.ClusterSpec(**kwargs)


def test_agents_get_the_operators_pet_env_and_nothing_on_the_command_line(tmp_path):
    from resilient_training.run import config as cfg

    spec = sim.ClusterSpec(nodes=4, min_nodes=3, nproc_per_node=2)
    env = nvrx_adapter.rendezvous_env(nnodes=spec.nnodes, nproc_per_node=2, rdzv_endpoint="rt-worker-0:29400",
                                      rdzv_id="job", rdzv_conf={"last_call_timeout": "5"})
    assert env == {"PET_NNODES": "3:4", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
                   "PET_RDZV_ENDPOINT": "rt-worker-0:29400", "PET_RDZV_ID": "job",
                   "PET_RDZV_CONF": "last_call_timeout=5"}
    config = cfg.TrainConfig(run_dir=str(tmp_path / "run"))
    command = sim.SimulatedCluster(config, spec, progress=None).command
    assert not [flag for flag in command if flag.startswith(("--nnodes", "--nproc", "--rdzv", "--standalone"))]


def test_the_simulator_acts_only_on_the_writers_own_logs(tmp_path):
    """A node-loss line in a file no writer writes (``rank00.jsonl``, which the gates refuse) made
    the simulator kill that node: it read every ``*.jsonl``."""
    import json

    line = json.dumps({"ts": time.time(), "rank": 0, "attempt": 0, "iteration": 0, "event": "fault_injected",
                       "step": 3, "fault": "node-loss@3:1", "type": "node-loss"}) + "\n"
    events = layout.events_dir(tmp_path)
    events.mkdir(parents=True)
    (events / "rank00.jsonl").write_text(line)
    (events / "rank0-copy.jsonl").write_text(line)
    assert sim._EventTail(tmp_path, since=0).read() == []
    (events / "rank0.jsonl").write_text(line)
    assert [e["fault"] for e in sim._EventTail(tmp_path, since=0).read()] == ["node-loss@3:1"]


def test_restart_abort_cause_tells_a_shrunken_world_from_the_retry_limit():
    from nvidia_resiliency_ext.inprocess.initialize import RetryController

    def abort(state: SimpleNamespace, **limits: int) -> BaseException:
        try:
            RetryController(**limits)(state)
        except BaseException as exc:  # noqa: BLE001 - the real NVRx exception is the point
            return exc
        raise AssertionError("RetryController did not abort")

    shrunk = abort(SimpleNamespace(iteration=1, world_size=2, active_world_size=2), max_iterations=9, min_world_size=3)
    limit = abort(SimpleNamespace(iteration=9, world_size=3, active_world_size=3), max_iterations=9, min_world_size=3)
    assert nvrx_adapter.restart_abort_cause(shrunk) == "world_too_small"
    assert nvrx_adapter.restart_abort_cause(limit) == "retry_limit"
    # 0.4.1's wrapper shutdown can raise over the abort; the cause is found through the context.
    try:
        try:
            raise shrunk
        except BaseException:
            raise ValueError("invalid literal for int() with base 10: \"b'1'\"") from None
    except ValueError as masked:
        masked.__context__ = shrunk
        assert nvrx_adapter.restart_abort_cause(masked) == "world_too_small"
    assert nvrx_adapter.restart_abort_cause(RuntimeError("gloo")) is None


def test_kill_labelled_kills_a_whole_pod_including_processes_in_their_own_sessions(tmp_path):
    label = f"test-{os.getpid()}-{time.time_ns()}/0/0"
    env = {**os.environ, sim.POD_LABEL_ENV: label}
    # An "agent" that starts a "worker" in a session of its own, as ft_launcher does.
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              "time.sleep(60)")
    agent = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(sim.pids_labelled(label)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sim.pids_labelled(label)) == 2
        assert sim.kill_labelled(label) == 2
        assert agent.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while sim.pids_labelled(label) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sim.pids_labelled(label) == []
    finally:
        sim.kill_labelled(label)


# --------------------------------------------------------------------------- slow: real agents


@pytest.mark.slow
def test_three_nodes_recover_a_worker_sigkill_and_a_node_loss(run_dir):
    run = train(run_dir, "--nodes", "3", "--nproc", "1", "--steps", "16", "--checkpoint-every", "4",
                "--no-async-checkpoint", "--pod-restart-delay", "1", "--faults", "sigkill@6:2,node-loss@12:1",
                timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    assert "done: completed: reached step 16" in run.output
    events = run.events
    sigkill_load = check_restored(events, "sigkill@6:2")
    load = check_restored(events, "node-loss@12:1")
    # The simulator killed node 1 (logged before acting), and its replacement joined as a pod restart.
    lost = next(e for e in events if e.event == "fault_injected" and e["fault"] == "node-loss@12:1")
    killed = [e for e in events if e.event == "restart_begin" and e.get("layer") == "pod"]
    assert [(e.get("node"), e.get("cause"), e.rank) for e in killed] == [(1, "node-loss", -1)]
    assert killed[0].ts >= lost.ts
    pod = [e for e in events if e.event == "restart_done" and e.get("layer") == "pod"]
    assert [(e.get("node"), e.attempt) for e in pod] == [(1, 0)]
    assert killed[0].ts < pod[0].ts < load.ts
    starts = [e for e in events if e.event == "start" and e.ts > pod[0].ts - 1]
    assert {e.get("node") for e in starts} == {0, 1, 2}
    # The sigkilled worker on node 2 was restarted by its own agent (launcher layer).
    sigkill = next(e for e in events if e.event == "fault_injected" and e["fault"] == "sigkill@6:2")
    assert any(e.event == "restart_done" and e.get("layer") == "launcher" and e.get("node") == 2
               and e.ts > sigkill.ts for e in events)
    # Every worker after the first three says which layer restarted it, once: the agents that only
    # restarted theirs because a node joined too (ft_launcher does not count those restarts).
    starts = [e for e in events if e.event == "start"]
    restarts = [e for e in events if e.event == "restart_done" and e.get("layer") in ("launcher", "pod")]
    assert len(starts) > 3 and len(restarts) == len(starts) - 3, ([(e.rank, e.attempt) for e in starts], restarts)
    assert {e.get("node") for e in restarts if e.ts < lost.ts} == {0, 1, 2}
    ends = [e for e in events if e.event == "end" and e.get("status") == "completed"]
    assert {e.rank for e in ends if e.step == 16} == {0, 1, 2}
    # The report's numbers (metrics.compute_metrics) attribute the node loss to the pod layer.
    found = metrics.compute_metrics(run.run_dir)
    assert [(f["fault"], f["layer"], f["restored_step"]) for f in found["faults"]] == [
        ("sigkill@6:2", "launcher", sigkill_load.step), ("node-loss@12:1", "pod", load.step)]
    check_no_leftovers(run)


@pytest.mark.slow
def test_a_node_that_replaces_a_lost_one_has_none_of_its_node_local_checkpoints(run_dir):
    """A stranger trial: the simulated nodes shared one /dev/shm, so the node replacing a lost one
    found the lost node's node-local steps, and the job restored from them, which no real node could.
    Each pod now has its own node-local directory, emptied when the pod dies: the node loss rolls
    back to the persistent tier, while a worker restarted inside a living pod still finds its own.
    """
    run = train(run_dir, "--nodes", "3", "--nproc", "1", "--steps", "16", "--checkpoint-every", "4",
                "--local-checkpoint-every", "2", "--no-async-checkpoint", "--pod-restart-delay", "1",
                "--network", "loopback", "--faults", "sigkill@7:2,node-loss@11:1", timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    events = run.events

    def first_load_after(fault: str) -> ev.Event:
        injected = next(e for e in events if e.event == "fault_injected" and e["fault"] == fault)
        return next(e for e in events if e.event == "load_done" and e.ts > injected.ts)

    local_commits = {e.step for e in events if e.event == "ckpt_committed" and e.get("tier") == "local"}
    assert {6, 10} <= local_commits, sorted(local_commits)
    # Killed worker, living pod: its node still holds node-local step 6 (newer than persistent 4).
    assert first_load_after("sigkill@7:2").step == 6
    # Lost node: its replacement has no node-local step 10; every rank goes back to persistent 8.
    assert first_load_after("node-loss@11:1").step == 8
    ends = [e for e in events if e.event == "end" and e.get("status") == "completed"]
    assert {e.rank for e in ends if e.step == 16} == {0, 1, 2}
    record = _cluster_record(run.run_dir)
    assert not list(Path(record["shm_base"]).glob(f"{sim.POD_SHM_PREFIX}{record['cluster_id']}-*"))
    check_no_leftovers(run)


@pytest.mark.slow
def test_four_nodes_with_min_three_continue_without_waiting_for_the_replacement(run_dir):
    # NVRx 0.4.1 (the version here): --nnodes=3:4 with the any-failed policy re-forms the world
    # from the three survivors once the lost node's rendezvous keep-alive expires; the
    # replacement is due only after 600 s, so finishing proves nobody waited for it.
    started = time.monotonic()
    # Synchronous saves: on a loaded CI machine (4 nodes on 2 cores) the background writers were
    # not up by step 8, leaving nothing committed to restore; membership is what this tests.
    run = train(run_dir, "--nodes", "4", "--min-nodes", "3", "--nproc", "1", "--steps", "16",
                "--checkpoint-every", "4", "--no-async-checkpoint", "--pod-restart-delay", "600",
                "--faults", "node-loss@8:3", timeout=240)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.output[-3000:]
    assert elapsed < 600
    assert "job succeeded without node(s) [3]: replacement not started" in run.output
    events = run.events
    lost = next(e for e in events if e.event == "fault_injected" and e["fault"] == "node-loss@8:3")
    assert not [e for e in events if e.event == "restart_done" and e.get("layer") == "pod"]
    after = [e for e in events if e.event == "start" and e.ts > lost.ts]
    assert {(e.rank, e["world_size"], e.get("node")) for e in after} == {(0, 3, 0), (1, 3, 1), (2, 3, 2)}
    load = next(e for e in events if e.event == "load_done" and e.ts > lost.ts)
    committed = [e.step for e in events if e.event == "ckpt_committed" and e.ts < load.ts and e.step <= lost.step]
    saves = [(e.event, e.step, e.rank) for e in events if e.event.startswith("ckpt_")]
    assert load.step == max(committed, default=0) and load.step > 0, (load.step, saves)
    # Restored from a 4-rank checkpoint into 3 ranks; the loss differs (3 ranks' data, not 4).
    ends = [e for e in events if e.event == "end" and e.get("status") == "completed" and e.step == 16]
    assert {e.rank for e in ends} == {0, 1, 2}
    check_no_leftovers(run)


@pytest.mark.slow
def test_losing_the_node_that_hosts_the_rendezvous_store_fails_the_job_with_its_cause(run_dir):
    # NVRx 0.4.1: the c10d store lives in node 0's agent; the survivors' agents lose it and exit 1
    # (RendezvousConnectionError), which restartPolicy ExitCode does not retry.
    run = train(run_dir, "--nodes", "3", "--nproc", "1", "--steps", "16", "--checkpoint-every", "4",
                "--no-async-checkpoint", "--pod-restart-delay", "1", "--faults", "node-loss@8:0", timeout=120)
    assert run.returncode == 1, run.output[-3000:]
    assert "lost the c10d rendezvous store (hosted by node 0; lost nodes: [0])" in run.output
    assert "run the same command again to resume from the last committed checkpoint" in run.output
    assert not [e for e in run.events if e.event == "end" and e.get("status") == "completed"]
    check_no_leftovers(run)


def test_a_sigkilled_train_takes_its_pods_along_and_a_resume_cleans_up_and_completes(run_dir):
    """A stranger trial: `train --nodes 2` killed with SIGKILL left both pods training (their
    agents in sessions of their own), and a resume trained beside them in the same run directory.
    The pods now stop when the command dies and hold the run directory's lock until they have."""
    command = [sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir), "--nodes", "2",
               "--nproc", "1", "--steps", "200", "--step-seconds", "0.3", "--checkpoint-every", "4",
               "--no-async-checkpoint"]
    cli = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [e for e in _read(run_dir) if e.event == "step"]:
            time.sleep(0.2)
        record = _cluster_record(run_dir)
    finally:
        cli.kill()
        cli.wait()
    label = f"{record['cluster_id']}/"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sim.pids_labelled(label):
        time.sleep(0.2)
    assert not sim.pids_labelled(label), "the pods outlived the command"
    resumed = train(run_dir, "--nodes", "2", "--nproc", "1", "--steps", "12", "--checkpoint-every", "4",
                    "--no-async-checkpoint", timeout=180)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "completed: reached step" in resumed.output


def test_ctrl_c_stops_the_pods_says_so_in_one_line_and_logs_the_runs_end(run_dir):
    """A stranger trial: `train` stopped by Ctrl-C or SIGTERM logged no end (the report said status
    unknown, as for a run still training) and said nothing but "interrupted"."""
    command = [sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir), "--nodes", "2",
               "--nproc", "1", "--steps", "200", "--step-seconds", "0.3", "--checkpoint-every", "4",
               "--no-async-checkpoint", "--network", "loopback"]
    # SIGINT as a terminal leaves it: a suite started in the background inherits it ignored.
    cli = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [e for e in _read(run_dir) if e.event == "step"]:
            time.sleep(0.2)
        record = _cluster_record(run_dir)
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 130, err
    assert err == ("interrupted (Ctrl-C): stopped the training and its workers; the same command resumes from "
                   f"the last committed checkpoint in {run_dir}\n"), err
    assert not sim.pids_labelled(f"{record['cluster_id']}/")
    last = ev.read_events(run_dir)[-1]
    assert (last.event, last.rank, last["status"]) == ("end", -1, "cancelled"), last
    assert last["reason"].startswith("cancelled (Ctrl-C); the workers were stopped"), last
    assert metrics.compute_metrics(run_dir)["status"] == "cancelled"


def _read(run_dir: Path) -> list[ev.Event]:
    try:
        return ev.read_events(run_dir)
    except (OSError, ev.EventLogError):
        return []
