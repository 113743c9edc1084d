import pytest

from resilient_training.run import faults as flt


def test_parse_compact_spec_sorted_by_step():
    schedule = flt.parse("hang@28:1, sigkill@12:1,exception@20:0x3")
    assert [str(f) for f in schedule] == ["sigkill@12:1", "exception@20:0x3", "hang@28:1"]
    assert schedule[1].count == 3


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sigkill@12", "expected TYPE@STEP:RANK"),
        ("explode@3:0", "unknown fault type 'explode'"),
        ("sigkill@0:0", "steps start at 1"),
        ("sigkill@-1:0", "expected TYPE@STEP:RANK"),
        ("sigkill@3:0,sigkill@3:0", "fault listed twice"),
        ("sigkill@3:0x0", "count must be between 1 and 1000000, got 0"),
        ("sigkill@12:1x99999999999999999999", "count must be between 1 and 1000000, got 99999999999999999999"),
        ("sigkill@\u0661\u0662:1", "expected TYPE@STEP:RANK"),  # Arabic-Indic digits: int() reads them as 12
        ("sigkill@12:\uff11", "expected TYPE@STEP:RANK"),  # a fullwidth 1
    ],
)
def test_malformed_specs_are_rejected_with_the_reason(spec, message):
    with pytest.raises(flt.FaultSpecError, match=message):
        flt.parse(spec)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("sigkill@3:2", {}, "rank 2 does not exist"),
        ("sigkill@50:0", {}, "after the last step"),
        ("ckpt-kill@7:0", {}, "saves no checkpoint"),
        ("ckpt-hang@7:0", {"local_checkpoint_every": 2}, r"saves no checkpoint \(every 5, node-local every 2\)"),
        ("writer-kill@10:0", {"async_checkpoint": False}, "needs async checkpointing"),
    ],
)
def test_schedules_that_cannot_act_are_rejected(spec, kwargs, message):
    args = {"world_size": 2, "steps": 40, "async_checkpoint": True, "checkpoint_every": 5, **kwargs}
    with pytest.raises(flt.FaultSpecError, match=message):
        flt.validate(flt.parse(spec), **args)


def test_a_checkpoint_fault_may_strike_a_node_local_save():
    """A node-local save is a save: rejecting ckpt-hang@175 with saves every 50 and node-local
    every 25 was a wrong "no" (found writing the GPU suite's schedule).
    """
    args = {"world_size": 2, "steps": 260, "async_checkpoint": True, "checkpoint_every": 50}
    flt.validate(flt.parse("ckpt-hang@175:1,ckpt-kill@200:0"), **args, local_checkpoint_every=25)
    with pytest.raises(flt.FaultSpecError, match="step 175 saves no checkpoint"):
        flt.validate(flt.parse("ckpt-hang@175:1"), **args)


def test_yaml_schedule_with_seeded_random_faults_is_deterministic(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_text(
        "seed: 7\n"
        "faults:\n  - {type: hang, step: 28, rank: 1}\n"
        "random: {count: 3, types: [exception, sigkill], min_step: 5, max_step: 35, max_rank: 1}\n"
    )
    first, second = flt.parse(str(path)), flt.parse(str(path))
    assert first == second
    assert len(first) == 4 and flt.Fault("hang", 28, 1) in first
    other = tmp_path / "other.yaml"
    other.write_text(path.read_text().replace("seed: 7", "seed: 8"))
    assert flt.parse(str(other)) != first


def test_yaml_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  - {type: hang, rank: 1}\n")
    with pytest.raises(flt.FaultSpecError, match="needs type, step and rank"):
        flt.parse(str(bad))
    with pytest.raises(flt.FaultSpecError, match="does not exist"):
        flt.parse(str(tmp_path / "missing.yaml"))
    # stranger trial: a seed that is no number was accepted when no random faults used it
    bad.write_text("seed: x\nfaults:\n  - {type: hang, step: 3, rank: 1}\n")
    with pytest.raises(flt.FaultSpecError, match="seed must be an integer, got 'x'"):
        flt.parse(str(bad))


@pytest.mark.parametrize(("text", "message"), [
    ("faults:\n  - {type: sigkill, step: 12, rank: -1}\n", "ranks start at 0"),  # never fired; the run passed
    ("faults:\n  - {type: sigkill, step: 12, rank: 1}\nfaults: []\n", "key faults given twice"),
    ("faults:\n  - {type: sigkill, step: 12, rank: 1, rank: 0}\n", "key rank given twice"),
    ("random: {count: 200000, max_step: 100000000}\n", "count 200000: at most 10000 faults"),  # minutes, then
    ("random: {count: 100000000, max_step: 1000000000}\n", "at most 10000 faults"),  # gigabytes
])
def test_yaml_schedules_that_would_silently_differ_or_never_end_are_refused(tmp_path, text, message):
    """Stranger trial: each was accepted (or ran for minutes) and the run passed without its faults."""
    import time

    path = tmp_path / "faults.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(flt.FaultSpecError, match=message):
        flt.parse(str(path))
    assert time.monotonic() - started < 5


def test_a_long_random_schedule_is_drawn_and_checked_quickly(tmp_path):
    import time

    path = tmp_path / "faults.yaml"
    path.write_text("random: {count: 10000, max_step: 1000000, max_rank: 3}\n")
    started = time.monotonic()
    assert len(flt.parse(str(path))) == 10000
    assert time.monotonic() - started < 5  # was quadratic: 200000 faults ran past a minute


def test_injector_fires_once_per_count_and_logs_before_acting():
    logged = []
    injector = flt.Injector(flt.parse("exception@3:0x2,nan@4:0,exception@3:1"), rank=0,
                            already_injected={"exception@3:0": 1}, emit=lambda *a, **k: logged.append((a, k)))
    assert injector.maybe_inject_in_step(2) is False
    with pytest.raises(flt.InjectedFault):
        injector.maybe_inject_in_step(3)
    assert logged[-1][1]["fault"] == "exception@3:0"
    assert injector.maybe_inject_in_step(3) is False  # count 2 reached (1 from the log + 1 now)
    assert injector.maybe_inject_in_step(4) is True  # nan poisons the loss, once
    assert injector.maybe_inject_in_step(4) is False


def test_oom_is_a_real_allocation_failure_and_restores_the_limit():
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(flt.InjectedOOM, match="out of memory"):
        flt.allocate_past_limit(64)
    assert resource.getrlimit(resource.RLIMIT_AS) == before


@pytest.mark.slow
def test_a_relative_yaml_schedule_is_recorded_absolute_so_the_report_reads_the_run_s_own(tmp_path, monkeypatch):
    # Stranger trial: config.json kept "sched.yaml" as given, and the report read whatever file of that
    # name was in its own directory: here one with a fault this run never had, claimed "never fired".
    import json
    import subprocess
    import sys

    from resilient_training.gates.metrics import compute_metrics
    from resilient_training.run import layout

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "sched.yaml").write_text("faults:\n  - {type: exception, step: 3, rank: 0}\n")
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", "run", "--nproc", "1",
                           "--steps", "4", "--checkpoint-every", "2", "--faults", "sched.yaml"],
                          cwd=tmp_path / "a", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "a" / "run"
    assert json.loads(layout.config_path(run_dir).read_text())["faults"] == str(tmp_path / "a" / "sched.yaml")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "sched.yaml").write_text("faults:\n  - {type: load-hang, step: 2, rank: 0}\n")
    monkeypatch.chdir(tmp_path / "b")
    assert compute_metrics(run_dir)["faults_not_injected"] == []
