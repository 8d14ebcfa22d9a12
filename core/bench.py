"""`moehal bench`: whole-layer forward time (dispatch + experts + combine) against a roofline.

Roofline, measured in the same run on the same device:
- copy bandwidth: a large device-to-device copy, bytes read + written per second;
- matmul rate: a large dense matmul in the layer dtype, FLOP/s.
For each shape, roofline time = max(expert weight bytes touched / bandwidth,
FLOPs / matmul rate); `% roofline` = roofline time / measured time. Weight bytes touched
counts each expert that received at least one token once (w13 + w2 + scales).

On CUDA the forward is timed as CUDA-graph replays when the pipeline claims graph capture
(eager otherwise; the table says which): median over samples of 10 replays queued back to
back between two CUDA events, after `--settle-s` seconds of the row's work back to back
(`BENCH_SETTLE_S`), so that clocks and power settle.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import moehal
import torch
from moehal.bench_goals import BENCH_SCHEMA, BENCH_SCHEMA_NAME, ISSUE_4_GOALS, PCT_ROOFLINE, is_peer
from moehal.clock_sampler import ClockSampler
from moehal.errors import MoEHalError
from moehal.hardware import detect
from moehal.quant import QuantScheme

SHAPES: dict[str, dict[str, int]] = {
    # name: E (local experts), H, I, top-k
    "deepseek_v3_ep8": dict(num_experts=32, hidden_size=7168, intermediate_size=2048, top_k=8),
    "qwen3_30b_a3b": dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8),
    "mixtral_8x7b": dict(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2),
    # tiny shapes so the machinery runs anywhere (CI, CPU)
    "tiny": dict(num_experts=8, hidden_size=128, intermediate_size=64, top_k=2),
}
DEFAULT_TOKENS = (1, 4, 16, 64, 128, 512, 1024, 4096)
# Tuned-shape declarations (`Implementation.tuned_shapes`) look for paths up to the benchmark's
# largest batch, the max_tokens its layers are built for
TUNED_MAX_TOKENS = max(DEFAULT_TOKENS)


@dataclass
class Ceilings:
    """What the device reached in this run: the roofline's terms (`measure_ceilings`)."""

    copy_bytes_per_s: float  # a copy's reads and writes: the issue's bandwidth term
    matmul_flops_per_s: float  # a dense bf16 matmul
    device: str
    # a read-only stream (`stream_bytes`), which weight streaming resembles more than a copy does: the
    # faster of `torch.sum` and, on GPUs, moehal's streaming kernel (`triton_stream`). On an H200
    # the sum alone measured the copy's rate (4.14 TB/s) while decode rows streamed their weights
    # at up to 4.38 TB/s (docs/device-runs/2026-11-27-session42)
    read_bytes_per_s: float = float("nan")
    # a dense fp8 matmul (`torch._scaled_mm`) where the GPU has fp8 tensor cores: the FLOP term
    # of fp8 rows (twice the bf16 rate on SM90; NaN where not measured: fp8 rows then use bf16's)
    fp8_matmul_flops_per_s: float = float("nan")
    # what measured `read_bytes_per_s`: "torch.sum" or "triton_stream(block, warps, programs)"
    read_kernel: str = "torch.sum"
    # bytes of the buffer the copy reads (and writes) and the read-only stream reads
    # (`STREAM_BYTES`; 1 GiB in records before session 43)
    stream_bytes: int = 1 << 30
    # a dense int8 matmul (`torch._int_mm`, int32 out), operations per second: the compute term of
    # w8a8_int8 rows, measured where the run has such rows (NaN otherwise, or where torch cannot
    # run it: those rows then get no % of roofline, never one against bf16's rate)
    int8_matmul_ops_per_s: float = float("nan")

    def matmul_rate(self, quant: QuantScheme) -> tuple[float, str]:
        """The dense rate a row of `quant` is held to, and its name: fp8's own where measured;
        int8's own, or NaN ("none: no int8 ceiling") where not measured or measured below bf16's
        (torch's int8 GEMM on a slow path, no ceiling): int8 tensor cores run
        about twice bf16's rate, and held to bf16's a compute-bound int8 row would read up to
        2x too high (as fp8 rows did before session 42). nvfp4 has no rate of its own: bf16's."""
        kind = quant.kind.value
        if kind.startswith("fp8") and math.isfinite(self.fp8_matmul_flops_per_s):
            return self.fp8_matmul_flops_per_s, "fp8"
        if kind == "w8a8_int8":
            # int8 tensor cores run at least bf16's rate: a measured rate below it is torch's
            # int8 GEMM taking a slow path, no ceiling (held to it, int8 rows read above 100%)
            if math.isfinite(self.int8_matmul_ops_per_s) and self.int8_matmul_ops_per_s >= self.matmul_flops_per_s:
                return self.int8_matmul_ops_per_s, "int8"
            return math.nan, NO_INT8_CEILING
        return self.matmul_flops_per_s, "bf16"


# `Row.roofline_matmul` of an int8 row without an int8 ceiling: its roofline and % are NaN
NO_INT8_CEILING = "none: no int8 ceiling"


@dataclass
class Row:
    shape: str
    backend: str
    pipeline: str
    quant: str
    tokens: int
    time_us: float
    timing: str  # 'graph' or 'eager'
    weight_bytes: int
    flops: int
    roofline_us: float
    pct_roofline: float
    tb_per_s: float
    tflop_per_s: float
    host_us: float = float("nan")  # CUDA only: host time per eager forward call (launch overhead)
    breakdown: dict[str, float] | None = None  # --breakdown: kernel (or op) -> us per forward
    # CUDA only: the same with `cuda_graph_tokens` (eager calls replay graphs), the same input
    # tensors at every call (replayed without an input copy, moehal.graphs) ...
    host_graph_us: float = float("nan")
    # ... and other input tensors at every call (copied into the graph's inputs first)
    host_graph_new_us: float = float("nan")
    # ... and the same input tensors and output buffer (`out=`) at every call: one replay
    host_graph_out_us: float = float("nan")
    # CUDA with nvidia-smi: median SM clock and board power while the row was timed
    # (`moehal.clock_sampler`; a row at its power cap runs well under boost clocks)
    sm_mhz: float = float("nan")
    power_w: float = float("nan")
    # CUDA only: host time per call of `HOST_BACK_TO_BACK` calls made back to back from an idle
    # GPU, as an engine's loop makes them (`host_time_back_to_back`): plain eager ...
    host_b2b_us: float = float("nan")
    # ... and replaying graphs with the same inputs and `out=`
    host_graph_out_b2b_us: float = float("nan")
    # `--rounds`: which pass over the run's cells measured this row (0 in a run of one round)
    round: int = 0
    # which dense rate the roofline's FLOP term used (`Ceilings.matmul_rate`; rows from before
    # 2026-11-27 session 42 held every scheme to bf16's)
    roofline_matmul: str = "bf16"
    # % of a roofline whose bandwidth term is the larger of the copy and the read-only rate
    # (what the issue's copy bandwidth would read under a read-only ceiling)
    pct_roofline_read: float = float("nan")
    # a peer's rows: which kernel config the peer ran, where it can say ("tuned", "default", ...;
    # `moehal.integrations.sglang.config_source`); "" for moehal's rows and older runs
    peer_config: str = ""
    # the row's output, computed once untimed, against the reference pipeline on the same device
    # with the same weights and routing, at conformance's tolerances (`check_output`): "pass",
    # "fail", or "" (not checked: `--no-check`, the reference's own rows, older runs)
    check: str = ""
    check_rel_l2: float = float("nan")
    # `pct_roofline` above 100: the row ran faster than the roofline measured in this run allows
    # (`OVER_CEILING_NOTE`); files before session 59 lack it (read `pct_roofline` > 100)
    over_ceiling: bool = False
    # the seed of the row's routing and inputs (`bench_inputs`: the token count); -1 in files
    # before session 59, which drew them the same way
    routing_seed: int = -1


