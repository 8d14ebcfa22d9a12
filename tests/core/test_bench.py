"""`moehal bench` machinery on tiny shapes (performance goals live in the benchmark itself,
not in tests: this only checks that it measures, reports and plots)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from moehal.bench import main

# Tests that check what a CPU run records (no host times, no clocks, operator names) name the
# CPU: on a GPU machine the benchmark would take the GPU (three of them failed there, session 25).
CPU = ["--device", "cpu"]


def test_bench_tiny_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    assert (
        main(["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "2", "--out", str(out)] + CPU)
        == 0
    )
    # strict JSON (a JavaScript or jq consumer refuses Python's NaN): what was not measured is null
    data = json.loads(out.with_suffix(".json").read_text(), parse_constant=_no_constant)
    assert data["interrupted"] is False and data["jobs"] == 2
    ceil = data["ceilings"]
    assert ceil["copy_bytes_per_s"] > 0 and ceil["matmul_flops_per_s"] > 0 and ceil["read_bytes_per_s"] > 0
    assert ceil["fp8_matmul_flops_per_s"] is None, "fp8 tensor cores: a GPU's, not measured here"
    rows = data["rows"]
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        assert r["time_us"] > 0 and 0 < r["roofline_us"] and r["pct_roofline"] > 0
        # the read-only rate can only raise the bandwidth term's rate: never a higher % than the copy's
        assert 0 < r["pct_roofline_read"] <= r["pct_roofline"] * (1 + 1e-9) and r["roofline_matmul"] == "bf16"
        assert r["flops"] == 2 * r["tokens"] * 2 * (128 * 128 + 64 * 128)
        assert r["host_us"] is None, "host overhead is a CUDA measurement: not measured on CPU"
        assert r["host_graph_us"] is None and r["host_b2b_us"] is None and r["host_graph_out_b2b_us"] is None
        assert r["over_ceiling"] is (r["pct_roofline"] > 100)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert data["layer_max_tokens"] == "each row's token count"


def test_bench_builds_layers_for_an_engines_largest_batch(tmp_path, monkeypatch):
    """--max-tokens: every layer is built as an engine builds it, for its largest batch."""
    import moehal

    built = []
    real = moehal.MoEConfig

    def spy(**kw):
        built.append(kw["max_tokens"])
        return real(**kw)

    monkeypatch.setattr(moehal, "MoEConfig", spy)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "1", "--out", str(out)]
    assert main([*argv, "--max-tokens", "4"]) == 0
    assert built == [4, 8], "the row's own count where it is larger"
    assert json.loads(out.with_suffix(".json").read_text())["layer_max_tokens"] == 4


def test_bench_breakdown_names_where_the_time_goes(tmp_path):
    out = tmp_path / "bench"
    assert (
        main(
            [
                "--shapes",
                "tiny",
                "--tokens",
                "4",
                "--backends",
                "reference",
                "--reps",
                "1",
                "--breakdown",
                "--out",
                str(out),
                *CPU,
            ]
        )
        == 0
    )
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    parts = row["breakdown"]
    # on CPU the parts are torch operators; the expert GEMMs must be among them
    assert any("mm" in name for name in parts), parts
    assert all(v > 0 for v in parts.values())
    assert len(parts) <= 9  # the top 8 plus "(other)"


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} in the JSON: not JSON")


def test_an_interrupted_run_says_so_in_its_file_and_exit_status(tmp_path, monkeypatch):
    """A time limit or Ctrl-C mid-run: the file keeps the rows measured, and says it is not the
    whole run; the exit status is not success (it was 0, with nothing in the file to tell)."""
    from moehal import bench

    real, calls = bench.bench_one, []

    def stopped_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_one", stopped_on_the_second)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,2,4", "--backends", "reference", "--reps", "1", "--out", str(out)]
    assert main([*argv, *CPU]) == 1
    data = json.loads(out.with_suffix(".json").read_text(), parse_constant=_no_constant)
    assert data["interrupted"] is True and data["jobs"] == 3 and [r["tokens"] for r in data["rows"]] == [1]


def test_bench_on_cpu_records_no_clocks(tmp_path):
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "2", "--backends", "reference", "--reps", "1", "--out", str(out), *CPU]
    assert main([*argv, "--settle-s", "1.5"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["settle_s"] == 1.5  # recorded as run (a CUDA row settles this long before it is timed)
    (row,) = data["rows"]
    assert row["sm_mhz"] is None and row["power_w"] is None, "no GPU sampled: null"


def test_clock_samples_parse_and_window():
    import datetime as dt

    from moehal.clock_sampler import ClockSampler, parse_sample, window_medians

    stamp = dt.datetime(2026, 11, 23, 8, 19, 10, 193000).timestamp()
    assert parse_sample("2026/11/23 08:19:10.193, 1980, 325.26\n") == (stamp, 1980.0, 325.26)
    assert parse_sample("2026/11/23 08:19:10.193, 1980, [N/A]") is None  # boards without power readings
    assert parse_sample("No devices were found") is None
    samples = [(stamp + 0.1 * i, 1980.0 - 100 * i, 300.0 + 100 * i) for i in range(6)]
    # the samples stamped inside the window only: i = 2, 3, 4
    assert window_medians(samples, stamp + 0.15, stamp + 0.45) == (1680.0, 600.0)
    nan_mhz, nan_w = window_medians(samples, stamp + 10, stamp + 11)
    assert nan_mhz != nan_mhz and nan_w != nan_w
    assert ClockSampler.start(torch.device("cpu")) is None, "nothing to sample off CUDA"


def test_results_table_shows_clocks_only_where_sampled():
    from moehal.bench import Row, results_table

    def row(mhz: float) -> Row:
        return Row("tiny", "cuda", "p", "bf16", 8, 10.0, "graph", 1, 1, 5.0, 50.0, 1.0, 1.0, sm_mhz=mhz, power_w=690.0)

    def header(rows: list) -> list[str]:
        return [c.header for c in results_table(rows).columns]

    assert "SM MHz" not in header([row(float("nan"))])
    t = results_table([row(1485.0), row(float("nan"))])
    cols = {c.header: list(c.cells) for c in t.columns}
    assert cols["SM MHz"] == ["1485", "-"] and cols["W"] == ["690", "690"]


def test_clock_sampler_reads_its_child_and_stops_it():
    import sys
    import time

    from moehal.clock_sampler import ClockSampler

    lines = "".join(f"print('2026/11/23 08:19:10.{i}00, {1980 - i}, 300.5', flush=True)\n" for i in range(3))
    sampler = ClockSampler([sys.executable, "-c", lines + "import time\ntime.sleep(60)"])
    t_end = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < t_end:
        time.sleep(0.02)
    assert [mhz for _, mhz, _ in sampler.samples] == [1980.0, 1979.0, 1978.0]
    sampler.close()
    assert sampler._proc.poll() is not None, "the sampling child is stopped"
    sampler.close()  # twice (atexit after an explicit close): no error


def test_back_to_back_host_time_is_per_call_and_syncs_only_between_samples(monkeypatch):
    """`host_time_back_to_back`: `queued` calls per sample, timed together, synchronized only
    before each sample (the host never waits between the calls of one sample)."""
    from moehal import bench

    clock, events = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: events.append("sync"))

    def call() -> None:
        clock[0] += 5e-6
        events.append("call")

    t = bench.host_time_back_to_back(call, torch.device("cuda"), queued=4, rounds=3)
    assert t == pytest.approx(5e-6)  # per call, not per sample of 4
    assert events.count("call") == 1 + 4 * 3  # one warm-up call
    runs = "".join("c" if e == "call" else "s" for e in events)
    assert runs == "c" + "scccc" * 3 + "s"
    assert bench.host_time_back_to_back(call, torch.device("cpu")) != bench.host_time_back_to_back(
        call, torch.device("cpu")
    ), "NaN off CUDA"


def test_bench_reference_rows_run_the_pure_reference_pipeline(tmp_path, monkeypatch, outranked_reference_registry):
    """`--backends reference` times reference.local -> reference.experts even where a vendor's
    dispatcher outranks reference.local (as cuda.permute does on a GPU)."""
    import moehal

    reg = outranked_reference_registry
    monkeypatch.setattr(moehal, "discover", lambda *a, **k: reg)
    out = tmp_path / "bench"
    assert main(["--shapes", "tiny", "--tokens", "2", "--backends", "reference", "--reps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows[0]["pipeline"].startswith("reference.local -> reference.experts"), rows[0]["pipeline"]


def test_bench_releases_the_previous_layers_buffers_between_cells(monkeypatch):
    """Each new (shape, batch bound) first releases what the previous rows' layers bound: the
    process-wide workspaces are sized per max_tokens, and kept they ran an H100 out of memory
    after 60 rows of three shapes."""
    import moehal.bench as bench

    seen = []
    monkeypatch.setattr(bench, "release_layers", lambda dev: seen.append(dev) or 0)
    argv = ["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "1", "--no-host"]
    assert main([*argv, "--quant", "bf16,fp8_block", "--settle-s", "0"]) == 0
    assert len(seen) == 4, "rows of one scheme at a time: the batch bound changes at every row"
    seen.clear()
    assert main([*argv, "--quant", "bf16,fp8_block", "--rounds", "2", "--settle-s", "0"]) == 0
    assert len(seen) == 4, "interleaved: a cell's schemes share one release, twice per round"
    seen.clear()
    assert main([*argv, "--max-tokens", "16", "--settle-s", "0"]) == 0
    assert len(seen) == 1, "one batch bound for every row: one set of buffers"


def test_interleaved_rounds_make_each_schemes_weights_once_per_shape(monkeypatch):
    """Rounds alternate schemes within a shape: each scheme's weights are made once while the
    shape lasts (they were made again at every row), and a new shape drops them all."""
    import moehal.bench as bench

    made = []
    real = bench.moehal.quantize_weights

    def counted(cfg, quant, *args, **kwargs):
        made.append(quant.name)
        return real(cfg, quant, *args, **kwargs)

    monkeypatch.setattr(bench.moehal, "quantize_weights", counted)
    monkeypatch.setattr(bench, "_FLOAT_WEIGHTS", {})
    monkeypatch.setattr(bench, "_QUANTIZED_WEIGHTS", {})
    argv = ["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "1", "--no-host"]
    assert main([*argv, "--quant", "bf16,fp8_block", "--rounds", "2", "--settle-s", "0"] + CPU) == 0
    assert made == ["bf16", "fp8_block"], "8 rows, one set per scheme"
    cpu = torch.device("cpu")
    cfg = bench.moehal.MoEConfig(**bench.SHAPES["tiny"])
    w13, _, bf16 = bench._weights("tiny", cfg, bench.QuantScheme.parse("bf16"), cpu)
    assert bench._weights("tiny", cfg, bench.QuantScheme.parse("bf16"), cpu)[2] is bf16
    float_again = torch.Generator(cpu).manual_seed(0)  # the same weights as before the cache
    e, h = cfg.num_local_experts, cfg.hidden_size
    assert torch.equal(w13, torch.randn(e, cfg.w13_rows, h, generator=float_again) / h**0.5)
    bench._weights("tiny, again", cfg, bench.QuantScheme.parse("bf16"), cpu)  # (a shape is keyed by its name)
    assert [k[0] for k in bench._QUANTIZED_WEIGHTS] == ["tiny, again"], "another shape: the first one's sets are gone"


def test_release_layers_frees_the_process_wide_workspaces():
    pytest.importorskip("triton")
    from moehal.bench import release_layers
    from moehal.kernels import triton_permute as TP

    TP.workspace("test.bench_release", (2, 8), 128, torch.bfloat16, torch.device("cpu"), False)
    assert release_layers(torch.device("cpu")) >= 2 * 8 * 128 * 2
    assert not [k for k in TP._WORKSPACE if k[0] == "test.bench_release"]


def test_a_logged_table_keeps_its_cells_whole(capsys, monkeypatch):
    """Written to a file or pipe (a device run's log), rich assumed 80 columns and cut the
    benchmark's cells to '…'; the console is now `LOG_WIDTH` wide there, unless COLUMNS says."""
    from moehal.cli.common import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--no-host"]) == 0
    table = capsys.readouterr().out.split("moehal bench (whole layer)")[1]
    assert "…" not in table and "reference" in table and "time us" in table
    assert "host us" not in table, "--no-host: no row has a host time, and no column shows only '-'"
    assert make_console().width == LOG_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100, "COLUMNS still decides"
    assert make_console(width=90).width == 90


def test_the_plot_draws_each_token_counts_median_over_the_rounds():
    from moehal.bench import medians_by_tokens

    pts = [(16, 90.0), (1, 50.0), (16, 70.0), (1, 52.0), (16, 80.0)]
    assert medians_by_tokens(pts) == [(1, 51.0), (16, 80.0)]
    assert medians_by_tokens([(4, 3.0)]) == [(4, 3.0)]


def test_fp8_rows_are_held_to_the_fp8_rate_where_measured():
    from moehal.bench import Ceilings
    from moehal.quant import QuantScheme

    nan = float("nan")
    with_fp8 = Ceilings(3e12, 600e12, "gpu", 4e12, 1200e12)
    assert with_fp8.matmul_rate(QuantScheme.parse("fp8_block")) == (1200e12, "fp8")
    assert with_fp8.matmul_rate(QuantScheme.parse("fp8_block:ue8m0")) == (1200e12, "fp8")
    assert with_fp8.matmul_rate(QuantScheme.parse("fp8_tensor")) == (1200e12, "fp8")
    assert with_fp8.matmul_rate(QuantScheme.parse("bf16")) == (600e12, "bf16")
    assert with_fp8.matmul_rate(QuantScheme.parse("nvfp4")) == (600e12, "bf16")  # no fp4 rate measured
    assert Ceilings(3e12, 600e12, "old", nan, nan).matmul_rate(QuantScheme.parse("fp8_block")) == (600e12, "bf16")


@pytest.mark.parametrize(
    ("numel", "block", "programs", "dtype"),
    [
        (1000, 64, 3, torch.float32),
        (4096, 128, 8, torch.bfloat16),
        (5, 64, 4, torch.float16),
        (0, 64, 2, torch.float32),
    ],
    ids=["ragged-tail", "whole-blocks-bf16", "fewer-elements-than-programs", "empty"],
)
def test_stream_read_reads_every_element_once(numel, block, programs, dtype):
    """The read ceiling's kernel (interpreted on CPU, compiled on a GPU): its partial sums add up
    to the tensor's sum, so it read every element once, none twice, nothing past the end."""
    from moehal.kernels.triton_stream import stream_read

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # integers: their float32 sums are exact in any order
    x = torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(numel)).to(dev, dtype)
    partials = torch.full((programs,), float("nan"), device=dev)
    stream_read(x, partials, block=block, num_warps=2)
    assert torch.isfinite(partials).all(), "every program stores its partial"
    assert partials.sum().item() == x.float().sum().item()
    # a wrong element (here the last one) changes the sum: the check above sees each element
    if numel:
        x[-1] += 1
        stream_read(x, partials, block=block, num_warps=2)
        assert partials.sum().item() == x.float().sum().item()


