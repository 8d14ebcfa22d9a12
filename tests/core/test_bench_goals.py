"""`moehal.bench_goals`: goals checked against benchmark rows, synthetic and committed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from moehal.bench_goals import (
    HOST_US,
    ISSUE_4_GOALS,
    PCT_ROOFLINE,
    VS_PEER,
    Goal,
    check_goals,
    check_runs,
    goals_markdown,
    load_runs,
    summarize,
)
from moehal.cli.main import main

REPO = Path(__file__).resolve().parents[2]
SESSION14 = REPO / "docs/device-runs/2026-11-23-session14"


def row(backend: str, tokens: int, time_us: float, quant: str = "bf16", shape: str = "s", **kw: float) -> dict:
    return {"backend": backend, "quant": quant, "shape": shape, "tokens": tokens, "time_us": time_us, **kw}


def by_cell(checks):
    return {(c.goal.name, c.backend, c.shape, c.tokens): c for c in checks}


def test_each_metric_reads_the_right_rows():
    rows = [
        row("cuda", 4, 10.0, pct_roofline=50.0, host_graph_out_us=12.0, host_us=300.0, host_graph_out_b2b_us=25.0),
        row("sglang", 4, 11.0, peer_config="tuned"),
        row("cuda", 256, 20.0, pct_roofline=95.0),  # covered by no goal
        row("cuda", 128, 30.0, pct_roofline=89.9, host_graph_out_us=20.5, host_us=float("nan")),
        row("cuda", 2048, 100.0, pct_roofline=80.0),
        row("sglang", 2048, 119.0, peer_config="tuned"),
        row("cuda", 2048, 60.0, quant="fp8_block", pct_roofline=70.0),
        row("cuda", 8192, 400.0),
        row("cuda", 8192, 250.0, quant="fp8_block"),
    ]
    c = by_cell(check_goals(rows, "dev"))
    assert c["decode_vs_peer", "cuda", "s", 4].value == pytest.approx(1.1) and c["decode_vs_peer", "cuda", "s", 4].met
    assert c["small_roofline", "cuda", "s", 128].status == "not met"  # 89.9 < 90
    assert c["prefill_roofline", "cuda", "s", 2048].met
    vs = c["prefill_vs_peer", "cuda", "s", 2048]
    assert vs.value == pytest.approx(1.19) and vs.status == "not met" and vs.value_text == "1.19x"
    assert c["fp8_vs_bf16", "cuda", "s", 2048].value == pytest.approx(100 / 60)
    assert c["fp8_vs_bf16", "cuda", "s", 8192].value == pytest.approx(1.6), "no upper bound on tokens"
    assert c["host_graphs", "cuda", "s", 4].met and not c["host_graphs", "cuda", "s", 128].met  # at most 20 us
    assert c["host_eager", "cuda", "s", 4].status == "not met"
    assert c["host_eager", "cuda", "s", 128].status == "not measured", "NaN: not measured (e.g. on CPU)"
    assert c["host_graphs_b2b", "cuda", "s", 4].status == "not met"  # its own column, not host_graph_out_us
    assert c["host_graphs_b2b", "cuda", "s", 128].status == "not measured", "a run from before the column"
    assert not any(k[1] == "sglang" for k in c), "the peer is compared against, never checked"
    assert not any(k[3] == 256 for k in c)
    assert all(x.device == "dev" for x in c.values())


def test_a_missing_peer_or_bf16_row_is_not_measured_never_met():
    c = by_cell(check_goals([row("cuda", 1, 5.0), row("cuda", 1024, 50.0, quant="fp8_block")]))
    assert c["decode_vs_peer", "cuda", "s", 1].status == "not measured"
    assert c["fp8_vs_bf16", "cuda", "s", 1024].status == "not measured"
    (s,) = [s for s in summarize(c.values()) if s.goal.name == "decode_vs_peer"]
    assert (s.status, s.measured, s.unmeasured) == ("not measured", 0, 1)


def test_goals_take_dataclass_rows_as_moehal_bench_makes_them():
    from moehal.bench import Row

    r = Row("s", "cuda", "p", "bf16", 16, 10.0, "graph", 1, 1, 9.5, 95.0, 1.0, 1.0)
    (check,) = [x for x in check_goals([r]) if x.goal.metric == PCT_ROOFLINE]
    assert check.goal.name == "small_roofline" and check.met and check.value_text == "95%"


def test_a_goal_must_name_a_known_metric():
    with pytest.raises(ValueError, match="unknown metric"):
        Goal("g", "text", "bf16", 1, 2, "speed", 1.0)
    g = Goal("g", "text", "bf16", 16, None, HOST_US, 20.0, at_most=True)
    assert g.covers("bf16", 10**6) and not g.covers("bf16", 8) and not g.covers("fp8_block", 16)
    assert g.met_by(20.0) and not g.met_by(20.1) and g.tokens_text == "16+"
    assert {x.metric for x in ISSUE_4_GOALS} >= {PCT_ROOFLINE, VS_PEER}


def test_runs_merge_per_device_and_the_later_file_wins(tmp_path):
    def run(name: str, device: str, rows: list[dict]) -> Path:
        p = tmp_path / name
        p.write_text(json.dumps({"ceilings": {"device": device}, "rows": rows}))
        return p

    a = run("a.json", "gpu0", [row("cuda", 2048, 100.0, pct_roofline=80.0)])
    b = run("b.json", "gpu0", [row("cuda", 2048, 50.0, quant="fp8_block", pct_roofline=90.0)])
    c = run("c.json", "gpu1", [row("cuda", 2048, 90.0, pct_roofline=70.0)])
    d = run("d.json", "gpu0", [row("cuda", 2048, 75.0, pct_roofline=81.0)])  # a rerun of a's row
    runs = load_runs([a, b, c, d])
    assert sorted(runs) == ["gpu0", "gpu1"] and len(runs["gpu0"]) == 2
    cells = {(x.goal.name, x.device): x for x in check_runs([a, b, c, d])}
    assert cells["prefill_roofline", "gpu0"].value == 81.0 and not cells["prefill_roofline", "gpu1"].met
    # fp8 (b) and bf16 (d) come from two files: paired only when asked, and then said so
    assert cells["fp8_vs_bf16", "gpu0"].status == "not measured"
    across = {(x.goal.name, x.device): x for x in check_runs([a, b, c, d], across_files=True)}
    fp8 = across["fp8_vs_bf16", "gpu0"]
    assert fp8.value == pytest.approx(1.5) and fp8.note == "rows of two files", "the same device's bf16"
    assert fp8.value_text == "1.50x [rows of two files]"


def test_committed_h100_record_reads_as_its_readme_says():
    """The session-14 H100 record: what its README states, computed from its JSON."""
    files = [SESSION14 / "h100/call2/bench.json", SESSION14 / "h100/call2/bench-fp8.json"]
    c = {(x.goal.name, x.shape, x.tokens): x for x in check_runs(files)}
    assert c["prefill_roofline", "deepseek_v3_ep8", 4096].met
    assert c["prefill_roofline", "qwen3_30b_a3b", 1024].met
    assert c["prefill_vs_peer", "qwen3_30b_a3b", 4096].status == "not met"
    assert c["prefill_vs_peer", "mixtral_8x7b", 1024].met
    assert all(x.met for (g, _, _), x in c.items() if g in ("decode_vs_peer", "small_roofline"))
    md = goals_markdown(list(c.values()))
    assert "| 1024-4096 tokens: at least 75% of roofline | >= 75% |" in md
    # (its SGLang rows predate `peer_config`: what SGLang ran is not in the file, and the cell says so)
    cell = (
        "| prefill_vs_peer | cuda:0 NVIDIA H100 80GB HBM3 sm90 | cuda | qwen3_30b_a3b | 4096 "
        "| 1.02x [peer config not recorded] | not met |"
    )
    assert cell in md and cell not in goals_markdown(list(c.values()), cells=False)


def test_cli_goals_markdown_json_and_table(capsys):
    files = [str(SESSION14 / "h200/call3/bench.json"), str(SESSION14 / "h200/call3/bench-fp8.json")]
    assert main(["goals", *files, "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert {c["goal"] for c in cells} == {g.name for g in ISSUE_4_GOALS}
    assert {c["status"] for c in cells} <= {"met", "not met", "not measured", "untuned peer"}
    assert {c["goal_status"] for c in cells} <= {"met", "not met", "not measured", "partly measured"}
    assert main(["goals", *files, "--markdown"]) == 0
    assert "| goal | target | device | backend | status | cells met | where not met |" in capsys.readouterr().out
    assert main(["goals", *files]) == 0
    assert "prefill_vs_peer" in capsys.readouterr().out


def test_cli_goals_says_when_nothing_is_covered(tmp_path, capsys):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"ceilings": {"device": "d"}, "rows": [row("cuda", 256, 1.0)]}))
    assert main(["goals", str(p)]) == 1
    assert "no row" in capsys.readouterr().err


def test_bench_goals_flag_checks_the_runs_own_rows(capsys):
    from moehal.bench import main as bench_main

    argv = ["--shapes", "tiny", "--tokens", "1,16", "--backends", "reference", "--reps", "1", "--goals"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "goals: reference on" in out and "small_roofline" in out
    assert "decode_vs_peer" in out and "unmeasured" in out, "no SGLang row in this run: not measured"


def test_rounds_pair_rows_of_one_round_and_take_the_median():
    """`moehal bench --rounds`: fp8 is compared with the bf16 row of its own round (measured next
    to it), and the cell reads the median of its rounds, with their range."""
    rows = []
    for rnd, (bf16, fp8, peer) in enumerate([(150.0, 100.0, 180.0), (160.0, 100.0, 190.0), (300.0, 200.0, 200.0)]):
        rows += [
            row("cuda", 2048, bf16, round=rnd, pct_roofline=70.0 + rnd),
            row("cuda", 2048, fp8, quant="fp8_block", round=rnd),
            row("sglang", 2048, peer, round=rnd),
        ]
    checks = check_goals(rows, "dev")
    assert len(checks) == 3, "one check per cell and goal, not one per round"
    c = by_cell(checks)
    fp8 = c["fp8_vs_bf16", "cuda", "s", 2048]
    # paired per round: 1.5, 1.6, 1.5 -> median 1.5; unpaired medians would give 160 / 100 = 1.6
    assert (fp8.value, fp8.low, fp8.high, fp8.rounds) == (pytest.approx(1.5), 1.5, 1.6, 3) and fp8.met
    assert fp8.value_text == "1.50x (1.50x-1.60x, 3 rounds)"
    peer = c["prefill_vs_peer", "cuda", "s", 2048]
    assert peer.value == pytest.approx(190 / 160) and peer.low == pytest.approx(200 / 300)
    assert c["prefill_roofline", "cuda", "s", 2048].value == 71.0


def test_a_round_without_its_pair_is_left_out_of_the_median():
    rows = [
        row("cuda", 1024, 150.0, round=0),
        row("cuda", 1024, 100.0, quant="fp8_block", round=0),
        row("cuda", 1024, 90.0, quant="fp8_block", round=1),  # its bf16 row failed: no pair
    ]
    fp8 = by_cell(check_goals(rows))["fp8_vs_bf16", "cuda", "s", 1024]
    assert (fp8.value, fp8.rounds, fp8.value_text) == (pytest.approx(1.5), 1, "1.50x")
    alone = by_cell(check_goals(rows[2:]))["fp8_vs_bf16", "cuda", "s", 1024]
    assert alone.status == "not measured" and alone.rounds == 0


def test_runs_keep_every_round_of_a_file(tmp_path):
    rows = [row("cuda", 2048, 100.0 + r, round=r) for r in range(3)]
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"ceilings": {"device": "d"}, "rows": rows}))
    assert len(load_runs([p])["d"]) == 3


def test_bench_rounds_interleave_the_cells_rows(tmp_path, capsys):
    from moehal.bench import main as bench_main

    out = tmp_path / "b"
    argv = ["--shapes", "tiny", "--tokens", "1,16", "--backends", "reference,sglang", "--quant", "bf16,fp8_block"]
    assert bench_main([*argv, "--reps", "1", "--rounds", "2", "--no-host", "--settle-s", "0", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    order = [(r["round"], r["tokens"], r["quant"]) for r in data["rows"]]
    assert order == [(n, t, q) for n in (0, 1) for t in (1, 16) for q in ("bf16", "fp8_block")]
    assert data["rounds"] == 2
    printed = capsys.readouterr().out
    assert "their rows run for bf16 only" in printed and "round" in printed


def test_a_later_file_replaces_every_round_of_a_cell(tmp_path):
    # a one-round rerun of a three-round record: the cell is the rerun's, not its round 0 beside
    # the record's rounds 1-2 (whose ratios would pair rows of two runs)
    def run(name: str, rows: list[dict]) -> Path:
        p = tmp_path / name
        p.write_text(json.dumps({"ceilings": {"device": "d"}, "rows": rows}))
        return p

    record = run("record.json", [row("cuda", 2048, 160.0 + r, round=r, pct_roofline=70.0) for r in range(3)])
    rerun = run("rerun.json", [row("cuda", 2048, 130.0, round=0, pct_roofline=80.0)])
    rows = load_runs([record, rerun])["d"]
    assert [(r["time_us"], r["round"]) for r in rows] == [(130.0, 0)]
    cell = by_cell(check_runs([record, rerun]))["prefill_roofline", "cuda", "s", 2048]
    assert (cell.value, cell.rounds) == (80.0, 1)


def test_transformers_peers_are_never_checked():
    rows = [row("transformers:grouped_mm", 16, 50.0, pct_roofline=10.0), row("cuda", 16, 40.0, pct_roofline=95.0)]
    assert {c.backend for c in check_goals(rows)} == {"cuda"}


def test_ue8m0_fp8_rows_are_fp8_block_rows():
    rows = [row("cuda", 2048, 150.0), row("cuda", 2048, 100.0, quant="fp8_block:ue8m0")]
    fp8 = by_cell(check_goals(rows))["fp8_vs_bf16", "cuda", "s", 2048]
    assert fp8.value == pytest.approx(1.5) and fp8.met


def test_bench_compare_takes_the_median_of_an_even_number_of_rounds(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "tools" / "bench_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [row("cuda", 16, t, round=r, pct_roofline=100.0 * 60.0 / t) for r, t in enumerate((100.0, 140.0))]
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"ceilings": {"device": "d"}, "date": "x", "rounds": 2, "rows": rows}))
    assert "| s | 16 | 120.0 (50%) |" in mod.table(str(p))


def test_readers_of_bench_json_refuse_a_schema_they_do_not_read(tmp_path):
    """`load_runs` and `tools/bench_compare.py` read files of `moehal.bench/1` and files without
    a schema (before session 59), and refuse any other with an error that names it."""
    import importlib.util

    from moehal.errors import InputError

    spec = importlib.util.spec_from_file_location("bench_compare", REPO / "tools" / "bench_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    rows = [row("cuda", 16, 100.0, pct_roofline=50.0)]
    for name, schema in (("v1.json", {"schema": "moehal.bench/1"}), ("none.json", {})):
        p = _run_file(tmp_path, name, rows, date="x", **schema)
        assert len(load_runs([p])["d"]) == 1
        assert "| s | 16 | 100.0 (50%) |" in compare.table(str(p))
    for name, schema in (("v2.json", "moehal.bench/2"), ("conf.json", "moehal.conformance/1")):
        p = _run_file(tmp_path, name, rows, date="x", schema=schema)
        with pytest.raises(InputError, match=f"schema '{schema}', not 'moehal.bench/1'"):
            load_runs([p])
        with pytest.raises(InputError, match=f"schema '{schema}', not 'moehal.bench/1'"):
            compare.table(str(p))


def test_goals_check_gates_on_a_missed_goal_and_still_prints_the_output(tmp_path, capsys):
    """`moehal goals` only reported: a CI could not fail on a missed goal. `--check` exits 1
    where a measured cell misses its goal, after the same output; cells not measured pass."""
    met = [row("cuda", 16, 10.0, pct_roofline=95.0), row("cuda", 64, 10.0, pct_roofline=91.0)]
    good = _run_file(tmp_path, "good.json", [*met, row("cuda", 4, 10.0)])  # decode_vs_peer: no peer row
    bad = _run_file(tmp_path, "bad.json", [*met, row("cuda", 32, 10.0, pct_roofline=50.0)])
    for args in ([], ["--markdown"], ["--json"]):
        assert main(["goals", *args, str(bad)]) == 0, "without --check it reports, whatever the goals say"
        without = capsys.readouterr().out
        assert main(["goals", *args, "--check", str(bad)]) == 1
        captured = capsys.readouterr()
        assert captured.out == without, "the same output, then the exit status"
        assert "1 of 3 measured cells miss their goal" in captured.err
        assert "small_roofline d cuda s 32: 50%" in captured.err
    json.loads(without)  # --json's stdout stays one JSON document
    assert main(["goals", "--check", str(good)]) == 0, "every measured cell met; an unmeasured one does not fail"
    err = capsys.readouterr().err
    assert "miss their goal" not in err
    # ... but the check says what it did not check (on CPU-like rows, the host goals too)
    assert "cells not measured, so not checked:" in err
    assert "  decode_vs_peer d cuda: not measured, 0 of 0 (1 not measured)" in err


def test_goals_check_fails_a_file_whose_rows_had_wrong_outputs(tmp_path, capsys):
    """A row whose output was wrong is no measurement, so none of its cells missed: --check
    passed a file of wrong rows (bench itself had exited 1 for them). It fails it now."""
    rows = [row("cuda", 16, 10.0, pct_roofline=95.0), row("cuda", 32, 10.0, pct_roofline=50.0, check="fail")]
    p = _run_file(tmp_path, "wrong.json", rows)
    assert main(["goals", str(p)]) == 0, "without --check it reports"
    capsys.readouterr()
    assert main(["goals", "--check", str(p)]) == 1
    err = capsys.readouterr().err
    assert "1 rows had a wrong output" in err and "  cuda bf16 s 32" in err, err
    assert "miss their goal" not in err, "the wrong row is not a missed cell"


def _run_file(tmp_path: Path, name: str, rows: list[dict], device: str = "d", **extra) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"ceilings": {"device": device}, "rows": rows, **extra}))
    return p


def test_a_ratio_pairs_rows_of_one_file_never_two_machines(tmp_path):
    """Session 44's audit: two files of one GPU model (two machines, one device string) paired a
    cuda-only rerun with another machine's SGLang rows, and a 0.5x cell read 1.11x, met."""
    first = _run_file(tmp_path, "a.json", [row("cuda", 8, 100.0), row("sglang", 8, 50.0)])
    rerun = _run_file(tmp_path, "b.json", [row("cuda", 8, 45.0)])  # another machine, cuda rows only
    cell = by_cell(check_runs([first, rerun]))["decode_vs_peer", "cuda", "s", 8]
    assert cell.status == "not measured" and cell.value is None
    cell = by_cell(check_runs([first, rerun], across_files=True))["decode_vs_peer", "cuda", "s", 8]
    assert cell.met and cell.note == "rows of two files; peer config not recorded"
    md = goals_markdown(check_runs([first, rerun], across_files=True), cells=False)
    assert "1 of 1; rows of two files in 1 of 1; peer config not recorded in 1 of 1 |" in md


