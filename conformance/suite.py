"""A conformance run: one backend, one device, every case, one report."""

from __future__ import annotations

import datetime as _dt
import functools
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import moehal
import torch
from moehal.hardware import HardwareInfo, detect, package_version
from moehal.interfaces import BuildRequest
from moehal.plugins import Registry
from moehal.settings import Settings
from moehal_conformance.cases import BASE, BF16, Case, CaseBuilder
from moehal_conformance.runner import DECLINED, FAIL, NOT_RUN, PASS, CaseResult, CaseRunner, context_lost

if TYPE_CHECKING:
    from moehal.distributed_check import EPCase

SUITE_VERSION = "0.1.0"


def make_registry(emulate: frozenset[str] = frozenset()) -> Registry:
    """The environment's settings (every field: the masked workspace budget changes which layout
    a layer takes), with no forced backend (each case names its own) and `emulate` added."""
    base = Settings.from_env()
    settings = replace(base, backend=None, emulate=base.emulate | emulate)
    reg = Registry(settings)
    reg.load_entry_points()
    return reg


def selected(select: str | None, case_id: str) -> bool:
    """`-k`: the case ids that contain `select` (all without it). As pytest's `-k`, `select` may
    combine texts with `and`, `or`, `not` and parentheses (`-k 'shapes/ and contiguous'`, `-k
    'not tuned/'`: the latter and `-k tuned/` split a long device run in two). A text is the
    words between those, spaces kept (`-k 'bf16 standard'` is one text). ValueError: a
    malformed expression."""
    if not select:
        return True
    return _KExpr(select).match(case_id)


@functools.lru_cache(maxsize=16)
def _k_tokens(text: str) -> tuple[str, ...]:
    """`-k`'s words and parentheses, split once per expression (not once per case id)."""
    return tuple(text.replace("(", " ( ").replace(")", " ) ").split())


class _KExpr:
    """A `-k` expression over substrings of a case id (recursive descent, pytest's precedence:
    `not` over `and` over `or`)."""

    _WORDS = frozenset({"and", "or", "not", "(", ")"})

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _k_tokens(text)

    def match(self, case_id: str) -> bool:
        self.pos, self.case_id = 0, case_id
        if not self.tokens:
            return True
        ok = self._or()
        if self.pos != len(self.tokens):
            raise ValueError(f"-k {self.text!r}: unexpected {self.tokens[self.pos]!r}")
        return ok

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _or(self) -> bool:
        ok = self._and()
        while self._peek() == "or":
            self.pos += 1
            ok = self._and() or ok  # (both sides parsed: a malformed right side raises)
        return ok

    def _and(self) -> bool:
        ok = self._not()
        while self._peek() == "and":
            self.pos += 1
            ok = self._not() and ok
        return ok

    def _not(self) -> bool:
        token = self._peek()
        if token == "not":
            self.pos += 1
            return not self._not()
        if token == "(":
            self.pos += 1
            ok = self._or()
            if self._peek() != ")":
                raise ValueError(f"-k {self.text!r}: a '(' without its ')'")
            self.pos += 1
            return ok
        words = []
        while (token := self._peek()) is not None and token not in self._WORDS:
            words.append(token)
            self.pos += 1
        if not words:
            where = "at the end" if token is None else f"before {token!r}"
            raise ValueError(f"-k {self.text!r}: expected a text {where}")
        return " ".join(words) in self.case_id


def ep_case_id(world: int, name: str) -> str:
    """An expert-parallel case's id in the reports (and for `-k`): `ep/world2/bf16 standard`."""
    return f"ep/world{world}/{name}"


def best_backend(registry: Registry, hw: HardwareInfo) -> str:
    """The highest-priority backend that runs the base bf16 config natively on this hardware
    (emulated and interpreted modes never count as 'best')."""
    req = BuildRequest(moehal.MoEConfig(**BASE), BF16, hw, registry.settings)  # type: ignore[arg-type]
    pipes, _ = moehal.enumerate_pipelines(req, registry)
    native = [p for p in pipes if p.execution_mode(req) == "native"]
    return native[0].main.backend if native else "reference"


