# ruff: noqa: ANN001, ANN202  (Triton JIT kernels: arguments are untyped by design)
"""What one host-side call costs on this machine, beside what one MoE forward costs (a diagnostic
for #4's "host overhead under 20 us per forward outside graphs").

Each number is the median host time of one call, timed from an idle GPU until the call returns
(its kernels queued, not finished), as `moehal.bench.host_time` does. The floor rows show what
any forward on this host pays per torch op, per CUDA-graph replay and per Triton launch, so the
forward's own numbers can be read against them.

    python tools/host_floor.py [--shapes qwen3_30b_a3b] [--tokens 1] [--profile] [--eager-only]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

PROFILE_MEMO = True  # --no-memo: the profiles run with DeepGEMM called (graphs.MEMO_ENABLED = False)


def host_us(
    fn: Callable[[], Any],
    calls: int = 200,
    before_sync: Callable[[], Any] | None = None,
    after_sync: Callable[[], Any] | None = None,
) -> float:
    """Median host us of one call of `fn` from an idle GPU; `before_sync` and `after_sync` run
    (untimed) around each synchronize (tools/host_wait_probe.py queues GPU sleeps there)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        if before_sync is not None:
            before_sync()
        torch.cuda.synchronize()
        if after_sync is not None:
            after_sync()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@triton.jit
