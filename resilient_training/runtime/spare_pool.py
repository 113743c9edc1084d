"""A node's warm spares: worker processes with torch, FSDP, NVRx and the trainer already imported.

``python -m resilient_training.runtime.spare_pool --key K --agent-pid P --agent-start T --size N``,
started by a :mod:`.spare_stub` on a cold start (never by hand). The pool imports everything a
worker imports, once, then forks ``N`` spares, one per local rank (``N`` = local world size: the
launcher restarts every worker of the node together). Forking after the imports makes a spare
cost milliseconds and little memory (pages shared copy-on-write). The pool never initializes CUDA
(a forked CUDA context would be unusable), which is asserted before each fork.

Each spare then prepares its own local rank's device: on a GPU node it makes that GPU's CUDA
context (0.15-0.5 s of a restart's critical path on an H200 otherwise), runs one tiny training step
there (:func:`warm_kernels`: cuBLAS handles, lazily loaded kernels), the run's first optimizer step
on fake tensors (:mod:`.step_warmup`: DTensor's sharding decisions, cached per thread and world
size; an elastic job's other world sizes too) and the restore's page-locked read buffers
(``tensor_read.warm_buffers``), ``PREPARE_AFTER_S`` after it was forked, so that a replacement
forked during a restart does not compete with the workers starting. A stub connects to its local
rank's address and gets that rank's spare. A spare that made a context declines a worker whose CUDA
environment differs from the pool's (the context was made under the pool's). Not with
``--no-worker-gpu-reclaim``: ft_launcher's own wait for GPU memory would count the idle spares'
contexts (about 0.5 GB each).

The task's preflight (meta-device model, optimizer, one batch; as ``train`` runs before any
worker starts) is run once too, for what a worker would otherwise import lazily while building
its model (``torch._dynamo`` and more).

A stub connects (an abstract ``SOCK_SEQPACKET`` socket per local rank, same uid only); the pool
passes the connection to that rank's idle spare and forks a replacement off the critical path.
The spare reads the stub's argv, environment, cwd, umask and stdio descriptors, adopts them,
starts its own process group (the stub relays signals to it) and runs ``worker.main``. When the spare exits, the pool
sends its wait status to the stub (which exits the same way) and then terminates what is left of
the spare's process group (the NVRx writer, say), as the launcher's ``killpg`` would.

Nothing outlives the run: the pool exits, killing idle spares and the process groups of spares at
work, when the agent that started the run's workers exits; an idle spare dies with the pool
(``PR_SET_PDEATHSIG``); a spare at work kills its process group when its stub's connection closes
(the stub was SIGKILLed).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import gc
import importlib
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from resilient_training.run import config as cfg
from resilient_training.runtime import spare_stub as stub
from resilient_training.runtime.step_warmup import world_sizes

DEFAULT_ENTRY = f"{stub.WORKER_MODULE}:main"
PR_SET_PDEATHSIG = 1
# After a spare at work exits, what is left of its process group gets SIGTERM, then SIGKILL.
GROUP_KILL_GRACE_S = 5.0
# Spares that die idle this many times in a row (an import that crashes after fork?) stop the pool.
MAX_IDLE_DEATHS = 5
AGENT_POLL_S = 0.2
# A spare prepares its device this long after its fork (unless work comes first): a replacement
# forked during a restart would otherwise make its CUDA context while the new workers start.
PREPARE_AFTER_S = 10.0
# Environment the CUDA runtime and torch's allocator read when a context is made: a spare that
# made one under the pool's values cannot stand in for a worker with other values.
CONTEXT_ENV_PREFIXES = ("CUDA_", "PYTORCH_CUDA_", "PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NVML_BASED_CUDA_CHECK")
# Environment that only takes effect when an interpreter starts: a spare cannot adopt a change.
START_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONNOUSERSITE", "PYTHONSAFEPATH",
             "LD_PRELOAD", "LD_LIBRARY_PATH")


def log(message: str) -> None:
    print(f"[spare-pool {os.getpid()} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def set_parent_death_signal(signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)


class CudaInitialized(RuntimeError):
    """Something initialized CUDA in the pool: forked spares could not use it."""


def warm(worker_argv: list[str]) -> cfg.TrainConfig | None:
    """Import what a worker imports before its first step (not CUDA: no device yet), then run the
    task's preflight (model on the meta device, optimizer, one batch) for the imports a worker
    would otherwise make lazily while building its model (``torch._dynamo`` and more). Returns the
    first worker's config, or None if its flags do not parse.
    """
    import warnings

    # torch.cuda imports pynvml, which warns about its own deprecation (the CLI silences it too).
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    # As the worker does before torch loads (c10d's logging level is read once, at import).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.device_mesh
    import torch.distributed.fsdp  # noqa: F401

    from resilient_training.runtime import checkpointing, model, nvrx_adapter, task, trainer, worker  # noqa: F401

    nvrx_adapter.preload()
    config: cfg.TrainConfig | None = None
    try:
        if not worker_argv:
            raise ValueError("no worker flags")
        config = cfg.from_argv(worker_argv)
        task.preflight(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except (SystemExit, Exception) as exc:  # noqa: BLE001 - the workers report a broken task or flag themselves
        log(f"task preflight skipped: {type(exc).__name__}: {exc}")
    gc.collect()
    if torch.cuda.is_initialized():
        raise CudaInitialized("CUDA was initialized while warming up; spares must not inherit it")
    return config


def make_cuda_context(local_rank: int) -> str:
    """What a spare prepares on a GPU node: its device's CUDA context, as the trainer makes it
    (``set_device`` and a first allocation). In the forked spare, never in the pool.
    """
    import torch

    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        return ""
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.empty(1, device=device)
    warm_kernels(device)
    return f"CUDA context on cuda:{local_rank}, kernels warmed"


def warm_kernels(device: Any) -> None:
    """One small training step of a transformer block on ``device``: the first launches a worker's
    restore and first step would otherwise pay in a fresh process (cuBLAS/cuBLASLt handles and
    workspaces, lazily loaded kernels: bf16 autocast matmuls, attention for head sizes 64 and 128,
    layer norm, GELU, cross-entropy, AdamW's foreach update, gradient clipping, and the zeros DCP
    fills an empty optimizer with). Measured on 1 H200 before this: a spare's first step after a
    1.3B restore took 0.98 s, the steady one 0.18 s. A few MB of device memory; the global RNG is
    left as it was (the worker seeds its own, but a task may not).
    """
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer sets it: TF32 picks other kernels
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for head_dim in (64, 128):
            width, heads, vocab, seq = 2 * head_dim, 2, 256, 64
            layers = torch.nn.ModuleDict({
                "embed": torch.nn.Embedding(vocab, width), "ln": torch.nn.LayerNorm(width),
                "qkv": torch.nn.Linear(width, 3 * width), "fc": torch.nn.Linear(width, 4 * width),
                "out": torch.nn.Linear(4 * width, width), "head": torch.nn.Linear(width, vocab, bias=False),
            }).to(device)
            optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-4)
            for param in layers.parameters():  # DCP's optimizer-state initialisation does this
                param.grad = torch.zeros_like(param)
            tokens = torch.randint(0, vocab, (2, seq), device=device)
            autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                        else contextlib.nullcontext())
            with autocast:
                x = layers["ln"](layers["embed"](tokens))
                q, k, v = layers["qkv"](x).view(2, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, seq, width)
                x = x + attn + layers["out"](F.gelu(layers["fc"](x)))
                logits = layers["head"](x)
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layers.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            del layers, optimizer, tokens, x, q, k, v, attn, logits, loss
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def load(spec: str) -> Callable[..., Any]:
    """The function ``MODULE:FUNC`` names."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def preparation(config: cfg.TrainConfig | None, spec: str) -> Callable[[int], str] | None:
    """The function a spare prepares its device with: ``spec`` (MODULE:FUNC, or ``none``), else
    from the first worker's config.
    """
    if spec == "none":
        return None
    if spec:
        return load(spec)
    if config is None or not (config.restart.spare_cuda_context and config.restart.worker_gpu_reclaim):
        return None
    worlds = world_sizes(os.environ)  # the first worker's, then an elastic job's other sizes

    def prepare(local_rank: int) -> str:
        made = make_cuda_context(local_rank)
        if not made:
            return made
        import torch

        from resilient_training.run.checkpoint_format import READ_THREADS
        from resilient_training.run.tensor_read import warm_buffers
        from resilient_training.runtime.step_warmup import warm_first_step

        device = torch.device("cuda", local_rank)
        warmed = warm_first_step(config, world_size=worlds, device=device, stop=work_waiting)
        # The restore's reading threads then find their page-locked buffers made (unless the
        # restore is waiting now: it makes them itself).
        buffers = "" if work_waiting() else warm_buffers(device, READ_THREADS)
        return ", ".join(part for part in (made, warmed, buffers) if part)

    return prepare


