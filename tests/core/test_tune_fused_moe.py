"""`moehal.kernels.tune_fused_moe`: the search on stand-in timings, and the whole tuner on the
CPU (Triton's interpreter: timings there mean nothing, the machinery is what is checked)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
from moehal.kernels.host import interpreting
from moehal.kernels.tiles import TileConfig
from moehal.kernels.tune_fused_moe import (
    block_heights,
    gemm_candidates,
    nearest_tile,
    neighbours,
    parse_tile,
    tune_entry,
)

HEURISTIC = (TileConfig(64, 64, 64, 8, 4, 3), TileConfig(64, 128, 64, 8, 8, 3))


def _search(times, wrong=(), fails=(), **kw):
    """tune_entry on a problem whose output is right unless the pair is in `wrong`, whose
    launch fails for pairs in `fails`, and whose time per pair comes from `times(pair)`."""
    from triton.runtime.errors import OutOfResources

    ref = torch.ones(4)
    current = {}

    def run(pair):
        if pair in fails:
            raise OutOfResources(300_000, 232_448, "shared memory")
        current["pair"] = pair
        return ref * (2.0 if pair in wrong else 1.0)

    def time_fn(fn):
        fn()
        return times(current["pair"])

    return tune_entry(run, HEURISTIC, rows_per_expert=256, time_fn=time_fn, **kw)


def test_candidates_by_rows_per_expert():
    assert block_heights(1) == (16, 32) and block_heights(256) == (32, 64, 128) and block_heights(1024) == (64, 128)
    nv, amd = gemm_candidates(128, 1024, is_rocm=False), gemm_candidates(128, 1024, is_rocm=True)
    assert all(c.block_m == 128 and c.group_m == 8 for c in nv) and len(nv) == 24
    assert {c.num_stages for c in amd} == {2} and len(amd) == 12
    assert {c.group_m for c in gemm_candidates(16, 4, is_rocm=False)} == {1}


def test_search_finds_the_fastest_correct_pair_and_never_loses_to_the_heuristic():
    fast1 = TileConfig(128, 256, 64, 8, 8, 4)  # GEMM1's best at height 128
    fast2 = TileConfig(128, 128, 128, 8, 4, 3)  # GEMM2's best given fast1
    wrong = (TileConfig(64, 64, 128, 8, 4, 3), HEURISTIC[1])  # tried at height 64, GEMM2 at the heuristic's

    def times(pair):
        g1, g2 = pair
        t = 10.0
        t -= 3.0 if g1 == fast1 else 0.0
        t -= 2.0 if g2 == fast2 else 0.0
        if pair == wrong:
            t = 0.1  # the fastest of all, but computes something else
        return t * 1e-6

    e = _search(times, wrong=(wrong,), fails=((TileConfig(64, 256, 128, 8, 8, 4), HEURISTIC[1]),))
    assert (e.gemm1, e.gemm2) == (fast1, fast2)
    assert e.us == pytest.approx(5.0) and e.heuristic_us == pytest.approx(10.0)
    assert e.rejected == {"wrong output": 1, "OutOfResources": 1}
    assert e.tried == 1 + 2 * 24 * len(block_heights(256))
    table = e.as_table_entry()
    assert TileConfig.from_dict(table["gemm1"]) == fast1 and table["us"] == 5.0


def test_search_budget_and_candidate_cap():
    flat = lambda pair: 1e-5  # noqa: E731 - nothing beats the heuristic
    only = _search(flat, budget_s=0.0)
    assert only.tried == 1 and (only.gemm1, only.gemm2) == HEURISTIC and only.us == only.heuristic_us
    capped = _search(flat, max_candidates=2)
    assert capped.tried == 1 + 2 * 2 * len(block_heights(256))


def test_a_short_budget_is_shared_over_every_tile_height():
    """Each measurement takes one (fake) second: 13 s for 3 heights gives each height 4 s (2 per
    GEMM), so every height gets candidates, where a first-come budget spent all on height 32."""
    clock = {"now": 0.0}
    seen = []

    def times(pair):
        clock["now"] += 1.0
        seen.append(pair)
        return 1e-5

    e = _search(times, budget_s=13.0, clock=lambda: clock["now"])
    heights = {p[0].block_m for p in seen[1:]}
    assert heights == set(block_heights(256)) and e.tried == len(seen) < 1 + 2 * 24 * 3


def test_seeds_are_tried_first_and_can_win():
    seed = (TileConfig(128, 256, 64, 1, 8, 4), TileConfig(128, 256, 64, 1, 8, 4))  # not among the candidates
    order = []

    def times(pair):
        order.append(pair)
        return (1.0 if pair == seed else 10.0) * 1e-6

    e = _search(times, seeds=[seed, HEURISTIC], budget_s=math.inf)
    assert order[:2] == [HEURISTIC, seed]  # the heuristic again as a seed is not measured twice
    assert (e.gemm1, e.gemm2) == seed and e.us == pytest.approx(1.0)


def test_neighbours_change_one_setting_of_one_gemm():
    pair = (TileConfig(128, 128, 64, 1, 8, 4), TileConfig(128, 256, 64, 1, 8, 4, True))
    near = neighbours(pair, is_rocm=False, tma=True)
    assert len(set(near)) == len(near) and pair not in near
    for g1, g2 in near:
        changed = [(a, b) for a, b in zip(pair, (g1, g2)) if a != b]
        assert len(changed) == 1  # one GEMM
        old, new = changed[0]
        assert new.block_m == old.block_m  # the height both GEMMs share is kept
        fields = ("block_n", "block_k", "group_m", "tma")
        diff = [f for f in fields if getattr(old, f) != getattr(new, f)]
        warps_stages = (old.num_warps, old.num_stages) != (new.num_warps, new.num_stages)
        assert len(diff) + warps_stages == 1
    # GEMM2's N block 256 only halves (256 is the largest tried); without TMA allowed, TMA only turns off
    assert (pair[0], TileConfig(128, 128, 64, 1, 8, 4, True)) in near
    assert (pair[0], TileConfig(128, 512, 64, 1, 8, 4, True)) not in near
    plain = neighbours(pair, is_rocm=False, tma=False)
    assert (pair[0], replace(pair[1], tma=False)) in plain and (replace(pair[0], tma=True), pair[1]) not in plain
    assert {(c.num_warps, c.num_stages) for p in neighbours(pair, is_rocm=True) for c in p} >= {(4, 2), (8, 2)}


def test_a_winning_seed_is_refined_one_step_at_a_time():
    """The seed beats the heuristic; two steps from it (GEMM1 with 3 stages, then GEMM2 grouped)
    is faster still, and the climb gets there before the height sweep."""
    seed = (TileConfig(128, 128, 64, 1, 8, 4), TileConfig(128, 256, 64, 1, 8, 4))
    step1 = (replace(seed[0], num_stages=3), seed[1])
    step2 = (step1[0], replace(seed[1], group_m=8))
    times = {seed: 5.0, step1: 4.0, step2: 3.0}
    e = _search(lambda pair: times.get(pair, 10.0) * 1e-6, seeds=[seed])
    assert (e.gemm1, e.gemm2) == step2 and e.us == pytest.approx(3.0)
    # no seed win, no climb: the same search as without seeds, plus the seed
    flat = _search(lambda pair: 10e-6, seeds=[seed])
    assert flat.tried == 2 + 2 * 24 * len(block_heights(256))


def test_seed_tiles_from_text_and_from_an_engine_config():
    assert parse_tile("128,256,64") == TileConfig(128, 256, 64)
    assert parse_tile("64,128,64,16,8,4") == TileConfig(64, 128, 64, 16, 8, 4)
    with pytest.raises(ValueError):
        parse_tile("64,128")

    def sgl(m, n, k, g, w, st):
        blocks = {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": g}
        return {**blocks, "num_warps": w, "num_stages": st}

    sglang = {"16": sgl(16, 128, 128, 1, 8, 5), "1024": sgl(64, 128, 64, 1, 4, 3)}  # SGLang / vLLM spelling
    assert nearest_tile(sglang, 100) == TileConfig(16, 128, 128, 1, 8, 5)
    assert nearest_tile(sglang, 4096) == TileConfig(64, 128, 64, 1, 4, 3)
    with pytest.raises(ValueError, match="no token-count keys"):
        nearest_tile({"_meta": {}}, 16)


def test_engine_configs_translate_to_this_kernels_tiles(tmp_path):
    """SGLang's / vLLM's GEMM1 N tile spans gate and up columns; ours counts one half (two
    accumulators side by side), so a gated seed halves it. SGLang's `_down` file seeds GEMM2."""
    from moehal.kernels.tune_fused_moe import EngineConfig

    def sgl(n, tma=False):
        tile = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 4}
        return {"4096": {**tile, "USE_TMA": True} if tma else tile}

    up = tmp_path / "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json"
    up.write_text(json.dumps(sgl(256)))
    alone = EngineConfig.load(up)
    assert alone.down is None
    g1, g2 = alone.seed(4096, gated=True)
    assert (g1.block_n, g2.block_n) == (128, 256)  # 256 columns of [gate | up] = 128 of each
    assert alone.seed(4096, gated=False)[0].block_n == 256
    (tmp_path / f"{up.stem}_down.json").write_text(json.dumps(sgl(128, tma=True)))
    both = EngineConfig.load(up)
    g1, g2 = both.seed(3000, gated=True)
    assert g1 == TileConfig(128, 128, 64, 1, 8, 4) and g2 == TileConfig(128, 128, 64, 1, 8, 4, True)


