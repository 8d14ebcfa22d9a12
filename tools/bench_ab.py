"""A/B of code paths timed exactly as `moehal bench` times a row (`moehal.bench.bench_one`: its
weights, routing, warm-up and CUDA-graph replays), the variants interleaved A B A B in one
process so that clocks and routing are shared. A diagnostic for #4: session 8's prefill probe
(`tools/fused_prefill_probe.py`, its own timing) measured fusion 4.6% faster at Qwen3 4096
tokens, while the benchmark of record moved by 1%.

    python3 tools/bench_ab.py --cases qwen3_30b_a3b:bf16:2048,4096 --variants shipped,no-prefill-fusion

Variants:
  shipped             the code as it is
  no-prefill-fusion   the tuned tables' whole-layer prefill fusion records ignored
  hint=N              DeepGEMM's masked GEMMs get expected_m=N instead of the mean rows per expert
  deepgemm-only       no tuned Triton GEMMs and no prefill fusion: DeepGEMM runs every masked GEMM
  act=R/S/W           masked batches with many row tiles run the activation with R rows, S columns
                      and W warps per program (`moehal_cuda.triton_glue.act_tile`)
  fp8-fused           FP8 layers fuse GEMM1 with the activation and GEMM2's input quantization
                      wherever GEMM1 runs on Triton at decode sizes (`fuse_fp8_gemm1_activation`
                      True), on the plain GEMM1 tile adapted to the fused kernel
  fp8-fused=M/N/K/W/S the same on this tile (block M, N, K, warps, stages)
  fp8-unfused         never fused (the switch False); `shipped` fuses where the device's table
                      measured the whole layer faster (`tools/decode_fused_records.py`)
  whole-segments      contiguous layouts mark padding rows with their expert, not -1
                      (`triton_permute.MARK_PADDING_ROWS` False): DeepGEMM's FP8 GEMM computes them
                      (layers take the contiguous layout where masked buffers exceed the budget:
                      `--max-tokens`)
  align=N             DeepGEMM's masked experts declare max_m aligned to N rows
                      (`deepgemm_experts.MASKED_ROW_ALIGNMENT`; 128 since session 40, 64 before)
  m-indices           DeepGEMM's contiguous GEMMs get the row-to-expert map only, not the segments'
                      ends (`DeepGemmOps.psum_layout` False)
  nvfp4-untuned       the NVFP4 experts for Hopper run `default_config`'s tiles, not the tuned
                      table's bf16 Triton tiles of the same GEMM shapes
                      (`Nvfp4DequantRunner.tuned_tiles` False)
  nvfp4-token-decode  the NVFP4 experts for Hopper run decode batches on the token-major decode
                      kernels, by the bf16 layers' rule (`Nvfp4DequantExperts.small_batch_max_tokens`
                      None; shipped since session 51, 0 before)
  nvfp4-masked-decode the same 0: decode batches on the masked path
  nvfp4-rebind-masked the NVFP4 experts for Hopper bind their masked batches' quantizer and
                      activation launches on every call (`Nvfp4DequantRunner.keep_masked_glue`
                      False; the code before session 52). With --host: eager host time
  serial-qdq          the NVFP4 quantizer walks a row's 128-column chunks in one program, in series
                      (`triton_glue.QDQ_SPLIT_COLUMNS` False; the code before session 51)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    from moehal_cuda.deepgemm_experts import DeepGemmOps
    from moehal_cuda.gemm_choice import DEEPGEMM, GemmChooser

    if name == "shipped":
        yield
    elif name == "no-prefill-fusion":
        rule = GemmChooser.prefill_fused
        GemmChooser.prefill_fused = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            GemmChooser.prefill_fused = rule  # type: ignore[method-assign]
    elif name == "deepgemm-only":
        choose, rule = GemmChooser.choose, GemmChooser.prefill_fused
        GemmChooser.choose = lambda *a, **k: DEEPGEMM  # type: ignore[method-assign]
        GemmChooser.prefill_fused = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            GemmChooser.choose, GemmChooser.prefill_fused = choose, rule  # type: ignore[method-assign]
    elif name.startswith("hint="):
        hint, masked = int(name.split("=", 1)[1]), DeepGemmOps.masked

        def hinted(self, a, sa, w, sw, d, mm, em):  # noqa: ANN001, ANN202
            return masked(self, a, sa, w, sw, d, mm, hint)

        DeepGemmOps.masked = hinted  # type: ignore[method-assign]
        try:
            yield
        finally:
            DeepGemmOps.masked = masked  # type: ignore[method-assign]
    elif name.startswith("act="):
        import moehal_cuda.triton_glue as glue

        r, span, warps = (int(v) for v in name.split("=", 1)[1].split("/"))
        rule = glue.act_tile

        def tile(rows, block_i):  # noqa: ANN001, ANN202
            small = rows.masked and rows.tiles(16) < 64
            return glue.ActTile(r, span, warps) if rows.masked and not small else rule(rows, block_i)

        glue.act_tile = tile
        try:
            yield
        finally:
            glue.act_tile = rule
    elif name.startswith("fp8-fused") or name == "fp8-unfused":
        import moehal_cuda.deepgemm_experts as dge
        from moehal.kernels.tiles import TileConfig
        from moehal_cuda.gemm_choice import GemmChoice

        runner, make = dge.DeepGemmExpertsRunner, dge.triton_masked_gemm_act
        was = runner.fuse_fp8_gemm1_activation
        runner.fuse_fp8_gemm1_activation = name != "fp8-unfused"
        if "=" in name:
            m, n, k, w, st = (int(v) for v in name.split("=", 1)[1].split("/"))
            tile = TileConfig(m, n, k, 1, w, st)

            def forced(choice, total_rows, config, ue8m0=False):  # noqa: ANN001, ANN202
                return make(GemmChoice("triton", choice.config, choice.tuned_tokens, tile), total_rows, config, ue8m0)

            dge.triton_masked_gemm_act = forced
        try:
            yield
        finally:
            runner.fuse_fp8_gemm1_activation, dge.triton_masked_gemm_act = was, make
    elif name.startswith("align="):
        import moehal_cuda.deepgemm_experts as dge

        was = dge.MASKED_ROW_ALIGNMENT
        dge.MASKED_ROW_ALIGNMENT = int(name.split("=", 1)[1])
        try:
            yield
        finally:
            dge.MASKED_ROW_ALIGNMENT = was
    elif name == "m-indices":
        from moehal_cuda.deepgemm_experts import DeepGemmOps

        DeepGemmOps.psum_layout = False
        try:
            yield
        finally:
            DeepGemmOps.psum_layout = True
    elif name == "whole-segments":
        import moehal.kernels.triton_permute as tp

        tp.MARK_PADDING_ROWS = False
        try:
            yield
        finally:
            tp.MARK_PADDING_ROWS = True
    elif name == "nvfp4-untuned":
        from moehal_cuda.nvfp4_dequant import Nvfp4DequantRunner

        Nvfp4DequantRunner.tuned_tiles = False
        try:
            yield
        finally:
            Nvfp4DequantRunner.tuned_tiles = True
    elif name in ("nvfp4-token-decode", "nvfp4-masked-decode"):
        from moehal_cuda.nvfp4_dequant import Nvfp4DequantExperts

        was = Nvfp4DequantExperts.small_batch_max_tokens
        Nvfp4DequantExperts.small_batch_max_tokens = None if name == "nvfp4-token-decode" else 0
        try:
            yield
        finally:
            Nvfp4DequantExperts.small_batch_max_tokens = was
    elif name == "nvfp4-rebind-masked":
        from moehal_cuda.nvfp4_dequant import Nvfp4DequantRunner

        Nvfp4DequantRunner.keep_masked_glue = False
        try:
            yield
        finally:
            Nvfp4DequantRunner.keep_masked_glue = True
    elif name == "serial-qdq":
        import moehal_cuda.triton_glue as tg

        tg.QDQ_SPLIT_COLUMNS = False
        try:
            yield
        finally:
            tg.QDQ_SPLIT_COLUMNS = True
    else:
        raise SystemExit(f"unknown variant {name!r}")


def main() -> None:
    import moehal
    from moehal.bench import SHAPES, Ceilings, bench_one
    from moehal.quant import QuantScheme

    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="qwen3_30b_a3b:bf16:2048,4096", help="SHAPE:QUANT:TOKENS[,TOKENS] ...")
    p.add_argument("--variants", default="shipped,no-prefill-fusion")
    p.add_argument("--rounds", type=int, default=2, help="times each variant is measured, interleaved")
    p.add_argument("--reps", type=int, default=30, help="samples of 10 replays (after 50 ms of warm-up)")
    p.add_argument("--max-tokens", type=int, default=0, help="build layers for this many tokens (0: the row's)")
    p.add_argument("--host", action="store_true", help="also the eager host-time columns (one call, 8 back to back)")
    a = p.parse_args()
    dev = torch.device("cuda")
    registry = moehal.discover()
    ceil = Ceilings(1.0, 1.0, torch.cuda.get_device_name())  # times only: no roofline here
    variants = a.variants.split(",")
    print(ceil.device)
    for case in a.cases.split():
        shape, q, tokens = case.split(":")
        for t in map(int, tokens.split(",")):
            cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=max(t, a.max_tokens))
            times: dict[str, list[float]] = {v: [] for v in variants}
            hosts: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
            for _ in range(a.rounds):
                for v in variants:
                    with variant(v):
                        quant = QuantScheme.parse(q)
                        row = bench_one(shape, cfg, quant, "cuda", t, dev, ceil, a.reps, registry, host_columns=a.host)
                    times[v].append(row.time_us)
                    hosts[v].append((row.host_us, row.host_b2b_us))
                    torch.cuda.empty_cache()
            base = statistics.median(times[variants[0]])
            print(f"== {shape} {q} T={t}")
            for v in variants:
                med = statistics.median(times[v])
                runs = ", ".join(f"{x:.1f}" for x in times[v])
                host = ""
                if a.host:
                    one, b2b = (statistics.median(h[i] for h in hosts[v]) for i in (0, 1))
                    host = f"  host {one:6.1f} us, back to back {b2b:6.1f} us"
                print(f"  {v:20s} {med:9.1f} us  {100 * (med / base - 1):+6.1f}%{host}  ({runs})")


if __name__ == "__main__":
    main()
