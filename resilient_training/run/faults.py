"""Deterministic fault injection: a schedule of (type, step, rank) and the code that acts it out.

Spec: ``TYPE@STEP:RANK[xCOUNT]`` comma-separated, e.g. ``sigkill@12:1,exception@20:0``, or
the path of a YAML file. Node faults (``node-loss@STEP:NODE``) name a simulated node (a pod
of the simulated cluster, ``simulated_cluster``) instead of a rank::

    seed: 7                 # optional: random faults below are drawn from it
    faults:
      - {type: hang, step: 28, rank: 1}
      - {type: exception, step: 30, rank: 0, count: 99}   # fires on every attempt, up to 99
    random: {count: 3, types: [exception, sigkill], min_step: 5, max_step: 35}

A fault fires once by default: before acting, it is logged as ``fault_injected`` in the event
log, and every (re)started worker skips faults the log already shows as injected. ``COUNT``
makes a deterministic failure that recurs on each attempt (to exhaust retry limits).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import re
import resource
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FAULT_TYPES = ("exception", "sigkill", "hang", "oom", "nan", "ckpt-kill", "writer-kill", "ckpt-hang", "load-hang",
               "node-loss")
# Faults that act while a checkpoint is being written, at a checkpoint step.
CHECKPOINT_FAULTS = ("ckpt-kill", "writer-kill", "ckpt-hang")
# A fault that acts in the first restore from a checkpoint after its step was trained (so another
# fault must cause a restore).
LOAD_FAULTS = ("load-hang",)
# Faults whose target is a node (pod index), not a rank; they need the simulated cluster.
NODE_FAULTS = ("node-loss",)
# How long the worker that announced a node loss waits for the simulated cluster to kill its
# node before it gives up and fails on its own (the simulator polls every 0.1 s).
NODE_LOSS_WAIT_SECONDS = 60.0
# The simulated node (pod index) of this process; set by the simulated cluster on each agent.
NODE_ENV = "RT_NODE"
# ASCII digits only: `\d` also takes '١٢' (Arabic-Indic), which int() reads as 12 (a stranger trial).
_SPEC = re.compile(r"(?P<type>[a-z-]+)@(?P<step>[0-9]+):(?P<rank>[0-9]+)(?:x(?P<count>[0-9]+))?")
# A schedule this long is a mistake (a YAML `random.count`): drawing and checking it would take minutes.
MAX_FAULTS = 10_000
# xCOUNT: enough to exhaust any retry limit; more is a typo.
MAX_COUNT = 1_000_000


class FaultSpecError(ValueError):
    """The fault schedule cannot be parsed or does not fit the run."""


class InjectedFault(RuntimeError):
    """Raised by the ``exception`` fault."""


class NodeLossNotActed(RuntimeError):
    """A node loss was announced but nothing killed the node in time (no simulated cluster)."""


class InjectedOOM(MemoryError):
    """Raised when the ``oom`` fault's real allocation fails (re-raised with a clear name)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    type: str
    step: int
    rank: int
    count: int = 1

    @property
    def key(self) -> str:
        return f"{self.type}@{self.step}:{self.rank}"

    @property
    def node_fault(self) -> bool:
        """True when ``rank`` names a node (pod index) rather than a rank."""
        return self.type in NODE_FAULTS

    def __str__(self) -> str:
        return self.key + (f"x{self.count}" if self.count != 1 else "")


def parse(spec: str) -> list[Fault]:
    """Parse a compact spec or a YAML file path into a sorted schedule."""
    spec = spec.strip()
    if not spec:
        return []
    if spec.endswith((".yaml", ".yml")) or os.path.isfile(spec):
        return _parse_yaml(Path(spec))
    faults = []
    for item in spec.split(","):
        item = item.strip()
        match = _SPEC.fullmatch(item)
        if not match:
            raise FaultSpecError(
                f"bad fault {item!r}: expected TYPE@STEP:RANK[xCOUNT] with TYPE one of {', '.join(FAULT_TYPES)}"
            )
        faults.append(_make(match["type"], int(match["step"]), int(match["rank"]), int(match["count"] or 1)))
    return _sorted_unique(faults)


def step_of(spec: str) -> int | None:
    """The STEP of one ``TYPE@STEP:RANK[xCOUNT]`` (as a ``fault_injected`` event names it), else None.
    Never a file: an event log is input, and a spec there naming one must not make a report read it.
    """
    match = _SPEC.fullmatch(spec)
    return int(match["step"]) if match else None