@dataclass
class Suite:
    backend: str
    registry: Registry
    device: torch.device
    profile: str = "full"
    select: str | None = None  # the `-k` text a subset of the cases was chosen by, if any
    select_by: str = "-k"  # how: "-k", or "pytest selection:" (node ids; `select` then lists the cases)
    poison: bool = True  # fill fresh allocations with NaN / 1 while cases run (`poison.py`)
    poisoned_allocations: int = 0  # how many were filled
    results: list[CaseResult] = field(default_factory=list)
    interrupted: bool = False
    lost_in: str = ""  # the case whose fault left the device unusable ...
    lost_error: str = ""  # ... and the error every later call would raise
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    @classmethod
    def create(
        cls, backend: str, device: str | None = None, emulate: bool = False, profile: str = "full", poison: bool = True
    ) -> Suite:
        reg = make_registry(frozenset({backend}) if emulate else frozenset())
        hw = detect(device)
        if backend in ("best", "auto"):
            backend = best_backend(reg, hw)
        reg.check_backend(backend)
        return cls(backend, reg, hw.device, profile, poison=poison)

    def cases(self) -> list[Case]:
        hw = detect(self.device)
        template = BuildRequest(moehal.MoEConfig(**BASE), BF16, hw, self.registry.settings)  # type: ignore[arg-type]
        return CaseBuilder(self.backend, self.registry, template, self.profile).all_cases()

    def run(
        self,
        cases: list[Case] | None = None,
        on_result: Callable[[CaseResult], None] | None = None,
        watch: Callable[[Case], AbstractContextManager[object]] | None = None,
    ) -> None:
        """Run `cases` (all by default) in order, keeping each result and handing it to
        `on_result`. Each case runs inside `watch(case)` where given (the CLI's heartbeat and live
        display), which is left when the case ends, by an exception or KeyboardInterrupt too."""
        runner = CaseRunner(self.registry, self.device, self.poison)
        todo = cases if cases is not None else self.cases()
        try:
            for n, case in enumerate(todo):
                try:
                    with watch(case) if watch is not None else nullcontext():
                        r = runner.run(case)
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a time limit): keep what ran, say what did not
                    self.interrupted = True
                    self._not_run(todo[n:], "the run was interrupted before this case")
                    return
                self.results.append(r)
                if on_result is not None:
                    on_result(r)
                if r.status == FAIL and (why := context_lost(self.device)):
                    # Every later case would fail with this error, not its own: stop, and say so.
                    self.lost_in, self.lost_error = r.id, why
                    self._not_run(todo[n + 1 :], f"the device's context was lost in {r.id}")
                    return
        finally:
            self.poisoned_allocations += runner.poisoned

    def _not_run(self, cases: list[Case], why: str) -> None:
        for c in cases:
            self.results.append(CaseResult(c.id, c.family, c.check, c.quant.name, c.layout, "-", NOT_RUN, detail=why))

    def run_ep(
        self, world: int = 2, dispatcher: str | None = None, timeout_s: float = 240.0, required: bool = True
    ) -> None:
        """The expert-parallel cases: `world` local processes (gloo), each running the backend's
        experts behind an EP dispatcher (the generic torch.distributed one unless `dispatcher`
        names another), compared with the single-process reference on all tokens. A named
        dispatcher that takes no case fails the run where `required` (the user named it), else
        gives one declined result (one of the backend's own, tried as `ep_dispatchers` lists)."""
        from moehal.distributed_check import run_ep_cases, run_spawned

        disp = dispatcher or "reference.torch_distributed"
        cases = self.ep_case_list(world)
        if not cases:  # `-k` selects none of them
            return
        # The ranks are fresh processes: they get this run's settings (`--emulate` among them)
        # as an argument, not through os.environ. Written there for the spawn, the switch raced
        # other threads, and beside MOEHAL_NPU_EMULATE=0 every rank refused the two variables'
        # disagreement (ConfigError), though `--emulate`, an argument, outranks both.
        args = (cases, "cpu", self.backend, disp, (), self.poison, self.registry.settings)
        outcomes = run_spawned(world, run_ep_cases, args, timeout_s=timeout_s)
        errors = [
            f"rank {o.rank} {o.status}: {o.error.strip().splitlines()[-1] if o.error else ''}"
            for o in outcomes
            if o.status != "ok"
        ]
        if errors:
            self.results.append(
                CaseResult(f"ep/world{world}", "ep", "ep", "-", "-", disp, FAIL, detail="; ".join(errors)[:400])
            )
            return
        if dispatcher is not None and all(r.declined for r in outcomes[0].result):
            # a named dispatcher that took no case proved nothing: not a pass (session 45's audit
            # found Ascend's HCCL dispatcher declining every case while the run said PASS)
            why = outcomes[0].result[0].declined if outcomes[0].result else "no case"
            self.results.append(
                CaseResult(
                    f"ep/world{world}/{disp}", "ep", "ep", "-", "-", disp, FAIL if required else DECLINED,
                    detail=f"{disp} took none of the EP cases; the first decline: {why}"[:400],
                )
            )  # fmt: skip
            if not required:
                return
        for rank0 in outcomes[0].result:
            if rank0.declined:
                self.results.append(
                    CaseResult(
                        ep_case_id(world, rank0.case), "ep", "ep", "-", "-", "-", DECLINED, detail=rank0.declined
                    )
                )
                continue
            status = PASS if rank0.all_ok else FAIL
            self.results.append(
                CaseResult(
                    ep_case_id(world, rank0.case),
                    "ep",
                    "ep",
                    "-",
                    "-",
                    rank0.pipeline,
                    status,
                    rank0.mode,
                    f"max err {rank0.max_abs_err:.2e} ({rank0.tolerance})"
                    + (f"; {rank0.detail}" if rank0.detail else ""),
                )
            )

    def ep_case_list(self, world: int) -> list[EPCase]:
        """The expert-parallel cases `--ep WORLD` runs: those whose id `-k` selects."""
        from moehal.distributed_check import ep_cases

        return [c for c in ep_cases(world) if selected(self.select, ep_case_id(world, c.name))]

    def ep_dispatchers(self) -> list[str]:
        """The backend's own dispatchers, which `moehal conformance --ep` tries beside the
        generic one when none is named: conformance runs what the backend declares."""
        return [d.qualname for d in self.registry.dispatchers if d.backend == self.backend]

    # Summary ------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        out = {PASS: 0, FAIL: 0, DECLINED: 0, NOT_RUN: 0}
        for r in self.results:
            out[r.status] += 1
        return out

    @property
    def claimed_anything(self) -> bool:
        return any(r.status == PASS and r.family in ("matrix", "features", "shapes") for r in self.results)

    @property
    def ran_anything(self) -> bool:
        return any(r.status == PASS and r.family != "honesty" for r in self.results)

    @property
    def ok(self) -> bool:
        # A `-k` subset need not hold a matrix, features or shapes case, but it must have run one.
        claimed = self.ran_anything if self.select else self.claimed_anything
        return self.counts()[FAIL] == 0 and claimed and not self.interrupted

    def metadata(self) -> dict[str, Any]:
        hw = detect(self.device)
        rec = self.registry.plugins.get(self.backend)
        libs: dict[str, str | None] = {}
        if rec is not None and rec.info is not None:
            try:
                libs = rec.info.libraries()
            except Exception as exc:  # noqa: BLE001
                libs = {"<error>": str(exc)}
        return {
            "suite_version": SUITE_VERSION,
            "backend": self.backend,
            "plugin_version": rec.version if rec else None,
            "plugin_distribution": rec.distribution if rec else None,
            "moehal_version": moehal.__version__,
            "date": self.started,
            "profile": self.profile,
            "select": self.select,
            "select_by": self.select_by if self.select else None,
            "poison": self.poison,
            "poisoned_allocations": self.poisoned_allocations,
            "interrupted": self.interrupted,
            "lost_context": {"case": self.lost_in, "error": self.lost_error} if self.lost_in else None,
            "hardware": {
                "kind": hw.kind,
                "device": str(hw.device),
                "name": hw.name,
                "capability": list(hw.capability) if hw.capability else None,
                "arch": hw.arch,
            },
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "triton": package_version("triton"),
            "vendor_libraries": libs,
            "emulate": sorted(self.registry.settings.emulate),
        }
