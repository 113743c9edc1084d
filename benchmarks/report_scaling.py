"""How long the report's maths take as a run's faults grow: a scripted event log of N in-process
restarts (2 ranks, 20 steps between faults, a save every 10), timed through ``compute_metrics``.

    python benchmarks/report_scaling.py --faults 500 1000 4000

A second stranger trial found 77 s for 4,000 faults (each episode scanned the whole log).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resilient_training.gates.metrics import compute_metrics  # noqa: E402
from resilient_training.run import events as ev  # noqa: E402
from tests.support.gates import ScriptedLog  # noqa: E402


def scripted(run: Path, faults: int) -> None:
    log = ScriptedLog(run)
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    step = 0
    for _ in range(faults):
        log.steps(step + 1, step + 20, checkpoint_every=10)
        step += 20
        log.emit("fault_injected", step + 1, rank=1, fault=f"exception@{step + 1}:1")
        log.emit("failure_detected", step + 1, rank=1, cause="exception", message="InjectedFault")
        log.emit("failure_detected", step + 1, rank=0, cause="peer_failure", message="rank 1 failed")
        log.emit("restart_begin", step + 1, layer="inprocess", cause="exception")
        log.iteration += 1
        log.wait(0.5)
        log.emit("restart_done", layer="inprocess")
        log.emit("load_done", step, path=f"checkpoints/step_{step}", seconds=0.1)
    log.steps(step + 1, step + 5)
    log.end()
    log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, nargs="+", default=[500, 1000, 4000])
    args = parser.parse_args()
    print("| faults | events | compute_metrics, s |")
    print("|---|---|---|")
    for count in args.faults:
        with tempfile.TemporaryDirectory() as tmp:
            scripted(Path(tmp), count)
            events = ev.read_events(tmp)
            started = time.perf_counter()
            m = compute_metrics(tmp, events)
            seconds = time.perf_counter() - started
            assert len(m["faults"]) == count, len(m["faults"])
            print(f"| {count} | {len(events)} | {seconds:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