def test_a_ratio_of_rows_timed_two_ways_is_not_measured():
    rows = [row("cuda", 8, 100.0, timing="graph"), row("sglang", 8, 150.0, timing="eager")]
    cell = by_cell(check_goals(rows))["decode_vs_peer", "cuda", "s", 8]
    assert cell.status == "not measured" and cell.note == "timed graph against eager"
    assert cell.value_text == "- (timed graph against eager)"


def test_cells_against_sglangs_default_config_say_so_and_are_not_measured():
    """The goal is "1.2x SGLang's tuned Triton path": a cell measured against SGLang's default tiles is shown,
    with its value, but is no measurement of the goal (it counted as met before)."""
    rows = [
        row("cuda", 2048, 100.0, round=r) for r in range(2)
    ] + [row("sglang", 2048, 130.0, round=r, peer_config="default") for r in range(2)] + [
        row("cuda", 1024, 100.0), row("sglang", 1024, 125.0, peer_config="tuned"),
        row("cuda", 4096, 100.0), row("sglang", 4096, 121.0, peer_config="tuned for Triton 3.1.0"),
    ]  # fmt: skip
    c = by_cell(check_goals(rows, "dev"))
    untuned = c["prefill_vs_peer", "cuda", "s", 2048]
    assert untuned.met is None and untuned.status == "untuned peer" and untuned.note == "peer config: default"
    assert untuned.value_text == "1.30x (1.30x-1.30x, 2 rounds) [peer config: default]", "the value stays visible"
    assert c["prefill_vs_peer", "cuda", "s", 1024].note == "", "a tuned peer needs no note"
    fallback = c["prefill_vs_peer", "cuda", "s", 4096]
    assert fallback.met and fallback.note == "peer config: tuned for Triton 3.1.0", "another release's tuned file"
    (s,) = [s for s in summarize(c.values()) if s.goal.name == "prefill_vs_peer"]
    assert s.notes == (("peer config: default", 1), ("peer config: tuned for Triton 3.1.0", 1))
    assert (s.status, s.met, s.measured, s.unmeasured, s.untuned) == ("partly measured", 2, 2, 1, 1)
    md = goals_markdown(list(c.values()), cells=False)
    assert "| partly measured | 2 of 2 (1 not measured, 1 of them against an untuned peer); peer config: default" in md
    decode = by_cell(check_goals([row("cuda", 8, 10.0), row("sglang", 8, 12.0, peer_config="default")]))
    assert decode["decode_vs_peer", "cuda", "s", 8].status == "untuned peer", "the 1-8 token goal too"


