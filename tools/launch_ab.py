"""Do fast Triton launches and DeepGEMM replays (`moehal.kernels.launch`, `moehal.graphs.LaunchMemo`)
change what the GPU runs? Two CUDA graphs of one layer's forward, one captured with both off
and one with both on, replayed in turns (so clocks and power are shared), with their outputs
compared bit for bit. A diagnostic for session 15; host time is `tools/host_floor.py`'s.

    python tools/launch_ab.py [--cases deepseek_v3_ep8:128,mixtral_8x7b:128,qwen3_30b_a3b:16]
"""

from __future__ import annotations

import argparse
import statistics

import moehal
import torch
from moehal import graphs
from moehal.bench import SHAPES, bench_inputs, settle
from moehal.graphs import capture
from moehal.kernels import launch


def one_case(shape: str, t: int, rounds: int, dev: torch.device) -> str:
    cfg = moehal.MoEConfig(**SHAPES[shape], max_tokens=t)
    h, i = cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(cfg.num_experts, cfg.w13_rows, h, device=dev) / h**0.5
    w2 = torch.randn(cfg.num_experts, h, i, device=dev) / i**0.5
    layer = moehal.MoELayer(cfg, "bf16", device=dev, validate=False)
    layer.load_weights(moehal.quantize_weights(cfg, layer.quant, w13, w2))
    x, ids, wts = bench_inputs(cfg, t)
    x, ids, wts = x.to(dev, cfg.dtype), ids.to(dev, torch.int32), wts.to(dev)

    def fwd() -> torch.Tensor:
        return layer(x, ids, wts)

    replays, outs = {}, {}
    for name, on in (("off", False), ("on", True)):
        launch.ENABLED, graphs.MEMO_ENABLED = on, on
        for _ in range(3):  # eager calls: first launches, DeepGEMM memo captures
            fwd()
        g, out = capture(fwd, warmup=2)
        replays[name], outs[name] = g.replay, out
    launch.ENABLED, graphs.MEMO_ENABLED = True, True  # the defaults

    def both() -> None:
        for r in replays.values():
            r()

    both()
    torch.cuda.synchronize()
    same = torch.equal(outs["off"], outs["on"])
    settle(both, dev, 2.0)
    us: dict[str, list[float]] = {k: [] for k in replays}
    for _ in range(rounds):
        for name, r in replays.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                r()
            e.record()
            e.synchronize()
            us[name].append(s.elapsed_time(e) * 100)  # ms per 10 replays -> us per replay
    off, on = statistics.median(us["off"]), statistics.median(us["on"])
    return (
        f"{shape} T={t}: graph replay {off:.1f} us (both off) vs {on:.1f} us (both on), "
        f"{(on / off - 1) * 100:+.1f}%; outputs bit-identical: {same}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="deepseek_v3_ep8:128,mixtral_8x7b:128,qwen3_30b_a3b:16,deepseek_v3_ep8:4096")
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    for case in a.cases.split(","):
        shape, tokens = case.split(":")
        print(one_case(shape, int(tokens), a.rounds, dev), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
