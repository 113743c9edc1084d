"""Warm spares: the stub the launcher starts hands its worker to a pre-imported spare process.

Real processes throughout: this test process plays the launcher (the stubs are its children,
each in its own session as torch elastic starts them), the pool is the real one, and only what the
spare runs is a stand-in (tests/support/spare_entry.py) until the last tests, which run the real
trainer under ft_launcher and torchrun.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient_training.run import config as cfg
from resilient_training.runtime import nvrx_adapter, spare_pool
from resilient_training.runtime import spare_stub as stub
from tests.support.runs import FAST, check_recovered, train

READY_TASK = f"{Path(__file__).parent / 'support' / 'ready_task.py'}:task"

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "tests.support.spare_entry:main"


def alive(pid: int) -> bool:
    try:
        return stub.proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def processes_mentioning(*texts: str) -> list[int]:
    """Live processes whose command line contains any of ``texts``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(text in cmdline for text in texts) and alive(int(entry)):
            found.append(int(entry))
    return found


def wait_until(predicate, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def start_pool(run_dir: Path, log_path: Path, size: int, *flags: str) -> subprocess.Popen[bytes]:
    """A real pool serving this process's stubs (this process is their agent)."""
    key = stub.pool_key(str(run_dir), stub.process_identity(os.getpid()))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", stub.POOL_MODULE, "--key", key, "--agent-pid", str(os.getpid()),
             "--agent-start", stub.process_identity(os.getpid()).rsplit(":", 1)[1], "--size", str(size),
             "--entry", ENTRY, *flags],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: "ready" in log_path.read_text(), 120), log_path.read_text()
    except BaseException:
        stop_pool(proc, key)
        raise
    return proc


def stop_pool(proc: subprocess.Popen[bytes], key: str) -> None:
    proc.kill()
    proc.wait()
    # An idle spare dies with its pool (PR_SET_PDEATHSIG).
    assert wait_until(lambda: not processes_mentioning(key), 5), processes_mentioning(key)