# What a row above 100% of its roofline means, as the table's footnote says it
OVER_CEILING_NOTE = (
    "* above 100% of roofline: the row ran faster than this run's ceilings allow. The copy ceiling "
    "(the issue's bandwidth term) counts reads and writes and sits a few % below a read-only "
    "stream (pct_roofline_read in the JSON uses the faster), and a dense matmul's rate can sit "
    "below the layer's own GEMMs. So the ceiling, not the row, is off: such a % is no measure of "
    "headroom, and rows near it read high too."
)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# Graph timings queue this many replays back to back per sample (as a model's graph runs its
# layers back to back): one replay alone between two events measured host jitter at decode
# sizes (Qwen3-30B-A3B at 1 token: 45-62 us across runs of the same code, on H100s).
GRAPH_REPLAYS_PER_SAMPLE = 10

# Every CUDA timing (the ceilings, each row, SGLang's rows) starts after this long of the same
# work back to back, so that it is taken where the GPU settles under that load. An H100 under
# prefill-sized MoE layers reaches its 700 W cap within about 0.3 s and then clocks down from
# 1980 MHz to 1100-1750 MHz (nvidia-smi at 50 ms, docs/device-runs/2026-11-23-session9): a
# timing of a few tens of milliseconds measures boost clocks that no sustained run keeps, and
# one that straddles the transition depends on what ran before it.
SETTLE_S = 0.5
# `moehal bench`'s default for its rows and ceilings: half a second can still end inside the
# limiter's transient. At Qwen3-30B-A3B 4096 tokens on an H100 it put one path at 1500 MHz and
# another at 1658 MHz, 9% apart from what 2 s probes of the same paths measured; with 2 s the
# bench agreed with them within 3% (docs/device-runs/2026-11-23-session12). The tile tuner keeps
# `SETTLE_S`: it compares candidates, and 2 s each would cut its search by three.
BENCH_SETTLE_S = 2.0


def settle(fn: Callable[[], Any], dev: torch.device, seconds: float = SETTLE_S, batch: int = 10) -> None:
    """On CUDA, `fn` back to back (synchronizing every `batch` calls) for `seconds`: what is
    timed next runs at the clocks the GPU holds under this work (see `SETTLE_S`)."""
    if dev.type != "cuda":
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        _sync(dev)


# Calls before any timing's settle (`time_call`): compilation, autotuning, first allocations
WARMUP_CALLS = 3


