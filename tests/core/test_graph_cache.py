"""`moehal.graphs.GraphCache`'s choices, on the CPU: which graph a call captures or replays,
where its result lands, and that a miss allocates once. CUDA graphs are stood in for by a
replay that reruns the captured function into the captured output (`fake_cuda_graphs`), and,
where addresses matter, the allocator by a script of output buffers; `tests/cuda/test_gpu.py`
runs the real thing on a GPU."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import pytest
import torch
from moehal.graphs import DIRECT_PER_TOKEN_COUNT, GraphCache, should_replay


class _Allocator:
    """Hands out the scripted buffers for each new output, counting the allocations."""

    def __init__(self, script: Iterator[torch.Tensor]) -> None:
        self.script, self.calls = script, 0

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.calls += 1
        return next(self.script)


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * 2 + w.sum(dim=1, keepdim=True)


def _cache(monkeypatch, buffers: list[torch.Tensor], cycle: bool = True) -> tuple[GraphCache, _Allocator]:
    def script() -> Iterator[torch.Tensor]:
        while True:
            yield from buffers
            if not cycle:
                return

    alloc = _Allocator(script())
    monkeypatch.setattr(GraphCache, "_fresh_output", staticmethod(alloc))
    return GraphCache(_forward, torch.device("cpu")), alloc


def _call(cache: GraphCache, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """What `MoELayer.forward` does: the direct replay first, then (its checks and) the cache."""
    y = cache.replay_direct((x, w), out)
    return y if y is not None else cache(x, w, out=out)


def test_an_output_address_that_recurs_gets_a_graph_that_writes_it(monkeypatch, fake_cuda_graphs):
    a = torch.empty(3, 4)
    cache, alloc = _cache(monkeypatch, [a])  # the caller drops each result: same address every call
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(5):
        x.copy_(torch.randn(3, 4))  # refilled in place, as an engine's buffers are
        before = alloc.calls
        y = _call(cache, x, w)
        assert y is a and torch.equal(y, _forward(x, w))
        assert alloc.calls - before == 1, "one output allocation per call, hit or miss"
    # call 1 copied into a graph's own inputs; call 2 captured the graph writing `a` in place
    assert cache.direct_graphs == 1 and cache.output_writing_graphs == 1
    assert cache.captured_token_counts == [3]


def test_outputs_the_caller_keeps_are_copied_out_and_never_written_again(monkeypatch, fake_cuda_graphs):
    bufs = [torch.empty(3, 4) for _ in range(5)]
    cache, _ = _cache(monkeypatch, bufs, cycle=False)  # every output at a new address
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    kept = []
    for _ in range(5):
        x.copy_(torch.randn(3, 4))
        y = _call(cache, x, w)
        assert torch.equal(y, _forward(x, w))
        kept.append((y, y.clone()))
    # inputs in place from call 2 on: a graph that reads them in place, its output copied out
    assert cache.direct_graphs == 1 and cache.output_writing_graphs == 0
    for y, then in kept:
        assert torch.equal(y, then)


def test_outputs_alternating_between_two_buffers_are_written_in_place(monkeypatch, fake_cuda_graphs):
    """A residual add keeps the previous result alive while the next is allocated."""
    a, b = torch.empty(3, 4), torch.empty(3, 4)
    cache, _ = _cache(monkeypatch, [a, b])
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(8):
        x.copy_(torch.randn(3, 4))
        y = _call(cache, x, w)
        assert torch.equal(y, _forward(x, w))
    # one graph reading the inputs in place, then one writing each of the two buffers
    assert cache.direct_graphs == 3 and cache.output_writing_graphs == 2
    writers = [cap.graph for cap in cache._direct.values() if cap.output is None]
    replays = [g.replays for g in writers]
    y = _call(cache, x, w)
    assert y is a or y is b
    assert sum(g.replays for g in writers) == sum(replays) + 1  # served by a writing graph


def test_out_gets_its_own_graph_and_new_inputs_are_copied_in(monkeypatch, fake_cuda_graphs):
    cache, alloc = _cache(monkeypatch, [torch.empty(3, 4)])
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    out = torch.empty(3, 4)
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        assert _call(cache, x, w, out=out) is out
        assert torch.equal(out, _forward(x, w))
    assert cache.output_writing_graphs == 1 and alloc.calls == 0  # `out=` allocates nothing
    # other input tensors every call: copied into the copying graph's inputs
    for _ in range(3):
        x2, w2 = torch.randn(3, 4), torch.randn(3, 2)
        assert torch.equal(_call(cache, x2, w2), _forward(x2, w2))
    assert cache.direct_graphs == 1


def test_calls_on_tensors_no_direct_graph_reads_allocate_one_output_and_keep_none(monkeypatch, fake_cuda_graphs):
    """Once a direct graph exists, every call first tries it. A call on other tensors (new
    inputs, or a prefill batch above the graph limit that then runs eagerly) must not get an
    output allocated by that try: the copying graph allocates its own, and an eager forward
    never takes the one kept for it, which would stay alive until the layer's next call."""
    cache, alloc = _cache(monkeypatch, [torch.empty(3, 4)])
    x, w = torch.randn(3, 4), torch.randn(3, 2)
    _call(cache, x, w)
    _call(cache, x, w)  # inputs in place: a direct graph
    assert cache.direct_graphs == 1
    before = alloc.calls
    big_x, big_w = torch.randn(4096, 4), torch.randn(4096, 2)  # what an eager prefill call tries
    assert cache.replay_direct((big_x, big_w)) is None
    assert alloc.calls == before and cache._missed is None
    x2, w2 = torch.randn(3, 4), torch.randn(3, 2)  # new inputs: the copying graph
    assert torch.equal(_call(cache, x2, w2), _forward(x2, w2))
    assert alloc.calls == before + 1 and cache._missed is None


