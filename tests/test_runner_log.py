"""The local runner's console digest: a real kfp.local pipeline through runner_log.capture."""

# No "from __future__ import annotations": kfp reads the component annotations as types.
import io
import sys

from kfp import dsl

from resilient_training.cli import runner_log


@dsl.component(base_image="python:3.11-slim")
def chatty(n: int) -> int:
    """Print progress among warnings, as a component does."""
    import warnings

    print("progress: step 1 of 2")
    warnings.warn("something deprecated", FutureWarning, stacklevel=1)
    print("progress: step 2 of 2")
    if n < 0:
        raise ValueError("n must not be negative")
    return n + 1


@dsl.pipeline(name="chatty-pipeline")
def chatty_pipeline(n: int = 1):
    first = chatty(n=n).set_caching_options(False)
    with dsl.If(first.output < 0, name="never"):
        chatty(n=first.output)


def _run(tmp_path, kfp_local, *, n: int, verbose: bool) -> tuple[str, str, runner_log.RunnerOutput]:
    console = io.StringIO()
    log_path = tmp_path / "logs" / "run.log"
    real_stdout = sys.stdout
    sys.stdout = console  # what capture() treats as the console
    try:
        with runner_log.capture(log_path, verbose=verbose) as digest:
            try:
                chatty_pipeline(n=n)
            except RuntimeError:
                pass  # kfp.local raises when a task fails
    finally:
        sys.stdout = real_stdout
    return console.getvalue(), log_path.read_text(), digest


def test_the_console_gets_step_lines_and_the_components_own_lines_the_log_gets_everything(tmp_path, kfp_local):
    console, log, digest = _run(tmp_path, kfp_local, n=1, verbose=False)
    lines = console.splitlines()
    assert [line.split(" ", 1)[1] for line in lines if not line.startswith("    ")][:2] == [
        "▶ chatty", "✓ chatty (" + lines[3].split("(", 1)[1]]
    assert "    progress: step 1 of 2" in lines and "    progress: step 2 of 2" in lines
    assert len(lines) == 4, console  # the condition's task never ran: no line for it
    assert "KFP Executor" not in console and "executor_input" not in console and "Warning" not in console
    # The log holds what the console left out: the executor input JSON, outputs, warnings.
    assert "Got executor_input:" in log and '"parameterValues"' in log and "FutureWarning" in log
    assert "progress: step 1 of 2" in log and "finished with status" in log
    assert digest.failed == []


def test_a_failing_step_is_named_and_verbose_shows_the_runners_full_output(tmp_path, kfp_local):
    console, log, digest = _run(tmp_path, kfp_local, n=-1, verbose=False)
    assert digest.failed == ["chatty"]
    assert any(line.split(" ", 1)[1].startswith("✗ chatty FAILURE (") for line in console.splitlines())
    # The step's line carries its exception; the traceback's frames go to the log only (a stranger
    # trial saw 25 lines of them before each failed step's line).
    failed_line = next(line for line in console.splitlines() if "✗ chatty FAILURE" in line)
    assert failed_line.endswith(": ValueError: n must not be negative"), console
    assert "Traceback" not in console and 'File "' not in console, console
    assert "Traceback (most recent call last):" in log
    assert digest.states == {"chatty": "FAILURE"} and digest.reasons == {"chatty": "ValueError: n must not be negative"}

    console, log, _ = _run(tmp_path, kfp_local, n=1, verbose=True)
    assert "Got executor_input:" in console and "FutureWarning" in console
    assert "Got executor_input:" in log


def test_a_line_split_across_writes_reaches_the_console_whole():
    console, log = io.StringIO(), io.StringIO()
    out = runner_log.RunnerOutput(log, console)
    for chunk in ["12:00:00.000 - INFO - Streamed logs:\n    progress 1\n    prog", "ress 2\n", "    {\n"]:
        out.write(chunk)
    assert console.getvalue() == "    progress 1\n    progress 2\n    {\n"
    assert log.getvalue().endswith("progress 1\n    progress 2\n    {\n")


def test_skipped_tasks_get_one_line_with_the_runners_reason():
    console, log = io.StringIO(), io.StringIO()
    out = runner_log.RunnerOutput(log, console)
    # kfp/local/orchestrator/enhanced_dag_orchestrator.py's two messages, colour codes as kfp writes them.
    out.write("12:00:00.000 - INFO - Skipping conditional task \x1b[96mcondition-2\x1b[0m (condition evaluated to False)\n")
    out.write("12:00:00.000 - INFO - Skipping task promote-model: upstream task(s) ['check-convergence'] failed.\n")
    lines = [line.split(" ", 1)[1] for line in console.getvalue().splitlines()]
    assert lines == ["– condition-2 skipped: condition evaluated to False",
                     "– promote-model skipped: upstream task(s) ['check-convergence'] failed."]


def test_a_failed_steps_reason_has_no_colour_codes() -> None:
    """Found by a stranger trial: `run`'s FAILED line showed kfp.local's colour codes raw."""
    from resilient_training.cli.local import _failure_reason

    exc = RuntimeError("Pipeline failed.\nTask \x1b[96m'launch-training'\x1b[0m finished with status "
                       "\x1b[91mFAILURE\x1b[0m\x1b[K")
    assert _failure_reason(exc) == "Task 'launch-training' finished with status FAILURE"


def test_a_chained_exception_gives_its_last_line_without_the_module_path() -> None:
    console, log = io.StringIO(), io.StringIO()
    out = runner_log.RunnerOutput(log, console)
    out.write("12:00:00.000 - INFO - Executing task 'promote-model'\n12:00:00.000 - INFO - Streamed logs:\n")
    for line in ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    f()",
                 "KeyError: 'a'", "", "During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", '  File "y.py", line 2, in g',
                 "resilient_training.gates.promote.PromotionRefused: /m already holds another promoted model"]:
        out.write(f"    {line}\n")
    out.write("12:00:01.000 - ERROR - Task 'promote-model' finished with status FAILURE\n")
    lines = console.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].endswith(
        "✗ promote-model FAILURE (0.0 s): PromotionRefused: /m already holds another promoted model"), lines
    assert out.reasons == {"promote-model": "PromotionRefused: /m already holds another promoted model"}