@contextlib.contextmanager
def preparing_pool(run_dir: Path, size: int, prepare: str, after: str = "0") -> Iterator[Path]:
    """A pool of this test's own whose spares prepare their device with spare_entry's ``prepare``."""
    proc = start_pool(run_dir, run_dir / "pool.log", size, "--prepare", f"tests.support.spare_entry:{prepare}",
                      "--prepare-after", after)
    try:
        yield run_dir / "pool.log"
    finally:
        stop_pool(proc, stub.pool_key(str(run_dir), stub.process_identity(os.getpid())))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A real pool with 2 spares (local ranks 0 and 1) that prepare their stand-in device at once."""
    run_dir = tmp_path_factory.mktemp("spare-run")
    with preparing_pool(run_dir, 2, "prepare"):
        yield run_dir


def start_stub(run_dir: Path, *action: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
               local_rank: str = "1") -> subprocess.Popen[str]:
    # LOCAL_RANK 1: a stub that found no spare starts cold without starting a pool of its own.
    return subprocess.Popen(
        [sys.executable, "-m", stub.STUB_MODULE, "--run-dir", str(run_dir), *action],
        cwd=cwd, env={**os.environ, "LOCAL_RANK": local_rank, **(env or {})}, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_exit_code_comes_back_through_the_stub(pool):
    for code in (0, 3, 93):
        proc = start_stub(pool, "exit", str(code))
        assert proc.wait(timeout=20) == code, proc.stderr.read()


def test_the_spare_adopts_env_cwd_umask_and_stdio(pool, tmp_path):
    proc = start_stub(pool, "report", cwd=tmp_path, env={"RT_PROBE": "here", "OMP_NUM_THREADS": "1"})
    out, err = proc.communicate("hello\n", timeout=20)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["pid"] != proc.pid  # a spare did the work
    assert report["cwd"] == str(tmp_path)
    assert report["env"]["RT_PROBE"] == "here"
    assert report["env"][stub.STUB_PID_ENV] == str(proc.pid)
    assert report["argv"][1:] == ["--run-dir", str(pool), "report"]
    assert report["stdin"] == "hello"
    assert report["threads"] == 1
    umask = os.umask(0)
    os.umask(umask)
    assert report["umask"] == umask
    assert "to stderr" in err


def test_sigterm_is_forwarded_to_the_spare(pool):
    proc = start_stub(pool, "wait-for-term")
    assert proc.stdout.readline().strip() == "waiting"
    os.killpg(proc.pid, signal.SIGTERM)  # what torch elastic's teardown sends to a worker
    assert proc.wait(timeout=10) == 7
    assert "got SIGTERM" in proc.stdout.read()


def test_the_spares_other_threads_block_the_signals_the_stub_relays(pool):
    """A CI run's ``test_sigterm_is_forwarded_to_the_spare`` timed out: the relayed SIGTERM went to
    the spare's watch thread, and the worker's handler ran only when the main thread's sleep
    ended. Every thread but the main one blocks the relayed signals, so the main thread gets them.
    """
    proc = start_stub(pool, "thread-masks")
    masks = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=20) == 0
    assert masks, "the spare has a watch thread"
    for sig in stub.FORWARDED:
        assert all(mask >> (sig - 1) & 1 for mask in masks.values()), (sig, masks)


def test_a_spare_killed_by_a_signal_kills_its_stub_the_same_way(pool):
    proc = start_stub(pool, "sleep")
    assert proc.stdout.readline().strip() == "sleeping"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    proc = start_stub(pool, "kill-self")
    assert proc.wait(timeout=20) == -signal.SIGKILL


def test_a_sigkilled_stub_takes_its_spare_and_the_spares_children_along(pool):
    proc = start_stub(pool, "child-and-sleep")
    pids = json.loads(proc.stdout.readline())
    assert alive(pids["pid"]) and alive(pids["child"])
    killed = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not alive(pids["pid"]) and not alive(pids["child"]), 1.0)
    assert time.monotonic() - killed < 1.0


def test_a_spare_declines_when_the_interpreter_would_start_differently(pool):
    # PYTHONPATH only acts at interpreter start: the stub falls back to a cold worker.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = start_stub(pool, "--bogus-flag", env={"PYTHONPATH": pythonpath})  # never the pool's own value
    _, err = proc.communicate(timeout=60)
    assert "spare declined" in err and "PYTHONPATH" in err
    assert proc.returncode == 2 and "unrecognized arguments: --bogus-flag" in err  # the real worker's parser


def report_of(run_dir: Path, local_rank: str, env: dict[str, str] | None = None) -> dict:
    proc = start_stub(run_dir, "report", local_rank=local_rank, env=env)
    out, err = proc.communicate("hello\n", timeout=30)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_each_local_rank_gets_its_own_spare_with_its_device_prepared(pool):
    reports = {rank: report_of(pool, rank) for rank in ("1", "0", "1")}
    assert reports["0"]["prepared"] == {"local_rank": 0, "pid": reports["0"]["pid"]}
    assert reports["1"]["prepared"] == {"local_rank": 1, "pid": reports["1"]["pid"]}
    assert (pool / "pool.log").read_text().count("test device 1") >= 2  # the replacement prepared too


def test_a_prepared_spare_declines_a_worker_whose_cuda_environment_differs(pool):
    # Its context was made under the pool's CUDA_VISIBLE_DEVICES: another GPU list would be wrong.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") + ",9"
    proc = start_stub(pool, "--bogus-flag", env={"CUDA_VISIBLE_DEVICES": visible})
    _, err = proc.communicate(timeout=60)
    assert "spare declined" in err and "CUDA_VISIBLE_DEVICES differ" in err and "test device 1" in err, err
    assert proc.returncode == 2 and "unrecognized arguments: --bogus-flag" in err  # started cold
    assert report_of(pool, "1", env={"NCCL_DEBUG": "WARN"})["prepared"]["local_rank"] == 1  # not a CUDA setting


def test_a_local_rank_without_a_spare_starts_cold(pool):
    proc = start_stub(pool, "--bogus-flag", local_rank="2")  # the pool has spares for ranks 0 and 1
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus-flag" in err and "declined" not in err


def test_work_that_comes_before_a_spare_prepares_its_device_takes_it_unprepared(tmp_path):
    with preparing_pool(tmp_path, 1, "prepare", after="60"):
        # Unprepared, the spare has no context a CUDA setting could contradict.
        report = report_of(tmp_path, "0", env={"CUDA_VISIBLE_DEVICES": "9"})
        assert report["prepared"] == {} and report["env"]["CUDA_VISIBLE_DEVICES"] == "9"


def test_a_spare_that_could_not_prepare_its_device_declines(tmp_path):
    with preparing_pool(tmp_path, 2, "prepare_fails") as log:
        assert wait_until(lambda: "RuntimeError: no device 1 here" in log.read_text(), 10)
        stub_proc = start_stub(tmp_path, "--bogus-flag")
        _, err = stub_proc.communicate(timeout=60)
        assert "spare declined" in err and "could not prepare its device: RuntimeError: no device 1 here" in err
        assert stub_proc.returncode == 2  # started cold


def test_a_signal_during_the_handover_reaches_the_spare(tmp_path):
    # The spare is busy preparing its device for 1.5 s when the stub connects; the launcher's
    # SIGTERM comes meanwhile. The stub used to die of it at once, leaving the spare to find out.
    with preparing_pool(tmp_path, 1, "prepare_slowly"):
        started = time.monotonic()
        stub_proc = start_stub(tmp_path, "exit", "5", local_rank="0")
        # Once the stub holds the signals for the handover (a fixed 0.3 s was shorter than a loaded
        # CI machine's interpreter start: the SIGTERM killed the stub before it could hold it).
        assert wait_until(lambda: _blocks(stub_proc.pid, signal.SIGTERM), 30), "the stub never began its handover"
        stub_proc.send_signal(signal.SIGTERM)
        code = stub_proc.wait(timeout=20)
        # The spare got the SIGTERM (-15) or finished first (5); either way it took the work.
        assert code in (5, -signal.SIGTERM) and time.monotonic() - started > 1.0, (code, stub_proc.stderr.read())


def _blocks(pid: int, sig: int) -> bool:
    """Whether process ``pid``'s main thread blocks ``sig`` (/proc's SigBlk)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def test_spares_make_a_cuda_context_unless_ft_launcher_waits_for_gpu_memory(tmp_path):
    def chosen(**overrides):
        return spare_pool.preparation(cfg.from_dict({"run_dir": str(tmp_path), **overrides}), "")

    prepare = chosen()  # the context, the kernels, then the first step's warm-up (step_warmup)
    assert prepare is not None and prepare(0) == ""  # no GPU here: nothing to prepare, nothing warmed
    assert chosen(spare_cuda_context=False) is None
    assert chosen(worker_gpu_reclaim=False) is None  # NVRx's NVML wait would count the idle contexts
    assert spare_pool.preparation(None, "") is None  # flags that do not parse: the workers report them
    assert spare_pool.preparation(cfg.from_dict({"run_dir": str(tmp_path)}), "none") is None
    assert spare_pool.make_cuda_context(0) == ""  # no GPU here: nothing to prepare