def test_top_1_ids_transposed_from_topk_are_copied_in(fake_cuda_graphs):
    """`torch.topk(..., 1, dim=0)` then `.t()` gives `[T, 1]` ids and weights with strides
    (1, T): contiguous to torch, but not viewable as bytes. They take the typed copy."""

    def forward(x, ids, w):
        return x + (ids.float() * w).sum(dim=1, keepdim=True).to(x.dtype)

    cache = GraphCache(forward, torch.device("cpu"))
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randn(5, 3, generator=g)
        top = torch.topk(scores, 1, dim=0)
        ids, w = top.indices.t().to(torch.int32), top.values.t()
        assert ids.is_contiguous() and ids.stride() == (1, 3)
        x = torch.randn(3, 8, generator=g).bfloat16()
        assert torch.equal(cache(x, ids, w), forward(x, ids, w))


def test_graph_cache_replays_with_new_inputs_on_cpu_semantics(fake_cuda_graphs):
    """The cache's bookkeeping (one capture per token count, inputs copied in, output copied
    out) without a GPU: a stand-in graph object that records and re-runs the function."""
    cache = GraphCache(lambda x, y: x * 2 + y, torch.device("cpu"))
    a = cache(torch.ones(3), torch.zeros(3))
    b = cache(torch.full((3,), 5.0), torch.ones(3))
    c = cache(torch.ones(2), torch.ones(2))
    d = cache(torch.ones(2, dtype=torch.float64), torch.ones(2))  # another dtype: another graph
    assert d.dtype == torch.float64 and len(cache._graphs) == 3
    assert a.tolist() == [2.0] * 3, "an earlier output must not change when the graph replays again"
    assert b.tolist() == [11.0] * 3 and c.tolist() == [3.0] * 2
    assert cache.captured_token_counts == [2, 3]
    assert not should_replay(64, torch.ones(3, 4))  # CPU tensors never replay


