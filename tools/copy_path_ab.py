"""Host time of the copying graph path, with its inputs copied as bytes or as typed tensors
(an interleaved A/B of `moehal.graphs.BYTE_COPY_INPUTS`; a diagnostic for #4's host goal).

A layer with `cuda_graph_tokens` that gets new input tensors at every call copies them into
its graph's static inputs before the replay. Hidden states, ids and weights have three dtypes,
so a typed `torch._foreach_copy_` launches a copy per tensor; as uint8 views they are one list
and one launch. The calls rotate over three input sets (as `moehal bench`'s "graphs, new
inputs" column does), and the two modes take turns call by call.

    python tools/copy_path_ab.py [--shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b] [--tokens 1,16,128]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from host_floor import bench_layer, host_interleaved
    from moehal import graphs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b")
    ap.add_argument("--tokens", default="1,16,128")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)

    def setter(on: bool) -> None:
        graphs.BYTE_COPY_INPUTS = on

    def measure(shape: str, t: int) -> str:
        layer, x, ids, wts = bench_layer(shape, t)
        sets = [(x * (i + 1), ids.roll(i, dims=0), wts) for i in range(3)]  # three different inputs
        eager = [layer(*s) for s in sets]  # before graphs are on
        layer.cuda_graph_tokens = t
        turn = itertools.cycle(sets)
        modes = {"bytes": (True,), "typed": (False,)}
        res = host_interleaved(lambda: layer(*next(turn)), modes, setter, default=(True,))
        exact = []
        for on in (True, False):
            setter(on)
            exact.append(all(torch.equal(layer(*s), e) for s, e in zip(sets, eager, strict=True)))
        setter(True)
        times = ", ".join(f"{k} {v:.1f}" for k, v in res.items())
        return f"{shape} T={t}: new inputs at every call, host us from idle: {times} (equal to eager: {exact})"

    for shape in args.shapes.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            print(measure(shape, t), flush=True)


if __name__ == "__main__":
    main()
