"""Run rendered PyTorchJobs' worker pods on one GPU host (one GPU per "pod"), as the operator would.

    python3 benchmarks/cluster/run_pods.py JOB.json [JOB.json ...] --out DIR

Each job (JSON from ``resilient-training render-job``) runs with tests.support.pods:
the container command as rendered, the operator's PET_* env, CUDA_VISIBLE_DEVICES=<pod index>.
Prints one summary line per job (exit codes, last committed step, world size, restarts, wall time)
and writes it to DIR/summary.jsonl; the pods' logs go to DIR/<job>/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# The pod simulator is a test double (tests/support), not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from resilient_training.run import events  # noqa: E402
from tests.support import pods  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for index, path in enumerate(args.jobs):
        job = json.loads(path.read_text())
        (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        run_dir = Path(container["args"][container["args"].index("--run-dir") + 1])
        start = time.time()
        results = pods.run_pods(job, log_dir=args.out / job["metadata"]["name"], rdzv_port=29500 + index,
                                timeout_s=args.timeout, pod_env=lambda i: {"CUDA_VISIBLE_DEVICES": str(i)})
        wall = time.time() - start
        evs = events.read_events(run_dir)
        latest = run_dir / "checkpoints" / "latest"
        summary = {
            "job": job["metadata"]["name"], "exit_codes": [r.exit_code for r in results],
            "latest": latest.read_text().strip() if latest.exists() else None,
            "world_sizes": sorted({e.fields.get("world_size") for e in events.select(evs, "start")}),
            "faults": [e.fields.get("fault") for e in events.select(evs, "fault_injected")],
            "restarts": [(e.fields.get("layer"), e.fields.get("cause")) for e in events.select(evs, "restart_begin")],
            "last_step": max((e.step for e in events.select(evs, "step")), default=None),
            "wall_s": round(wall, 1),
        }
        print(json.dumps(summary), flush=True)
        with open(args.out / "summary.jsonl", "a") as f:
            f.write(json.dumps(summary) + "\n")
        for r in results:
            if r.exit_code:
                print(f"--- tail of {r.name}\n" + "\n".join(r.log.read_text().splitlines()[-30:]))


if __name__ == "__main__":
    main()