def test_a_graph_captured_in_inference_mode_replays_outside_it(fake_cuda_graphs):
    """A copying graph's static inputs are normal tensors even when it was captured under
    `torch.inference_mode()`: a later call under `no_grad` copies new inputs into them in place,
    which torch refuses for inference tensors."""
    cache = GraphCache(lambda x, y: x * 2 + y, torch.device("cpu"))
    with torch.inference_mode():
        assert cache(torch.ones(3), torch.zeros(3)).tolist() == [2.0] * 3
    (graph,) = cache._graphs.values()
    assert not any(t.is_inference() for t in graph.inputs)
    with torch.no_grad():
        assert cache(torch.full((3,), 5.0), torch.ones(3)).tolist() == [11.0] * 3


def test_graph_cache_reads_inputs_in_place_when_the_caller_reuses_its_tensors(fake_cuda_graphs):
    """A caller that passes the same tensors again gets a graph captured on them (no copy in);
    it reads what they hold at each call, and other tensors still take the copying graph."""
    cache = GraphCache(lambda x, y: x * 2 + y, torch.device("cpu"))
    x, y = torch.ones(3), torch.zeros(3)
    first = cache(x, y)  # new addresses: the copying graph
    assert cache.direct_graphs == 0
    second = cache(x, y)  # the same addresses twice in a row: captured on x and y themselves
    assert cache.direct_graphs == 1
    x.fill_(5.0)  # the caller refills its buffer in place
    third = cache(x, y)
    assert third.tolist() == [10.0] * 3 and cache.direct_graphs == 1
    static = cache._graphs[cache.key((x, y))].inputs[0]
    assert static.tolist() == [1.0] * 3, "a direct replay must not copy into the copying graph's inputs"
    other = cache(torch.full((3,), 2.0), torch.ones(3))  # other tensors: copied in
    assert other.tolist() == [5.0] * 3
    assert first.tolist() == second.tolist() == [2.0] * 3, "outputs stay the caller's"
    assert cache._direct[cache.where((x, y))].inputs == (), "no reference kept"
    y_t = torch.zeros(3, 2)[:, 0]  # same shape, other strides: never the direct graph of y
    assert cache.where((x, y_t)) != cache.where((x, y))
    for _ in range(3 * DIRECT_PER_TOKEN_COUNT):  # at most this many direct graphs per count
        u, v = torch.rand(3), torch.rand(3)
        assert torch.allclose(cache(u, v), u * 2 + v) and torch.allclose(cache(u, v), u * 2 + v)
    assert cache.direct_graphs == DIRECT_PER_TOKEN_COUNT
    cache.clear()
    assert cache.direct_graphs == 0 and cache.captured_token_counts == []


def test_graph_cache_writes_into_the_callers_output_buffer(fake_cuda_graphs):
    """`out=`: a direct graph captured with the caller's output buffer writes the result there
    (the call returns that very tensor, nothing cloned); other calls copy into it."""
    cache = GraphCache(lambda x, y: x * 2 + y, torch.device("cpu"))
    x, y, out = torch.ones(3), torch.zeros(3), torch.empty(3)
    assert cache(x, y, out=out) is out and out.tolist() == [2.0] * 3  # copying graph, copied out
    assert cache(x, y, out=out) is out and cache.direct_graphs == 1  # captured on x, y and out
    x.fill_(4.0)
    assert cache(x, y, out=out) is out and out.tolist() == [8.0] * 3
    cap = next(iter(cache._direct.values()))
    assert cap.output is None, "a graph that writes `out` keeps no reference to it"
    other = torch.empty(3)  # another output buffer: not the direct graph's
    assert cache(x, y, out=other) is other and other.tolist() == [8.0] * 3
    plain = cache(x, y)  # no out: a fresh tensor, as before
    assert plain is not out and plain.tolist() == [8.0] * 3


def test_a_forward_that_takes_out_is_captured_writing_it_itself(fake_cuda_graphs):
    """A forward `fn(*inputs, out=None)` (the layer's) is captured as `fn(..., out=out)` for a
    graph that writes an output: no copy of the forward's own result inside the graph."""
    given = []

    def forward(x, y, out=None):
        given.append(out)
        return x * 2 + y if out is None else torch.mul(x, 2, out=out).add_(y)

    cache = GraphCache(forward, torch.device("cpu"))
    x, y, out = torch.ones(3), torch.zeros(3), torch.empty(3)
    # the copying graph writes the rows the cache shares among its graphs, then copies them out
    assert cache(x, y, out=out) is out and given and all(g is not None and g is not out for g in given)
    first = len(given)
    assert cache(x, y, out=out) is out and cache.output_writing_graphs == 1
    assert len(given) > first and all(g is out for g in given[first:])  # captured (and replayed) on `out`
    x.fill_(4.0)
    assert cache.replay_direct((x, y), out) is out and out.tolist() == [8.0] * 3 and given[-1] is out