def test_a_round_against_an_untuned_peer_is_left_out_where_others_are_tuned():
    rows = [row("cuda", 2048, 100.0, round=r) for r in range(3)] + [
        row("sglang", 2048, t, round=r, peer_config=how)
        for r, (t, how) in enumerate([(130.0, "tuned"), (150.0, "default"), (126.0, "tuned")])
    ]
    cell = by_cell(check_goals(rows))["prefill_vs_peer", "cuda", "s", 2048]
    assert (cell.value, cell.rounds, cell.status) == (pytest.approx(1.28), 2, "met")
    assert cell.note == "peer config: default", "the round left out is still said"


def test_a_goal_with_cells_not_measured_is_partly_measured_never_met(tmp_path, capsys):
    """The audit's repro (session 59): three decode cells, one against SGLang's default config and
    two with no peer row, read "met, 1 of 1 (2 not measured)". "met" now means every cell of
    the goal's range in the rows was measured and met."""
    repro = [
        row("cuda", 1, 10.0), row("sglang", 1, 12.0, peer_config="default"), row("cuda", 4, 10.0), row("cuda", 8, 10.0)
    ]  # fmt: skip
    (s,) = [s for s in summarize(check_goals(repro)) if s.goal.name == "decode_vs_peer"]
    assert (s.status, s.measured, s.unmeasured, s.untuned) == ("not measured", 0, 3, 1)
    partly = [row("cuda", 1, 10.0), row("sglang", 1, 12.0, peer_config="tuned"), row("cuda", 4, 10.0)]
    (s,) = [s for s in summarize(check_goals(partly)) if s.goal.name == "decode_vs_peer"]
    assert (s.status, s.met, s.measured, s.unmeasured) == ("partly measured", 1, 1, 1)
    every = [*partly, row("sglang", 4, 11.0, peer_config="tuned")]
    (s,) = [s for s in summarize(check_goals(every)) if s.goal.name == "decode_vs_peer"]
    assert s.status == "met"
    missed = [*partly, row("sglang", 4, 9.0, peer_config="tuned")]
    (s,) = [s for s in summarize(check_goals(missed)) if s.goal.name == "decode_vs_peer"]
    assert s.status == "not met"
    # the table, the markdown and `moehal goals --json` say "partly measured", not "met"
    p = _run_file(tmp_path, "partly.json", partly)
    assert main(["goals", "--markdown", "--check", str(p)]) == 0, "partly measured does not fail --check"
    captured = capsys.readouterr()
    line = next(x for x in captured.out.splitlines() if x.startswith("| 1-8 tokens"))
    assert "| partly measured | 1 of 1 (1 not measured) |" in line and "| met |" not in line
    assert "  decode_vs_peer d cuda: partly measured, 1 of 1 (1 not measured)" in captured.err
    assert main(["goals", "--json", str(p)]) == 0
    cells = [c for c in json.loads(capsys.readouterr().out) if c["goal"] == "decode_vs_peer"]
    assert [(c["tokens"], c["status"], c["goal_status"]) for c in cells] == [
        (1, "met", "partly measured"), (4, "not measured", "partly measured")
    ]  # fmt: skip
    assert main(["goals", str(p)]) == 0
    table = capsys.readouterr().out
    assert "partly measured" in table