def test_the_kernel_warm_up_runs_a_training_step_and_leaves_the_global_rng_alone():
    import torch

    before = torch.random.get_rng_state()
    expected = torch.rand(3)
    torch.random.set_rng_state(before)
    calls = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        calls.append(len(self.param_groups[0]["params"]))
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        spare_pool.warm_kernels(torch.device("cpu"))  # on a GPU: in the spare, after its CUDA context
    finally:
        torch.optim.AdamW.step = original
    assert calls == [10, 10]  # head sizes 64 and 128: embedding, norm (2), three linears with bias (6), head
    assert torch.equal(torch.rand(3), expected)  # a task that does not seed sees what it would have


def test_no_pool_means_a_cold_start_and_a_pool_for_next_time_that_ends_with_its_agent(tmp_path):
    run_dir = tmp_path / "run"
    # A stand-in agent: it starts one stub (local rank 0 of 1) and exits when the stub exits.
    agent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:], start_new_session=True))",
         sys.executable, "-m", stub.STUB_MODULE, "--run-dir", str(run_dir), "--bogus-flag"],
        cwd=ROOT, env={**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    key = stub.pool_key(str(run_dir), stub.process_identity(agent.pid))
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 2, err  # the cold worker's own answer to a bad flag
    assert "unrecognized arguments: --bogus-flag" in err
    assert wait_until(lambda: list((run_dir / "logs").glob("spare-pool-*.log")), 5)
    logs = list((run_dir / "logs").glob("spare-pool-*.log"))
    # The agent is gone: the pool stops, even in the middle of its imports; nothing of it is left.
    assert wait_until(lambda: "pool stopped" in logs[0].read_text(), 10), logs[0].read_text()
    assert wait_until(lambda: not processes_mentioning(key), 5), processes_mentioning(key)


AGENT = """
import pathlib, subprocess, sys, time
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
stub = subprocess.Popen(sys.argv[2:], start_new_session=True)
print(stub.pid, flush=True)
time.sleep(120)
"""


def test_when_the_agent_dies_the_pool_ends_its_spares_at_work_and_the_orphaned_stubs(tmp_path):
    # An agent SIGKILLed (the local launcher cancelled, a node lost) leaves its worker stubs running;
    # the pool sees the agent gone and kills its spares' process groups, so the stubs end too.
    run_dir, go = tmp_path / "run", tmp_path / "go"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(go), sys.executable, "-m", stub.STUB_MODULE, "--run-dir", str(run_dir),
         "sleep"], cwd=ROOT, env={**os.environ, "LOCAL_RANK": "0"}, text=True, stdout=subprocess.PIPE)
    identity = stub.process_identity(agent.pid)
    key = stub.pool_key(str(run_dir), identity)
    log_path = tmp_path / "pool.log"
    with open(log_path, "wb") as log:
        subprocess.Popen([sys.executable, "-m", stub.POOL_MODULE, "--key", key, "--agent-pid", str(agent.pid),
                          "--agent-start", identity.rsplit(":", 1)[1], "--size", "1", "--entry", ENTRY],
                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: "ready" in log_path.read_text(), 120), log_path.read_text()
        go.touch()
        stub_pid = int(agent.stdout.readline())
        assert wait_until(lambda: len(processes_mentioning(key)) == 3, 10)  # pool, spare at work, idle spare
        agent.kill()
        agent.wait()
        assert wait_until(lambda: not alive(stub_pid) and not processes_mentioning(key), 5), \
            (alive(stub_pid), processes_mentioning(key))
        assert "agent exited; stopping" in log_path.read_text()
    finally:
        agent.kill()
        for pid in processes_mentioning(key):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_pool_and_its_idle_spares(tmp_path):
    key = stub.pool_key(str(tmp_path), "test:sigterm")
    log_path = tmp_path / "pool.log"
    with open(log_path, "wb") as log:
        pool = subprocess.Popen(
            [sys.executable, "-m", stub.POOL_MODULE, "--key", key, "--agent-pid", str(os.getpid()),
             "--agent-start", stub.process_identity(os.getpid()).rsplit(":", 1)[1], "--size", "2", "--entry", ENTRY],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: "ready" in log_path.read_text(), 120), log_path.read_text()
        assert wait_until(lambda: len(processes_mentioning(key)) == 3, 10)
        pool.terminate()
        assert pool.wait(timeout=10) == 0
        assert wait_until(lambda: not processes_mentioning(key), 5), processes_mentioning(key)
    finally:
        pool.kill()