def test_stream_read_refuses_what_it_cannot_read():
    from moehal.kernels.triton_stream import stream_read

    with pytest.raises(ValueError, match="contiguous"):
        stream_read(torch.zeros(8, 8).t(), torch.zeros(2))
    with pytest.raises(ValueError, match="float32"):
        stream_read(torch.zeros(64), torch.zeros(2, dtype=torch.float64))


def test_cpu_read_ceiling_is_the_sum_and_says_so(tmp_path):
    """Off GPUs the streaming kernel is not timed (an interpreted rate says nothing of a device):
    the read ceiling is torch.sum's, and the JSON names it."""
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--out", str(out)]
    assert main(argv + CPU) == 0
    ceil = json.loads(out.with_suffix(".json").read_text())["ceilings"]
    assert ceil["read_kernel"] == "torch.sum" and ceil["stream_bytes"] == 4 << 22


def test_gpu_streams_take_4_gib_where_memory_allows(monkeypatch):
    """The copy and read ceilings stream 4 GiB where the GPU's free memory holds the copy's two
    buffers twice over (a 1 GiB stream read 7% slower on an H100 than 4 GiB), else 1 GiB."""
    from moehal import bench

    free = {"n": 64 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free["n"], 80 << 30))
    assert bench.stream_elements(torch.device("cuda")) * 4 == bench.STREAM_BYTES == 4 << 30
    free["n"] = 12 << 30
    assert bench.stream_elements(torch.device("cuda")) * 4 == 1 << 30


