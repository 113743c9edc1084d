"""Begun saves the log never closes: a rank's ``ckpt_begin`` with no ``ckpt_committed`` (rank 0
logs the commit, of either tier), no ``ckpt_abandoned`` of its own and no later begin of that step,
while that rank's process went on past an in-process restart (it lived to say what became of it).

    python benchmarks/open_saves.py benchmarks/results/*/*.tar.gz
"""

from __future__ import annotations

import sys
from pathlib import Path

from committed_runs import run_dirs

from resilient_training.run import events as ev


def open_saves(run_dir: Path) -> list[tuple[int, str, int]]:
    """(rank, tier, step) of each begun save dropped unsaid."""
    events = ev.read_events(run_dir)
    begun: dict[tuple[int, str, int | None], int] = {}
    for i, e in enumerate(events):
        key = (e.rank, e.get("tier", "persistent"), e.step)
        if e.event == "ckpt_begin" and e.rank >= 0:
            begun[key] = i
        elif e.event == "ckpt_abandoned":
            begun.pop(key, None)
        elif e.event == "ckpt_committed":
            for done in [k for k in begun if k[1:] == key[1:]]:
                del begun[done]
    return [key for key, i in begun.items()
            if any(x.rank == events[i].rank and x.attempt == events[i].attempt and x.iteration > events[i].iteration
                   for x in events[i + 1:])]


def main(paths: list[str]) -> None:
    runs = found = 0
    for label, run in run_dirs(paths):
        runs += 1
        if dropped := open_saves(run):
            found += len(dropped)
            tiers = {t: sum(1 for _, tier, _ in dropped if tier == t) for t in ("persistent", "local")}
            print(f"{label}: {len(dropped)} ({tiers['persistent']} persistent, {tiers['local']} node-local)")
    print(f"{found} begun saves dropped unsaid, in {runs} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