def _make(kind: str, step: int, rank: int, count: int) -> Fault:
    if kind not in FAULT_TYPES:
        raise FaultSpecError(f"unknown fault type {kind!r}; known: {', '.join(FAULT_TYPES)}")
    if step < 1:
        raise FaultSpecError(f"fault {kind}@{step}:{rank}: steps start at 1")
    if rank < 0:  # a YAML schedule's; it would never fire, and the run would pass without its fault
        raise FaultSpecError(f"fault {kind}@{step}:{rank}: ranks start at 0")
    if not 1 <= count <= MAX_COUNT:  # 20 digits were passed on to the job (a stranger trial)
        raise FaultSpecError(f"fault {kind}@{step}:{rank}: count must be between 1 and {MAX_COUNT}, got {count}")
    return Fault(kind, step, rank, count)


def _sorted_unique(faults: Iterable[Fault]) -> list[Fault]:
    faults = sorted(faults, key=lambda f: (f.step, f.rank, f.type))
    dupes = sorted(k for k, n in collections.Counter(f.key for f in faults).items() if n > 1)
    if dupes:
        raise FaultSpecError(f"fault listed twice: {', '.join(dupes)}")
    return faults


def _int_field(value: Any, where: str) -> int:
    """A YAML integer (not a bool, float or string): a wrongly typed field is a clear error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FaultSpecError(f"{where} must be an integer, got {value!r}")
    return value


def _parse_yaml(path: Path) -> list[Fault]:
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        """A key given twice is an error: PyYAML keeps the last (a stranger trial's `faults:` list was
        silently replaced by a later `faults: []`).
        """

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"key {', '.join(repeated)} given twice",
                                                    node.start_mark)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                               lambda loader, node: mapping(loader, node, deep=True))
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeys)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise FaultSpecError(f"fault schedule file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FaultSpecError(f"cannot read fault schedule {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        raise FaultSpecError(f"fault schedule {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise FaultSpecError(f"fault schedule {path} must be a mapping with a 'faults' list")
    unknown = sorted(str(k) for k in set(data) - {"seed", "faults", "random"})
    if unknown:
        raise FaultSpecError(f"{path}: unknown keys {', '.join(unknown)} (known: seed, faults, random)")
    seed = _int_field(data.get("seed", 0), f"{path}: seed")  # checked even when nothing random uses it
    items = data.get("faults") or []
    if not isinstance(items, list):
        raise FaultSpecError(f"{path}: faults must be a list of {{type, step, rank[, count]}}, got {items!r}")
    if len(items) > MAX_FAULTS:
        raise FaultSpecError(f"{path}: {len(items)} faults; at most {MAX_FAULTS} in a schedule")
    faults = []
    for i, item in enumerate(items):
        where = f"{path}: faults[{i}]"
        if not isinstance(item, dict) or not {"type", "step", "rank"} <= set(item) or set(item) - {
                "type", "step", "rank", "count"}:
            raise FaultSpecError(f"{where} needs type, step and rank (and optionally count), got {item!r}")
        if not isinstance(item["type"], str):
            raise FaultSpecError(f"{where}.type must be a string, got {item['type']!r}")
        faults.append(_make(item["type"], _int_field(item["step"], f"{where}.step"),
                            _int_field(item["rank"], f"{where}.rank"),
                            _int_field(item.get("count", 1), f"{where}.count")))
    rand = data.get("random")
    if rand is not None:
        faults += _random_faults(rand, seed, faults, path)
    return _sorted_unique(faults)


def _random_faults(rand: Any, seed: int, faults: list[Fault], path: Path) -> list[Fault]:
    where = f"{path}: random"
    known = {"count", "types", "min_step", "max_step", "max_rank"}
    if not isinstance(rand, dict) or "max_step" not in rand or set(rand) - known:
        optional = ", ".join(sorted(known - {"max_step"}))
        raise FaultSpecError(f"{where} must be a mapping with max_step and optionally {optional}, got {rand!r}")
    types = rand.get("types", ["exception", "sigkill"])
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise FaultSpecError(f"{where}.types must be a non-empty list of fault types, got {types!r}")
    for kind in types:
        _make(kind, 1, 0, 1)  # an unknown type fails here, with the known ones
    count = _int_field(rand.get("count", 1), f"{where}.count")
    lo = _int_field(rand.get("min_step", 1), f"{where}.min_step")
    hi = _int_field(rand["max_step"], f"{where}.max_step")
    max_rank = _int_field(rand.get("max_rank", 0), f"{where}.max_rank")
    if count > MAX_FAULTS - len(faults):
        raise FaultSpecError(f"{where}.count {count}: at most {MAX_FAULTS} faults in a schedule")
    if not 1 <= lo <= hi or max_rank < 0 or count < 0:
        raise FaultSpecError(f"{where}: need 1 <= min_step <= max_step, max_rank >= 0 and count >= 0 "
                             f"(got min_step {lo}, max_step {hi}, max_rank {max_rank}, count {count})")
    slots = (hi - lo + 1) * (max_rank + 1) - len(faults)
    if count > slots:
        raise FaultSpecError(f"{where}: {count} random faults do not fit {slots} free (step, rank) slots")
    rng = random.Random(seed)
    taken = {(f.step, f.rank) for f in faults}
    out = []
    for _ in range(count):
        for _attempt in range(100):
            step = rng.randint(lo, hi)
            rank = rng.randint(0, max_rank)
            if (step, rank) not in taken:
                break
        taken.add((step, rank))
        out.append(_make(rng.choice(types), step, rank, 1))
    return out


def validate(faults: list[Fault], *, world_size: int, steps: int, async_checkpoint: bool,
             checkpoint_every: int, nodes: int = 0, local_checkpoint_every: int = 0) -> None:
    """Reject schedules that cannot act as written, before anything starts.

    A checkpoint fault needs a save at its step: persistent (``checkpoint_every``), node-local
    (``local_checkpoint_every``, 0 = none) or the final step's.

    ``nodes`` is the simulated cluster's node count; 0 means no simulated cluster (the
    single-agent launcher), where node faults cannot act.
    """
    for fault in faults:
        if fault.node_fault:
            if nodes < 1:
                raise FaultSpecError(f"fault {fault}: node faults need the simulated cluster (--nodes N)")
            if fault.rank >= nodes:
                raise FaultSpecError(f"fault {fault}: node {fault.rank} does not exist ({nodes} nodes)")
            if fault.count != 1:
                raise FaultSpecError(f"fault {fault}: a node can be lost only once per fault entry")
        elif fault.rank >= world_size:
            raise FaultSpecError(f"fault {fault}: rank {fault.rank} does not exist (world size {world_size})")
        if fault.step > steps:
            raise FaultSpecError(f"fault {fault}: step {fault.step} is after the last step ({steps})")
        saves = fault.step % checkpoint_every == 0 or fault.step == steps or (
            local_checkpoint_every > 0 and fault.step % local_checkpoint_every == 0)
        if fault.type in CHECKPOINT_FAULTS and not saves:
            local = f", node-local every {local_checkpoint_every}" if local_checkpoint_every else ""
            raise FaultSpecError(
                f"fault {fault}: {fault.type} acts during a checkpoint write, but step {fault.step} "
                f"saves no checkpoint (every {checkpoint_every}{local})"
            )
        if fault.type in LOAD_FAULTS and fault.step == 0:
            raise FaultSpecError(f"fault {fault}: {fault.type} acts in a restore after step {fault.step}; use a step >= 1")
        if fault.type == "writer-kill" and not async_checkpoint:
            raise FaultSpecError(f"fault {fault}: writer-kill needs async checkpointing (the writer process)")


class Injector:
    """Decides which faults are due for this rank and acts them out, logging first."""

    def __init__(self, faults: list[Fault], *, rank: int, already_injected: dict[str, int],
                 emit: Any, memory_limit_mb: int = 0, node: int | None = None, local_rank: int = 0) -> None:
        # A node fault is announced by local rank 0 of that node: one announcement per node.
        self._mine = [f for f in faults if (f.rank == node and local_rank == 0 if f.node_fault else f.rank == rank)]
        self._fired = dict(already_injected)  # key -> times injected so far (from the event log)
        self._emit = emit
        self._memory_limit_mb = memory_limit_mb
        self.hanging = False

    def due(self, step: int, types: tuple[str, ...]) -> Fault | None:
        for fault in self._mine:
            if fault.step == step and fault.type in types and self._fired.get(fault.key, 0) < fault.count:
                return fault
        return None

    def due_checkpoint(self, step: int) -> Fault | None:
        """A checkpoint fault whose step has come (saves can be deferred past it)."""
        for fault in self._mine:
            if (fault.type in CHECKPOINT_FAULTS and fault.step <= step
                    and self._fired.get(fault.key, 0) < fault.count):
                return fault
        return None

    def mark(self, fault: Fault, step: int) -> None:
        """Log the injection (before it acts) and remember it."""
        self._fired[fault.key] = self._fired.get(fault.key, 0) + 1
        self._emit("fault_injected", step, fault=fault.key, type=fault.type)

    def hang_in_restore(self, reached: int, step: int) -> None:
        """Act out a ``load-hang`` due by now: this rank has trained up to ``reached`` and is
        restoring the checkpoint of ``step``.
        """
        for fault in self._mine:
            if fault.type in LOAD_FAULTS and fault.step <= reached and self._fired.get(fault.key, 0) < fault.count:
                self.mark(fault, step)
                self.hang()

    def hang(self) -> None:
        self.hanging = True
        hang_forever()

    def maybe_inject_in_step(self, step: int) -> bool:
        """Act out a step fault due now. Returns True when the loss must be poisoned (``nan``)."""
        fault = self.due(step, ("exception", "sigkill", "hang", "oom", "nan", "node-loss"))
        if fault is None:
            return False
        self.mark(fault, step)
        if fault.type == "node-loss":
            # The simulated cluster reads the event just logged and kills this whole node
            # (agent, workers, monitors, writers); waiting here keeps the loss at this step.
            self.hanging = True
            wait_for_node_kill(fault, NODE_LOSS_WAIT_SECONDS)
        if fault.type == "exception":
            raise InjectedFault(f"injected exception at step {step}")
        if fault.type == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.type == "hang":
            self.hang()
        if fault.type == "oom":
            allocate_past_limit(self._memory_limit_mb)
        return fault.type == "nan"


def hang_forever() -> None:
    """Stop making progress (no steps, pings or heartbeats) until something interrupts us.

    A Python-level sleep loop, so the in-process layer's asynchronous exception can land; a
    launcher-level monitor has to kill the process.
    """
    while True:
        time.sleep(0.05)


def this_node() -> int | None:
    """The simulated node (pod index) this process belongs to, or None outside the simulation."""
    value = os.environ.get(NODE_ENV, "")
    return int(value) if value.isdigit() else None


def wait_for_node_kill(fault: Fault, seconds: float) -> None:
    """Sleep until the simulated cluster kills this node; fail if it never does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise NodeLossNotActed(f"{fault}: nothing killed node {fault.rank} within {seconds:.0f} s")


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmSize not found in /proc/self/status")


