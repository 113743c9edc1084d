"""Reading the event log is strict: a line that is not an event is named (file, line, what is wrong),
never taken for one; only a torn final line (a writer killed mid-write) is skipped.
"""

import json
import math
import re
from pathlib import Path

import pytest

from resilient_training.cli.main import main
from resilient_training.run import faults as flt
from resilient_training.run import layout
from resilient_training.run.events import EventLog, EventLogError, read_events
from tests.support.gates import ScriptedLog

GOOD = {"ts": 1.5, "rank": 0, "attempt": 0, "iteration": 0, "event": "step", "step": 3, "loss": 2.5, "seconds": 0.1}


def log_with(run: Path, line: str) -> Path:
    """rank0.jsonl holding a good line, then ``line``, then a good line; its path."""
    path = layout.events_dir(run) / "rank0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps({**GOOD, "ts": 2.0, "step": 4}) + "\n")
    return path


def edited(**changes: object) -> str:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not DROP})


DROP = object()

BAD_LINES = [
    ("loss-string", edited(loss="0.01"), "a step event's loss must be a JSON number, got '0.01'"),
    ("loss-true", edited(loss=True), "a step event's loss must be a JSON number, got True"),
    ("loss-newline", edited(loss="0.5\n"), r"got '0.5\n'"),
    ("loss-list", edited(loss=[1.0]), "a step event's loss must be a JSON number, got [1.0]"),
    ("loss-abc", edited(loss="abc"), "got 'abc'"),
    ("loss-null", edited(loss=None), "a step event's loss must be a JSON number, got None"),
    ("loss-missing", edited(loss=DROP), "a step event's loss must be a JSON number"),
    ("loss-huge-int", edited(loss=10**400), "a step event's loss must be a JSON number"),
    ("seconds-string", edited(seconds="0.1"), "a step event's seconds must be a finite number"),
    # a second stranger trial: goodput 838 %, a math domain error, a NaN interval, OverflowErrors
    ("seconds-nan", edited(seconds=math.nan), "a step event's seconds must be a finite number, got nan"),
    ("seconds-inf", edited(seconds=math.inf), "a step event's seconds must be a finite number, got inf"),
    ("step-huge-int", edited(step=10**400), "step must be an integer or null"),
    ("rank-huge-int", edited(rank=-(10**30)), "rank must be an integer"),
    ("staged-seconds-nan", edited(event="ckpt_staged", seconds=math.nan), "seconds must be a finite number or null"),
    ("commit-bytes-negative", edited(event="ckpt_committed", bytes=-5), "bytes must be a finite number >= 0 or null"),
    ("start-process-seconds-bool", edited(event="start", process_seconds=True),
     "process_seconds must be a JSON number or null, got True"),
    ("start-process-seconds-huge", edited(event="start", process_seconds=10**400),
     "process_seconds must be a JSON number or null"),
    ("load-phases-list", edited(event="load_done", phases=[1, 2]), "phases must be an object of finite numbers"),
    ("load-phases-string", edited(event="load_done", phases={"read": "abc"}), "phases must be an object of finite"),
    ("load-phases-huge", edited(event="load_done", phases={"read": 10**400}), "phases must be an object of finite"),
    ("ts-string", edited(ts="1.5"), "ts must be a finite number, got '1.5'"),
    ("ts-nan", edited(ts=math.nan), "ts must be a finite number, got nan"),
    ("ts-missing", edited(ts=DROP), "no ts"),
    ("rank-bool", edited(rank=True), "rank must be an integer, got True"),
    ("rank-string", edited(rank="0"), "rank must be an integer, got '0'"),
    # a second stranger trial: rank0.jsonl copied beside itself counted every event twice
    ("rank-not-the-files", edited(rank=1), "rank 1 in rank0.jsonl, which holds rank 0's events only"),
    ("ts-far-future", edited(ts=1e308), "ts 1e+308 lies more than a day in the future"),
    ("attempt-float", edited(attempt=1.0), "attempt must be an integer, got 1.0"),
    ("iteration-string", edited(iteration="0"), "iteration must be an integer, got '0'"),
    ("event-number", edited(event=5), "event must be a string, got 5"),
    ("event-unknown", edited(event="End"), "event 'End' is none of the event log's"),
    ("step-string", edited(step="3"), "step must be an integer or null, got '3'"),
    ("step-float", edited(step=3.0), "step must be an integer or null, got 3.0"),
    ("step-bool", edited(step=False), "step must be an integer or null, got False"),
    ("step-event-without-step", edited(step=None), "a step event must name its step"),
    # Fields the metrics compute with, in any event (a list there was a traceback in the report).
    ("commit-bytes-list", edited(event="ckpt_committed", bytes=[2004480]),
     "a ckpt_committed event's bytes must be a JSON number or null, got [2004480]"),
    ("commit-bytes-string", edited(event="ckpt_committed", bytes="x"), "bytes must be a JSON number or null, got 'x'"),
    ("commit-seconds-list", edited(event="ckpt_committed", seconds=[1]), "seconds must be a JSON number or null"),
    ("commit-tier-list", edited(event="ckpt_committed", tier=[1]), "a ckpt_committed event's tier must be a string"),
    ("fault-list", edited(event="fault_injected", fault=[1]), "fault must be a string or null, got [1]"),
    ("cause-list", edited(event="failure_detected", cause=[1]), "a failure_detected event's cause must be a string"),
    ("layer-list", edited(event="restart_done", layer=[1]), "a restart_done event's layer must be a string"),
    ("pid-float", edited(event="writer_ready", pid=1.5), "pid must be an integer or null, got 1.5"),
    ("not-json", "{this is not json", "not JSON"),
    ("list", "[1, 2]", "not a JSON object but list"),
    ("number", "12", "not a JSON object but int"),
]