def time_call(
    fn: Callable[[], Any],
    dev: torch.device,
    reps: int,
    warmup: int = WARMUP_CALLS,
    warmup_s: float = SETTLE_S,
    per_sample: int = 1,
) -> float:
    """Median seconds per call over `reps` samples; on CUDA each sample times `per_sample` calls
    queued back to back between two events (for graph replays of decode-sized forwards, whose
    GPU time is shorter than the host's cost of one replay call: a single replay between events
    measures the host as much as the GPU). Warm-up: `warmup` calls, and on CUDA back-to-back calls for at
    least `warmup_s` (`SETTLE_S`: clocks and power settled under this load, see there)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    settle(fn, dev, warmup_s)
    samples = []
    if dev.type == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_sample):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / per_sample)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def host_time(fn: Callable[[], Any], dev: torch.device, calls: int = 100) -> float:
    """Median seconds of host time per eager call on CUDA: each call starts with the GPU idle
    and is timed until it returns (its kernels queued, not finished), so this is Python and
    launch overhead (the issue's "host overhead under 20 us per forward outside graphs"),
    without back-pressure from earlier calls. NaN off CUDA. (`host_time_back_to_back` with one
    call per sample.)"""
    return host_time_back_to_back(fn, dev, queued=1, rounds=calls)


# Calls per sample of `host_time_back_to_back`: a model queues its layers back to back, and
# 8 graph replays or eager forwards stay far below the launch queue's depth.
HOST_BACK_TO_BACK = 8


def host_time_back_to_back(
    fn: Callable[[], Any], dev: torch.device, queued: int = HOST_BACK_TO_BACK, rounds: int = 30
) -> float:
    """Median seconds of host time per call, over `queued` calls made back to back from an idle
    GPU (each returns once its kernels are queued), NaN off CUDA.

    `host_time` times one call right after `synchronize`, so it adds whatever the host pays to
    resume after waiting there: on the device hosts a 1-kernel graph replay took 3 us after no
    wait and 7 us (an H100 host) to 30 us (a 2 x H200 host) after a 3 ms one, and rows with a longer
    GPU time read slower (docs/device-runs/2026-11-24-session17). In an engine's step the host
    waits once, then queues every layer: this is the per-layer host time it sees."""
    if dev.type != "cuda":
        return float("nan")
    fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(queued):
            fn()
        samples.append((time.perf_counter() - t0) / queued)
    torch.cuda.synchronize(dev)
    return statistics.median(samples)


def kernel_breakdown(fn: Callable[[], Any], dev: torch.device, calls: int = 5, top: int = 8) -> dict[str, float]:
    """Where one forward's device time goes: microseconds per call for each kernel (CUDA),
    or each operator's self time (CPU), from torch.profiler over `calls` eager calls. The
    `top` largest are named; the rest are summed under "(other)"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    fn()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync(dev)
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if cuda and ev.device_type != DeviceType.CUDA:
            continue
        us = (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / calls
        if us > 0:
            times[ev.key] = times.get(ev.key, 0.0) + us
    merged: dict[str, float] = {}  # template instances of one kernel share a short name: sum them
    for k, v in times.items():
        merged[_short_kernel_name(k)] = merged.get(_short_kernel_name(k), 0.0) + v
    ranked = sorted(merged.items(), key=lambda kv: -kv[1])
    out = {k: round(v, 2) for k, v in ranked[:top]}
    rest = sum(v for _, v in ranked[top:])
    if rest > 0:
        out["(other)"] = round(rest, 2)
    return out


def _short_kernel_name(name: str) -> str:
    """Kernel names from the profiler can be whole C++ template signatures: keep the head."""
    head = name.split("(")[0].split("<")[0].strip()
    return head[-60:] if head else name[:60]


# The streams' buffer (the copy's source and destination, the read's input) on a GPU, where its
# memory allows: an H100 read 1 GiB at 2.85 TB/s and 4 GiB at 3.05 TB/s (torch.sum; a copy or
# a launch costs a fixed few tens of microseconds that a short stream does not hide), while a
# DeepSeek-V3 EP8 decode row streamed its 2.7 GB of weights at 3.02 TB/s
# (docs/device-runs/2026-11-27-session43). Rows read up to a few GB per forward.
STREAM_BYTES = 4 << 30


def stream_elements(dev: torch.device) -> int:
    """float32 elements of each ceiling stream's buffer: `STREAM_BYTES` on a GPU whose free
    memory holds the copy's two buffers twice over (else 1 GiB, as before session 43); 4M on
    the CPU (its rate is only for the tests' tables)."""
    if dev.type != "cuda":
        return 1 << 22
    free, _ = torch.cuda.mem_get_info(dev)
    return STREAM_BYTES // 4 if free >= 4 * STREAM_BYTES else 1 << 28


def ceiling_reps(dev: torch.device) -> tuple[int, int]:
    """Samples (the median of which is taken) of each stream ceiling, and of each matmul one."""
    return (20, 10) if dev.type == "cuda" else (5, 3)


def measure_ceilings(
    dev: torch.device, dtype: torch.dtype = torch.bfloat16, settle_s: float = SETTLE_S, int8: bool = False
) -> Ceilings:
    """Copy bandwidth and dense matmul rate, each timed as the rows are (`time_call`: after
    `settle_s` of the same work, so at the clocks the GPU holds under it); `int8`: also a dense
    int8 matmul's rate (`_int8_matmul_rate`), for w8a8_int8 rows."""
    big = stream_elements(dev)
    src = torch.randn(big, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    stream_reps, matmul_reps = ceiling_reps(dev)
    t = time_call(functools.partial(dst.copy_, src), dev, reps=stream_reps, warmup_s=settle_s)
    copy = 2 * src.numel() * src.element_size() / t
    n = 8192 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    t = time_call(lambda: a @ b, dev, reps=matmul_reps, warmup_s=settle_s)
    matmul = 2 * n**3 / t
    t = time_call(src.sum, dev, reps=stream_reps, warmup_s=settle_s)
    read, read_kernel = src.numel() * src.element_size() / t, "torch.sum"
    for rate, name in _stream_read_rates(src, settle_s):
        if rate > read:
            read, read_kernel = rate, name
    fp8 = _fp8_matmul_rate(dev, n, settle_s)
    int8_rate = _int8_matmul_rate(dev, n, settle_s) if int8 else math.nan
    nbytes = big * src.element_size()
    del src, dst
    if dev.type == "cuda":  # the streams' 8 GiB back to the device, not kept for the rows
        torch.cuda.empty_cache()
    return Ceilings(copy, matmul, detect(dev).describe(), read, fp8, read_kernel, nbytes, int8_rate)


# (elements per step, warps, programs per SM) of the streaming-read kernel that the ceiling
# tries: the fastest one counts. More programs per SM keep more loads in flight; wider steps
# issue fewer loop iterations.
STREAM_READ_CONFIGS = ((4096, 8, 8), (8192, 8, 4), (2048, 4, 16), (8192, 16, 2))


def _stream_read_rates(src: torch.Tensor, settle_s: float) -> list[tuple[float, str]]:
    """Bytes/s of `moehal.kernels.triton_stream` over `src` per `STREAM_READ_CONFIGS` entry, on
    GPUs where Triton compiles (none on CPU or under TRITON_INTERPRET: the interpreter's rate
    says nothing about the device). Each config settles `settle_s` / 4 after the first's full
    settle: the GPU holds the same streaming load from one config to the next."""
    from moehal.kernels.host import interpreting

    dev = src.device
    if dev.type != "cuda" or interpreting():
        return []
    try:
        from moehal.kernels.triton_stream import stream_read
    except ImportError:  # no triton
        return []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rates = []
    for i, (block, warps, per_sm) in enumerate(STREAM_READ_CONFIGS):
        partials = torch.empty(sms * per_sm, device=dev, dtype=torch.float32)
        fn = functools.partial(stream_read, src, partials, block, warps)
        t = time_call(fn, dev, reps=ceiling_reps(dev)[0], warmup_s=settle_s if i == 0 else settle_s / 4)
        rates.append((src.numel() * src.element_size() / t, f"triton_stream({block}, {warps}, {sms * per_sm})"))
    return rates


def _fp8_matmul_rate(dev: torch.device, n: int, settle_s: float) -> float:
    """Dense e4m3 matmul FLOP/s (`torch._scaled_mm`, per-tensor scales, bf16 out) on GPUs with
    fp8 tensor cores (CUDA SM89+); NaN elsewhere or where torch cannot run it."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
        return math.nan
    try:
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as it wants
        one = torch.ones((), device=dev)
        mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        mm()
    except (RuntimeError, AttributeError):
        return math.nan
    return 2 * n**3 / time_call(mm, dev, reps=ceiling_reps(dev)[1], warmup_s=settle_s)


def _int8_matmul_rate(dev: torch.device, n: int, settle_s: float) -> float:
    """Dense int8 matmul operations per second (`torch._int_mm`: int8 x int8 -> int32, the
    int8 tensor-core path on CUDA), an `n` x `n` x `n` product; NaN where torch cannot run it.
    The second operand is column-major, the layout cuBLASLt's int8 kernels take (as for fp8
    above): with a row-major one an H200 measured 126 TOP/s, below its bf16 rate, and an int8
    layer read 214% of that "ceiling" (session 59)."""
    try:
        a = torch.randint(-128, 128, (n, n), device=dev, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, n), device=dev, dtype=torch.int8).t()  # column-major
        mm = functools.partial(torch._int_mm, a, b)
        mm()
    except (RuntimeError, AttributeError, NotImplementedError):
        return math.nan
    return 2 * n**3 / time_call(mm, dev, reps=ceiling_reps(dev)[1], warmup_s=settle_s)


def _weight_bytes_per_expert(layer_weights: moehal.ExpertWeights) -> float:
    e = layer_weights.w13.shape[0]
    total = 0
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        t = getattr(layer_weights, name)
        if t is not None and t.dim() > 1:
            total += t.numel() * t.element_size()
    return total / e


# One shape's weights at a time (the big shapes take GBs): its float weights, and each scheme's
# quantized set. Interleaved rounds alternate schemes within a shape, so a set per scheme is
# kept until the shape changes, rather than made again at every row.
_FLOAT_WEIGHTS: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_QUANTIZED_WEIGHTS: dict[tuple[str, str, str], moehal.ExpertWeights] = {}


def _weights(
    shape: str, cfg: moehal.MoEConfig, quant: QuantScheme, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, moehal.ExpertWeights]:
    """Float and quantized weights, made on the device once per (shape, quant) while rows of
    one shape follow each other."""
    key = (shape, str(dev))
    if key not in _FLOAT_WEIGHTS:
        _FLOAT_WEIGHTS.clear()
        _QUANTIZED_WEIGHTS.clear()
        gen = torch.Generator(dev).manual_seed(0)
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        w13 = torch.randn(e, cfg.w13_rows, h, generator=gen, device=dev) / h**0.5
        w2 = torch.randn(e, h, i, generator=gen, device=dev) / i**0.5
        _FLOAT_WEIGHTS[key] = (w13, w2, torch.randn(64, h, generator=gen, device=dev))
    w13, w2, calib = _FLOAT_WEIGHTS[key]
    qkey = (shape, quant.name, str(dev))
    if qkey not in _QUANTIZED_WEIGHTS:
        _QUANTIZED_WEIGHTS[qkey] = moehal.quantize_weights(cfg, quant, w13, w2, calibration_input=calib)
    return w13, w2, _QUANTIZED_WEIGHTS[qkey]


# The reference pipeline's output per (shape, scheme, tokens) of the shape in progress: every
# backend's row of a cell (and every round's) is checked against one computation
_REFERENCE_OUT: dict[tuple[str, str, int, str], torch.Tensor] = {}


def check_output(
    shape: str,
    cfg: moehal.MoEConfig,
    quant: QuantScheme,
    weights: moehal.ExpertWeights,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    got: torch.Tensor,
    registry: moehal.Registry,
) -> tuple[str, float]:
    """("pass" or "fail", rel_l2) of a row's output `got` against the reference pipeline's on the
    same device, weights and `inputs` (hidden, ids, weights), at conformance's tolerance for the
    scheme (`moehal_conformance.tolerances`): a time is reported next to whether its numbers are
    right. The reference runs on the row's device (a check, not conformance's CPU oracle)."""
    from moehal.reference.oracle import reference_layer
    from moehal_conformance.tolerances import compare, tolerance_for

    x = inputs[0]
    key = (shape, quant.name, int(x.shape[0]), str(x.device))
    ref = _REFERENCE_OUT.get(key)
    if ref is None:
        if any(k[0] != shape for k in _REFERENCE_OUT):
            _REFERENCE_OUT.clear()
        oracle = reference_layer(cfg, quant, x.device, registry=registry, validate=False)
        oracle.load_weights(weights)
        ref = _REFERENCE_OUT[key] = oracle(*inputs).float().cpu()
        del oracle
    c = compare(got.float().cpu(), ref, tolerance_for(quant, cfg.dtype))
    return ("pass" if c.ok else "fail"), c.rel_l2


def release_layers(dev: torch.device) -> int:
    """Before rows of another shape or batch bound: forget the process-wide workspaces that
    the previous rows' layers bound (`release_workspaces`), collect the dead layers (reference
    cycles hold their CUDA graphs and pools) and return the cached blocks to the device. Returns
    the workspace bytes released. The workspaces are meant to be shared by an engine's layers of
    one shape; a benchmark of many shapes and batch bounds otherwise keeps every set it built."""
    import gc
    import sys

    permute = sys.modules.get("moehal.kernels.triton_permute")  # not imported: no workspace exists
    held = permute.release_workspaces(dev) if permute is not None else 0
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return held


def _pipeline_named(
    qualname: str, cfg: moehal.MoEConfig, quant: QuantScheme, dev: torch.device, registry: moehal.Registry
) -> moehal.selection.Pipeline:
    """The best accepted pipeline whose experts (or fused forward) is `qualname`, e.g. 'cuda.triton'."""
    req = moehal.BuildRequest(cfg, quant, detect(dev), registry.settings)
    pipes, decisions = moehal.enumerate_pipelines(req, registry, qualname.split(".")[0])
    for p in pipes:
        if p.main.qualname == qualname:
            return p
    why = [d.reason for d in decisions if d.name == qualname]
    raise moehal.NoBackendError(f"{qualname} declines this shape: {why[0] if why else 'not registered'}")


def model_requests(
    impl: moehal.interfaces.Implementation, req: moehal.BuildRequest, max_tokens: int = TUNED_MAX_TOKENS
) -> list[tuple[str, moehal.BuildRequest]]:
    """(name, request) for each of the benchmark's model shapes (`SHAPES`, built for
    `max_tokens`) with each quant scheme `impl` declares, on `req`'s hardware and settings, that
    `impl` accepts there: the configurations a tuned table may cover (`tuned_shapes`)."""
    out = []
    for name, dims in SHAPES.items():
        for quant in sorted(impl.quant_schemes, key=lambda q: q.name):
            cfg = moehal.MoEConfig(**dims, max_tokens=max_tokens)  # type: ignore[arg-type]
            r = moehal.BuildRequest(cfg, quant, req.hardware, req.settings)
            if impl.supports(r).ok:
                out.append((name, r))
    return out


def routing_seed(tokens: int) -> int:
    """The seed of a row's inputs (`bench_inputs`): its token count, so every run of a row, and
    `tools/tile_padding_bound.py`, draws the same routing."""
    return tokens


# How a run measures, as its JSON says it (`method`): what the file's numbers are medians of,
# what timed them, and what the inputs were
ROUTING = (
    "uniform: each token's top-k experts drawn uniformly at random without replacement "
    "(moehal.bench.bench_inputs), one draw per row, seeded by routing_seed"
)


def method(reps: int, dev: torch.device) -> dict[str, Any]:
    """The `method` object of `moehal bench --out`'s JSON: how each row's time was taken."""
    cuda = dev.type == "cuda"
    return {
        "statistic": "median",
        "reps": reps,  # samples per row, the median of which is time_us
        "timer": "CUDA events" if cuda else "wall clock (time.perf_counter)",
        # calls per sample, by the row's `timing`: graph replays queued back to back between
        # two events, divided by their number
        "calls_per_sample": {"graph": GRAPH_REPLAYS_PER_SAMPLE, "eager": 1},
        "warmup_calls": WARMUP_CALLS,  # then `settle_s` of the row's work back to back (CUDA)
        "routing": ROUTING,
        "routing_seed": "each row's token count (its `routing_seed`)",
        "inputs": "the same inputs (hidden states, routing, weights) at every call and replay of a row",
        "l2_flush": False,  # nothing evicts the L2 between samples or replays
        "ceiling_reps": dict(zip(("stream", "matmul"), ceiling_reps(dev))),  # samples per ceiling (median)
    }


def bench_inputs(cfg: moehal.MoEConfig, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The benchmark's inputs for one row, on the CPU and seeded by `routing_seed` (so every run,
    and `tools/tile_padding_bound.py`, sees the same routing): hidden states `[T, H]` float32,
    top-k ids `[T, K]` int64 drawn uniformly without replacement per token, weights `[T, K]`."""
    gen = torch.Generator().manual_seed(routing_seed(tokens))
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    # argsort of noise: top-k without replacement, vectorized (no Python loop over tokens)
    ids = torch.rand(tokens, cfg.num_experts, generator=gen).argsort(dim=1)[:, : cfg.top_k]
    return x, ids, torch.rand(tokens, cfg.top_k, generator=gen) + 0.1


