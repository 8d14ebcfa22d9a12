"""What a conformance run did with each component of the backend under test.

The matrix says which (quant, layout) cells passed; a reader of a vendor's report also asks
"which of this backend's kernels actually ran here, and why not the others?". Every dispatcher,
experts kernel and fused forward the backend declares gets one line:

- `verified`: it ran natively in at least one passing case, and in no failing one;
- `emulated` / `interpreted`: it passed only as torch stand-ins of vendor ops, or only under an
  interpreter (TRITON_INTERPRET=1): neither is a hardware result;
- `FAIL`: a case it ran in failed;
- `not run`: no case ran it, with the reason its own checks give on this device (for example
  "needs SM100 ... this device is sm90", or a missing vendor library).

The components are `Registry.components(backend)`: weight processors are not listed, since each
serves the experts kernel it prepares weights for.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import moehal
from moehal.errors import PluginCheckError
from moehal.hardware import HardwareInfo, detect
from moehal.interfaces import BuildRequest, Dispatcher, Implementation
from moehal_conformance.cases import BASE, BF16
from moehal_conformance.runner import FAIL, NOT_RUN, PASS, CaseResult

if TYPE_CHECKING:
    from moehal_conformance.suite import Suite

VERIFIED, EMULATED, INTERPRETED, FAILED, NOT_RAN = "verified", "emulated", "interpreted", "FAIL", "not run"


@dataclass(frozen=True)
class ComponentResult:
    """One declared component and what the run did with it."""

    qualname: str  # e.g. "cuda.deepgemm"
    kind: str  # dispatcher | experts | fused
    status: str  # verified | emulated | interpreted | FAIL | not run
    passed: int  # cases it ran in that passed
    failed: int  # ... that failed
    detail: str  # the counts, or why it did not run

    @property
    def label(self) -> str:
        """'verified', or 'not run: <why>' as the brief's reports put it."""
        return f"{self.status}: {self.detail}" if self.status == NOT_RAN else self.status


def ran_in(result: CaseResult, qualname: str) -> bool:
    """Whether a case's pipeline (`Pipeline.name`: "cuda.permute -> cuda.deepgemm [...]",
    "fused cuda.trtllm_fp8_block") names the component."""
    return qualname in result.pipeline.split()


def summarize(suite: Suite, hardware: HardwareInfo | None = None) -> list[ComponentResult]:
    """One `ComponentResult` per dispatcher, experts kernel and fused forward of the suite's
    backend, highest priority first within each kind. hardware: what the reasons for `not run`
    are asked against (default: the suite's device, as detected)."""
    reg = suite.registry
    hw = hardware if hardware is not None else detect(suite.device)
    template = BuildRequest(moehal.MoEConfig(**BASE), BF16, hw, reg.settings)  # type: ignore[arg-type]
    return [
        _one(impl, kind, [r for r in suite.results if ran_in(r, impl.qualname)], template)
        for kind, impl in reg.components(suite.backend)
    ]


def _one(impl: Implementation, kind: str, ran: list[CaseResult], template: BuildRequest) -> ComponentResult:
    passed = [r for r in ran if r.status == PASS]
    failed = [r for r in ran if r.status == FAIL]
    if failed:
        return ComponentResult(
            impl.qualname, kind, FAILED, len(passed), len(failed), f"{len(failed)} of {_cases(len(ran))} failed"
        )
    if passed:
        modes = Counter(r.mode for r in passed)
        status = VERIFIED if modes["native"] else (EMULATED if modes["emulated"] else INTERPRETED)
        detail = f"{_cases(len(passed))} passed"
        if set(modes) != {"native"}:
            detail += " (" + ", ".join(f"{n} {m}" for m, n in sorted(modes.items())) + ")"
        skipped = sum(r.status == NOT_RUN for r in ran)
        if skipped:
            detail += f"; {skipped} not run"
        return ComponentResult(impl.qualname, kind, status, len(passed), 0, detail)
    return ComponentResult(impl.qualname, kind, NOT_RAN, 0, 0, why_not_run(impl, ran, template))


def _cases(n: int) -> str:
    return f"{n} case" if n == 1 else f"{n} cases"


def why_not_run(impl: Implementation, ran: list[CaseResult], template: BuildRequest) -> str:
    """Why no case ran `impl`: the reason its cases were not run, else the first decline its own
    checks give for the suite's base config on this device, in every quant scheme it declares."""
    skipped = [r.detail for r in ran if r.status == NOT_RUN and r.detail]
    if skipped:
        return skipped[0]
    schemes = sorted(impl.quant_schemes, key=lambda q: q.name) or [template.quant]
    decisions = []
    for quant in schemes:
        try:
            decisions.append(impl.supports(dataclasses.replace(template, quant=quant)))
        except PluginCheckError as exc:  # a plugin's check that raises is itself the answer
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - likewise, from an implementation that overrides supports()
            return f"its capability checks raised {type(exc).__name__}: {exc}"
    if any(d.ok for d in decisions):
        return "its own checks accept the base config on this device, but no case's pipeline included it"
    d = decisions[0]
    why = f"[{d.predicate}] {d.reason}" if d.predicate else d.reason
    if d.predicate == "parallel" and isinstance(impl, Dispatcher):
        why += f"; the expert-parallel cases run it (`moehal conformance --ep WORLD --ep-dispatcher {impl.qualname}`)"
    return why