def test_search_refuses_a_problem_whose_heuristic_fails():
    from triton.runtime.errors import OutOfResources

    with pytest.raises(OutOfResources):
        _search(lambda pair: math.inf, fails=(HEURISTIC,))


@pytest.mark.skipif(not interpreting(), reason="the kernels run on the CPU only under TRITON_INTERPRET=1")
def test_the_tuner_writes_a_table_select_configs_reads(tmp_path, capsys):
    from moehal.kernels import triton_fused_moe as k
    from moehal.kernels.tune_fused_moe import main

    out = tmp_path / "table.json"
    argv = ["--shapes", "tiny", "--tokens", "4", "--max-candidates", "1", "--settle-s", "0", "--reps", "1"]
    assert main([*argv, "--device", "cpu", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["_meta"]["device"].startswith("cpu")
    key = k.table_key(8, 128, 64, "fp32")  # the tiny shape; fp32 on the CPU (the interpreter's bf16 dot is wrong)
    entry = table[key]["4"]
    assert entry["tried"] == 1 + 2 * len(block_heights(4 * 2 / 8)) and entry["us"] <= entry["heuristic_us"]
    k.register_tuned_configs("Tuned test GPU", {key: table[key]})
    g1, g2 = k.select_configs(4, 8, 128, 64, 2, "none", "fp32", "Tuned test GPU")
    assert g1 == k._fit(TileConfig.from_dict(entry["gemm1"]), 64, 128, "none")
    assert g2 == k._fit(TileConfig.from_dict(entry["gemm2"]), 128, 64, "none")
    assert "wrote" in capsys.readouterr().err

    # Seeds (a tile, and an engine's config file) are measured before the search.
    cfg_file = tmp_path / "E=8,N=64.json"
    cfg_file.write_text(json.dumps({"4": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32}}))
    seeded = ["--seed", "16,64,64,1,4,1", "--seed-config", str(cfg_file), "--trace", str(tmp_path / "trace.jsonl")]
    assert main([*argv, *seeded, "--device", "cpu", "--out", str(tmp_path / "seeded.json")]) == 0
    entry = json.loads((tmp_path / "seeded.json").read_text())[key]["4"]
    climbed = entry["tried"] - (3 + 2 * len(block_heights(4 * 2 / 8)))
    assert climbed in (0, 1)  # one climb step at most (--max-candidates 1), if a seed won
    # The trace has every candidate, in order: the heuristic, then the seeds (the engine's
    # GEMM1 N tile halved: the tiny shape is gated), each with a time or a reason.
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(lines) == entry["tried"] and all(("us" in x) != ("rejected" in x) for x in lines)
    assert lines[1]["gemm1"]["BLOCK_N"] == 64 and lines[2]["gemm1"]["BLOCK_N"] == 16
    assert lines[2]["gemm2"]["BLOCK_N"] == 32 and lines[0]["tokens"] == 4


def test_shipped_tables_are_tuner_output_select_configs_reads():
    """Every `triton_fused_moe.<device>.json` in the package: written by the tuner on that
    device (its `_meta`), each entry no slower than the heuristic it was measured against, and
    each read by `select_configs` for that device's name."""
    from pathlib import Path

    from moehal.kernels import triton_fused_moe as k

    tables = sorted(Path(k.__file__).parent.glob("triton_fused_moe.*.json"))
    assert tables, "the H100 table ships with the package"
    for path in tables:
        table = json.loads(path.read_text())
        device = table.pop("_meta")["device"]
        assert path.name == f"triton_fused_moe.{k.device_slug(device)}.json"
        for key, rows in table.items():
            e, h, i = (int(part.split("=")[1]) for part in key.split(",")[:3])
            for tokens, entry in rows.items():
                assert entry["us"] <= entry["heuristic_us"], (path.name, key, tokens)
                want = k._fit(TileConfig.from_dict(entry["gemm1"]), i, h, "none")
                got = k.select_configs(int(tokens), e, h, i, 8, "none", key.split("dtype=")[1], device)
                assert got[0] == want, (path.name, key, tokens)


def test_int8_tiles_take_k_tiles_of_32_or_more():
    """A K tile of 16 compiled the int8 dot to no matrix instruction for gfx942 and gfx950 (a
    review's AOT compile, session 54); fp8 tiles had the same floor already."""
    from moehal.kernels import triton_fused_moe as k

    small = TileConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2)
    assert k._fit(small, 256, 256, "int8").block_k == 32
    assert k._fit(small, 256, 256, "none").block_k == 16