@pytest.mark.parametrize(("line", "says"), [(line, says) for _, line, says in BAD_LINES],
                         ids=[name for name, _, _ in BAD_LINES])
def test_malformed_line_names_file_line_and_problem(tmp_path: Path, line: str, says: str) -> None:
    path = log_with(tmp_path, line)
    with pytest.raises(EventLogError) as exc:
        read_events(tmp_path)
    message = str(exc.value)
    assert message.startswith(f"{path}:2: not an event: ") and says in message and "\n" not in message
    assert isinstance(exc.value, ValueError)


def test_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = log_with(tmp_path, "")
    path.write_bytes(path.read_bytes().replace(b"\n\n", b"\n\xff\xfe\n"))
    with pytest.raises(EventLogError, match=rf"^{re.escape(str(path))}:2: not an event: 'utf-8' codec"):
        read_events(tmp_path)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf, 3, 0.25])
def test_json_numbers_are_losses(tmp_path: Path, loss: float) -> None:
    log_with(tmp_path, edited(ts=1.7, loss=loss))
    (event,) = [e for e in read_events(tmp_path) if e.ts == 1.7]
    assert isinstance(event["loss"], (int, float)) and (event["loss"] == loss or math.isnan(loss))


def test_other_events_need_no_loss_and_may_carry_a_null_step(tmp_path: Path) -> None:
    log_with(tmp_path, edited(event="end", step=None, loss=DROP, status="completed"))
    assert [e.event for e in read_events(tmp_path)] == ["step", "end", "step"]


def test_torn_final_line_is_skipped_silently(tmp_path: Path) -> None:
    path = log_with(tmp_path, edited(ts=1.7))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"ts": 3.0, "rank": 0, "attempt": 0, "iteration": 0, "event": "step", "step": 5, "lo')
    assert [e.step for e in read_events(tmp_path)] == [3, 3, 4]


def test_the_next_writer_cuts_a_torn_last_line_instead_of_gluing_its_first_onto_it(tmp_path: Path) -> None:
    """A second stranger trial: a killed rank's torn last line, then its restarted process's first
    event appended to the same line, and the whole log could no longer be read."""
    path = log_with(tmp_path, edited(ts=1.7))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"ts": 3.0, "rank": 0, "attempt": 0, "iteration": 0, "event": "step", "step": 5, "lo')
    log = EventLog(tmp_path, rank=0, attempt=1)
    log.emit("start", world_size=2)
    log.close()
    events = read_events(tmp_path)
    assert [(e.event, e.step) for e in events] == [("step", 3), ("step", 3), ("step", 4), ("start", None)]
    torn_only = EventLog(tmp_path / "b", rank=1)  # a file that is nothing but a torn line
    torn_only.close()
    (layout.events_dir(tmp_path / "b") / "rank1.jsonl").write_text('{"ts": 3.0, "ra')
    EventLog(tmp_path / "b", rank=1).close()
    assert (layout.events_dir(tmp_path / "b") / "rank1.jsonl").read_bytes() == b""


def test_what_the_writer_writes_reads_back(tmp_path: Path) -> None:
    with EventLog(tmp_path, rank=1, attempt=2) as log:
        log.emit("step", 7, loss=math.nan, seconds=0.2)
        log.emit("load_done", 0, path=None, source=None, seconds=0.1, phases={})
    step, load = read_events(tmp_path)
    assert (step.rank, step.attempt, step.step, math.isnan(step["loss"])) == (1, 2, 7, True)
    assert load.event == "load_done" and load["path"] is None


def test_the_trainers_own_reading_raises_the_same_error(tmp_path: Path) -> None:
    # The trainer counts the faults already injected from the log when each iteration starts.
    log_with(tmp_path, edited(loss="0.01"))
    with pytest.raises(EventLogError, match=r"rank0\.jsonl:2: not an event"):
        flt.injected_counts(read_events(tmp_path), 0)


