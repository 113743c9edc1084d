"""KFP recurring-run cron expressions: six fields, seconds first, checked before any call.

Kubeflow Pipelines' ScheduledWorkflow controller parses cron with robfig/cron v1, whose
``Parse`` takes ``second minute hour day-of-month month day-of-week``. It also accepts five
fields, filling them from the left (second, minute, hour, day, month), so a classic crontab
line such as ``0 2 * * *`` is not an error there: it silently runs at minute 2 of every hour.
That is why five fields are refused here, with the six-field equivalent as the hint.
"""

from __future__ import annotations

import dataclasses

# The fixed descriptors robfig/cron v1 accepts besides six fields ("@every <duration>" is left
# out: this CLI offers cron schedules only).
DESCRIPTORS: frozenset[str] = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)


class CronError(ValueError):
    """A cron expression that KFP would reject or misread."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # names[i] stands for low + i

    def value(self, token: str) -> int:
        lowered = token.lower()
        if lowered in self.names:
            return self.low + self.names.index(lowered)
        if not (token.isascii() and token.isdigit()):  # '²' and '٢' are digits to Python, not to Go's Atoi
            raise CronError(f"{self.name} field: {token!r} is not a number" + self._names_hint())
        return int(token)

    def _names_hint(self) -> str:
        return f" (or one of {', '.join(self.names)})" if self.names else ""


FIELDS: tuple[_Field, ...] = (
    _Field("second", 0, 59),
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day-of-month", 1, 31),
    _Field("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
    _Field("day-of-week", 0, 6, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)


def validate_cron(expression: str) -> str:
    """Check a KFP cron expression field by field, the way robfig/cron v1 reads it.

    Args:
        expression: six space-separated fields (``second minute hour day-of-month month
            day-of-week``), each ``*``, ``?``, a value, a range ``a-b``, a step ``x/n`` or a
            comma list of those; or one of :data:`DESCRIPTORS`.

    Returns:
        The expression with surrounding and repeated blanks normalised.

    Raises:
        CronError: five fields (with the six-field equivalent as a hint), another field count,
            or a field out of its range.

    """
    parts = expression.split()
    if parts and parts[0].startswith("@"):
        if len(parts) > 1 or parts[0].lower() not in DESCRIPTORS:
            known = ", ".join(sorted(DESCRIPTORS))
            raise CronError(f"unknown cron descriptor {parts[0]!r}; use six fields or one of {known}")
        return parts[0].lower()
    if len(parts) == 5:
        six = "0 " + " ".join(parts)
        raise CronError(
            f"cron {' '.join(parts)!r} has 5 fields, but KFP cron has 6 with seconds first "
            f"(second minute hour day-of-month month day-of-week); KFP would read it as second={parts[0]} "
            f"minute={parts[1]} hour={parts[2]}. Did you mean {six!r}?"
        )
    if len(parts) != 6:
        raise CronError(
            f"cron {expression!r} has {len(parts)} fields; KFP cron has 6: "
            "second minute hour day-of-month month day-of-week, e.g. '0 0 2 * * *' (02:00 every day)"
        )
    for field, part in zip(FIELDS, parts, strict=True):
        check_field(field, part)
    check_days(*parts[3:])
    seconds, _ = _expand(FIELDS[0], parts[0], True)
    if len(seconds) > 1:
        # '* * * * * *' started a training pipeline every second, with catchup on (stranger trial).
        raise CronError(f"second field {parts[0]!r} starts a run {len(seconds)} times a minute; a schedule may start "
                        f"one at most once a minute: give one second, e.g. '0 {' '.join(parts[1:])}'")
    return " ".join(parts)


def check_field(field: _Field, part: str) -> None:
    """Check one field (a comma list of items) against ``field``'s range and names.

    Shared with Argo's five-field dialect (``resilient_training.argo.cron``), which has the same
    fields less the seconds.

    Raises:
        CronError: an item is empty, malformed or out of range.

    """
    for item in part.split(","):
        _check_range(field, item)


_DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # February 29: fires in leap years


def check_days(day_of_month: str, month: str, day_of_week: str, *, step_keeps_star: bool = True) -> None:
    """Refuse a schedule that never fires: days that no listed month has (``31 2``, ``30-31 feb``).

    robfig/cron matches a date when day-of-month AND day-of-week match if either is "star", OR
    when both are restricted; only the first case can be empty. ``*``/``?`` is star; with a step
    (``*/2``) still star in robfig/cron v1 (KFP, ``step_keeps_star``), no longer in v3 (Argo).
    Call after :func:`check_field`.

    Raises:
        CronError: no listed month has any of the listed days.

    """
    days, days_star = _expand(FIELDS[3], day_of_month, step_keeps_star)
    months, _ = _expand(FIELDS[4], month, step_keeps_star)
    _, weekdays_star = _expand(FIELDS[5], day_of_week, step_keeps_star)
    if not (days_star or weekdays_star):
        return  # OR: every weekday occurs in every month
    if not any(day <= _DAYS_IN_MONTH[m - 1] for m in months for day in days):
        raise CronError(f"day-of-month {day_of_month!r} with month {month!r} never fires: "
                        "no listed month has any of those days")


def _expand(field: _Field, part: str, step_keeps_star: bool) -> tuple[set[int], bool]:
    """The values a field matches, and whether it is robfig's "star" (see :func:`check_days`)."""
    values: set[int] = set()
    star = False
    for item in part.split(","):
        base, _, step_text = item.partition("/")
        step = int(step_text) if step_text else 1
        if base in ("*", "?"):
            start, end = field.low, field.high
            star = star or step == 1 or step_keeps_star
        else:
            bounds = base.split("-")
            start = field.value(bounds[0])
            end = field.value(bounds[1]) if len(bounds) == 2 else (field.high if step_text else start)
        values.update(range(start, end + 1, step))
    return values, star


def _check_range(field: _Field, item: str) -> None:
    """One comma-separated item: ``*``, ``?``, ``v``, ``a-b``, each optionally ``/step``."""
    if not item:
        raise CronError(f"{field.name} field: empty item in a comma list")
    base, *steps = item.split("/")
    if len(steps) > 1:
        raise CronError(f"{field.name} field: {item!r} has more than one '/'")
    if steps and (not (steps[0].isascii() and steps[0].isdigit()) or int(steps[0]) == 0):
        raise CronError(f"{field.name} field: step in {item!r} must be a positive whole number")
    if base in ("*", "?"):
        return
    bounds = base.split("-")
    if len(bounds) > 2:
        raise CronError(f"{field.name} field: {item!r} has more than one '-'")
    start = field.value(bounds[0])
    end = field.value(bounds[1]) if len(bounds) == 2 else start
    for number in (start, end):
        if not field.low <= number <= field.high:
            where = "" if item == str(number) else f" (in {item!r})"
            raise CronError(f"{field.name} field: {number} is outside {field.low}-{field.high}{where}")
    if start > end:
        raise CronError(f"{field.name} field: range {item!r} starts after it ends")