def test_read_ceiling_takes_the_fastest_reader(monkeypatch):
    """On a GPU the streaming kernel's configs run beside the sum; the fastest is the ceiling and
    is named (a slower kernel leaves the sum's rate)."""
    from moehal import bench

    dev = torch.device("cpu")
    monkeypatch.setattr(bench, "_stream_read_rates", lambda src, s: [(1e30, "triton_stream(fast)"), (1.0, "slow")])
    ceil = bench.measure_ceilings(dev, settle_s=0)
    assert (ceil.read_bytes_per_s, ceil.read_kernel) == (1e30, "triton_stream(fast)")
    monkeypatch.setattr(bench, "_stream_read_rates", lambda src, s: [(1.0, "slow")])
    ceil = bench.measure_ceilings(dev, settle_s=0)
    assert ceil.read_kernel == "torch.sum" and ceil.read_bytes_per_s > 1.0


def test_each_row_says_whether_its_output_is_right(tmp_path, monkeypatch, capsys):
    """Every timed row is first checked, untimed, against the reference pipeline on its device
    (`check_output`): a backend wrong by 5% is timed, saved as wrong, and said so loudly."""
    import dataclasses

    import moehal
    from moehal.reference.experts import ReferenceExperts, ReferenceExpertsRunner

    class _OffRunner(ReferenceExpertsRunner):
        def apply(self, inp):
            out = super().apply(inp)
            return dataclasses.replace(out, hidden=out.hidden * 1.05)

    class _Off(ReferenceExperts):
        name, priority = "experts", 40

        def build(self, req, fmt):
            return _OffRunner(req, fmt)

    class Plugin:
        @moehal.hookimpl
        def moehal_backend_info(self):
            return moehal.BackendInfo("offby5", "0", "test plugin")

        @moehal.hookimpl
        def moehal_experts(self):
            return [_Off()]

    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    assert reg.register(Plugin(), "offby5").status == "loaded"
    monkeypatch.setattr(moehal, "discover", lambda *a, **k: reg)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "2", "--backends", "reference,offby5", "--reps", "1", "--no-host"]
    assert main([*argv, "--settle-s", "0", "--out", str(out), *CPU]) == 1  # a wrong row fails the run
    rows = {r["backend"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["reference"]["check"] == "", "the reference is not checked against itself"
    assert rows["offby5"]["check"] == "fail" and 0.04 < rows["offby5"]["check_rel_l2"] < 0.06
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "offby5 T=2: WRONG OUTPUT" in printed and "WRONG" in printed and "1 rows with wrong output" in printed
    assert main([*argv, "--settle-s", "0", "--out", str(out), "--no-check", *CPU]) == 0
    assert {r["check"] for r in json.loads(out.with_suffix(".json").read_text())["rows"]} == {""}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the ROCm Triton path needs TRITON_INTERPRET=1")
def test_a_right_backends_rows_pass_the_check(tmp_path):
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,8", "--backends", "rocm", "--reps", "1", "--no-host", "--settle-s", "0"]
    assert main([*argv, "--out", str(out), *CPU]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["check"] for r in rows] == ["pass", "pass"] and all(r["check_rel_l2"] < 0.016 for r in rows)


def test_names_and_numbers_are_checked_before_anything_is_measured(capsys):
    """A typo in --shapes, --tokens or --quant is a usage error (exit 2) up front, not a
    traceback or an empty table after the ceilings were measured."""
    for flags, said in (
        (["--shapes", "bogus"], "unknown ['bogus']"),
        (["--tokens", "x"], "invalid literal"),
        (["--tokens", "0"], "positive"),
        (["--quant", "fp9"], "unknown quant scheme 'fp9'"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*flags, *CPU])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_a_run_that_measured_nothing_fails():
    """(A known backend that declines every row: an unknown name is a usage error, exit 2.)"""
    assert (
        main(["--shapes", "tiny", "--tokens", "1", "--backends", "cuda", "--settle-s", "0", "--reps", "1", *CPU]) == 1
    )


@pytest.fixture
def nothing_measured(monkeypatch):
    """Fails the test where `moehal bench` starts measuring (its ceilings come first)."""
    from moehal import bench

    def measured(*args, **kwargs):
        raise AssertionError("measuring started: the arguments should have been refused first")

    monkeypatch.setattr(bench, "measure_ceilings", measured)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--reps", "0"], "argument --reps: must be at least 1, got 0"),  # was a StatisticsError after the ceilings
        (["--rounds", "0"], "argument --rounds: must be at least 1"),  # was refused after the ceilings
        (["--rounds", "x"], "argument --rounds: not an integer: 'x'"),
        (["--settle-s", "-1"], "argument --settle-s: must be a finite number of seconds"),
        (["--settle-s", "inf"], "argument --settle-s: must be a finite number of seconds"),  # settled forever
        (["--max-tokens", "0"], "argument --max-tokens: must be at least 1"),
        (["--max-reference-tokens", "-1"], "argument --max-reference-tokens: must be at least 0"),
        (["--backends", "reference", "--max-reference-tokens", "0"], "nothing to measure"),  # was exit 0, no row
    ],
)
def test_every_number_is_checked_before_anything_is_measured(flags, said, capsys, nothing_measured):
    with pytest.raises(SystemExit) as exc:
        main(["--shapes", "tiny", "--tokens", "1", *flags, *CPU])
    assert exc.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("backends", ["reference,nosuch", "nosuch", "cuda.nosuch", "transformers:nosuch", ""])