def test_skipped_rows_are_cells_not_measured_with_the_reason(tmp_path):
    skipped = [
        {"shape": "s", "quant": "bf16", "backend": "cuda", "tokens": 4096, "round": 0, "skipped": "CUDA out of memory"},
        {"shape": "s", "quant": "bf16", "backend": "sglang", "tokens": 8, "round": 0, "skipped": "peer failed: X"},
    ]
    p = _run_file(tmp_path, "a.json", [row("cuda", 8, 10.0, pct_roofline=1.0)], skipped=skipped)
    c = by_cell(check_runs([p]))
    oom = c["prefill_roofline", "cuda", "s", 4096]
    assert oom.status == "not measured" and oom.note == "skipped: CUDA out of memory"
    peer = c["decode_vs_peer", "cuda", "s", 8]
    assert peer.status == "not measured" and peer.note == "sglang bf16 row skipped: peer failed: X"
    (s,) = [s for s in summarize(c.values()) if s.goal.name == "prefill_roofline"]
    assert (s.measured, s.unmeasured) == (0, 1), "a skipped row is counted, not dropped"
    # a later file that measured the cell replaces the skip; a later skip never hides a measurement
    later = _run_file(tmp_path, "b.json", [row("cuda", 4096, 50.0, pct_roofline=80.0)])
    assert by_cell(check_runs([p, later]))["prefill_roofline", "cuda", "s", 4096].met
    skip_again = _run_file(tmp_path, "c.json", [], skipped=skipped[:1])
    assert by_cell(check_runs([later, skip_again]))["prefill_roofline", "cuda", "s", 4096].met


