"""KFP cron: six fields, seconds first; five fields refused with the six-field hint; ranges per field."""

from __future__ import annotations

import pytest

from resilient_training.kfp.cron import CronError, validate_cron


@pytest.mark.parametrize(
    ("expression", "normalised"),
    [
        ("0 0 2 * * *", "0 0 2 * * *"),
        ("  0   0 2 * * * ", "0 0 2 * * *"),
        ("0 */15 * * * ?", "0 */15 * * * ?"),
        ("0 * * * * *", "0 * * * * *"),  # once a minute: the most often a schedule may start a run
        ("0 30 9 ? * MON-FRI", "0 30 9 ? * MON-FRI"),
        ("0 0 0 1 jan,jul *", "0 0 0 1 jan,jul *"),
        ("59 59 23 31 12 6", "59 59 23 31 12 6"),
        ("0 0 1-5/2 * * 0,6", "0 0 1-5/2 * * 0,6"),
        ("5/60 * * * * *", "5/60 * * * * *"),
        ("@Daily", "@daily"),
        # Days some listed month has: fires (February 29 in leap years).
        ("0 0 2 29 2 *", "0 0 2 29 2 *"),
        ("0 0 2 31 4,5 *", "0 0 2 31 4,5 *"),
        ("0 0 2 31 2/2 *", "0 0 2 31 2/2 *"),  # Aug, Oct, Dec
        # Both day fields restricted: robfig matches either, so the weekday makes it fire.
        ("0 0 2 31 2 1", "0 0 2 31 2 1"),
    ],
)
def test_valid_cron_is_accepted(expression, normalised):
    assert validate_cron(expression) == normalised


def test_five_fields_are_refused_with_the_six_field_equivalent():
    with pytest.raises(CronError) as caught:
        validate_cron("0 2 * * *")
    message = str(caught.value)
    assert "has 5 fields" in message
    assert "seconds first" in message
    # What KFP's robfig/cron v1 parser would do with it, and the fix.
    assert "KFP would read it as second=0 minute=2 hour=*" in message
    assert "Did you mean '0 0 2 * * *'?" in message


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("60 0 2 * * *", "second field: 60 is outside 0-59"),
        ("0 60 2 * * *", "minute field: 60 is outside 0-59"),
        ("0 0 24 * * *", "hour field: 24 is outside 0-23"),
        ("0 0 2 0 * *", "day-of-month field: 0 is outside 1-31"),
        ("0 0 2 32 * *", "day-of-month field: 32 is outside 1-31"),
        ("0 0 2 * 13 *", "month field: 13 is outside 1-12"),
        ("0 0 2 * * 7", "day-of-week field: 7 is outside 0-6"),
        ("0 0 2 1,40 * *", "day-of-month field: 40 is outside 1-31"),
        ("0 0 5-3 * * *", "hour field: range '5-3' starts after it ends"),
        ("*/0 * * * * *", "second field: step in '*/0' must be a positive whole number"),
        ("0 0 x * * *", "hour field: 'x' is not a number"),
        ("0 0 2 * foo *", "month field: 'foo' is not a number (or one of jan,"),
        ("0 0 1,,2 * * *", "hour field: empty item"),
        ("0 0 1-2-3 * * *", "hour field: '1-2-3' has more than one '-'"),
        ("0 0 */2/3 * * *", "hour field: '*/2/3' has more than one '/'"),
        ("0 0 2 * * * 2026", "has 7 fields; KFP cron has 6"),
        ("", "has 0 fields"),
        ("@every 1h", "unknown cron descriptor '@every'"),
        # Valid fields, a schedule that never fires (a scheduled run that silently never runs).
        ("0 0 2 31 2 *", "day-of-month '31' with month '2' never fires"),
        ("0 0 2 30-31 feb ?", "never fires"),
        ("0 0 2 31 4,6,9,11 *", "never fires"),
        # KFP's robfig/cron v1 keeps '*/2' a "star" (v3, Argo's, does not): day AND weekday, never (stranger trial).
        ("0 0 2 31 2 */2", "never fires"),
        ("0 0 ² * * *", "hour field: '²' is not a number"),  # a traceback before
        ("0 0 ٢ * * *", "hour field: '٢' is not a number"),  # Go's Atoi takes ASCII digits only
        # A training pipeline started every second, catchup on, was accepted (stranger trial).
        ("* * * * * *", "second field '*' starts a run 60 times a minute; a schedule may start one at most once a "
                        "minute: give one second, e.g. '0 * * * * *'"),
        ("*/15 * * * * ?", "starts a run 4 times a minute"),
        ("0,30 0 2 * * *", "starts a run 2 times a minute"),
        ("5/10 * * * * *", "starts a run 6 times a minute"),
    ],
)
def test_bad_cron_names_the_field_and_range(expression, message):
    with pytest.raises(CronError) as caught:
        validate_cron(expression)
    assert message in str(caught.value)