def test_a_typo_in_backends_is_a_usage_error_naming_the_valid_ones(backends, capsys, nothing_measured):
    """`--backends reference,nosuch` exited 0 with a 'skipped' line, `--backends nosuch` 1
    after the ceilings: a typo is now exit 2 before anything is measured, with what is known."""
    with pytest.raises(SystemExit) as exc:
        main(["--shapes", "tiny", "--tokens", "1", "--backends", backends, *CPU])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--backends: unknown" in err
    assert all(n in err for n in ("auto", "reference", "cuda.triton", "sglang", "peers", "transformers:NAME"))


def test_backend_names_take_every_backend_kernel_and_peer():
    import moehal
    from moehal.bench import unknown_backends

    names = ["auto", "reference", "cuda", "cuda.triton", "rocm.triton", "sglang", "peers", "transformers:grouped_mm"]
    assert unknown_backends(names, moehal.discover()) == []
    assert unknown_backends(["cuda.permute", "triton", "Reference"], moehal.discover()) == [
        "cuda.permute",  # a dispatcher: no layer is named by it
        "triton",
        "Reference",
    ]


@pytest.mark.parametrize("columns", [60, 120])
def test_a_narrow_terminal_cuts_no_number_and_hides_no_column_of_numbers(tmp_path, capsys, monkeypatch, columns):
    """The table's 16-18 columns were cut to '…' below ~220 columns (`│ … │ … │` at 60, times
    `551…` at 120): every number now reads whole, columns split over tables where too narrow,
    and the columns no row measured (host times off CUDA) are left out."""
    monkeypatch.setenv("COLUMNS", str(columns))
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,4", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--out", str(out), *CPU]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 2 and "…" not in printed and "host us" not in printed
    assert max(len(line) for line in printed.splitlines()) <= columns
    words = set(printed.split())
    for r in rows:
        assert {f"{r['time_us']:.1f}", f"{r['pct_roofline']:.0f}", f"{r['tflop_per_s']:.1f}"} <= words, r