@contextlib.contextmanager
def exit_when_agent_exits(agent_pid: int, agent_start: str) -> Iterator[None]:
    """While warming up (seconds): a short run may end meanwhile, and the pool must not outlive it.
    The watching thread is gone before the first fork.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(AGENT_POLL_S):
            if not agent_alive(agent_pid, agent_start):
                log("agent exited while warming up; pool stopped")
                os._exit(0)

    thread = threading.Thread(target=watch, name="spare-pool-agent-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def agent_alive(pid: int, start: str) -> bool:
    try:
        stat = stub.proc_stat(pid)
    except (OSError, IndexError):
        return False
    return stat[19] == start and stat[0] != "Z"


class Pool:
    """The pool's event loop: accept, hand over, replace, reap, report."""

    def __init__(self, listeners: dict[int, socket.socket], lock: socket.socket, agent_pid: int, agent_start: str):
        self.listeners, self.lock = listeners, lock  # local rank -> its address's listener
        self.agent_pid, self.agent_start = agent_pid, agent_start
        self.idle: dict[int, tuple[int, socket.socket]] = {}  # local rank -> its spare's pid, control socket
        self.working: dict[int, socket.socket] = {}  # spare pid -> the stub's connection
        self.group_kills: dict[int, float] = {}  # process group of a finished spare -> SIGKILL deadline
        self.idle_deaths = 0
        self.stopping = False  # SIGTERM: stop as if the agent had exited
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)

    def serve(self) -> tuple[int, socket.socket] | None:
        """Run until the agent exits (returns None); in a forked spare, returns its local rank and
        control socket.
        """
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self.stop)
        try:
            pidfd: int | None = os.pidfd_open(self.agent_pid)
        except (AttributeError, OSError):
            pidfd = None
        while not self.stopping and agent_alive(self.agent_pid, self.agent_start):
            for local_rank in self.listeners:
                if local_rank not in self.idle:
                    spare = self.fork_spare(local_rank, pidfd)
                    if spare is not None:
                        return local_rank, spare
            watched = [*self.listeners.values(), self.wake_r] + ([pidfd] if pidfd is not None else [])
            timeout = AGENT_POLL_S if pidfd is None else max(0.0, min(
                [deadline - time.monotonic() for deadline in self.group_kills.values()], default=60.0))
            ready, _, _ = select.select(watched, [], [], timeout)
            if self.wake_r in ready:
                self.drain_wakeups()
            self.reap()
            self.kill_leftover_groups()
            for local_rank, listener in self.listeners.items():
                if listener in ready:
                    self.accept(local_rank)
            if self.idle_deaths >= MAX_IDLE_DEATHS:
                log(f"{self.idle_deaths} spares died while idle; stopping (stubs will start cold)")
                break
        log("stopping" if self.stopping else "agent exited; stopping")
        self.shutdown()
        return None

    def stop(self, _signum: int, _frame: Any) -> None:
        self.stopping = True

    def fork_spare(self, local_rank: int, pidfd: int | None) -> socket.socket | None:
        import torch

        assert not torch.cuda.is_initialized(), "a spare pool must not initialize CUDA before forking"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pool_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the spare: drop every descriptor of the pool, keep the control socket
            set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != pool_pid:
                os._exit(0)
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(signum, signal.SIG_DFL)
            for sock in (ours, *self.listeners.values(), self.lock, self.wake_r, self.wake_w,
                         *(control for _, control in self.idle.values()), *self.working.values()):
                sock.close()
            if pidfd is not None:
                os.close(pidfd)
            return theirs
        theirs.close()
        self.idle[local_rank] = (pid, ours)
        return None

    def drain_wakeups(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def accept(self, local_rank: int) -> None:
        try:
            conn, _ = self.listeners[local_rank].accept()
        except OSError:
            return
        if peer_uid(conn) != os.getuid():
            conn.close()
            return
        if local_rank not in self.idle:
            conn.close()  # the stub starts cold
            return
        pid, control = self.idle.pop(local_rank)
        try:
            stub.send_message(control, {"job": True}, (conn.fileno(),))
        except OSError:
            conn.close()
            control.close()
            return
        control.close()
        self.working[pid] = conn
        self.idle_deaths = 0

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            idle_rank = next((rank for rank, (spare, _) in self.idle.items() if spare == pid), None)
            if pid in self.working:
                conn = self.working.pop(pid)
                if os.WIFSIGNALED(status):
                    ended = {"ended": "signal", "signal": os.WTERMSIG(status)}
                else:
                    ended = {"ended": "exit", "code": os.waitstatus_to_exitcode(status)}
                try:
                    stub.send_message(conn, ended)
                except OSError:
                    pass
                conn.close()
                self.signal_group(pid, signal.SIGTERM)
                self.group_kills[pid] = time.monotonic() + GROUP_KILL_GRACE_S
            elif idle_rank is not None:
                self.idle.pop(idle_rank)[1].close()
                self.idle_deaths += 1
                log(f"idle spare {pid} (local rank {idle_rank}) died (status {status})")

    @staticmethod
    def signal_group(pgid: int, signum: int) -> bool:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def kill_leftover_groups(self) -> None:
        now = time.monotonic()
        for pgid, deadline in list(self.group_kills.items()):
            if not self.signal_group(pgid, 0):
                del self.group_kills[pgid]
            elif now >= deadline:
                self.signal_group(pgid, signal.SIGKILL)
                del self.group_kills[pgid]

    def shutdown(self) -> None:
        """The agent is gone: so is the run on this node. Leave nothing behind."""
        idle = {pid for pid, _ in self.idle.values()}
        for pid in [*idle, *self.working, *self.group_kills]:
            self.signal_group(pid, signal.SIGKILL)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for sock in (*(control for _, control in self.idle.values()), *self.working.values()):
            sock.close()
        deadline = time.monotonic() + 5
        while (idle or self.working) and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            idle.discard(pid)
            self.working.pop(pid, None)
        for listener in self.listeners.values():
            listener.close()
        self.lock.close()


# --------------------------------------------------------------------------- one spare


_control: socket.socket | None = None  # an idle spare's control socket while it prepares its device


def work_waiting() -> bool:
    """Whether work has come for this spare while it prepares (a stub's connection is waiting)."""
    return _control is not None and bool(select.select([_control], [], [], 0)[0])


def wait_for_work(control: socket.socket, entry: str = DEFAULT_ENTRY, local_rank: int = 0,
                  prepare: Callable[[int], str] | None = None, prepare_after: float = PREPARE_AFTER_S) -> int:
    """An idle spare: prepare its device (unless work comes first), wait for a stub's connection,
    then become that stub's worker.
    """
    global _control
    prepared = unusable = ""
    if prepare is not None and not select.select([control], [], [], prepare_after)[0]:
        started = time.monotonic()
        _control = control
        try:
            prepared = prepare(local_rank) or ""
        except Exception as exc:  # noqa: BLE001 - a worker here would fail too: decline, start cold
            unusable = f"the spare for local rank {local_rank} could not prepare its device: {type(exc).__name__}: {exc}"
        finally:
            _control = None
        log(f"spare for local rank {local_rank}: {unusable or prepared or 'nothing to prepare'} "
            f"({time.monotonic() - started:.2f} s)")
    message, fds = stub.recv_message(control)
    control.close()
    if message is None or len(fds) != 1:
        return 0  # the pool is gone
    conn = socket.socket(fileno=fds[0])
    conn.set_inheritable(False)
    request, stdio = stub.recv_message(conn)
    if request is None or len(stdio) != 3:
        return 0  # the stub gave up before handing over
    declined = unusable or mismatch(request, local_rank, prepared)
    if declined:
        stub.send_message(conn, {"declined": declined})
        return 0
    adopt(request, stdio)
    try:
        stub.send_message(conn, {"pid": os.getpid()})
    except OSError:
        return 0  # the stub is gone (killed while handing over): nothing to run for
    # The watch thread blocks the signals the stub relays (it inherits this mask), so they reach
    # the main thread: one delivered to it ran the worker's handler only once the main thread's
    # blocking call returned (a SIGTERM waited out a 60 s sleep: a flaky test, since CI runs).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stub.FORWARDED)
    try:
        threading.Thread(target=watch_stub, args=(conn,), name="spare-stub-watch", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    code = run_worker(entry, request["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        stub.send_message(conn, {"exiting": code})
    except OSError:
        pass
    return code


def mismatch(request: dict[str, Any], local_rank: int = 0, prepared: str = "") -> str:
    """Why this spare cannot stand in for a cold start of the request, or ''."""
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} differs from the pool's {sys.executable}"
    env = request.get("env", {})
    differ = [name for name in START_ENV if env.get(name) != os.environ.get(name)]
    if differ:
        return f"{', '.join(differ)} differ from the pool's environment"
    if prepared:
        if env.get("LOCAL_RANK", "0") != str(local_rank):
            return f"LOCAL_RANK {env.get('LOCAL_RANK', '0')!r} is not the spare's {local_rank} ({prepared})"
        names = {name for name in (*env, *os.environ) if name.startswith(CONTEXT_ENV_PREFIXES)}
        differ = sorted(name for name in names if env.get(name) != os.environ.get(name))
        if differ:
            return f"{', '.join(differ)} differ from the environment its {prepared} was made in"
    return ""


def adopt(request: dict[str, Any], stdio: list[int]) -> None:
    """Become the process the launcher meant to start: its session, env, cwd and stdio."""
    os.setsid()  # the stub relays the launcher's signals to this group
    set_parent_death_signal(0)  # now bound to the stub (its connection), not to the pool
    os.umask(int(request["umask"]))
    os.chdir(request["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((0, 1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=unbuffered or os.isatty(stream.fileno()), write_through=unbuffered)
    sys.argv = [stub.WORKER_MODULE, *request["argv"]]
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # OpenMP read the pool's env when torch was imported


def watch_stub(conn: socket.socket) -> None:
    """The stub's connection closed (it was killed): end this worker and its children at once."""
    while True:
        try:
            message, fds = stub.recv_message(conn)
        except OSError:
            message = None
        if message is None:
            os.killpg(0, signal.SIGKILL)
        for fd in fds:
            os.close(fd)


def run_worker(entry: str, argv: list[str]) -> int:
    """``sys.exit(entry(argv))`` as a fresh interpreter would report it."""
    try:
        code: Any = load(entry)(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed and exit 1, like an uncaught exception
        traceback.print_exc()
        return 1
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=stub.POOL_MODULE, description="A node's warm spare workers.")
    parser.add_argument("--key", required=True)
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument("--agent-start", required=True)
    parser.add_argument("--size", type=int, default=1)
    parser.add_argument("--entry", default=DEFAULT_ENTRY, help="MODULE:FUNC a spare runs with the stub's argv")
    parser.add_argument("--prepare", default="", help="MODULE:FUNC(local_rank) a spare prepares its device with, "
                        "or none (default: the GPU's CUDA context, as the worker's config says)")
    parser.add_argument("--prepare-after", type=float, default=PREPARE_AFTER_S,
                        help="seconds after its fork that a spare prepares its device")
    parser.add_argument("worker_argv", nargs=argparse.REMAINDER, help="-- and the first worker's flags (warm-up)")
    args = parser.parse_args(argv)
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        lock.bind(stub.address(args.key, "lock"))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return 0  # another stub started this node's pool first
        raise
    started = time.monotonic()
    try:
        with exit_when_agent_exits(args.agent_pid, args.agent_start):
            config = warm(args.worker_argv[1:] if args.worker_argv[:1] == ["--"] else args.worker_argv)
    except CudaInitialized as exc:
        log(f"{exc}: no spares (workers start cold)")
        return 0
    prepare = preparation(config, args.prepare)
    if threading.active_count() > 1:  # forked spares would hold none of these threads
        log(f"threads left after warming up: {[t.name for t in threading.enumerate()]}")
    listeners = {}
    for local_rank in range(max(1, args.size)):
        listeners[local_rank] = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listeners[local_rank].bind(stub.address(args.key, stub.rank_suffix(local_rank)))
        listeners[local_rank].listen(8)
    log(f"ready in {time.monotonic() - started:.2f} s: a spare for each of {len(listeners)} local rank(s) "
        f"of agent {args.agent_pid}{', each preparing its device' if prepare else ''}")
    served = Pool(listeners, lock, args.agent_pid, args.agent_start).serve()
    if served is None:
        log("pool stopped")
        return 0
    local_rank, control = served
    return wait_for_work(control, args.entry, local_rank, prepare, args.prepare_after)


if __name__ == "__main__":
    sys.exit(main())
