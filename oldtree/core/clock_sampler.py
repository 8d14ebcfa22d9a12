"""A CUDA GPU's SM clock and board power, sampled in the background while work is timed.

Why: under sustained prefill-sized layers an H100 or H200 sits at its power cap, at 1100-1700
MHz instead of its 1980 MHz boost, and how far it clocks down differs between machines of one
model. A time without the clock it ran at cannot be compared across runs
(docs/device-runs/2026-11-23-session9). `moehal bench` records both per row.

The samples come from `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms PERIOD`, run
as a child process for the device by PCI bus id (right under `CUDA_VISIBLE_DEVICES`). Where
there is no NVIDIA GPU or no `nvidia-smi`, `ClockSampler.start` returns None and nothing is
recorded. The clock is read as it is at each sample. `power.draw` is the driver's reading, which
on recent boards is averaged over about a second, so a window shorter than that shows power that
lags the work (a benchmark row's window is at least half its settle time plus its samples).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import math
import shutil
import statistics
import subprocess
import threading
import time

import torch

__all__ = ["ClockSampler", "parse_sample", "window_medians"]


def parse_sample(line: str) -> tuple[float, float, float] | None:
    """One `timestamp, clocks.sm, power.draw` line (csv, noheader, nounits) as (UNIX time,
    MHz, W); None for anything else ('[N/A]' power on some boards, a warning line)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        # nvidia-smi stamps local time, as time.time() is read against here
        stamp = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]), float(parts[2])
    except ValueError:
        return None


def window_medians(samples: list[tuple[float, float, float]], t0: float, t1: float) -> tuple[float, float]:
    """Median MHz and W of the samples stamped in [t0, t1]; NaN, NaN if there are none."""
    sel = [(mhz, w) for t, mhz, w in samples if t0 <= t <= t1]
    if not sel:
        return math.nan, math.nan
    return statistics.median(m for m, _ in sel), statistics.median(w for _, w in sel)


def _pci_id(dev: torch.device) -> str | None:
    props = torch.cuda.get_device_properties(dev)
    dom, bus, slot = (getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device"))
    if bus is None or slot is None:
        return None
    return f"{dom or 0:08X}:{bus:02X}:{slot:02X}.0"


class ClockSampler:
    """Samples every `period_ms` into `samples` until `close()`; use `ClockSampler.start`."""

    def __init__(self, cmd: list[str]) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_sample(line)
            if s is not None:
                self.samples.append(s)

    @classmethod
    def start(cls, dev: torch.device, period_ms: int = 100) -> ClockSampler | None:
        """A running sampler for `dev`, or None where it cannot sample (not an NVIDIA GPU, no
        nvidia-smi, no PCI id, or no sample within a second)."""
        if dev.type != "cuda" or torch.version.cuda is None or shutil.which("nvidia-smi") is None:
            return None
        pci = _pci_id(dev)
        if pci is None:
            return None
        query = "--query-gpu=timestamp,clocks.sm,power.draw"
        sampler = cls(["nvidia-smi", f"--id={pci}", query, "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"])
        t_end = time.monotonic() + 1.0
        while not sampler.samples and time.monotonic() < t_end:
            time.sleep(0.02)
        if not sampler.samples:
            sampler.close()
            return None
        atexit.register(sampler.close)  # the child must not outlive a run that stops early
        return sampler

    def medians(self, t0: float, t1: float) -> tuple[float, float]:
        """Median SM MHz and board W between wall times t0 and t1 (`time.time()`)."""
        time.sleep(0.15)  # let the sample that closes the window arrive
        return window_medians(self.samples, t0, t1)

    def close(self) -> None:
        if self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