def bench_one(
    shape: str,
    cfg: moehal.MoEConfig,
    quant: QuantScheme,
    backend: str,
    tokens: int,
    dev: torch.device,
    ceil: Ceilings,
    reps: int,
    registry: moehal.Registry,
    breakdown: bool = False,
    sampler: ClockSampler | None = None,
    settle_s: float = BENCH_SETTLE_S,
    host_columns: bool = True,
    check_outputs: bool = True,
) -> Row:
    """One row: the layer of `backend` (or a peer's experts function) at `tokens`, timed as a
    CUDA-graph replay where it captures; `host_columns`: also the host-time columns (NaN without);
    `check_outputs`: first check its output against the reference pipeline (`check_output`)."""
    if is_peer(backend) and quant.is_quantized:  # before the weights are made: they cost seconds
        raise moehal.NotSupportedError(f"the {backend} peer takes float (bf16) weights only")
    w13, w2, weights = _weights(shape, cfg, quant, dev)
    h = cfg.hidden_size
    x, ids, wts = bench_inputs(cfg, tokens)
    ids, wts = ids.to(dev, torch.int32), wts.to(dev)
    xd = x.to(dev, cfg.dtype)
    capturable = False
    layer: moehal.MoELayer | None = None
    peer_config = ""
    if backend.startswith("transformers:") or backend == "sglang":
        # A peer: another library's experts function on the same float weights and routing.
        if backend == "sglang":
            from moehal.integrations import sglang

            call = sglang.peer_callable(cfg, w13, w2, dev)
            peer_config = sglang.config_source(cfg)  # before its first call: see there
            capturable = True  # SGLang captures its MoE into CUDA graphs when serving
        else:
            from moehal.integrations.transformers import peer_callable

            call = peer_callable(backend.split(":", 1)[1], cfg, w13, w2, dev)
        fn: Callable[[], Any] = lambda: call(xd, ids, wts)
        pipeline = backend
    else:
        if backend == "reference":  # the pure reference pipeline, not a vendor's dispatcher in front of it
            from moehal.reference.oracle import reference_layer

            layer = reference_layer(cfg, quant, dev, registry=registry, validate=False)
        else:
            pipe = _pipeline_named(backend, cfg, quant, dev, registry) if "." in backend else None
            layer = moehal.MoELayer(
                cfg, quant, backend=backend.split(".")[0], device=dev, registry=registry, validate=False, pipeline=pipe
            )
        layer.load_weights(weights)
        fn = lambda: layer(xd, ids, wts)
        pipeline, capturable = layer.plan.pipeline.name, layer.plan.pipeline.graph_capturable
    check, check_rel = "", math.nan
    if check_outputs and backend != "reference":  # once, untimed: is the output right?
        check, check_rel = check_output(shape, cfg, quant, weights, (xd, ids, wts), fn(), registry)
    timing = "eager"
    nan = float("nan")
    host, host_b2b = (host_time(fn, dev), host_time_back_to_back(fn, dev)) if host_columns else (nan, nan)
    host_graph = host_graph_new = host_graph_out = host_graph_out_b2b = nan
    if host_columns and dev.type == "cuda" and capturable and layer is not None:
        layer.cuda_graph_tokens = tokens  # eager calls replay a captured graph (moehal.graphs)
        host_graph = host_time(fn, dev)
        sets = [(xd.clone(), ids.clone(), wts.clone()) for _ in range(3)]  # other addresses at every call
        turn = iter(range(1 << 30))
        host_graph_new = host_time(lambda: layer(*sets[next(turn) % 3]), dev)
        out_buf = torch.empty_like(xd)
        host_graph_out = host_time(lambda: layer(xd, ids, wts, out=out_buf), dev)
        host_graph_out_b2b = host_time_back_to_back(lambda: layer(xd, ids, wts, out=out_buf), dev)
        layer.cuda_graph_tokens = 0
    parts = kernel_breakdown(fn, dev) if breakdown else None
    if dev.type == "cuda" and capturable:
        fn, timing = _graphed(fn), "graph"
    t0 = time.time()
    t = time_call(fn, dev, reps, warmup_s=settle_s, per_sample=GRAPH_REPLAYS_PER_SAMPLE if timing == "graph" else 1)
    # the clocks from the second half of the settling on: a decode row's samples alone are
    # shorter than the sampling period
    mhz, watts = sampler.medians(t0 + settle_s / 2, time.time()) if sampler is not None else (math.nan, math.nan)
    touched = int(torch.unique(ids).numel())
    wbytes = int(_weight_bytes_per_expert(weights) * touched)
    flops = 2 * tokens * cfg.top_k * (h * cfg.w13_rows + cfg.intermediate_size * h)
    rate, rate_name = ceil.matmul_rate(quant)
    read = ceil.read_bytes_per_s
    if math.isfinite(rate):
        roof = max(wbytes / ceil.copy_bytes_per_s, flops / rate)
        roof_read = max(wbytes / max(ceil.copy_bytes_per_s, read), flops / rate) if math.isfinite(read) else math.nan
    else:  # no rate to hold this scheme to (`NO_INT8_CEILING`): no roofline, rather than a wrong one
        roof = roof_read = math.nan
    return Row(
        shape,
        backend,
        pipeline,
        quant.name,
        tokens,
        t * 1e6,
        timing,
        wbytes,
        flops,
        roof * 1e6,
        100 * roof / t,
        wbytes / t / 1e12,
        flops / t / 1e12,
        host * 1e6,
        parts,
        host_graph * 1e6,
        host_graph_new * 1e6,
        host_graph_out * 1e6,
        mhz,
        watts,
        host_b2b_us=host_b2b * 1e6,
        host_graph_out_b2b_us=host_graph_out_b2b * 1e6,
        roofline_matmul=rate_name,
        pct_roofline_read=100 * roof_read / t,
        peer_config=peer_config,
        check=check,
        check_rel_l2=check_rel,
        over_ceiling=roof > t,
        routing_seed=routing_seed(tokens),
    )


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured into a CUDA graph (after two warm-up calls on a side stream): its replay."""
    from moehal.graphs import capture

    graph, _ = capture(fn, warmup=2)
    return graph.replay


def medians_by_tokens(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """(tokens, value) points of one series, several per token count in a run of `--rounds`:
    one (tokens, median) per token count, in token order."""
    by_tokens: dict[int, list[float]] = {}
    for t, v in points:
        by_tokens.setdefault(t, []).append(v)
    return [(t, statistics.median(by_tokens[t])) for t in sorted(by_tokens)]


# The goals drawn on the plot: (% of roofline, token range) of the issue's % of roofline goals
# (`moehal.bench_goals.ISSUE_4_GOALS`: 90% at 16-128 tokens, 75% at 1024-4096), bf16 rows
PLOT_GOALS = tuple(
    (g.target, g.min_tokens, g.max_tokens or g.min_tokens) for g in ISSUE_4_GOALS if g.metric == PCT_ROOFLINE
)


def figure(rows: Sequence[Row], ceil: Ceilings | None = None, date: str = "") -> Any:
    """The plot of `moehal bench --out` (a matplotlib Figure; ImportError without matplotlib):
    per shape, % of roofline against tokens, one marker per round and a thin line through each
    token count's median (drawn at the token counts measured only); rows above 100% ringed in
    red; the bf16 goals' thresholds over their token ranges. The title names the device and the
    date, the caption the ceilings; each series names the matmul rate its roofline used (fp8
    rows: fp8's, where measured), so fp8 and bf16 are each against their own roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in rows})
    fig, axes = plt.subplots(1, max(len(shapes), 1), figsize=(5 * max(len(shapes), 1), 4.6), squeeze=False,
                             sharey=True)  # fmt: skip
    top = max([105.0, *(r.pct_roofline * 1.05 for r in rows if math.isfinite(r.pct_roofline))])
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r.shape == shape and math.isfinite(r.pct_roofline)]  # (int8 without its rate)
        for key in sorted({(r.backend, r.quant) for r in mine}):
            series = [r for r in mine if (r.backend, r.quant) == key]
            basis = "/".join(sorted({r.roofline_matmul for r in series}))
            pts = sorted((r.tokens, r.pct_roofline) for r in series)
            # markers where measured (every round), a thin line through the medians
            (line,) = ax.plot(*zip(*medians_by_tokens(pts)), "-", lw=0.8, alpha=0.7)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=line.get_color(), ms=4,
                    label=f"{key[0]} {key[1]} (roofline: {basis} matmul rate)")  # fmt: skip
        over = [(r.tokens, r.pct_roofline) for r in mine if r.pct_roofline > 100]
        if over:
            ax.plot(*zip(*over), "o", ms=9, mfc="none", mec="red", mew=1.2, label="above 100%: ceiling exceeded")
        tokens = sorted({r.tokens for r in mine})
        for pct, lo, hi in PLOT_GOALS:  # where the run has token counts in the goal's range
            if not any(lo <= t <= hi for t in tokens):
                continue
            span = (max(lo, tokens[0]), min(hi, tokens[-1]))  # within the measured counts, where that is a span
            ax.plot(span if span[0] < span[1] else (lo, hi), (pct, pct), "--", color="grey", lw=1,
                    label=f"goal: {pct:.0f}% (bf16, {lo}-{hi} tokens)")  # fmt: skip
        ax.axhline(100, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.set_ylim(0, top)
        ax.set_title(shape)
        ax.set_xlabel("tokens (measured counts only)")
        ax.set_ylabel("% of roofline (copy bandwidth, matmul rate)")
        ax.legend(fontsize=6, loc="lower right")
    device = ceil.device if ceil is not None else "device not recorded"
    fig.suptitle(f"moehal bench: {device}, {date or 'date not recorded'}", fontsize=10)
    if ceil is not None:
        fp8 = ", no fp8 matmul rate (fp8 rows: bf16's)"
        if math.isfinite(ceil.fp8_matmul_flops_per_s):
            fp8 = f", fp8 matmul {ceil.fp8_matmul_flops_per_s / 1e12:.0f} TFLOP/s"
        fig.text(
            0.5, 0.01,
            f"ceilings measured in this run: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s (reads + writes; "
            f"read-only stream {ceil.read_bytes_per_s / 1e12:.2f} TB/s, not used for this %), bf16 matmul "
            f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s{fp8}. Timing: "
            + "/".join(sorted({r.timing for r in rows})) + ". One marker per round.",
            ha="center", va="bottom", fontsize=7, wrap=True,
        )  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


def plot(rows: list[Row], path: Path, ceil: Ceilings | None = None, date: str = "") -> Path | None:
    """`figure` written to `path` (whole or not at all: `WriteError`); None without matplotlib."""
    try:
        import matplotlib.pyplot as plt

        fig = figure(rows, ceil, date)
    except ImportError:
        return None
    try:  # written whole or not at all, as the JSON
        _write(path, lambda part: fig.savefig(part, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return path


def breakdown_table(rows: Sequence[Row]) -> Any:
    """One line per row: its kernels by device time per forward, largest first (fitted to the
    console: `moehal.cli.tables.FittedTable`)."""
    from moehal.cli.tables import FittedTable
    from rich.table import Table

    t = Table(title="where the time goes (us per forward, eager, profiler)", title_justify="left")
    for col in ("shape", "backend", "quant", "tokens", "kernels"):
        t.add_column(col)
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in (r.breakdown or {}).items())
        t.add_row(r.shape, r.backend, r.quant, str(r.tokens), parts or "-")
    return FittedTable(t, keys=4)


class _DefaultsHelp(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help that names an option's default where it has one to name (not None, False, or a
    default its help already explains); the epilog as written (its exit-status table)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _seconds(text: str) -> float:
    """An argparse `type`: a finite number of seconds, 0 or more."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text}")
    return x


def _token_counts(text: str) -> list[int]:
    """An argparse `type`: a comma list of positive token counts."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive integers, got {text}")
    return counts


def _transformers_peers() -> list[str] | None:
    """The names of transformers' experts functions (`--backends transformers:NAME`), whether or
    not they run on this machine; None where transformers is not installed."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return sorted(ALL_EXPERTS_FUNCTIONS.keys())


def backend_names(registry: moehal.Registry) -> list[str]:
    """What `--backends` takes besides 'transformers:NAME': auto, every registered backend
    (loaded or not: one that failed to load has its rows skipped, saying why), every experts
    kernel and fused forward by qualified name (cuda.triton), and the peers sglang and peers."""
    registered = sorted({r.name for r in registry.plugins.values()})
    impls = sorted(i.qualname for i in (*registry.experts, *registry.fused))
    return ["auto", *registered, *impls, "sglang", "peers"]


def unknown_backends(names: Sequence[str], registry: moehal.Registry) -> list[str]:
    """The names in `names` that `--backends` does not know (`backend_names`): typos, checked
    before anything is measured. A 'transformers:NAME' must name one of transformers'
    experts functions where transformers is installed."""
    known = set(backend_names(registry))
    loaded = set(registry.loaded_backends())
    unknown = []
    for name in names:
        if name in known:
            continue
        if name.startswith("transformers:"):
            peers = _transformers_peers()
            if peers is None or name.split(":", 1)[1] in peers:
                continue
        elif "." in name and name.split(".")[0] in known - loaded:  # a plugin that did not load: unknowable
            continue
        unknown.append(name)
    return unknown


EPILOG = """\
Off CUDA the host-time columns are left out (they time eager calls against a GPU's queue) and
the TB/s and TFLOP/s columns are small: the shapes are GPU-sized, so on a CPU try --shapes tiny.

"weight TB/s" is the expert weight bytes the row touches, in the checkpoint's format (quantized
bytes and their scales), per second: not the DRAM traffic, which is larger where a path
dequantizes weights first (nvfp4 on SM90 reads bf16 copies) and adds activations. "TFLOP/s"
counts the routed tokens' FLOPs, not the padding rows a tiled GEMM also computes. A "% roofline"
marked * is above 100%: the row beat the run's ceilings (the footnote under the table says more).

exit status:
  0  the run finished and measured rows, none of them with a wrong output (rows that a backend
     declines are skipped: listed, and saved as such)
  1  a row's output was wrong, no row was measured, or the run was interrupted (Ctrl-C or
     SIGTERM, while measuring or while reporting): --out's JSON keeps the rows measured, with
     "interrupted": true where it lacks some of them
  2  a usage error (an unknown shape, quant scheme or backend; a number out of range; nothing
     to measure), an --out that cannot be written (checked before measuring) or a write that
     failed (the run stops there and prints the table of the rows measured, then the error on
     stderr; a run with wrong outputs keeps its 1), or a device or configuration moehal refuses
  (a moehal failure while measuring is a bug: a traceback, exit 1)"""


def main(argv: Sequence[str] | None = None) -> int:
    """`moehal bench`: the exit status (`EPILOG`). The run takes SIGTERM as Ctrl-C (a time
    limit's signal ends it as an interrupted run, its rows kept); the caller's handler is given
    back however the run ends."""
    import signal

    previous_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)


def _main(argv: Sequence[str] | None) -> int:
    from moehal.cli.common import int_at_least, json_text, make_console
    from moehal.integrations.sglang import sglang_version
    from rich.progress import Progress

    p = argparse.ArgumentParser(
        prog="moehal bench",
        description=(__doc__ or "moehal bench").splitlines()[0],  # (python -OO strips docstrings)
        epilog=EPILOG,
        formatter_class=_DefaultsHelp,
    )
    p.add_argument(
        "--shapes", default="deepseek_v3_ep8,qwen3_30b_a3b,mixtral_8x7b", help=f"comma list of {sorted(SHAPES)}"
    )
    p.add_argument(
        "--tokens", type=_token_counts, default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of token counts"
    )
    p.add_argument(
        "--backends",
        default="auto",
        help="comma list of backends (auto = best) or experts names (cuda.triton); peers: 'sglang' "
        "(SGLang's Triton fused MoE, when importable), 'transformers:NAME', or 'peers' for every transformers one",
    )
    p.add_argument("--quant", default="bf16", help="comma list of quant schemes")
    p.add_argument("--device", default=None, help="torch device (default: the best one torch sees)")
    p.add_argument(
        "--reps", type=int_at_least(1), default=50, help="timed forwards per row (CUDA: replays of one graph)"
    )
    p.add_argument(
        "--settle-s",
        type=_seconds,
        default=BENCH_SETTLE_S,
        help="seconds of each row's (and each ceiling's) work back to back before it is timed, so clocks and "
        "power settle (see moehal.bench.BENCH_SETTLE_S)",
    )
    p.add_argument(
        "--max-reference-tokens", type=int_at_least(0), default=256, help="the reference is slow: cap its tokens"
    )
    p.add_argument(
        "--out",
        default=None,
        help="write OUT.json and OUT.png, after every row; a .json or .png suffix of OUT is replaced "
        "(--out run.json: run.json and run.png), any other is part of the name (--out run.v2: run.v2.json)",
    )
    p.add_argument(
        "--max-tokens",
        type=int_at_least(1),
        default=None,
        help="build every layer for this many tokens (its buffers), as an engine builds its layers once for its "
        "largest batch; default: each row's own token count",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="also profile each row: device time per kernel (CPU: per operator)"
    )
    p.add_argument(
        "--goals", action="store_true", help="also check this run's rows against the goals (moehal.bench_goals)"
    )
    p.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=1,
        help="measure every row this many times, cell by cell: a cell's (shape, tokens) rows of every quant scheme "
        "and backend run next to each other, and the goals compare rows of one round, then take the median "
        "(for ratios such as fp8 against bf16, which a GPU's drift between distant rows can tip)",
    )
    p.add_argument(
        "--no-host", action="store_true", help="skip the host-time columns (NaN): the device times alone, sooner"
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip checking each row's output against the reference pipeline on the device (untimed, once a row)",
    )
    args = p.parse_args(argv)
    # every name and number up front (the numbers: their argparse types): a typo is an error
    # now, not an empty table or a traceback after the ceilings were measured
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    try:
        for q in args.quant.split(","):
            QuantScheme.parse(q)
    except ValueError as exc:  # ConfigError is a ValueError too
        p.error(f"--quant: {exc}")
    token_counts: list[int] = args.tokens
    console = make_console()
    dev = detect(args.device).device
    registry = moehal.discover()
    backends = args.backends.split(",")
    unknown = unknown_backends(backends, registry)
    if unknown:
        peers = _transformers_peers()
        p.error(
            f"--backends: unknown {unknown}; known: {', '.join(backend_names(registry))}, and 'transformers:NAME' "
            + (f"for NAME in {peers}" if peers is not None else "(transformers is not installed)")
        )
    if "peers" in backends:
        from moehal.integrations.transformers import peer_implementations

        backends = [b for b in backends if b != "peers"] + [f"transformers:{n}" for n in peer_implementations(dev)]
    shapes, quants = args.shapes.split(","), args.quant.split(",")
    if args.rounds == 1:  # grouped by scheme and backend, as the table reads
        order = [(s, q, b, t, 0) for s in shapes for q in quants for b in backends for t in token_counts]
    else:  # interleaved: the rows that a goal compares run next to each other, in every round
        cells = [(s, t) for s in shapes for t in token_counts]
        order = [(s, q, b, t, r) for r in range(args.rounds) for s, t in cells for q in quants for b in backends]
    jobs = [j for j in order if not (j[2] == "reference" and j[3] > args.max_reference_tokens)]
    peers_float = [j for j in jobs if not (is_peer(j[2]) and QuantScheme.parse(j[1]).is_quantized)]
    if len(peers_float) < len(jobs):
        console.print("peers take float weights: their rows run for bf16 only", markup=False)
    jobs = peers_float
    if not jobs:
        p.error(
            "nothing to measure: every row is left out (reference rows above --max-reference-tokens "
            f"{args.max_reference_tokens}, peers' rows of quantized schemes, 'peers' with no peer here)"
        )
    out = Path(args.out) if args.out else None
    if out is not None:  # before hours of measurements, not after
        why = out_problem(out)
        if why is not None:
            p.error(f"--out: {why}")
        out_json, out_png = out_paths(out)
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # a time limit's SIGTERM: as Ctrl-C (`main` gives it back)
    sampler = ClockSampler.start(dev)  # None off NVIDIA GPUs: no clock columns
    int8 = any(QuantScheme.parse(j[1]).kind.value == "w8a8_int8" for j in jobs)  # its rows' own ceiling
    try:
        ceil = measure_ceilings(dev, settle_s=args.settle_s, int8=int8)
    except BaseException as exc:
        if sampler is not None:
            sampler.close()
        if not isinstance(exc, KeyboardInterrupt):
            raise
        console.print("interrupted while measuring the ceilings: no row measured, no file written", markup=False)
        return 1
    fp8 = f", fp8 matmul {ceil.fp8_matmul_flops_per_s / 1e12:.3g}" if math.isfinite(ceil.fp8_matmul_flops_per_s) else ""
    int8_text = ""
    if int8:
        int8_rate = ceil.int8_matmul_ops_per_s
        int8_text = ", no int8 matmul rate (torch._int_mm did not run: int8 rows get no % of roofline)"
        if math.isfinite(int8_rate):
            int8_text = f", int8 matmul {int8_rate / 1e12:.3g} TOP/s"
    console.print(
        f"{ceil.device}: copy {ceil.copy_bytes_per_s / 1e12:.3g} TB/s, read {ceil.read_bytes_per_s / 1e12:.3g} TB/s "
        f"({ceil.read_kernel}; streams of {ceil.stream_bytes / 2**30:g} GiB), "
        f"matmul {ceil.matmul_flops_per_s / 1e12:.3g}{fp8} TFLOP/s{int8_text} (measured now)"
    )
    if args.max_tokens:
        console.print(f"every layer is built for max_tokens={args.max_tokens} (or its row's count, if larger)")
    run_method = method(args.reps, dev)
    rows: list[Row] = []
    # rows that could not be measured, and why: saved beside the rows, so that `moehal goals`
    # reads their cells as "not measured" instead of losing them (`bench_goals.SKIPPED`)
    skipped: list[dict[str, Any]] = []
    interrupted: list[str] = []  # why the run stopped before its last job (a signal, Ctrl-C)
    written: list[Path] = []  # the JSON, once saved
    saved_rows = [0]  # how many of `rows` the JSON on disk holds
    # why the files could not be written (a full disk, a directory gone): the run stops measuring
    # what it cannot keep, but its table still shows every row measured (then the error, on stderr)
    write_failed: list[WriteError] = []

    def save() -> None:  # after every row: a time limit keeps what was measured
        if out is None:
            return
        data = {
            "schema": BENCH_SCHEMA,  # (readers: `moehal.bench_goals.read_bench_json`)
            "ceilings": asdict(ceil),
            "torch": torch.__version__,
            "moehal": moehal.__version__,
            "peers": {"sglang": sglang_version()} if any(b == "sglang" for b in backends) else {},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "method": run_method,  # how each row was timed, on what inputs
            "layer_max_tokens": args.max_tokens or "each row's token count",
            "settle_s": args.settle_s,
            "rounds": args.rounds,
            "rows": [asdict(r) for r in rows],
            "skipped": skipped,
            # a run a time limit or Ctrl-C stopped: its file holds fewer rows than it asked for
            "interrupted": bool(interrupted),
            "jobs": len(jobs),
        }
        text = json_text(data)  # NaN (no GPU clock, no check) as null
        _write(out_json, lambda part: part.write_text(text))
        written[:] = [out_json]
        saved_rows[0] = len(rows)

    # rich draws its progress bar on a terminal only: a log or a pipe (a device run) saw nothing
    # between rows for hours, so there each finished row is a plain line on stderr
    plain_progress = not console.is_terminal
    started = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(jobs))
        try:
            last_cell: tuple[str, int | None] | None = None
            for done, (shape, q, backend, tokens, rnd) in enumerate(jobs, 1):
                cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(tokens, args.max_tokens or 0))
                if (shape, cfg.max_tokens) != last_cell:  # the previous layers' buffers cannot be reused
                    release_layers(dev)
                    last_cell = (shape, cfg.max_tokens)
                try:
                    row = bench_one(
                        shape,
                        cfg,
                        QuantScheme.parse(q),
                        backend,
                        tokens,
                        dev,
                        ceil,
                        args.reps,
                        registry,
                        args.breakdown,
                        sampler,
                        args.settle_s,
                        host_columns=not args.no_host,
                        check_outputs=not args.no_check,
                    )
                    row.round = rnd
                    rows.append(row)
                    result = f"{row.time_us:.1f} us" + (", WRONG OUTPUT" if row.check == "fail" else "")
                    if row.check == "fail":  # loud: a wrong result's time means nothing
                        console.print(
                            f"{shape} {q} {backend} T={tokens}: WRONG OUTPUT: rel_l2 {row.check_rel_l2:.3g} "
                            "against the reference pipeline (its goals read 'not measured')",
                            markup=False,
                        )
                except (MoEHalError, NotImplementedError, torch.OutOfMemoryError) as exc:
                    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    console.print(f"{shape} {q} {backend} T={tokens}: skipped: {why}", markup=False)
                    skipped.append(_skip(shape, q, backend, tokens, rnd, why))
                    result = "skipped"
                except Exception as exc:  # noqa: BLE001
                    if not is_peer(backend):
                        raise  # a moehal failure is a bug: loud
                    # another library's failure must not cost the rest of the run
                    console.print(f"{shape} {q} {backend} T={tokens}: peer failed: {exc!r}", markup=False)
                    skipped.append(_skip(shape, q, backend, tokens, rnd, f"peer failed: {exc!r}"))
                    result = "peer failed"
                try:  # (not in the try above: a file that cannot be written is no peer's failure)
                    save()
                except WriteError as exc:
                    write_failed.append(exc)
                progress.advance(task)
                if plain_progress:
                    print(
                        f"[{done}/{len(jobs)}] {shape} {q} {backend} T={tokens}"
                        + (f" round {rnd}" if args.rounds > 1 else "")
                        + f": {result} ({time.perf_counter() - started:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                if write_failed:
                    console.print(
                        f"stopped after {len(rows)} of {len(jobs)} measurements: the results cannot be written",
                        markup=False,
                    )
                    break
        except KeyboardInterrupt:
            console.print(f"interrupted after {len(rows)} of {len(jobs)} measurements", markup=False)
            interrupted.append(f"after {len(rows)} of {len(jobs)} measurements")
        finally:
            if sampler is not None:
                sampler.close()
    no_png = "no PNG: matplotlib is not installed; pip install 'moehal[plot]'"
    png: Path | None = None
    try:
        console.print(results_view(rows))
        if args.breakdown:
            console.print(breakdown_table(rows))
        if args.goals:
            from moehal.bench_goals import check_goals, goals_table

            checks = check_goals([*rows, *skipped], ceil.device)
            console.print(goals_table(checks) if checks else "goals: no row of this run is covered by a goal")
        if out is not None and not write_failed:
            try:
                save()
                png = plot(rows, out_png, ceil, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            except WriteError as exc:
                write_failed.append(exc)
    except KeyboardInterrupt:  # (a second Ctrl-C, or the first after the last row): what was written stays
        console.print("interrupted while reporting the run", markup=False)
        interrupted.append("while reporting")
        no_png = "no PNG: interrupted"
    if written and write_failed:  # the file keeps what its last write that succeeded saved
        console.print(f"{written[0]} holds {saved_rows[0]} of the {len(rows)} rows above (no PNG)", markup=False)
    elif written:
        console.print(f"wrote {written[0]}" + (f" and {png}" if png else f" ({no_png})"), markup=False)
    if write_failed:  # after the table: the measurements are on the screen (or in the log) whatever the disk did
        print(f"moehal bench: {write_failed[0]}", file=sys.stderr)
        return 1 if any(r.check == "fail" for r in rows) else 2  # a wrong output stays the news
    wrong = sum(r.check == "fail" for r in rows)
    if wrong or (jobs and not rows) or interrupted:  # measured nothing, wrong outputs, or not all: no success
        why = f"{wrong} rows with wrong output" if wrong else "no row was measured" if not rows else "interrupted"
        console.print(why, markup=False)
        return 1
    return 0


class WriteError(Exception):
    """`moehal bench --out` could not write one of its files (`OSError` at write time)."""


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, write: Callable[[Path], Any]) -> None:
    """`path` replaced in one step (`moehal.cli.common.replace_file`); `WriteError` where it
    cannot be written."""
    from moehal.cli.common import replace_file

    try:
        replace_file(path, write)
    except OSError as exc:
        raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _earlier_output(path: Path) -> bool:
    """Whether the existing file `path` is a `moehal bench --out` file that a new run may replace:
    OUT.json a JSON object that names a bench schema (any version) or holds rows and ceilings
    (files before the schema), OUT.png a PNG image."""
    try:
        if path.suffix == ".png":
            with path.open("rb") as f:
                return f.read(len(_PNG_SIGNATURE)) == _PNG_SIGNATURE
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return False
    if not isinstance(data, dict):
        return False
    return str(data.get("schema", "")).startswith(f"{BENCH_SCHEMA_NAME}/") or ("rows" in data and "ceilings" in data)


def out_paths(out: str | Path) -> tuple[Path, Path]:
    """The JSON and PNG files of `moehal bench --out OUT` (`moehal.cli.common.output_files`):
    `--out run.json` writes run.json and run.png, `--out run.v2` run.v2.json and run.v2.png.
    ValueError where OUT names no file ('.', '..', '')."""
    from moehal.cli.common import output_files

    js, png = output_files(out, (".json", ".png"))
    return js, png


def out_problem(out: Path) -> str | None:
    """Why `moehal bench --out OUT` could not write its files (`out_paths`), found before
    anything is measured; None where it can. Makes nothing (OUT's directory is made at the first
    write, `moehal.cli.common.replace_file`). A file already there is replaced only where it is
    an earlier run's output (`_earlier_output`); never a directory."""
    try:
        targets = list(out_paths(out))
    except ValueError as exc:  # '.', '..': no file name
        return f"{out}: {exc}"
    from moehal.cli.common import output_problem

    return output_problem(targets, _earlier_output, "a `moehal bench --out` file")


def _skip(shape: str, quant: str, backend: str, tokens: int, rnd: int, why: str) -> dict[str, Any]:
    """A row `moehal bench` could not measure, as `moehal.bench_goals` reads it (`SKIPPED`)."""
    from moehal.bench_goals import SKIPPED

    return {"shape": shape, "quant": quant, "backend": backend, "tokens": tokens, "round": rnd, SKIPPED: why}


def results_table(rows: Sequence[Row]) -> Any:
    """One line per row; the clock columns only where a sampler recorded them, and no column
    that no row measured (every cell '-': the host times off CUDA, the output with --no-check).
    Its first `result_keys(rows)` columns say which row a line is (`results_view`)."""
    from rich.table import Table

    t = Table(title="moehal bench (whole layer)", title_justify="left")
    rounds = any(r.round for r in rows)  # a run of `--rounds` > 1
    clocks = any(r.sm_mhz == r.sm_mhz for r in rows)  # NaN != NaN: no sample
    columns: list[tuple[str, list[str]]] = [
        ("shape", [r.shape for r in rows]),
        ("backend", [r.backend for r in rows]),
        ("quant", [r.quant for r in rows]),
        ("tokens", [str(r.tokens) for r in rows]),
        *((("round", [str(r.round) for r in rows]),) if rounds else ()),
        ("time us", [f"{r.time_us:.1f}" for r in rows]),
        ("timing", [r.timing for r in rows]),
        ("% roofline", [_pct_text(r) for r in rows]),
        ("weight TB/s", [f"{r.tb_per_s:.2f}" for r in rows]),  # checkpoint-format bytes: `EPILOG`
        ("TFLOP/s", [f"{r.tflop_per_s:.1f}" for r in rows]),
        ("output", [{"pass": "right", "fail": "[red]WRONG[/red]"}.get(r.check, "-") for r in rows]),
        *((("SM MHz", [_num(r.sm_mhz, "{:.0f}") for r in rows]), ("W", [_num(r.power_w, "{:.0f}") for r in rows]))
          if clocks else ()),
        ("host us", [_num(r.host_us, "{:.1f}") for r in rows]),  # NaN off CUDA
        ("host us (graphs)", [_num(r.host_graph_us, "{:.1f}") for r in rows]),
        ("host us (graphs, new inputs)", [_num(r.host_graph_new_us, "{:.1f}") for r in rows]),
        ("host us (graphs, out=)", [_num(r.host_graph_out_us, "{:.1f}") for r in rows]),
        ("host us back to back", [_num(r.host_b2b_us, "{:.1f}") for r in rows]),
        ("host us back to back (graphs, out=)", [_num(r.host_graph_out_b2b_us, "{:.1f}") for r in rows]),
    ]  # fmt: skip
    if rows:
        columns = [(h, cells) for h, cells in columns if any(c != "-" for c in cells)]
    for header, _ in columns:
        t.add_column(header)
    for i in range(len(rows)):
        t.add_row(*(cells[i] for _, cells in columns))
    return t


def result_keys(rows: Sequence[Row]) -> int:
    """How many of `results_table`'s first columns name a row: shape, backend, quant, tokens
    (and round, in a run of `--rounds` > 1)."""
    return 5 if any(r.round for r in rows) else 4


def results_view(rows: Sequence[Row]) -> Any:
    """`results_table` fitted to the console: no cell cut, split into tables where too narrow;
    below it, where a row reads above 100% of roofline (marked `*`), what that means
    (`OVER_CEILING_NOTE`)."""
    from moehal.cli.tables import FittedTable
    from rich.console import Group
    from rich.text import Text

    table = FittedTable(results_table(rows), keys=result_keys(rows))
    if not any(r.pct_roofline > 100 for r in rows):
        return table
    return Group(table, Text(OVER_CEILING_NOTE))


def _pct_text(r: Row) -> str:
    """A row's % of roofline: `*` above 100 (`OVER_CEILING_NOTE`), "n/a: no int8 ceiling" where
    no matmul rate held it (`NO_INT8_CEILING`)."""
    if not math.isfinite(r.pct_roofline):
        return f"n/a: {r.roofline_matmul.removeprefix('none: ')}" if r.roofline_matmul.startswith("none") else "-"
    return f"{r.pct_roofline:.0f}" + ("*" if r.pct_roofline > 100 else "")


def _num(x: float, fmt: str) -> str:
    return "-" if x != x else fmt.format(x)  # NaN: not measured