def test_bench_saves_skipped_rows_and_its_goals_count_them(tmp_path, capsys):
    from moehal.bench import main as bench_main

    out = tmp_path / "b"
    argv = ["--shapes", "tiny", "--tokens", "2", "--backends", "reference,sglang", "--reps", "1", "--no-host"]
    # on the CPU, where the peer declines for the device whatever is installed (session 44's H200
    # run, without SGLang, skipped it for the import instead)
    assert bench_main([*argv, "--device", "cpu", "--settle-s", "0", "--goals", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (skip,) = data["skipped"]
    assert (skip["backend"], skip["tokens"], skip["round"]) == ("sglang", 2, 0)
    assert "CUDA devices only" in skip["skipped"]
    assert "sglang bf16 row skipped" in capsys.readouterr().out.replace("\n", " ")
    cell = by_cell(check_runs([out.with_suffix(".json")]))["decode_vs_peer", "reference", "tiny", 2]
    assert cell.status == "not measured" and "CUDA devices only" in cell.note


def test_the_docs_marker_can_pair_across_files(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reports_hook", REPO / "docs" / "_hooks" / "reports.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    _run_file(tmp_path, "a.json", [row("cuda", 8, 100.0)])
    _run_file(tmp_path, "b.json", [row("sglang", 8, 150.0)])
    assert "| not measured | 0 of 0 (1 not measured) | - |" in hook._goals(tmp_path, "a.json b.json")
    assert "| met | 1 of 1; rows of two files in 1 of 1; peer config not recorded in 1 of 1 |" in hook._goals(
        tmp_path, "--pair-across-files a.json b.json"
    )


def test_the_docs_hook_expands_markers_alone_on_their_line_only(tmp_path):
    """A marker quoted in a code span or a sentence stays text (it was expanded mid-line)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("reports_hook", REPO / "docs" / "_hooks" / "reports.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x.md").write_text("report")
    _run_file(tmp_path, "a.json", [row("cuda", 8, 100.0)])
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="page.md"))
    quoted = "Write `<!-- goals:a.json -->` or `<!-- reports:runs -->` on a line of its own."
    markdown = f"{quoted}\n\n<!-- reports:runs -->\n\n<!-- goals:a.json -->  \n"
    out = hook.on_page_markdown(markdown, page, {"docs_dir": str(tmp_path)}, None)
    assert out.startswith(quoted + "\n")
    assert "| [x.md](runs/x.md) | report |" in out and "<!-- reports:runs -->\n" not in out
    assert "| goal |" in out and "<!-- goals:a.json -->  " not in out


def test_a_row_with_a_wrong_output_is_no_measurement_on_either_side_of_a_ratio():
    """`moehal bench` checks each row's output against the reference (`Row.check`): a wrong
    result's time meets no goal, and no ratio is taken against it."""
    rows = [
        row("cuda", 16, 10.0, check="fail", check_rel_l2=0.5, pct_roofline=99.0),
        row("cuda", 32, 10.0, check="pass", pct_roofline=99.0),
        row("cuda", 8, 10.0, check="pass"),
        row("sglang", 8, 30.0, check="fail", check_rel_l2=0.2),
        row("cuda", 2048, 100.0, check="pass", pct_roofline=80.0),
        row("cuda", 2048, 100.0, check="fail", check_rel_l2=0.1, round=1, pct_roofline=80.0),
    ]
    c = by_cell(check_goals(rows))
    wrong = c["small_roofline", "cuda", "s", 16]
    assert wrong.status == "not measured" and wrong.note == "cuda bf16 output wrong (rel_l2 0.5)"
    assert c["small_roofline", "cuda", "s", 32].met
    peer = c["decode_vs_peer", "cuda", "s", 8]
    assert peer.status == "not measured" and peer.note == "sglang bf16 output wrong (rel_l2 0.2)"
    one_round = c["prefill_roofline", "cuda", "s", 2048]
    assert one_round.met and one_round.rounds == 1 and "output wrong (rel_l2 0.1)" in one_round.note


def test_cli_goals_table_keeps_every_failing_value_whole_in_a_narrow_terminal():
    """At 60 columns the table cut its "where not met" column to `qwen3_30b_a` and `(73%-74%, 3`
    (and at less, to nothing): the values that fail a goal are the table's point."""
    import os
    import subprocess
    import sys

    path = str(REPO / "docs/device-runs/2026-11-29-session57/h200/call1/bench.json")
    run = subprocess.run(
        [sys.executable, "-m", "moehal.cli.main", "goals", path],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "60"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    misses = [c for c in check_runs([path]) if c.met is False]
    assert misses and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 60
    words = set(out.split())
    for c in misses:  # each word whole on some line: wrapped at spaces, never cut
        assert c.shape in words and set(f"{c.tokens}: {c.value_text}".split()) <= words, c


def test_a_value_that_misses_its_target_never_prints_as_the_target():
    """The audit (session 59, finding 14): 89.6% printed "90%" next to "not met", 1.497x "1.50x".
    A value prints with the digits that keep it on its own side of the target, ranges too."""
    rows = [
        row("cuda", 16, 10.0, pct_roofline=89.6),
        *(row("cuda", 128, 10.0, round=r, pct_roofline=p) for r, p in enumerate((89.995, 91.2, 90.6))),
        row("cuda", 64, 10.0, pct_roofline=90.4),
        row("cuda", 4096, 149.7),
        row("cuda", 4096, 100.0, quant="fp8_block"),
        row("cuda", 8, 10.0, host_us=20.04),
    ]
    c = by_cell(check_goals(rows))
    assert (c["small_roofline", "cuda", "s", 16].value_text, c["small_roofline", "cuda", "s", 16].status) == (
        "89.6%", "not met"
    )  # fmt: skip
    assert c["small_roofline", "cuda", "s", 64].value_text == "90%", "a met value keeps the usual digits"
    assert c["small_roofline", "cuda", "s", 128].value_text == "91% (89.995%-91%, 3 rounds)", "a round under 90%"
    fp8 = c["fp8_vs_bf16", "cuda", "s", 4096]
    assert (fp8.value_text, fp8.status) == ("1.497x", "not met")
    assert c["host_eager", "cuda", "s", 8].value_text == "20.04 us", "at most 20 us: 20.04 is not 20.0"
    from moehal.bench_goals import format_value

    goal = c["small_roofline", "cuda", "s", 16].goal
    assert format_value(goal, 89.99999999) == "89.999%", "closer than the digits: rounded toward its own side"
    assert format_value(goal, 90.0) == "90%"


def test_a_met_cell_that_rests_on_a_row_above_100_percent_says_so():
    rows = [
        row("cuda", 16, 10.0, pct_roofline=104.6, pct_roofline_read=98.0),
        row("cuda", 32, 10.0, round=0, pct_roofline=99.0),
        row("cuda", 32, 10.0, round=1, pct_roofline=101.0, pct_roofline_read=100.2),
        row("cuda", 64, 10.0, pct_roofline=95.0),
    ]
    c = by_cell(check_goals(rows))
    assert c["small_roofline", "cuda", "s", 16].note == "above 100% of roofline (ceiling exceeded)"
    assert c["small_roofline", "cuda", "s", 16].met
    both = "above 100% of roofline (ceiling exceeded, the read ceiling's too)"
    assert c["small_roofline", "cuda", "s", 32].note == both, "one round above 100% of either ceiling"
    assert c["small_roofline", "cuda", "s", 64].note == ""
    md = goals_markdown(list(c.values()), cells=False)
    assert "| met | 3 of 3; above 100% of roofline (ceiling exceeded) in 1 of 3; above 100%" in md


def test_the_graph_replay_host_goals_are_informational_and_do_not_gate(tmp_path, capsys):
    """The audit (session 59, finding 7): two host goals about graph replays read "per eager
    forward" and "met", beside the issue's one ("under 20 us per forward outside graphs"), which
    no run meets. Now they say what they time, are marked informational, and --check skips them."""
    goals = {g.name: g for g in ISSUE_4_GOALS}
    assert [n for n, g in goals.items() if g.metric in (HOST_US, "host_us", "host_graph_out_b2b_us")] == [
        "host_eager", "host_graphs", "host_graphs_b2b"
    ]  # fmt: skip
    assert not goals["host_eager"].informational and "outside graphs" in goals["host_eager"].text
    for name in ("host_graphs", "host_graphs_b2b"):
        g = goals[name]
        assert g.informational and "eager" not in g.text and "inside a CUDA graph" in g.text
        assert g.text.startswith("informational:")
    assert [g.name for g in ISSUE_4_GOALS if not g.informational and g.metric.startswith("host")] == ["host_eager"]
    replays_fast = [row("cuda", 8, 10.0, host_us=15.0, host_graph_out_us=25.0, host_graph_out_b2b_us=30.0)]
    md = goals_markdown(check_goals(replays_fast), cells=False)
    assert "| not met (informational) |" in md and "| met |" in md  # host_eager met, the replays not
    p = _run_file(tmp_path, "r.json", replays_fast)
    assert main(["goals", "--check", str(p)]) == 0, "an informational goal's miss does not fail --check"
    err = capsys.readouterr().err
    assert "2 cells of informational goals not checked" in err and "miss their goal" not in err
    assert main(["goals", "--json", str(p)]) == 0
    gating = {c["goal"]: c["gating"] for c in json.loads(capsys.readouterr().out)}
    assert gating["host_eager"] and not gating["host_graphs"] and not gating["host_graphs_b2b"]
    eager_slow = _run_file(tmp_path, "e.json", [row("cuda", 8, 10.0, host_us=45.0, host_graph_out_us=5.0)])
    assert main(["goals", "--check", str(eager_slow)]) == 1, "the issue's host goal gates"
    assert "host_eager d cuda s 8: 45.0 us" in capsys.readouterr().err


def test_every_doc_page_the_code_cites_exists():
    """core/integrations/sglang.py and tools/sglang_peer.py cited docs/benchmarks.md, which never
    existed (session 59's review, finding 15): a page named in the code must be in the tree."""
    import re

    cited = []
    for d in ("core", "tools", "backends_cuda", "backends_rocm", "backends_npu", "conformance"):
        for f in sorted((REPO / d).rglob("*.py")):
            cited += [(f.relative_to(REPO), m) for m in re.findall(r"docs/[\w\-./]*[\w\-]\.md\b", f.read_text())]
    assert len(cited) >= 10, "the pattern still finds the citations"
    assert [(str(f), page) for f, page in cited if not (REPO / page).is_file()] == []


def test_the_goals_markdown_escapes_what_backends_and_devices_say(tmp_path):
    """The Reports page publishes this markdown: a backend's skip reason (its decline text) and
    the device name went in raw, so a `|` split the row and HTML reached the site (as in
    conformance reports before session 59)."""
    from moehal.bench_goals import goals_markdown

    hostile = "<img src=x onerror=alert(1)> | [x](javascript:y())"
    skip = {"shape": "s", "quant": "bf16", "backend": "cuda", "tokens": 32, "round": 0, "skipped": hostile}
    p = _run_file(tmp_path, "r.json", [row("cuda", 16, 10.0, pct_roofline=95.0)], device="gpu <b>", skipped=[skip])
    md = goals_markdown(check_runs([p]))
    assert "<img" not in md and "<b>" not in md and "[x](javascript" not in md, md
    assert "&lt;img src=x onerror=alert(1)&gt; \\| [x\\](javascript:y())" in md
    for line in md.splitlines():
        if line.startswith("| "):
            assert line.replace("\\|", "").count("|") == 8, line  # 7 columns: no cell split