def test_replay_direct_serves_only_the_exact_tensors_it_was_captured_on(fake_cuda_graphs):
    """`replay_direct` is the forward's first step, before the input checks, so it must miss for
    anything the checks would look at: another shape at the same address, other strides,
    another dtype, another output buffer, or a non-tensor."""
    cache = GraphCache(lambda x, y: x * 2 + y, torch.device("cpu"))
    x, y, out = torch.ones(4, 6), torch.zeros(4, 6), torch.empty(4, 6)
    assert cache.replay_direct((x, y), out) is None, "nothing captured yet"
    cache(x, y, out=out)
    cache(x, y, out=out)  # the same addresses twice: the direct graph
    x.fill_(3.0)
    assert cache.replay_direct((x, y), out) is out and out.tolist() == [[6.0] * 6] * 4
    assert cache.replay_direct((x[:, :4], y[:, :4]), out[:, :4]) is None, "a narrower view at the same address"
    assert cache.replay_direct((x[:2], y[:2]), out[:2]) is None, "fewer tokens at the same address"
    assert cache.replay_direct((x, y.t().contiguous().t()), out) is None, "other strides"
    assert cache.replay_direct((x, y), torch.empty(4, 6)) is None, "another output buffer"
    assert cache.replay_direct((x, y), None) is None, "no direct graph for calls without out= yet"
    assert cache.replay_direct((x, None), out) is None and cache.replay_direct((x, 3), out) is None
    assert cache.captured_token_counts == [4]


def test_replay_direct_with_three_inputs_checks_every_one(fake_cuda_graphs):
    """The top-k forward's three inputs take an unrolled signature (it runs at every replay):
    it must pin the third input as the generic one pins the others."""
    cache = GraphCache(lambda x, y, z: x * 2 + y + z, torch.device("cpu"))
    x, y, z, out = torch.ones(4, 6), torch.zeros(4, 6), torch.zeros(4, 6), torch.empty(4, 6)
    generic = tuple(v for t in (x, y, z, out) for v in (t.data_ptr(), t.dtype, t.shape, t.stride()))
    assert cache.where((x, y, z), out) == generic and cache.where((x, y, z)) == generic[:12]
    cache(x, y, z, out=out)
    cache(x, y, z, out=out)
    z.fill_(1.0)
    assert cache.replay_direct((x, y, z), out) is out and out.tolist() == [[3.0] * 6] * 4
    assert cache.replay_direct((x, y, z.as_strided((4, 6), (1, 4))), out) is None, "the third input's strides"
    assert cache.replay_direct((x, y, z.double()), out) is None, "the third input's dtype"
    assert cache.replay_direct((x, y, z[:2]), out) is None, "the third input's shape"
    assert cache.replay_direct((x, y, None), out) is None