def test_the_pool_key_separates_runs_and_agents(tmp_path):
    a = stub.pool_key(str(tmp_path / "a"), "host:1:100")
    assert a != stub.pool_key(str(tmp_path / "b"), "host:1:100")
    assert a != stub.pool_key(str(tmp_path / "a"), "host:1:101")
    assert a == stub.pool_key(str(tmp_path / "x" / ".." / "a"), "host:1:100")


def test_the_flag_reaches_the_worker_command(tmp_path):
    config = cfg.from_dict({"run_dir": str(tmp_path), "warm_spare": True})
    assert cfg.from_argv(cfg.to_argv(config)).restart.warm_spare
    command = nvrx_adapter.worker_command(config, cfg.to_argv(config), python="python", standalone=True)
    assert command[command.index("-m", 3) + 1] == stub.STUB_MODULE
    config.restart.ft_launcher = False
    command = nvrx_adapter.worker_command(config, cfg.to_argv(config), python="python", standalone=True)
    assert command[command.index("-m", 3) + 1] == stub.STUB_MODULE
    assert not cfg.TrainConfig(run_dir=str(tmp_path)).restart.warm_spare  # off unless asked for


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [[], ["--no-ft-launcher"]], ids=["ft_launcher", "torchrun"])
def test_a_killed_rank_restarts_from_warm_spares_and_nothing_outlives_the_run(tmp_path, launcher):
    # Each worker starts training once the pool (started by the first workers) listens and its
    # checkpoint writer is up: the kill meets both, however busy this machine is.
    run = train(tmp_path / "run", *FAST, "--warm-spare", "--faults", "sigkill@10:1", *launcher,
                "--task", READY_TASK, "--task-arg", f"run_dir={tmp_path / 'run'}", "--task-arg", "nproc=2")
    check_recovered(run, "sigkill@10:1", layer="launcher", cause=None)
    starts = [e for e in run.events if e.event == "start"]
    assert {(e.rank, e["spare"]) for e in starts if e.attempt == 0} == {(0, False), (1, False)}
    restarted = [e for e in starts if e.attempt > 0]
    assert {(e.rank, e["spare"]) for e in restarted} == {(0, True), (1, True)}, [e.fields for e in restarted]
    assert all(e["process_seconds"] < 1.0 for e in restarted), [e["process_seconds"] for e in restarted]
    first = {e.rank: e for e in starts if e.attempt == 0}
    assert all(e["agent"] == first[e.rank]["agent"] for e in restarted)  # the stub passed the agent's identity
    key = stub.pool_key(str(run.run_dir), starts[0]["agent"])
    assert wait_until(lambda: not processes_mentioning(key, str(run.run_dir)), 5), \
        processes_mentioning(key, str(run.run_dir))
    # Nor does a checkpoint writer: the killed rank's lost its worker to the SIGKILL (under
    # torchrun nothing else stopped it, found alive long after the suite ended).
    writers = [e["pid"] for e in run.events if e.event in ("writer_ready", "writer_restarted") and e.get("pid")]
    assert len(writers) >= 4  # both ranks' before and after the restart
    assert wait_until(lambda: not [pid for pid in writers if alive(pid)], 5), [pid for pid in writers if alive(pid)]


