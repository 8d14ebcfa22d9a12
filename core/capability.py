"""Capability answers: `(ok, reason)` built from small named predicates.

Every decline carries a sentence a person can act on; `moehal explain` prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    """An implementation's answer to one capability check: `ok`, and a `reason` a person can
    read (`moehal explain` shows every decline). Truthy when ok."""

    ok: bool
    reason: str
    predicate: str = ""  # which named check decided (e.g. 'hardware', 'quant', 'shape')

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        where = f"[{self.predicate}] " if self.predicate else ""
        return f"{'ok' if self.ok else 'declined'}: {where}{self.reason}"


def accept(reason: str = "supported", predicate: str = "") -> Decision:
    """A yes from the named check `predicate` (e.g. 'quant'), with why."""
    return Decision(True, reason, predicate)


def decline(reason: str, predicate: str = "") -> Decision:
    """A no from the named check `predicate`. `reason` is what `moehal explain` shows a person:
    say what is missing and, where there is one, what to do (a package, a quant scheme)."""
    return Decision(False, reason, predicate)


def require(condition: bool, reason_if_not: str, predicate: str = "") -> Decision:
    """`accept` when `condition` holds, else `decline(reason_if_not)`: one line per predicate."""
    return Decision(True, "ok", predicate) if condition else Decision(False, reason_if_not, predicate)


def all_of(checks: Iterable[tuple[str, Callable[[], Decision]]]) -> Decision:
    """Run named checks in order; the first decline wins. Checks run lazily so a later one
    may assume an earlier one passed (e.g. a shape check after the library import check)."""
    for name, check in checks:
        d = check()
        if not d.ok:
            return Decision(False, d.reason, d.predicate or name)
    return accept("all checks passed")