def test_gc_paused_stops_automatic_collection_and_restores_the_state_it_found():
    """Captures run under `gc_paused`: no automatic collection inside (one could free a dead
    cycle's CUDA graph mid-capture), the collector's state as before afterwards, also after an
    exception, and a collector the caller had switched off stays off."""
    import gc

    from moehal.graphs import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested captures (a memo's inside a layer's warm-up) keep it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with gc_paused():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_capture_leaves_the_callers_stream_current(monkeypatch):
    """torch's `torch.cuda.graph` makes the caller's stream current again only after
    `capture_end` succeeds: an invalidated capture raises there and leaves torch's capture
    stream current (seen on an H100, session 36). `capturing` hands the caller's stream back,
    after a failed capture and after a failure in the captured code, and pauses the collector."""
    import gc

    from moehal import graphs

    current = ["caller"]
    ended = []

    class TorchGraph:  # torch's order: stream switch, capture; on exit capture_end, switch back
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local"  # other threads may allocate meanwhile
            self.graph = graph

        def __enter__(self):
            current[0] = "capture"

        def __exit__(self, *exc):
            ended.append(self.graph)
            if self.graph == "invalidated":
                raise RuntimeError("operation not permitted when stream is capturing")
            current[0] = "caller"

    monkeypatch.setattr(torch.cuda, "graph", TorchGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))

    with graphs.capturing("fine"):
        assert current == ["capture"] and not gc.isenabled()
    assert current == ["caller"] and gc.isenabled()
    with pytest.raises(RuntimeError, match="not permitted"), graphs.capturing("invalidated"):
        pass
    assert current == ["caller"] and gc.isenabled()
    with pytest.raises(ValueError), graphs.capturing("fine"):
        raise ValueError("the captured code failed")
    assert current == ["caller"]
    assert ended == ["fine", "invalidated", "fine"]


def test_copying_graph_copies_its_inputs_as_bytes_in_one_call(fake_cuda_graphs, monkeypatch):
    """Hidden states, ids and weights have three dtypes: a typed `_foreach_copy_` of them takes
    torch's per-tensor path (a launch each on a GPU). Contiguous inputs are copied as one list of
    uint8 views instead; the replay reads exactly what a typed copy would have put there.
    Non-contiguous inputs (and `BYTE_COPY_INPUTS = False`) take the typed copy."""
    from moehal import graphs

    def forward(x, ids, w):
        return x + (ids.float() * w).sum(dim=1, keepdim=True).to(x.dtype)

    copies = []
    real = torch._foreach_copy_

    def spy(dst, src):
        copies.append({t.dtype for t in dst})
        return real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    cache = GraphCache(forward, torch.device("cpu"))

    def inputs(seed, ids_t=False):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 8, (2, 4) if ids_t else (4, 2), generator=g, dtype=torch.int32)
        return (torch.randn(4, 16, generator=g).bfloat16(), ids.t() if ids_t else ids, torch.rand(4, 2, generator=g))

    for seed in range(3):  # new tensors at every call: the copying graph
        args = inputs(seed)
        assert torch.equal(cache(*args), forward(*args))
    assert copies == [{torch.uint8}] * 3, "one list of bytes per call"
    static = cache._graphs[cache.key(args)].inputs
    assert all(t.is_contiguous() for t in static) and torch.equal(static[1], args[1])
    copies.clear()
    strided = inputs(7, ids_t=True)  # ids `[4, 2]` as a transposed view: not contiguous
    assert not strided[1].is_contiguous()
    assert torch.equal(cache(*strided), forward(*strided)) and copies == [{torch.bfloat16, torch.int32, torch.float32}]
    copies.clear()
    monkeypatch.setattr(graphs, "BYTE_COPY_INPUTS", False)
    args = inputs(8)
    assert torch.equal(cache(*args), forward(*args)) and len(copies[0]) == 3


@pytest.mark.parametrize("view", [False, True], ids=["same-tensor", "view-of-the-input"])
def test_in_place_calls_are_right_on_the_call_that_captures(monkeypatch, fake_cuda_graphs, view):
    """`out=` in the input's storage (an engine's `layer(h, ..., out=h)`): the capture's warm-up
    run wrote the result over the input, and the call that captured returned f(f(x))."""
    cache, _ = _cache(monkeypatch, [torch.empty(3, 4)])
    buf, w = torch.empty(3, 4), torch.randn(3, 2)
    for step in range(5):
        x = torch.randn(3, 4)
        buf.copy_(x)
        out = buf[:] if view else buf
        y = _call(cache, buf, w, out=out)
        assert torch.equal(y, _forward(x, w)), f"call {step}"
    assert cache.output_writing_graphs == 1, "the in-place call still gets the graph that writes out"