def test_a_sigkilled_train_command_takes_its_launcher_workers_and_spares_along(tmp_path):
    """Found by a stranger trial: `resilient-training train` killed with SIGKILL (no chance to
    clean up) left ft_launcher and the workers training on, in sessions of their own, with nobody
    watching. The launcher now gets SIGTERM when the command dies and stops its workers.
    """
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir), "--steps", "400",
               "--step-seconds", "0.3", "--checkpoint-every", "100", "--warm-spare"]
    cli = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: any(e.get("event") == "step" for e in _events(run_dir)), timeout=120)
        assert len(processes_mentioning(str(run_dir))) >= 3  # launcher and two workers at least
    finally:
        cli.kill()
        cli.wait()
    assert wait_until(lambda: not processes_mentioning(str(run_dir)), timeout=30), \
        processes_mentioning(str(run_dir))
    # The workers' pid records in /dev/shm (a resume of the run would read and remove them): not left on the machine.
    import shutil

    from resilient_training.run import config as cfg
    from resilient_training.run import layout

    shutil.rmtree(layout.worker_records(cfg.TrainConfig(run_dir=str(run_dir))), ignore_errors=True)


def _events(run_dir: Path) -> list[dict]:
    out = []
    for path in (run_dir / "events").glob("*.jsonl") if (run_dir / "events").is_dir() else []:
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def test_a_preparing_spare_sees_work_waiting_on_its_control_socket(monkeypatch):
    # What stops an elastic job's spare between the world sizes it warms (step_warmup's ``stop``).
    import socket

    assert not spare_pool.work_waiting()  # not preparing
    mine, pools = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with mine, pools:
        monkeypatch.setattr(spare_pool, "_control", mine)
        assert not spare_pool.work_waiting()
        pools.send(b"work")
        assert spare_pool.work_waiting()


def test_a_spare_watches_its_own_control_socket_only_while_it_prepares():
    import socket
    import threading

    mine, pools = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seen: list[bool] = []

    def prepare(local_rank: int) -> str:
        seen.append(spare_pool._control is mine and not spare_pool.work_waiting())
        return "prepared"

    done: list[int] = []
    spare = threading.Thread(target=lambda: done.append(spare_pool.wait_for_work(mine, prepare=prepare,
                                                                                 prepare_after=0.01)))
    spare.start()
    assert wait_until(lambda: bool(seen), 10.0)
    pools.close()  # the pool is gone: the spare returns
    spare.join(timeout=10)
    assert seen == [True] and done == [0] and spare_pool._control is None
