"""How far a replay after a restore drifts from the losses logged before the fault, step by step.

For every restore (``load_done`` of a rank that had trained) in the committed runs: the steps
after it, as long as each was logged before by that rank, compared with that earlier loss. The
convergence gate's replay tolerance (``convergence.REPLAY_RTOL_FACTOR`` x ``continuity_rtol``
over ``REPLAY_STEPS``) comes from this table.

    python benchmarks/replay_drift.py benchmarks/results/*/*.tar.gz
"""

from __future__ import annotations

import collections
import math
import sys

from committed_runs import run_dirs

from resilient_training.gates import metrics
from resilient_training.run import events as ev

DEPTH = 12


def drift(run) -> dict[int, list[float]]:
    """k (0: the first step after the restore) -> relative deviations of the k-th replayed step."""
    events = ev.read_events(run)
    steps = collections.defaultdict(list)
    for e in events:
        if e.event == "step":
            steps[e.rank].append(e)
    loads = metrics.restores(events)
    out: dict[int, list[float]] = collections.defaultdict(list)
    for load in loads:
        before = {e.step: e.get("loss") for e in steps[load.rank] if e.ts < load.ts}
        following = min((x.ts for x in loads if x.rank == load.rank and x.ts > load.ts), default=math.inf)
        for k, e in enumerate(e for e in steps[load.rank] if load.ts < e.ts < following):
            expected, loss = before.get(e.step), e.get("loss")
            if k >= DEPTH or expected is None or not (math.isfinite(expected) and math.isfinite(loss)):
                break
            out[k].append(abs(loss - expected) / abs(expected) if expected else abs(loss - expected))
    return out


def main(paths: list[str]) -> None:
    table: dict[int, list[float]] = collections.defaultdict(list)
    runs = 0
    for _, run in run_dirs(paths):
        runs += 1
        for k, values in drift(run).items():
            table[k].extend(values)
    print(f"{runs} runs, {len(table[0])} restores with a replayed step\n")
    print("| step after the restore | restores | max relative deviation | > 1e-3 | > 1e-2 |")
    print("|---|---|---|---|---|")
    for k in sorted(table):
        values = table[k]
        print(f"| {k + 1} | {len(values)} | {max(values):.3g} | {sum(v > 1e-3 for v in values)} "
              f"| {sum(v > 1e-2 for v in values)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
