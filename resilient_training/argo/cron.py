"""Argo CronWorkflow schedule fields, checked before anything is written.

Argo Workflows reads ``spec.schedules`` with robfig/cron v3's standard parser: five fields,
``minute hour day-of-month month day-of-week``, or a descriptor (``@daily``, ``@every 6h``). That
is one field fewer than KFP's recurring runs (seconds first, :mod:`resilient_training.kfp.cron`),
so a schedule copied from KFP is refused here with the five-field equivalent as the hint instead
of being misread on the cluster.
"""

from __future__ import annotations

import re
import zoneinfo

from resilient_training.kfp.cron import DESCRIPTORS, FIELDS, CronError, check_days, check_field

CONCURRENCY_POLICIES: tuple[str, ...] = ("Allow", "Forbid")
# Argo's third policy, refused: the cron controller terminates the running workflow for it, and a
# terminated workflow runs no onExit handler, so teardown-storage never deletes the job, the claim
# or the FSx file system that run created.
REPLACE = "Replace"
# Go durations as the CronWorkflow CRD's pattern takes them: 90m, 1h30m, 2h (whole numbers, no
# sign, at least one unit). Go parses 0.5h too, but the CRD refuses it (stranger trial: written).
_GO_DURATION = re.compile(r"^([0-9]+(ns|us|µs|ms|s|m|h))+$")


def validate_schedule(expression: str) -> str:
    """One Argo cron schedule, normalised.

    Raises:
        CronError: not five fields (six: the KFP form, with the hint), an unknown descriptor, a
            bad ``@every`` duration, or a field out of range.

    """
    parts = expression.split()
    if parts and parts[0].startswith(("CRON_TZ=", "TZ=")):
        # robfig/cron's own time zone prefix: the CronWorkflow has a field for it (stranger trial:
        # it got the six-field hint, which dropped the zone).
        zone = parts[0].split("=", 1)[1]
        raise CronError(f"schedule {expression!r} names its time zone in the expression: give --timezone {zone} "
                        f"and the schedule alone, {' '.join(parts[1:])!r}")
    if parts and parts[0].startswith("@"):
        if parts[0].lower() == "@every":
            if len(parts) == 2 and re.fullmatch(r"([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+", parts[1]) \
                    and not _GO_DURATION.match(parts[1]):
                raise CronError(f"@every takes whole numbers of each unit (the CronWorkflow CRD refuses "
                                f"{parts[1]!r}): write 30m for 0.5h, 90s for 1.5m")
            if len(parts) != 2 or not _GO_DURATION.match(parts[1]):
                raise CronError(f"@every needs one duration such as 6h or 90m, got {expression!r}")
            if _seconds(parts[1]) < MIN_INTERVAL_SECONDS:
                # robfig/cron runs anything under 1s every second; a training pipeline is never meant
                # to start more than once a minute (five fields cannot say more often either).
                raise CronError(f"@every needs a duration of at least 1m (a run at most once a minute), got {parts[1]!r}")
            if _seconds(parts[1]) > GO_DURATION_MAX_SECONDS:
                raise CronError(f"@every {parts[1]} is past Go's longest duration (2562047h), which Argo refuses")
            return f"@every {parts[1]}"
        if len(parts) > 1 or parts[0].lower() not in DESCRIPTORS:
            known = ", ".join(sorted(DESCRIPTORS | {"@every DURATION"}))
            raise CronError(f"unknown cron descriptor {parts[0]!r}; use five fields or one of {known}")
        return parts[0].lower()
    if len(parts) == 6:
        raise CronError(
            f"schedule {' '.join(parts)!r} has 6 fields (KFP's form, seconds first), but Argo cron has 5: "
            f"minute hour day-of-month month day-of-week. Did you mean {' '.join(parts[1:])!r}?"
        )
    if len(parts) != 5:
        raise CronError(
            f"schedule {expression!r} has {len(parts)} fields; Argo cron has 5: "
            "minute hour day-of-month month day-of-week, e.g. '0 2 * * *' (02:00 every day)"
        )
    for field, part in zip(FIELDS[1:], parts, strict=True):
        check_field(field, part)
    check_days(*parts[2:], step_keeps_star=False)  # Argo: robfig/cron v3
    return " ".join(parts)


MIN_INTERVAL_SECONDS = 60
GO_DURATION_MAX_SECONDS = (2**63 - 1) / 1e9  # time.ParseDuration's int64 nanoseconds: 2562047h47m16.85s
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(duration: str) -> float:
    """A Go duration (already matched by _GO_DURATION) in seconds."""
    return sum(float(number) * _UNIT_SECONDS[unit]
               for number, unit in re.findall(r"([0-9]+)(ns|us|µs|ms|s|m|h)", duration))


def validate_timezone(name: str) -> str:
    """An IANA time zone name (``UTC``, ``Europe/Berlin``) the controller can load.

    Raises:
        CronError: the name is not in the time zone database.

    """
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(f"unknown time zone {name!r}; use an IANA name such as UTC or Europe/Berlin") from None
    return name


def validate_concurrency_policy(policy: str) -> str:
    """Allow or Forbid, spelt as Argo spells them.

    Raises:
        CronError: Replace (its runs' resources would leak), or any other value (a wrong case too:
            the controller compares exactly).

    """
    if policy == REPLACE:
        raise CronError("concurrency policy Replace terminates the running workflow, and a terminated workflow "
                        "runs no exit handler: teardown-storage would never delete its job, claim and FSx file "
                        "system; use Forbid (the default: skip a start while a run is active) or Allow")
    if policy not in CONCURRENCY_POLICIES:
        raise CronError(f"concurrency policy must be one of {', '.join(CONCURRENCY_POLICIES)}, got {policy!r}")
    return policy
