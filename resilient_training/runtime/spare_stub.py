"""The launcher's worker command with ``--warm-spare``: hand this worker to a warm spare process.

``python -m resilient_training.runtime.spare_stub FLAGS`` (the flags of
``resilient_training.runtime.worker``). Imports only the standard library, so it starts in
milliseconds. It connects to this node's spare pool (:mod:`.spare_pool`) at its local rank's
address, passes its argv, environment, cwd, umask and stdin/stdout/stderr (``SCM_RIGHTS``) to that
rank's spare, which has torch, FSDP, NVRx and the trainer imported already (and on a GPU node its
device's CUDA context made), and then only relays: SIGTERM/SIGINT/... go to the
spare's process group, the spare's exit status comes back as this process's own (a signal death
is re-raised here), and if this stub is SIGKILLed the spare sees the connection close and kills
its process group.

With no pool to reach (the first start of a run, or a pool that is gone), it ``exec``s the
normal worker in place (a cold start, same pid) and, as local rank 0, starts a pool in the
background for the next restart. The pool lives in its own session (the launcher's teardown
``killpg`` of a worker must not reach it) and exits when the agent that started this stub exits.

The socket is an abstract unix socket named from the user, the run directory, the agent (host,
pid, start time) and the interpreter: two runs, two agents or two users never share a pool, and
nothing is left on disk. Only processes of the same uid are served (``SO_PEERCRED``).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import signal
import socket
import sys
from typing import Any, NoReturn

STUB_MODULE = "resilient_training.runtime.spare_stub"
WORKER_MODULE = "resilient_training.runtime.worker"
POOL_MODULE = "resilient_training.runtime.spare_pool"
# In a spare's adopted environment: the pid of the stub the launcher started (what it watches).
STUB_PID_ENV = "RT_SPARE_STUB_PID"
# Signals a launcher or rank monitor sends to a worker's process group; relayed to the spare's.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
MAX_MESSAGE = 1 << 20
# How long a pool that accepted the connection may take to say a spare started.
START_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- protocol


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """One JSON message (a ``SOCK_SEQPACKET`` record), with file descriptors if given."""
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` at end of stream."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


def pool_key(run_dir: str, agent: str) -> str:
    """Names one pool: this user, run directory, agent and interpreter."""
    material = "\0".join((str(os.getuid()), os.path.realpath(run_dir), agent, sys.executable))
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def rank_suffix(local_rank: int | str) -> str:
    """The address suffix of a local rank's spare (each spare prepares its own rank's device)."""
    return f"rank{local_rank}"


def address(key: str, suffix: str = "") -> bytes:
    """The abstract socket address of a pool (``suffix`` ``lock``: the one a starting pool holds)."""
    return f"\0resilient-training-spare-{key}{'-' + suffix if suffix else ''}".encode()


def proc_stat(pid: int | str) -> list[str]:
    """Fields of /proc/PID/stat after the command name: [0] state, [1] ppid, [19] start ticks."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def process_identity(pid: int) -> str:
    """host:pid:start-ticks, which a later process reusing the pid does not share."""
    try:
        started = proc_stat(pid)[19]
    except (OSError, IndexError):
        started = "?"
    return f"{os.uname().nodename}:{pid}:{started}"


def run_dir_of(argv: list[str]) -> str | None:
    """``--run-dir`` from the worker's flags, without parsing the rest (the worker does that)."""
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return None


# --------------------------------------------------------------------------- the stub


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = run_dir_of(argv)
    if not run_dir:
        cold_start(argv)  # the worker reports the bad flags
    agent_pid = os.getppid()
    key = pool_key(run_dir, process_identity(agent_pid))
    local_rank = os.environ.get("LOCAL_RANK", "0")
    sock = connect(address(key, rank_suffix(local_rank))) if local_rank.isdigit() else None
    if sock is not None:
        relay(sock, argv)  # returns only when no spare took the work
        sock.close()
    if local_rank == "0":
        start_pool(key, run_dir, agent_pid, argv)
    cold_start(argv)


def connect(addr: bytes) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(addr)
    except OSError:  # no pool (ECONNREFUSED) or one that is still importing
        sock.close()
        return None
    return sock


def relay(sock: socket.socket, argv: list[str]) -> None:
    """Hand the work to a spare and live as its stand-in; returns only if no spare started."""
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": argv, "env": {**os.environ, STUB_PID_ENV: str(os.getpid())}, "cwd": os.getcwd(),
               "umask": umask, "executable": sys.executable}
    sock.settimeout(START_TIMEOUT_S)
    # A signal during the handover waits until it can be relayed (or, with no spare, acts on this
    # process as on a cold worker): the spare may print before this process has its handlers.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        send_message(sock, request, (0, 1, 2))
        started, _ = recv_message(sock)
    except (OSError, ValueError):
        started = None
    if not started or "pid" not in started:
        if started and started.get("declined"):
            print(f"resilient-training spare declined, starting cold: {started['declined']}", file=sys.stderr)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return
    sock.settimeout(None)
    spare = int(started["pid"])
    forwarded: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        try:
            os.killpg(spare, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    exiting: int | None = None
    while True:
        try:
            message, _ = recv_message(sock)
        except (OSError, ValueError):
            message = None
        if message is None:
            break  # the spare and the pool are gone without a word: the pool died
        if "ended" in message:  # the pool reaped the spare: its real wait status
            if message["ended"] == "signal":
                die_by(int(message["signal"]))
            os._exit(int(message["code"]))
        if "exiting" in message:  # the spare's own word, used if the pool cannot report
            exiting = int(message["exiting"])
    if exiting is not None:
        os._exit(exiting)
    die_by(forwarded[-1] if forwarded else signal.SIGKILL)


def die_by(signum: int) -> NoReturn:
    """End this stub the way its spare ended, so the launcher sees the same death."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def cold_start(argv: list[str]) -> NoReturn:
    """Become the normal worker (same pid, so the launcher watches the right process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", WORKER_MODULE, *argv])


def start_pool(key: str, run_dir: str, agent_pid: int, argv: list[str]) -> None:
    """Start this node's spare pool, detached from this worker (double fork, own session).

    The pool holds the key's lock address while it imports, so a second stub's attempt exits at
    once. Its output goes to ``RUN/logs/spare-pool-HOST-AGENTPID.log``.
    """
    size = os.environ.get("LOCAL_WORLD_SIZE", "1")
    log = os.path.join(run_dir, "logs", f"spare-pool-{os.uname().nodename}-{agent_pid}.log")
    command = [sys.executable, "-m", POOL_MODULE, "--key", key, "--agent-pid", str(agent_pid),
               "--agent-start", process_identity(agent_pid).rsplit(":", 1)[1], "--size", size, "--", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    code = 0
    try:
        os.setsid()
        if os.fork() == 0:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.execv(sys.executable, command)
    except OSError:
        code = 1
    finally:
        os._exit(code)


if __name__ == "__main__":
    main()
