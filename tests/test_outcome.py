"""The one line a failed local run ends with names the root cause, not a peer that noticed it."""

from __future__ import annotations

from pathlib import Path

from resilient_training.launch.local import outcome
from resilient_training.run import events as ev


def _write(run_dir: Path, records: list[ev.Event]) -> None:
    directory = ev.events_dir(run_dir)
    directory.mkdir(parents=True)
    for rank in {r.rank for r in records}:
        lines = [r.to_json() + "\n" for r in records if r.rank == rank]
        (directory / f"rank{rank}.jsonl").write_text("".join(lines))


def _event(ts: float, rank: int, iteration: int, event: str, step: int, **fields) -> ev.Event:
    return ev.Event(ts=ts, rank=rank, attempt=0, iteration=iteration, event=event, step=step, fields=fields)


def test_the_first_failure_of_the_last_restart_round_is_the_root_cause(tmp_path):
    # Seen in CI: rank 0 raised; rank 1, held in a collective, failed 0.3 s later when its
    # progress allowance ran out ("hang"), and the summary named rank 1.
    records = [
        _event(100.0, 1, 0, "failure_detected", 5, cause="oom", message="earlier round"),
        _event(200.0, 0, 2, "failure_detected", 6, cause="exception", message="InjectedFault: boom"),
        _event(200.3, 1, 2, "failure_detected", 6, cause="hang", message="RuntimeError: Timed out send"),
        _event(200.4, 1, 2, "failure_detected", 6, cause="peer_failure", message="Connection closed"),
        _event(201.0, 0, 2, "end", 6, status="failed", reason="in-process restart gave up after 2 restarts"),
    ]
    _write(tmp_path, records)
    line = outcome(tmp_path, 16, 1, since=0.0, log=tmp_path / "log")
    assert line == ("in-process restart gave up after 2 restarts; "
                    "last failure on rank 0 at step 6: exception (InjectedFault: boom)")


def test_a_later_round_wins_over_an_earlier_first_failure(tmp_path):
    records = [
        _event(100.0, 0, 0, "failure_detected", 5, cause="exception", message="first round"),
        _event(200.0, 1, 1, "failure_detected", 7, cause="nan", message="NonFiniteLoss: loss nan"),
        _event(201.0, 1, 1, "end", 7, status="failed", reason="in-process restart gave up after 1 restarts"),
    ]
    _write(tmp_path, records)
    assert "last failure on rank 1 at step 7: nan" in outcome(tmp_path, 16, 1, since=0.0, log=tmp_path / "log")


def test_a_restart_with_no_checkpoint_to_restore_is_shown_as_starting_again(tmp_path):
    """Found by a stranger trial: a SIGKILL before the first commit restarted the workers from step 1
    and the console said nothing of it (only a restore of a committed step had a line).
    """
    from resilient_training.launch.local import ProgressPrinter

    def load(ts: float, rank: int, attempt: int, iteration: int, step: int, source: str = "storage") -> ev.Event:
        return ev.Event(ts=ts, rank=rank, attempt=attempt, iteration=iteration, event="load_done", step=step,
                        fields={"source": source})

    _write(tmp_path, [
        load(1.0, 0, 0, 0, 0),  # the first start: nothing lost, nothing to say
        load(2.0, 0, 1, 0, 0),  # a launcher restart before the first commit
        load(3.0, 1, 1, 0, 0),  # (rank 0 speaks for the run)
        load(4.0, 0, 1, 1, 0),  # an in-process restart, still before the first commit
        load(5.0, 0, 0, 0, 0),  # a replaced pod counts its attempts from 0 again
        load(6.0, 0, 2, 0, 4),
        load(7.0, 0, 2, 1, 6, "memory (staged, not yet committed)"),  # never read from disk: say so
        load(8.0, 0, 2, 2, 8, "storage (resharded)"),
    ])
    lines: list[str] = []
    printer = ProgressPrinter(tmp_path, 10, since=0.0, emit=lines.append)
    printer.start()
    printer.stop()
    again = "  ⤓ no checkpoint yet: starting again from step 1"
    assert lines == [again, again, again, "  ⤓ restored step 4",
                     "  ⤓ restored step 6 from memory (staged, not yet committed)",
                     "  ⤓ restored step 8 from storage (resharded)"]