@pytest.mark.parametrize("width, tables", [(50, 0), (80, 0), (120, 4), (220, 1)])
def test_results_view_fits_every_cuda_column_into_the_width(width, tables):
    """A CUDA row's 19 columns at any width: no cell cut, nothing wider than the console; split
    into `tables` tables that each repeat the key columns (shape, backend, quant, tokens, round),
    or (0) where those and one more column do not fit, a (column, value) line per cell."""
    import io

    from moehal.bench import Row, results_view
    from rich.console import Console

    rows = [
        Row("deepseek_v3_ep8", "transformers:grouped_mm", "p", "fp8_block:ue8m0", 4096, 123456.78, "graph", 1, 1,
            5.0, 87.6, 3.21, 654.3, host_us=1234.5, host_graph_us=17.25, host_graph_new_us=23.5,
            host_graph_out_us=9.75, sm_mhz=1755.0, power_w=698.0, host_b2b_us=88.8, host_graph_out_b2b_us=7.7,
            round=2, check="pass"),
        Row("tiny", "cuda", "p", "bf16", 1, 9.0, "eager", 1, 1, 5.0, 1.0, 0.01, 0.02, round=0, check="fail"),
    ]  # fmt: skip
    c = Console(width=width, file=io.StringIO(), color_system=None)
    c.print(results_view(rows))
    text = c.file.getvalue()
    lines = text.splitlines()
    assert "…" not in text and max(len(line) for line in lines) <= width
    words = set(text.split())
    want = {"123456.8", "88", "3.21", "654.3", "1234.5", "17.2", "23.5", "9.8", "1755", "698", "88.8", "7.7",
            "deepseek_v3_ep8", "transformers:grouped_mm", "fp8_block:ue8m0", "4096", "WRONG", "right"}  # fmt: skip
    assert want <= words, want - words
    titles = [line for line in lines if line.startswith("moehal bench (whole layer)")]
    if tables:
        assert len(titles) == tables and text.count("deepseek_v3_ep8") == tables, "each table names its rows"
    else:
        assert len(titles) == 1 and any(line.replace("│", " ").split() == ["time", "us", "123456.8"] for line in lines)


def test_an_out_path_that_cannot_be_written_is_refused_before_anything_is_measured(tmp_path, capsys, nothing_measured):
    """`--out /proc/nope/b` measured the whole run, then died in a traceback at its first write."""
    (tmp_path / "file").write_text("a file, not a directory")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "notes.json").write_text('{"mine": "not a benchmark"}')
    for out, said in (
        (tmp_path / "file" / "b", "cannot write to"),
        (tmp_path / "dir", "dir.json is a directory"),
        (tmp_path / "notes", "notes.json exists and is not a `moehal bench --out` file"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--shapes", "tiny", "--tokens", "1", "--out", str(out), *CPU])
        assert exc.value.code == 2 and said in capsys.readouterr().err
    assert (tmp_path / "notes.json").read_text() == '{"mine": "not a benchmark"}', "not overwritten"


def test_an_earlier_runs_files_are_replaced_and_the_paths_written_are_printed(tmp_path, capsys):
    out = tmp_path / "runs" / "bench"
    out.parent.mkdir()
    out.with_suffix(".json").write_text('{"ceilings": {}, "rows": []}')
    out.with_suffix(".png").write_bytes(b"\x89PNG\r\n\x1a\nold")
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "rocm", "--reps", "1", "--settle-s", "0", "--no-host"]
    assert main([*argv, "--out", str(out), *CPU]) == 0
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 1
    assert f"wrote {out.with_suffix('.json')}" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) in (["bench.json", "bench.png"], ["bench.json"])


@pytest.mark.parametrize(
    "given, files",
    [
        ("run.v2", ["run.v2.json", "run.v2.png"]),  # was run.json and run.png: ".v2" taken as a suffix
        ("run.json", ["run.json", "run.png"]),
        ("acme-0.1.2", ["acme-0.1.2.json", "acme-0.1.2.png"]),
    ],
)
def test_out_keeps_a_suffix_that_is_part_of_the_name(tmp_path, capsys, given, files):
    """`--out run.v2` wrote run.json and run.png: a suffix the user meant as part of the name
    was dropped (and could overwrite another run's run.json). Only .json and .png are replaced."""
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(tmp_path / given), *CPU]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written in (files, files[:1]), written  # (no PNG without matplotlib)
    assert len(json.loads((tmp_path / files[0]).read_text())["rows"]) == 1
    assert f"wrote {tmp_path / files[0]}" in capsys.readouterr().out


def test_out_paths_replace_only_their_own_suffixes(tmp_path):
    from moehal.bench import out_paths

    assert out_paths("reports/bench") == (Path("reports/bench.json"), Path("reports/bench.png"))
    assert out_paths("bench.png") == (Path("bench.json"), Path("bench.png"))
    assert out_paths("bench.txt") == (Path("bench.txt.json"), Path("bench.txt.png"))
    for nameless in (".", "..", "runs/.."):
        with pytest.raises(ValueError, match="names no file"):
            out_paths(nameless)


