"""Recompute the report's figures of every committed benchmark run with the metrics code on the path,
one line per run, so that two versions can be compared (``diff``) after a change to the goodput maths:

    python benchmarks/recompute_committed.py benchmarks/results/*/*.tar.gz > now.txt
    PYTHONPATH=OLD_TREE python benchmarks/recompute_committed.py benchmarks/results/*/*.tar.gz > before.txt
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from committed_runs import run_dirs  # noqa: E402


def _r(value: object, digits: int = 3) -> object:
    return round(value, digits) if isinstance(value, float) else value


def main(paths: list[str]) -> int:
    from resilient_training.gates.metrics import RunError, compute_metrics

    for label, run in run_dirs(paths):
        try:
            m = compute_metrics(run)
        except (RunError, ValueError) as exc:
            print(f"{label}\terror: {exc}")
            continue
        ck = m["checkpoints"]
        row = {
            "status": m["status"], "train": _r(m["training_goodput"]), "infra": _r(m["infrastructure_goodput"]),
            "lost_mean": _r(m["lost_seconds_per_fault"]["mean"]), "rollback_n": m["rollback_steps"]["count"],
            "attempts": m["attempts"], "failed_saves": ck["failed"], "interval": _r(ck["interval_steps"], 1),
            "faults": [[f["fault"], f["layer"], _r(f["recovery_seconds"], 2), _r(f["lost_seconds"], 2),
                        f["rollback_steps"]] for f in m["faults"]],
        }
        print(f"{label}\t{json.dumps(row, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
