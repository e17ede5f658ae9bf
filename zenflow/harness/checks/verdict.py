"""The verdict lines of `make gpu-check` (docs/gpu-check.md), shared by every check module.

A check ends as "pass", "fail" or "not checked" (the last two always with a reason). "not run" marks a check the
command has not reached yet: the record is written after every check, so a command killed midway leaves one that
says which checks finished. A negative control is a deliberately broken variant a check must fail on; one that
passes means the check cannot see what it exists to see, and fails the check.
"""

from __future__ import annotations

import traceback
from typing import Any

STATUSES = ("pass", "fail", "not checked", "not run")
NOT_REACHED = "not reached: the command stopped before this check (killed, or still running)"
FAILED_AS_EXPECTED, PASSED, NOT_RUN = "failed as expected", "passed", "not run"


def check(name: str, status: str, reason: str | None = None, **details: Any) -> dict[str, Any]:
    """One line of the verdict: status, and why (always for "fail", "not checked" and "not run")."""
    assert status in STATUSES, status
    return {"name": name, "status": status, "reason": reason, **details}


def pending(name: str) -> dict[str, Any]:
    """A check not yet run: what the record says of it until it finishes."""
    return check(name, "not run", NOT_REACHED)


def guarded(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(...), or a failed check with the exception when it raises: one broken check must not lose the others'
    results on a host that is lent for minutes."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return check(name, "fail", f"raised {type(exc).__name__}: {exc}", traceback=traceback.format_exc())


def control(name: str, failed: bool | None, detail: str) -> dict[str, Any]:
    """A negative control's outcome: it failed as it must (True), passed (False: the check is blind to it), or did
    not run here (None, with the reason in `detail`)."""
    outcome = NOT_RUN if failed is None else FAILED_AS_EXPECTED if failed else PASSED
    return {"control": name, "outcome": outcome, "detail": detail}


def blind_spots(controls: list[dict[str, Any]]) -> list[str]:
    """The controls that passed: each is a failure of the check that ran them."""
    return [c["control"] for c in controls if c["outcome"] == PASSED]


def verdict(checks: list[dict[str, Any]]) -> int:
    """Exit code: 1 if any check failed, else 0 ("not checked" is reported, not failed)."""
    return 1 if any(c["status"] == "fail" for c in checks) else 0