def test_the_json_names_its_schema_and_goals_reads_it_with_or_without(tmp_path, capsys):
    """bench's JSON had no format version, where conformance's names `moehal.conformance/1`:
    a reader could not tell a later format from this one. Files from before keep being read."""
    from moehal.bench import _earlier_output
    from moehal.cli.main import main as moehal_main

    out = tmp_path / "new"
    argv = ["--shapes", "tiny", "--tokens", "2", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(out), *CPU]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert next(iter(data)) == "schema" and data["schema"] == "moehal.bench/1"
    old = tmp_path / "old.json"  # as files before session 59 are
    old.write_text(json.dumps({k: v for k, v in data.items() if k != "schema"}))
    later = tmp_path / "later.json"
    later.write_text(json.dumps({**data, "schema": "moehal.bench/2"}))
    for path in (out.with_suffix(".json"), old, later):
        assert _earlier_output(path), "any bench file may be replaced by a new run"
    capsys.readouterr()
    for path in (out.with_suffix(".json"), old):
        assert moehal_main(["goals", "--json", str(path)]) == 0
        (cell,) = [c for c in json.loads(capsys.readouterr().out) if c["goal"] == "decode_vs_peer"]
        assert (cell["backend"], cell["tokens"], cell["status"]) == ("reference", 2, "not measured")
    assert moehal_main(["goals", str(later)]) == 2
    captured = capsys.readouterr()
    assert "schema 'moehal.bench/2', not 'moehal.bench/1'" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def _fill_disk(monkeypatch, folder, after: int = 0) -> list[str]:
    """`Path.write_text` into `folder` raises ENOSPC from its write number `after` + 1 on;
    returns the names written or tried there, in order."""
    import pathlib

    real = pathlib.Path.write_text
    writes: list[str] = []

    def full(self, *args, **kwargs):
        if self.parent == folder:
            writes.append(self.name)
            if len(writes) > after:
                raise OSError(28, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    return writes


def test_a_write_that_fails_mid_run_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """A disk that fills up (OSError at write time) ended the run in a traceback."""
    _fill_disk(monkeypatch, tmp_path)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,2", "--backends", "rocm", "--reps", "1", "--settle-s", "0", "--no-host"]
    assert main([*argv, "--out", str(out), *CPU]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("moehal bench:")]
    assert "cannot write" in line and "No space left on device" in line and "Traceback" not in err, err
    assert not any(tmp_path.iterdir()), "no partial file left behind"


def _table_rows(printed: str) -> list[list[str]]:
    """The cells of each line of `results_table` in `printed` (its rows start with the shape)."""
    lines = [line.replace("│", " ").split() for line in printed.splitlines() if line.startswith("│ tiny")]
    return [cells[:4] for cells in lines]


def test_a_failed_write_still_prints_the_table_of_the_rows_measured(tmp_path, capsys, monkeypatch):
    """A write that failed after a row was measured ended the run with the error alone: the
    table never came, and the rows measured were lost. Now the run stops measuring, prints the
    table of every row it measured, says what the file on disk holds, then the error (exit 2)."""
    writes = _fill_disk(monkeypatch, tmp_path, after=1)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,2,4", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(out), *CPU]) == 2
    captured = capsys.readouterr()
    assert _table_rows(captured.out) == [["tiny", "reference", "bf16", "1"], ["tiny", "reference", "bf16", "2"]]
    assert "stopped after 2 of 3 measurements" in captured.out
    assert f"{out}.json holds 1 of the 2 rows above" in captured.out
    (line,) = [line for line in captured.err.splitlines() if line.startswith("moehal bench:")]
    assert "cannot write" in line and "No space left on device" in line and "Traceback" not in captured.err
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 1, "the last whole file stays"
    assert len(writes) == 2, "no write after the one that failed: the run stopped"


def test_a_failed_first_write_still_prints_the_table(tmp_path, capsys, monkeypatch):
    _fill_disk(monkeypatch, tmp_path)
    argv = ["--shapes", "tiny", "--tokens", "1,2", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(tmp_path / "b"), *CPU]) == 2
    captured = capsys.readouterr()
    assert _table_rows(captured.out) == [["tiny", "reference", "bf16", "1"]]
    assert "holds" not in captured.out and "wrote" not in captured.out, "no file was written"
    assert "No space left on device" in captured.err


def test_a_png_that_cannot_be_written_keeps_the_table_and_the_whole_json(tmp_path, capsys, monkeypatch):
    from moehal import bench

    def no_room(rows, path, *context):
        raise bench.WriteError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(bench, "plot", no_room)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,2", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(out), *CPU]) == 2
    captured = capsys.readouterr()
    assert [r[3] for r in _table_rows(captured.out)] == ["1", "2"]
    assert f"{out}.json holds 2 of the 2 rows above (no PNG)" in captured.out
    assert f"moehal bench: cannot write {out}.png" in captured.err
    assert len(json.loads(out.with_suffix(".json").read_text())["rows"]) == 2


def test_a_run_not_on_a_terminal_says_each_finished_row_on_stderr(capsys):
    """rich draws its progress bar on a terminal only: a run logged to a file printed nothing
    between rows (for hours, on a GPU). Now a plain line per finished row, without '\\r' frames."""
    import re

    argv = ["--shapes", "tiny", "--tokens", "1,2", "--backends", "reference,cuda", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", *CPU]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in lines] == [
        "[1/4] tiny bf16 reference T=1",
        "[2/4] tiny bf16 reference T=2",
        "[3/4] tiny bf16 cuda T=1",  # (no CUDA pipeline on the CPU: skipped, and said so)
        "[4/4] tiny bf16 cuda T=2",
    ]
    assert re.fullmatch(r"\[1/4\] tiny bf16 reference T=1: \d+\.\d us \(\d+ s\)", lines[0]), lines[0]
    assert lines[2].endswith(")") and ": skipped (" in lines[2]


def _not_escaping(call):
    """`call()`, failing the test (not ending pytest) where a KeyboardInterrupt escapes it."""
    try:
        return call()
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped moehal bench: a raw traceback for the user")


def test_ctrl_c_while_the_png_is_written_reports_an_interrupted_run(tmp_path, capsys, monkeypatch):
    """A Ctrl-C in the PNG step was a raw traceback; now it is an interrupted run (exit 1) whose
    JSON, written before the PNG, holds every row."""
    from moehal import bench

    def slow_plot(rows, path, *context):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "plot", slow_plot)
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "rocm", "--reps", "1", "--settle-s", "0", "--no-host"]
    assert _not_escaping(lambda: main([*argv, "--out", str(out), *CPU])) == 1
    printed = capsys.readouterr().out
    assert "interrupted while reporting the run" in printed
    assert f"wrote {out.with_suffix('.json')} (no PNG: interrupted)" in printed
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["rows"]) == 1 and data["interrupted"] is False, "every row is in the file"
    assert not out.with_suffix(".png").exists()


def test_ctrl_c_while_the_ceilings_are_measured_is_an_interrupted_run(tmp_path, capsys, monkeypatch):
    import signal

    from moehal import bench

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "measure_ceilings", stopped)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "bench"
    assert _not_escaping(lambda: main(["--shapes", "tiny", "--tokens", "1", "--out", str(out), *CPU])) == 1
    assert "interrupted while measuring the ceilings" in capsys.readouterr().out
    assert not out.with_suffix(".json").exists()
    assert signal.getsignal(signal.SIGTERM) is before, "SIGTERM's handler given back"