def _add_one_wide(x_ptr, a1, a2, a3, a4, a5, a6, a7, n, s1, s2, s3, s4, s5, s6, s7, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def host_us_queued(fn: Callable[[], Any], queued: int = 16, rounds: int = 30) -> float:
    """Median host us per call of `queued` calls made back to back from an idle GPU (each
    returns once its kernels are queued): an eager engine's steady state, where the host runs
    ahead of the GPU, against `host_us`'s single call from idle."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(queued):
            fn()
        samples.append((time.perf_counter() - t0) / queued)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def host_interleaved(
    fn: Callable[[], Any],
    modes: dict[str, tuple[bool, ...]],
    setter: Callable[..., None],
    calls: int = 200,
    default: tuple[bool, ...] = (True, True),
) -> dict[str, float]:
    """Median host us of `fn` under each mode, the modes taking turns call by call, in an order
    that rotates every round (session 15-16: with a fixed order the last mode read 4-15 us low
    even where it ran the same code as the one before it). `setter(*mode)` runs before each
    call, `setter(*default)` at the end."""
    for mode in modes.values():  # warm each mode (captures, first launches)
        setter(*mode)
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in modes}
    order = list(modes.items())
    for i in range(calls):
        for name, mode in order[i % len(order) :] + order[: i % len(order)]:
            setter(*mode)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    setter(*default)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


def floor(report: Callable[[str, float], None]) -> None:
    dev = torch.device("cuda")
    a, b = torch.zeros(64, device=dev), torch.ones(64, device=dev)
    c, d = torch.zeros(8, device=dev, dtype=torch.int32), torch.ones(8, device=dev, dtype=torch.int32)
    report("python call (a no-op lambda)", host_us(lambda: None))
    report("torch.empty(64) on cuda", host_us(lambda: torch.empty(64, device=dev)))
    report("a.copy_(b) (64 floats)", host_us(lambda: a.copy_(b)))
    report("torch._foreach_copy_ of 2 tensors", host_us(lambda: torch._foreach_copy_([a, c], [b, d])))
    report("a.clone()", host_us(lambda: a.clone()))
    report("torch.cuda.is_current_stream_capturing()", host_us(torch.cuda.is_current_stream_capturing))
    for nk in (1, 4):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            a.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(nk):
                a.add_(1)
        g.replay()
        report(f"CUDAGraph.replay(), {nk} kernel(s)", host_us(g.replay))
    n = a.numel()
    report("Triton launch, 2 args (JIT path)", host_us(lambda: _add_one[(1,)](a, n, BLOCK=64)))
    args = (a, a, a, a, a, a, a, a, n, 1, 2, 3, 4, 5, 6, 7)
    report("Triton launch, 16 args (JIT path)", host_us(lambda: _add_one_wide[(1,)](*args, BLOCK=64)))
    try:  # the compiled kernel's own launcher, skipping binding and the cache lookup
        ck = _add_one_wide[(1,)](*args, BLOCK=64)
        from triton.runtime import driver

        stream = driver.active.get_current_stream(driver.active.get_current_device())
        full = (*args, 64)

        def direct() -> None:
            ck.run(1, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *full)

        direct()
        torch.cuda.synchronize()
        report("Triton launch, 16 args (CompiledKernel.run)", host_us(direct))
        # the same with the 8 tensors as their addresses: no data_ptr() call and no driver
        # query (cuPointerGetAttribute) per tensor in Triton's launcher (launch.RAW_POINTERS)
        raw = (*(t.data_ptr() for t in args[:8]), *args[8:], 64)

        def direct_raw() -> None:
            ck.run(1, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *raw)

        direct_raw()
        torch.cuda.synchronize()
        report("Triton launch, 16 args (CompiledKernel.run, tensors as addresses)", host_us(direct_raw))
        # beneath the launcher's Python wrapper (CudaLauncher.__call__): its C launch function,
        # with Triton 3.6's argument order (a measurement only; moehal does not call it)
        run = ck.run
        if run.global_scratch_size == 0 and run.profile_scratch_size == 0:
            coop, pdl = run.launch_cooperative_grid, run.launch_pdl

            def c_launch() -> None:
                run.launch(1, 1, 1, stream, ck.function, coop, pdl, None, None, ck.packed_metadata, None, None, None,
                           *raw)  # fmt: skip

            try:
                c_launch()
                torch.cuda.synchronize()
                report("Triton launch, 16 args (the launcher's C function, addresses)", host_us(c_launch))
            except Exception as exc:  # another release's argument order
                print(f"C launch failed: {type(exc).__name__}: {exc}")
    except Exception as exc:  # the launcher's signature differs across Triton releases
        print(f"direct launch failed: {type(exc).__name__}: {exc}")
    try:
        from moehal.kernels.launch import Launcher
    except ImportError:  # an older moehal (A/B runs)
        return
    fast = Launcher(_add_one_wide)
    fast[(1,)](*args, BLOCK=64)
    report("Triton launch, 16 args (moehal.kernels.launch)", host_us(lambda: fast[(1,)](*args, BLOCK=64)))
    deepgemm_floor(report)


def deepgemm_floor(report: Callable[[str, float], None]) -> None:
    """One DeepGEMM masked bf16 GEMM at a decode shape (Qwen3-30B-A3B GEMM1, 16 tokens): its
    host time as a call, and replayed from a one-kernel CUDA graph."""
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001
        print(f"no DeepGEMM floor: {type(exc).__name__}: {exc}")
        return
    e, m, n, k = 128, 64, 1536, 2048
    a = torch.randn(e, m, k, device="cuda").bfloat16()
    b = torch.randn(e, n, k, device="cuda").bfloat16()
    d = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
    mm = torch.full((e,), 1, device="cuda", dtype=torch.int32)
    fn = getattr(deep_gemm, "m_grouped_bf16_gemm_nt_masked", None) or deep_gemm.bf16_m_grouped_gemm_nt_masked
    call = lambda: fn(a, b, d, mm, 1)  # noqa: E731
    report("DeepGEMM masked bf16 GEMM, one call", host_us(call))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        call()
    g.replay()
    report("DeepGEMM masked bf16 GEMM, replayed from a graph", host_us(g.replay))


def profiled(fn: Callable[[], Any], calls: int) -> cProfile.Profile:
    """cProfile of `calls` calls of `fn` (the GPU synchronized after, outside the profile)."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    return pr


def print_profile(fn: Callable[[], Any], top: int, calls: int = 200) -> None:
    """cProfile of `calls` calls of `fn`, the `top` entries by own time."""
    pr = profiled(fn, calls)
    for order in ("tottime", "cumulative"):  # own time, then where it accrues
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(order).print_stats(top)
        print(s.getvalue())


def bench_layer(shape: str, tokens: int, quant: str = "bf16") -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A `moehal bench` shape's layer on the GPU (random weights, built for max(tokens, 256)
    tokens) and one batch of `tokens` tokens for it: (layer, x, topk_ids, topk_weights)."""
    import moehal
    from moehal.bench import SHAPES

    dev = torch.device("cuda")
    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(tokens, 256))
    w13 = torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden_size, device=dev) / cfg.hidden_size**0.5
    w2 = torch.randn(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, device=dev) / cfg.intermediate_size**0.5
    layer = moehal.MoELayer(cfg, quant, device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
    x = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=cfg.dtype)
    ids = torch.rand(tokens, cfg.num_experts, device=dev).argsort(dim=1)[:, : cfg.top_k].int()
    return layer, x, ids, torch.rand(tokens, cfg.top_k, device=dev)


def layer_rows(
    shape: str, tokens: int, quant: str, report: Callable[[str, float], None], profile: bool, eager_only: bool = False
) -> None:
    from moehal.routing import TopK

    layer, x, ids, wts = bench_layer(shape, tokens, quant)
    tag = f"{shape} T={tokens} {quant}"
    print(f"layer: {layer.plan.pipeline.name}")
    report(f"{tag}: eager forward", host_us(lambda: layer(x, ids, wts)))
    report(f"{tag}: eager forward, back to back (per call, 16 queued)", host_us_queued(lambda: layer(x, ids, wts)))
    if eager_only:
        return
    try:
        from moehal import graphs
        from moehal.kernels import launch
    except ImportError:  # an older moehal (A/B runs)
        launch = None
    if launch is not None and hasattr(graphs, "MEMO_ENABLED"):

        def fast(on: bool, memo: bool, pinned: bool = True, raw: bool = True) -> None:
            launch.ENABLED, graphs.MEMO_ENABLED = on, memo
            if hasattr(launch, "PINNED"):  # session 28's pinned sites (absent in older moehal)
                launch.PINNED = pinned
            if hasattr(launch, "RAW_POINTERS"):  # session 29's tensors as addresses
                launch.RAW_POINTERS = raw

        # interleaved, call by call: this host's times drift by tens of us between back-to-back
        # measurements of one call (session 15), so separate medians would compare drifts
        modes = {
            "Triton's launch path, DeepGEMM called": (False, False, False),
            "fast launches, DeepGEMM called (graphs.MEMO_ENABLED = False)": (True, False, True),
            "fast launches, DeepGEMM replayed (default)": (True, True, True),
        }
        if hasattr(launch, "PINNED"):
            modes["fast launches, keyed at every launch (launch.PINNED = False), DeepGEMM replayed"] = (
                True,
                True,
                False,
            )
        if hasattr(launch, "RAW_POINTERS"):
            modes["pinned, tensors to Triton's launcher (launch.RAW_POINTERS = False)"] = (True, True, True, False)
        memos = getattr(getattr(layer._experts, "ops", None), "memos", None)
        for m in memos or ():
            m.replays = 0
        for name, us in host_interleaved(lambda: layer(x, ids, wts), modes, fast, default=(True, True, True)).items():
            report(f"{tag}: eager forward, {name}", us)
        if memos:  # the replay mode's 203 forwards (3 warm-up): how many DeepGEMM calls they replayed
            print(f"{tag}: DeepGEMM replays in the A/B: masked {memos[0].replays}, contiguous {memos[1].replays}")
    # What sessions 18-19 keep, per token count or batch bound: session 18 the decode kernels'
    # launches (`TokenMoE`), the dispatcher's permute launches and the experts' masked
    # workspaces; session 19 the dispatcher's combine launch (`bind_combine`), the experts'
    # Triton masked GEMM launches (kept while `takes` says so) and their activation launch. The
    # other modes bind at every call what they do not keep: each mode swaps in its own (empty)
    # dicts rather than clearing the kept ones, so no mode pays for another's rebinding.
    experts = layer._experts
    token_moe = getattr(experts, "_tokens", None)
    # session 27: the portable fused MoE's launches, one `bind_fused_moe` per token count (its
    # runner, the experts' own or the one DeepGEMM's experts keep for 64-724 tokens)
    portable = getattr(experts, "_portable", None)
    if portable is None and type(experts).__name__ == "TritonExpertsRunner":
        portable = experts
    dispatchers = [d for d in (layer._dispatch, layer._small_dispatch) if isinstance(getattr(d, "_bound", None), dict)]
    try:
        from moehal.kernels import triton_grouped_gemm as tgg

        launch_classes = [tgg.MaskedGemmLaunch, tgg.MaskedGemmActLaunch]
    except AttributeError:  # an older moehal (A/B runs)
        launch_classes = []
    takes = {cls: cls.takes for cls in launch_classes}
    saved: dict[tuple[int, str], Any] = {}

    def hold(obj: Any, attr: str, keep: bool, other: Any = None) -> None:
        """obj.attr = the dict it keeps (keep) or `other` (default: a new empty one)."""
        if obj is None or not hasattr(obj, attr):
            return
        kept = saved.setdefault((id(obj), attr), getattr(obj, attr))
        setattr(obj, attr, kept if keep else ({} if other is None else other))

    if token_moe is not None or dispatchers or portable is not None:

        def bound(keep_18: bool, keep_19: bool) -> None:
            for cls, fn in takes.items():
                cls.takes = fn if keep_19 else (lambda *a: False)  # type: ignore[method-assign]
            hold(token_moe, "_plans", keep_18)
            hold(experts, "_masked_buffers", keep_18)
            hold(experts, "_activations", keep_19)
            hold(portable, "_bound", keep_19)
            for d in dispatchers:
                kept = saved.setdefault((id(d), "_bound"), d._bound)
                # session 18's dispatcher: the permute kept, the combine bound at every call
                permutes = {t: (b[0], None) for t, b in kept.items()}  # (one entry: well under 1 us)
                hold(d, "_bound", keep_18 and keep_19, permutes if keep_18 else None)

        modes = {
            "launches bound once per token count (default)": (True, True),
            "session 18's binds only (masked GEMMs, activation, combine, portable MoE bound per call)": (True, False),
            "bound at every call": (False, False),
        }
        for name, us in host_interleaved(lambda: layer(x, ids, wts), modes, bound, default=(True, True)).items():
            report(f"{tag}: eager forward, {name}", us)
    disp, exp = layer._dispatch, layer._experts
    topk = TopK(ids, wts)
    if disp is not None and exp is not None:
        d, hd = disp.dispatch(x, topk)
        y = exp.apply(d)
        report(f"{tag}: dispatch", host_us(lambda: disp.dispatch(x, topk)))
        report(f"{tag}: experts.apply", host_us(lambda: exp.apply(d)))
        report(f"{tag}: combine", host_us(lambda: disp.combine(y, hd)))
    if profile:
        from moehal import graphs

        graphs.MEMO_ENABLED = PROFILE_MEMO
        for _ in range(3):  # the replays' captures happen outside the profile
            layer(x, ids, wts)
        print_profile(lambda: layer(x, ids, wts), 30)
        graphs.MEMO_ENABLED = True  # the default
    layer.cuda_graph_tokens = tokens
    report(f"{tag}: eager forward replaying a graph, same input tensors", host_us(lambda: layer(x, ids, wts)))
    out = torch.empty_like(x)
    report(
        f"{tag}: eager forward replaying a graph, same input tensors and out=",
        host_us(lambda: layer(x, ids, wts, out=out)),
    )
    sets = [(x.clone(), ids.clone(), wts.clone()) for _ in range(3)]  # new addresses at every call
    turn = iter(range(10**9))
    report(
        f"{tag}: eager forward replaying a graph, other input tensors",
        host_us(lambda: layer(*sets[next(turn) % 3])),
    )
    cache = layer._graphs_topk
    if not hasattr(cache, "key"):  # an older moehal (A/B runs): no per-part timings
        return
    cap = cache._graphs[cache.key((x, ids, wts))]
    inp = (x, ids, wts)
    report(f"{tag}:   the input checks", host_us(lambda: (layer._check_hidden(x), layer._check_topk(ids, wts, x))))
    report(f"{tag}:   copying the inputs in (foreach)", host_us(lambda: torch._foreach_copy_(cap.inputs, inp)))
    report(f"{tag}:   CUDAGraph.replay()", host_us(cap.graph.replay))
    report(f"{tag}:   cloning the output", host_us(cap.output.clone))
    if hasattr(cache, "_fresh_output"):  # absent in older moehal (A/B runs)
        report(f"{tag}:   allocating an output (torch.empty)", host_us(lambda: cache._fresh_output(inp)))
    report(f"{tag}:   GraphCache call, same tensors", host_us(lambda: cache(*inp)))
    report(f"{tag}:   layer.forward, same tensors (no Module.__call__)", host_us(lambda: layer.forward(*inp)))
    print(f"{tag}: direct graphs {getattr(cache, 'direct_graphs', 0)}")
    if profile:
        print_profile(lambda: layer(x, ids, wts), 20)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--profile", action="store_true")
    replays = "profile with DeepGEMM replays (the default)"
    p.add_argument("--memo", action=argparse.BooleanOptionalAction, default=True, help=replays)
    trees = "only the two eager rows per layer (no floor, no A/Bs): for A/Bs of two trees, one process each"
    p.add_argument("--eager-only", action="store_true", help=trees)
    a = p.parse_args()

    def report(what: str, us: float) -> None:
        print(f"{us:9.1f} us  {what}", flush=True)

    import moehal

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {moehal.__file__}")
    global PROFILE_MEMO
    PROFILE_MEMO = a.memo
    if not a.eager_only:
        floor(report)
    for shape in a.shapes.split(","):
        for t in a.tokens.split(","):
            layer_rows(shape, int(t), a.quant, report, a.profile and t == a.tokens.split(",")[0], a.eager_only)


if __name__ == "__main__":
    main()