def allocate_past_limit(limit_mb: int) -> None:
    """A real allocation failure, contained to this process.

    On CPU, cap this process's own address space (RLIMIT_AS, soft limit only) just above what
    it uses, so the failing allocation endangers nothing else on the machine; then ask for more
    than the cap. The soft limit is restored before the error propagates, so an in-process
    restart continues with normal limits. On GPU the allocation is a real CUDA OOM.
    """
    import torch

    if torch.cuda.is_available():
        # More than the whole device: free memory alone is not enough (seen on an H200: PyTorch's
        # cache held more than the driver reported free, and `free + 1 GiB` succeeded).
        _free, total = torch.cuda.mem_get_info()
        torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")
        raise InjectedOOM("expected CUDA OOM did not happen")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    headroom = (limit_mb or 256) << 20
    cap = _vm_size_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        torch.empty(cap, dtype=torch.uint8).fill_(1)
    except RuntimeError as exc:
        raise InjectedOOM(f"out of memory (address space capped at {cap >> 20} MiB): {exc}") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    raise InjectedOOM("expected allocation failure did not happen")


def reached_step(events: Iterable[Any], rank: int) -> int:
    """The highest step ``rank`` has trained so far (0 before any)."""
    return max((e.step for e in events if e.event == "step" and e.rank == rank and e.step), default=0)


def injected_counts(events: Iterable[Any], rank: int) -> dict[str, int]:
    """Times each fault of ``rank`` was injected, plus every node fault (whoever announced it:
    a replacement node's ranks can differ from the lost node's).
    """
    counts: dict[str, int] = {}
    for event in events:
        if event.event == "fault_injected" and (event.rank == rank or event.get("type") in NODE_FAULTS):
            counts[event["fault"]] = counts.get(event["fault"], 0) + 1
    return counts