def test_a_failed_in_place_capture_gives_the_caller_its_input_back(monkeypatch):
    """`layer(h, ..., out=h)` whose capture fails after the warm-up wrote f(h) over h (an OOM in
    the graph pool, an invalidated capture): an engine that catches the error and runs eagerly on
    the same buffer must compute f(h), not f(f(h)). The input's bytes came back only on success."""
    from moehal import graphs

    captures = []

    def capture(fn, device=None, warmup: int = 1, pool=None):
        output = fn()  # the warm-up, which writes `out`
        captures.append(fn)
        if len(captures) == 2:  # the direct graph of the second call
            raise RuntimeError("operation failed due to a previous error during capture")
        return types.SimpleNamespace(replay=fn), output

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    cache = GraphCache(lambda x, w, out=None: out.copy_(_forward(x, w)), torch.device("cpu"))
    h, w = torch.randn(3, 4), torch.randn(3, 2)
    cache(h, w, out=h)  # a copying graph
    before = h.clone()
    with pytest.raises(RuntimeError, match="during capture"):
        cache(h, w, out=h)  # the same addresses: the direct graph, whose capture fails
    assert torch.equal(h, before), "the failed call left its warm-up's result in the input"


def test_a_warm_up_that_raises_still_orders_the_callers_stream_after_its_kernels(monkeypatch):
    """`capture`'s warm-up runs on a side stream; one that raises (an OOM past its first launches)
    has queued kernels that read the inputs and write shared workspaces. The caller's stream
    waits for them, or its next forward overlaps them."""
    from moehal import graphs

    waits = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            waits.append((self.name, other.name))

    caller = Stream("caller")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def forward():
        raise torch.OutOfMemoryError("CUDA out of memory (the combine's output)")

    with pytest.raises(torch.OutOfMemoryError):
        graphs.capture(forward, torch.device("cuda", 0))
    assert waits == [("side", "caller"), ("caller", "side")]


def test_graphs_of_every_token_count_share_the_rows_they_read_and_write(fake_cuda_graphs):
    """A copying graph per token count used to keep its own inputs and output: sum(T) rows for
    counts 1..N (3.5 GiB per layer of DeepSeek-V3's hidden size at N = 512). They are now
    prefixes of buffers the cache shares, replaced by larger ones as larger counts come: the
    graphs hold under 2x the largest count's rows per role, and each still computes its own."""
    cache = GraphCache(_forward, torch.device("cpu"))
    counts = [*range(1, 65), 7, 64, 1, 33]
    kept = []  # every call's tensors stay alive: new addresses each call, so no direct graph
    for t in counts:
        x, w = torch.randn(t, 4), torch.randn(t, 2)
        kept.append((x, w))
        assert torch.equal(cache(x, w), _forward(x, w)), t  # new tensors each call: the copying graphs
    assert cache.captured_token_counts == list(range(1, 65)) and cache.direct_graphs == 0
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
        for cap in cache._graphs.values()
        for v in (*cap.inputs, cap.output)
    }
    row_bytes = (4 + 2 + 4) * 4  # x, w and the output, fp32
    assert sum(storages.values()) < 2 * 64 * row_bytes < sum(range(1, 65)) * row_bytes


def test_pauses_of_the_collector_in_two_threads_end_with_the_last():
    """Captures in two threads (one per GPU) each pause the garbage collector: the first to
    end turned it back on while the other still captured. It now stays off until the last
    pause ends, then goes back to what it was."""
    import gc
    import threading

    from moehal.graphs import gc_paused, gc_pauses

    was = gc.isenabled()
    gc.enable()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def a() -> None:
        with gc_paused():
            a_in.set()
            b_in.wait()
        a_out.set()

    def b() -> None:
        a_in.wait()
        with gc_paused():
            b_in.set()
            a_out.wait()  # A's pause has ended, B's capture goes on
            seen["during"], seen["pauses"] = gc.isenabled(), gc_pauses()

    try:
        threads = [threading.Thread(target=f) for f in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == {"during": False, "pauses": 1} and gc.isenabled() and gc_pauses() == 0
    finally:
        gc.enable() if was else gc.disable()