def test_sigterms_handler_is_given_back_after_a_run():
    """bench turns SIGTERM (a time limit) into KeyboardInterrupt while it runs; it left that
    handler installed in the calling process (a test session, a notebook) after returning."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, *CPU]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterms_handler_is_given_back_however_the_run_ends(monkeypatch):
    """The handler was given back on two of the ways out: an interrupt between installing it
    and the measurements (while the clock sampler starts, say) left it installed."""
    import signal

    from moehal import bench

    def interrupted(dev):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.ClockSampler, "start", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    with pytest.raises(KeyboardInterrupt):
        main([*argv, *CPU])
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failed_write_keeps_a_wrong_outputs_exit_status(tmp_path, capsys, monkeypatch):
    """A write that failed returned 2 (usage) even when rows had wrong outputs (1)."""

    from moehal import bench

    real_bench_one = bench.bench_one

    def wrong(*args, **kwargs):
        row = real_bench_one(*args, **kwargs)
        row.check = "fail"
        return row

    monkeypatch.setattr(bench, "bench_one", wrong)
    _fill_disk(monkeypatch, tmp_path)
    argv = ["--shapes", "tiny", "--tokens", "1", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--out", str(tmp_path / "b"), *CPU]) == 1
    assert "No space left" in capsys.readouterr().err


def test_bench_and_goals_help_document_their_exit_status(capsys):
    from moehal.cli.main import main as moehal_main

    for argv in (["bench", "--help"], ["goals", "--help"]):
        with pytest.raises(SystemExit) as exc:
            moehal_main(argv)
        text = capsys.readouterr().out
        assert exc.value.code == 0 and "exit status:" in text
        assert all(f"\n  {code}  " in text for code in (0, 1, 2)), text
    with pytest.raises(SystemExit):
        moehal_main(["bench", "--help"])
    assert "interrupted" in capsys.readouterr().out


def test_a_row_above_100_percent_of_roofline_is_marked_and_explained(tmp_path, capsys, monkeypatch):
    """The audit (session 59, finding 1): 650 committed rows read 100-165% of roofline with no
    mark. A row faster than its run's ceilings is marked in the table (`*`, a footnote saying what
    it means), in the JSON (`over_ceiling`), and in its goal's notes."""
    from moehal import bench

    low = bench.Ceilings(1e3, 1e3, "cpu (ceilings set low)", 1e3)  # every row beats them
    monkeypatch.setattr(bench, "measure_ceilings", lambda dev, settle_s=0, int8=False: low)
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "16", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--goals", "--out", str(out), *CPU]) == 0
    printed = capsys.readouterr().out
    (r,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert r["pct_roofline"] > 100 and r["over_ceiling"] is True
    assert f"{r['pct_roofline']:.0f}*" in printed.split()
    assert "* above 100% of roofline: the row ran faster than this run's ceilings allow." in " ".join(printed.split())
    assert "above 100% of roofline (ceiling exceeded, the read ceiling's too)" in printed, "the goal's note"


def test_the_table_has_no_footnote_where_no_row_is_above_100_percent():
    import io

    from moehal.bench import Row, results_view
    from rich.console import Console

    def text(pct: float) -> str:
        c = Console(width=200, file=io.StringIO(), color_system=None)
        c.print(results_view([Row("tiny", "cuda", "p", "bf16", 8, 10.0, "graph", 1, 1, 5.0, pct, 1.0, 1.0)]))
        return c.file.getvalue()

    assert "above 100%" not in text(99.6) and " 100 " in text(99.6).replace("│", " ")
    assert "above 100%" in text(100.4) and " 100* " in text(100.4).replace("│", " "), "100.4 is over, though it rounds"


def test_the_json_says_how_its_rows_were_measured(tmp_path):
    """The audit (session 59, finding 9): the file did not say its reps, statistic, timer,
    routing or L2 policy. `method` does, and each row its routing's seed."""
    from moehal import bench

    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "7", "--settle-s", "0"]
    assert main([*argv, "--no-host", "--out", str(out), *CPU]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    m = data["method"]
    assert (m["statistic"], m["reps"], m["timer"]) == ("median", 7, "wall clock (time.perf_counter)")
    assert m["calls_per_sample"] == {"graph": bench.GRAPH_REPLAYS_PER_SAMPLE, "eager": 1} == {"graph": 10, "eager": 1}
    assert m["warmup_calls"] == 3 and m["l2_flush"] is False and m["ceiling_reps"] == {"stream": 5, "matmul": 3}
    assert m["routing"].startswith("uniform:") and "without replacement" in m["routing"]
    assert "same inputs" in m["inputs"]
    assert [(r["tokens"], r["routing_seed"]) for r in data["rows"]] == [(1, 1), (8, 8)]
    assert bench.method(50, torch.device("cuda"))["timer"] == "CUDA events"
    assert bench.method(50, torch.device("cuda"))["ceiling_reps"] == {"stream": 20, "matmul": 10}


def _fig_rows():
    from moehal.bench import Row

    def row(quant, tokens, pct, rnd=0, basis="bf16"):
        return Row("deepseek_v3_ep8", "cuda", "p", quant, tokens, 10.0, "graph", 1, 1, 5.0, pct, 1.0, 1.0,
                   round=rnd, roofline_matmul=basis)  # fmt: skip

    return [
        row("bf16", 16, 103.0), row("bf16", 16, 101.0, 1), row("bf16", 128, 91.0), row("bf16", 1024, 80.0),
        row("bf16", 4096, 74.0), row("fp8_block", 1024, 60.0, basis="fp8"), row("fp8_block", 4096, 70.0, basis="fp8"),
    ]  # fmt: skip


def test_the_plot_names_its_device_date_ceilings_goals_and_rooflines():
    """The audit (session 59, finding 10): the PNG named no device, date or ceiling, drew no goal,
    joined medians across token counts never measured, and put fp8 (against fp8's rate) and bf16
    on one axis unlabelled. The Figure is inspected, not its pixels."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from moehal.bench import Ceilings, figure

    ceil = Ceilings(4.2e12, 700e12, "cuda:0 NVIDIA H200 sm90", 4.45e12, 1400e12)
    fig = figure(_fig_rows(), ceil, "2026-11-29 10:00 UTC")
    try:
        assert fig._suptitle.get_text() == "moehal bench: cuda:0 NVIDIA H200 sm90, 2026-11-29 10:00 UTC"
        caption = " ".join(t.get_text() for t in fig.texts)
        assert "copy 4.20 TB/s" in caption and "bf16 matmul 700 TFLOP/s" in caption
        assert "fp8 matmul 1400 TFLOP/s" in caption and "read-only stream 4.45 TB/s" in caption
        (ax,) = fig.axes
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        goal90, goal75 = lines["goal: 90% (bf16, 16-128 tokens)"], lines["goal: 75% (bf16, 1024-4096 tokens)"]
        assert list(goal90.get_ydata()) == [90.0, 90.0] and list(goal90.get_xdata()) == [16, 128]
        assert list(goal75.get_ydata()) == [75.0, 75.0] and list(goal75.get_xdata()) == [1024, 4096]
        bf16 = lines["cuda bf16 (roofline: bf16 matmul rate)"]
        fp8 = lines["cuda fp8_block (roofline: fp8 matmul rate)"]
        assert bf16.get_marker() == "o" and bf16.get_linestyle() == "None", "a marker per measured point"
        assert list(bf16.get_xdata()) == [16, 16, 128, 1024, 4096] and list(fp8.get_xdata()) == [1024, 4096]
        over = lines["above 100%: ceiling exceeded"]
        assert list(over.get_xdata()) == [16, 16] and sorted(over.get_ydata()) == [101.0, 103.0]
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 105, "from 0: a spread of a few points looks its size"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "128", "1024", "4096"], "measured counts only"
    finally:
        plt.close(fig)


def test_the_bandwidth_column_says_it_counts_checkpoint_format_weight_bytes(capsys):
    """The column "TB/s" read as DRAM bandwidth, but it is the weight bytes touched in the checkpoint's format
    per second (nvfp4 on SM90 reads bf16 copies: 3.5x the traffic; session 59's review)."""
    from moehal.bench import Row, results_table

    r = Row("tiny", "cuda", "p", "nvfp4", 8, 10.0, "graph", 1, 1, 5.0, 50.0, 0.65, 1.0)
    headers = [c.header for c in results_table([r]).columns]
    assert "weight TB/s" in headers and "TB/s" not in headers
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert '"weight TB/s" is the expert weight bytes the row touches, in the checkpoint\'s format' in help_text
    assert "not the DRAM traffic" in help_text


def test_int8_rows_are_held_to_an_int8_rate_never_to_bf16s(monkeypatch):
    """The audit (session 59, finding 12): w8a8_int8 rows were held to the bf16 matmul rate, as fp8
    rows were before session 42 (int8 tensor cores run about twice bf16's rate: up to 2x too high).
    They now take an int8 rate where the run measured one, and no % of roofline where it did not."""
    from moehal import bench
    from moehal.bench import NO_INT8_CEILING, Ceilings, Row, results_table
    from moehal.quant import QuantScheme

    int8 = QuantScheme.parse("w8a8_int8")
    nan = float("nan")
    measured = Ceilings(3e12, 600e12, "gpu", 4e12, 1200e12, int8_matmul_ops_per_s=1150e12)
    assert measured.matmul_rate(int8) == (1150e12, "int8")
    assert measured.matmul_rate(QuantScheme.parse("bf16")) == (600e12, "bf16")
    rate, name = Ceilings(3e12, 600e12, "gpu", 4e12, nan).matmul_rate(int8)
    assert rate != rate and name == NO_INT8_CEILING == "none: no int8 ceiling", "never bf16's rate"
    # session 59's H200: torch._int_mm with a row-major operand ran 126 TOP/s, below bf16's 657
    slow = Ceilings(4.2e12, 657e12, "gpu", 4.4e12, 1124e12, int8_matmul_ops_per_s=126e12)
    rate, name = slow.matmul_rate(int8)
    assert rate != rate and name == NO_INT8_CEILING, "a rate below bf16's is no int8 ceiling"
    # the ceiling step, with a fake timer: 2 n^3 operations over the median sample
    monkeypatch.setattr(bench, "time_call", lambda fn, dev, reps, warmup_s=0: 0.5)
    assert bench._int8_matmul_rate(torch.device("cpu"), 64, 0) == 2 * 64**3 / 0.5
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (_ for _ in ()).throw(RuntimeError("no int8 GEMM")))
    rate = bench._int8_matmul_rate(torch.device("cpu"), 64, 0)
    assert rate != rate, "torch cannot run it: NaN, so the rows get no %"
    row = Row("tiny", "cuda", "p", "w8a8_int8", 8, 10.0, "graph", 1, 1, nan, nan, 1.0, 1.0,
              roofline_matmul=NO_INT8_CEILING)  # fmt: skip
    cols = {c.header: list(c.cells) for c in results_table([row]).columns}
    assert cols["% roofline"] == ["n/a: no int8 ceiling"]


def test_a_run_with_int8_rows_measures_their_rate_and_holds_them_to_it(tmp_path, monkeypatch):
    from moehal import bench

    out = tmp_path / "bench"
    argv = ["--shapes", "tiny", "--tokens", "4", "--backends", "reference", "--reps", "1", "--settle-s", "0"]
    assert main([*argv, "--quant", "bf16,w8a8_int8", "--no-host", "--out", str(out), *CPU]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rate = data["ceilings"]["int8_matmul_ops_per_s"]
    assert rate is not None and rate > 0, "torch._int_mm runs on the CPU too"
    # held to it where it is at least bf16's rate, else no ceiling (never bf16's): both, whatever
    # this CPU's own int8 and bf16 GEMMs run at
    for int8_rate, held in ((1e18, True), (1.0, False)):
        monkeypatch.setattr(bench, "_int8_matmul_rate", lambda dev, n, settle_s, r=int8_rate: r)
        assert main([*argv, "--quant", "bf16,w8a8_int8", "--no-host", "--out", str(out), *CPU]) == 0
        data = json.loads(out.with_suffix(".json").read_text())
        bf16, int8 = data["rows"]
        ceil = bench.Ceilings(**{k: v for k, v in data["ceilings"].items()})
        if held:
            assert (bf16["roofline_matmul"], int8["roofline_matmul"]) == ("bf16", "int8")
            roof = max(int8["weight_bytes"] / ceil.copy_bytes_per_s, int8["flops"] / int8_rate)
            assert int8["roofline_us"] == pytest.approx(roof * 1e6)
        else:
            assert (bf16["roofline_matmul"], int8["roofline_matmul"]) == ("bf16", bench.NO_INT8_CEILING)
            assert int8["pct_roofline"] is None
    monkeypatch.undo()
    assert main([*argv, "--no-host", "--out", str(out), *CPU]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["ceilings"]["int8_matmul_ops_per_s"] is None, (
        "measured only where the run has int8 rows"
    )