def _no_run(*args, **kwargs):
    raise AssertionError("the tuning run started")


@pytest.mark.parametrize(
    "name,content,flag",
    [
        ("README.md", "# my project\n", "--out"),  # not JSON: merged into after the run, or a crash there
        ("list.json", "[1, 2]\n", "--out"),  # JSON, not an object: the merge crashed after the run
        ("other.json", '{"name": "my settings"}\n', "--out"),  # an object, not a table: merged into
        ("notes.txt", "my notes\n", "--trace"),  # appended to
    ],
)
def test_an_output_that_is_not_the_tuners_is_refused_before_the_run(tmp_path, capsys, monkeypatch, name, content, flag):
    from moehal.kernels import tune_fused_moe

    monkeypatch.setattr(tune_fused_moe, "tune", _no_run)
    target = tmp_path / name
    target.write_text(content)
    outputs = {"--out": str(tmp_path / "table.json"), flag: str(target)}
    argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", *(x for kv in outputs.items() for x in kv)]
    assert tune_fused_moe.main(argv) == 2
    err = capsys.readouterr().err
    assert str(target) in err.replace("\n", "") and "not overwritten" in err
    assert target.read_text() == content


def test_a_directory_as_out_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    from moehal.kernels import tune_fused_moe

    monkeypatch.setattr(tune_fused_moe, "tune", _no_run)
    assert tune_fused_moe.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_an_earlier_table_is_merged_into_and_one_changed_during_the_run_is_kept(tmp_path, capsys, monkeypatch):
    from moehal.kernels import tune_fused_moe

    new = {"E=8,H=64,I=128,dtype=fp32": {"4": {"us": 1.0, "heuristic_us": 2.0, "tried": 1, "rejected": {}}}}
    out = tmp_path / "table.json"
    out.write_text(json.dumps({"_meta": {"device": "old"}, "E=1,H=2,I=3,dtype=bf16": {"1": {}}}))
    out.chmod(0o600)
    monkeypatch.setattr(tune_fused_moe, "tune", lambda *a, **k: new)
    argv = ["--device", "cpu", "--shapes", "tiny", "--tokens", "4", "--out", str(out)]
    assert tune_fused_moe.main(argv) == 0
    merged = json.loads(out.read_text())
    assert set(merged) == {"_meta", "E=1,H=2,I=3,dtype=bf16", *new} and merged["_meta"]["device"].startswith("cpu")
    assert os.stat(out).st_mode & 0o777 == 0o600 and sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]

    def overwritten(*args, **kwargs):  # someone writes another file there during the run
        out.write_text("not a table any more\n")
        return new

    monkeypatch.setattr(tune_fused_moe, "tune", overwritten)
    assert tune_fused_moe.main(argv) == 0
    assert out.read_text() == "not a table any more\n"
    (kept,) = [p for p in tmp_path.iterdir() if p != out]
    assert set(json.loads(kept.read_text())) == {"_meta", *new} and str(kept) in capsys.readouterr().err.replace(
        "\n", ""
    )


def test_a_trace_into_a_folder_not_made_yet_is_written(tmp_path):
    """`outputs_problem` checks --trace before the run and makes nothing (since session 59):
    the first trace line then raised FileNotFoundError for a folder not made yet."""
    from moehal.kernels.tune_fused_moe import _trace_logger, outputs_problem

    out, trace = tmp_path / "new" / "table.json", tmp_path / "traces" / "t.jsonl"
    assert outputs_problem(out, trace) is None
    assert not out.parent.exists() and not trace.parent.exists(), "checked, nothing made"
    log = _trace_logger(trace, "E=8,N=64", 16)
    log((HEURISTIC[0], HEURISTIC[1]), 1e-5, None)
    assert json.loads(trace.read_text())["us"] == 10.0
