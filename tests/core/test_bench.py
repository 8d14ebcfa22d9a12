"""`moehal bench` machinery on tiny shapes (performance goals live in the benchmark itself,
not in tests: this only checks that it measures, reports and plots)."""

from __future__ import annotations

import json

from moehal.bench import main


def test_bench_tiny_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    assert (
        main(["--shapes", "tiny", "--tokens", "1,8", "--backends", "reference", "--reps", "2", "--out", str(out)]) == 0
    )
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["ceilings"]["copy_bytes_per_s"] > 0 and data["ceilings"]["matmul_flops_per_s"] > 0
    rows = data["rows"]
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        assert r["time_us"] > 0 and 0 < r["roofline_us"] and r["pct_roofline"] > 0
        assert r["flops"] == 2 * r["tokens"] * 2 * (128 * 128 + 64 * 128)
        assert r["host_us"] != r["host_us"], "host overhead is a CUDA measurement: NaN on CPU"
        assert r["host_graph_us"] != r["host_graph_us"]
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