def failing_run(run: Path) -> Path:
    """A run the gate fails (the loss never fell below 4); its rank 0 log."""
    log = ScriptedLog(run)
    log.steps(1, 30, loss=lambda s: 5.0 - 0.01 * s)
    log.end()
    log.close()
    return layout.events_dir(run) / "rank0.jsonl"


@pytest.mark.parametrize("loss", ['"0.01"', "true", '"0.5\\n"', "[0.01]", '"abc"'])
def test_gate_cli_exits_2_on_a_forged_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str], loss: str) -> None:
    path = failing_run(tmp_path)
    assert main(["check-convergence", str(tmp_path), "--max-final-loss", "1.0", "--no-record"]) == 1
    capsys.readouterr()
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, start=1) if json.loads(line)["event"] == "step")
    lines[number - 1] = json.dumps({**json.loads(lines[number - 1]), "loss": json.loads(loss)})
    path.write_text("\n".join(lines) + "\n")
    # Every step's loss forged in turn would pass the gate; one is enough to refuse the log.
    assert main(["check-convergence", str(tmp_path), "--max-final-loss", "1.0"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}:{number}: not an event: a step event's loss must be a JSON number, got " \
        f"{json.loads(loss)!r}\n"
    assert not layout.gates_dir(tmp_path).exists()


def test_forged_string_losses_no_longer_pass_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = failing_run(tmp_path)
    forged = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "step":
            record["loss"] = "0.01"
        forged.append(json.dumps(record))
    path.write_text("\n".join(forged) + "\n")
    assert main(["check-convergence", str(tmp_path), "--max-final-loss", "1.0", "--min-improvement", "0"]) == 2
    assert "a step event's loss must be a JSON number, got '0.01'" in capsys.readouterr().err


def test_a_directory_named_like_a_log_file_is_named_not_a_traceback(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    (layout.events_dir(run) / "rank9.jsonl").mkdir(parents=True)
    with pytest.raises(EventLogError, match=r"rank9\.jsonl: not a file"):
        read_events(run)
    assert main(["check-convergence", str(run), "--no-record"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank9.jsonl: not a file" in err[0], err


def test_a_copy_of_a_ranks_log_under_another_name_is_refused(tmp_path: Path) -> None:
    """A second stranger trial: rank0.jsonl copied to rank0-copy.jsonl counted every step, save and
    fault twice ("66 replayed"). A file of no writer's name is refused; a launcher's file holds the
    launchers' events only."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 2)
    log.close()
    events = layout.events_dir(tmp_path)
    (events / "rank0-copy.jsonl").write_bytes((events / "rank0.jsonl").read_bytes())
    with pytest.raises(EventLogError, match=re.escape("rank0-copy.jsonl: no writer's event log (put there by hand, "
                                                      "or a copy?): events/ holds rankN.jsonl")):
        read_events(tmp_path)
    (events / "rank0-copy.jsonl").rename(events / "cluster.jsonl")
    with pytest.raises(EventLogError, match=re.escape("cluster.jsonl:1: not an event: rank 0 in cluster.jsonl, "
                                                      "which holds the launchers' (rank -1) only")):
        read_events(tmp_path)


@pytest.mark.parametrize(("name", "owner"), [
    ("rank0.jsonl", 0), ("rank1.jsonl", 1), ("rank12.jsonl", 12), ("launcher.jsonl", -1), ("cluster.jsonl", -1),
    ("agent-node-a-4242.jsonl", -1), ("agent-a.jsonl", -1),
    ("rank00.jsonl", None), ("rank01.jsonl", None), ("rank+1.jsonl", None), ("rank-1.jsonl", None),
    ("rank\u0660.jsonl", None), ("rank\uff10.jsonl", None), ("rank1\u0663.jsonl", None), ("Rank0.jsonl", None),
    ("rank 0.jsonl", None), ("rank0 .jsonl", None), ("rank.jsonl", None), ("rank0.jsonl.jsonl", None),
    ("launcher2.jsonl", None), ("agent-.jsonl", None), ("zz.jsonl", None)])
def test_only_the_writers_exact_file_names_are_logs(name: str, owner: int | None) -> None:
    """A stranger trial: `rank(\\d+)` took rank00.jsonl (and Unicode digits: `\\d` matches them) for
    rank 0's own log."""
    from resilient_training.run.events import log_owner

    assert log_owner(name) == owner


@pytest.mark.parametrize("name", ["rank00.jsonl", "rank\u0660.jsonl", "rank+0.jsonl", "ranks.jsonl"])
def test_a_file_of_no_writers_name_is_refused_by_name(tmp_path: Path, name: str, capsys) -> None:
    """A stranger trial: a new events/rank00.jsonl holding a rank-0 ckpt_committed line (another
    checkpoint's manifest digest) was read as rank 0's log, and the gates took its commit as the run's."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 30, checkpoint_every=5)
    log.end()
    log.close()
    assert main(["check-convergence", str(tmp_path), "--no-record", "--max-final-loss", "10"]) == 0
    forged = {"ts": 1_700_000_100.0, "rank": 0, "attempt": 0, "iteration": 0, "event": "ckpt_committed", "step": 30,
              "bytes": 0, "seconds": 0.0, "path": "checkpoints/step_30", "tier": "persistent", "world_size": 2,
              "manifest_checksum": "0" * 32}
    (layout.events_dir(tmp_path) / name).write_text(json.dumps(forged) + "\n")
    with pytest.raises(EventLogError, match=re.escape(f"{name}: no writer's event log")):
        read_events(tmp_path)
    capsys.readouterr()
    assert main(["check-convergence", str(tmp_path), "--no-record", "--max-final-loss", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{name}: no writer's event log" in err, err


def test_a_writer_cannot_name_its_log_as_no_reader_reads_it(tmp_path: Path) -> None:
    for rank, writer in ((0, "rank00"), (-1, "rank0"), (-1, "notes"), (3, "launcher")):
        with pytest.raises(ValueError, match="cannot be named"):
            EventLog(tmp_path, rank=rank, writer=writer)
    assert not list(layout.events_dir(tmp_path).glob("*.jsonl"))
    for rank, writer in ((0, None), (7, None), (-1, None), (-1, "cluster"), (-1, "agent-host-12")):
        EventLog(tmp_path, rank=rank, writer=writer).close()
    assert sorted(p.name for p in layout.events_dir(tmp_path).iterdir()) == [
        "agent-host-12.jsonl", "cluster.jsonl", "launcher.jsonl", "rank0.jsonl", "rank7.jsonl"]


def test_a_fifo_named_like_a_log_is_refused_not_waited_on(tmp_path: Path) -> None:
    import os

    layout.events_dir(tmp_path).mkdir(parents=True)
    os.mkfifo(layout.events_dir(tmp_path) / "rank0.jsonl")
    with pytest.raises(EventLogError, match=r"rank0\.jsonl: not a file"):
        read_events(tmp_path)


def test_a_ts_a_decade_before_an_earlier_line_of_its_file_is_refused(tmp_path: Path) -> None:
    """A second stranger trial's one edited ts made the wall time 57 years (goodput 99.99999996 %)."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 3)
    log.close()
    path = layout.events_dir(tmp_path) / "rank1.jsonl"
    lines = path.read_text().splitlines()
    last = json.loads(lines[-1])
    lines[-1] = json.dumps({**last, "ts": 5.0})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(EventLogError, match=re.escape(f"rank1.jsonl:{len(lines)}: not an event: ts 5.0 goes back 54 years")):
        read_events(tmp_path)
    lines[-1] = json.dumps({**last, "ts": last["ts"] - 3 * 86400})  # a clock stepped back (or a test's clock): read
    path.write_text("\n".join(lines) + "\n")
    assert len(read_events(tmp_path)) == 2 * len(lines)


def test_a_log_appended_to_itself_or_a_launcher_file_copied_is_refused(tmp_path: Path, capsys) -> None:
    """A stranger trial: `cat rank0.jsonl >> rank0.jsonl` (or a launcher's file copied under another
    agent's name) counted each repeated event twice. No writer writes a line twice (each has its ts)."""
    log = ScriptedLog(tmp_path)
    log.start()
    log.steps(1, 3)
    log.close()
    events = layout.events_dir(tmp_path)
    agent = EventLog(tmp_path, rank=-1, writer="agent-a")
    agent.emit("restart_done", None, layer="launcher")
    agent.close()
    assert len(read_events(tmp_path)) == 2 * 4 + 1  # as written: read
    rank0 = events / "rank0.jsonl"
    lines = rank0.read_bytes().splitlines(keepends=True)
    rank0.write_bytes(b"".join(lines + lines[1:2]))
    with pytest.raises(EventLogError, match=re.escape(f"rank0.jsonl:{len(lines) + 1}: not an event: repeats "
                                                      "rank0.jsonl:2 exactly (a copied or concatenated log")):
        read_events(tmp_path)
    assert main(["report", str(tmp_path), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "repeats rank0.jsonl:2 exactly" in err[0], err
    rank0.write_bytes(b"".join(lines))
    (events / "agent-b.jsonl").write_bytes((events / "agent-a.jsonl").read_bytes())
    with pytest.raises(EventLogError, match=re.escape("agent-b.jsonl:1: not an event: repeats agent-a.jsonl:1 exactly")):
        read_events(tmp_path)
