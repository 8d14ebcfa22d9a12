"""One failing GPU-fuzz example, replayed call by call, and its neighbours (other seeds).

A failure of `tests/cuda/test_gpu_fuzz.py` prints its case as a dict. This probe runs that case
through `layer_fuzz._check` itself (the same draws from the device's generator, the same
layers, calls and inputs), records every call instead of stopping at the first miss, and
compares each call's output with three things:

- the oracle on this device (what the test compares with);
- the oracle on the CPU, fed the same weights and inputs (the oracle's own device noise);
- the float64 loop of `moe_testing.float64_oracle` (the exact result, with the roundings to
  the layer dtype that kernels and the reference make).

A kernel that is as far from the float64 loop as the oracle is, is in the scheme's own noise;
one much farther off is at fault. `--seeds N` draws the case again with seeds 0..N-1 and prints
the same three distances per call, to tell a rare flip of a coarse quantization step from a
fault. Every call's inputs and outputs are saved (`case.pt`) for a CPU read.

    python tools/fuzz_case_probe.py --case case.json --out DIR [--seeds 64]      # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS)]

import layer_fuzz  # noqa: E402
import moehal  # noqa: E402
from moe_testing import float64_oracle  # noqa: E402
from moehal.poison import poisoned  # noqa: E402
from moehal.quant import QuantScheme  # noqa: E402
from moehal.reference.oracle import reference_layer  # noqa: E402
from moehal_conformance.tolerances import compare, tolerance_for  # noqa: E402


class _Recorder:
    """Patches layer_fuzz's draw, forward and compare to record each call, and lets every
    call run (the comparison is made here afterwards)."""

    def __init__(self) -> None:
        self.layers: list[moehal.ExpertWeights] = []
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> _Recorder:
        self._saved = (layer_fuzz._layer_and_oracle, layer_fuzz._forward, layer_fuzz.compare, layer_fuzz.note)
        draw, forward = layer_fuzz._layer_and_oracle, layer_fuzz._forward

        def layer_and_oracle(c, cfg, quant, registry, pipe, gen):  # noqa: ANN001, ANN202
            layer, oracle, weights, cb = draw(c, cfg, quant, registry, pipe, gen)
            layer._probe_index = len(self.layers)
            self.layers.append(weights)
            return layer, oracle, weights, cb

        def fwd(layer, c, x, args, kwargs):  # noqa: ANN001, ANN202
            out = forward(layer, c, x, args, kwargs)
            self.calls.append(dict(layer=layer._probe_index, x=x, args=args, kwargs=kwargs, out=out.clone()))
            return out

        def keep(out, want, tol):  # noqa: ANN001, ANN202
            self.calls[-1].setdefault("want", want.clone())  # the oracle's; then the float64 loop's
            return compare(out, out, tol)  # ok: every call runs

        layer_fuzz._layer_and_oracle, layer_fuzz._forward, layer_fuzz.compare = layer_and_oracle, fwd, keep
        layer_fuzz.note = lambda *a, **k: None
        return self

    def __exit__(self, *exc: object) -> None:
        layer_fuzz._layer_and_oracle, layer_fuzz._forward, layer_fuzz.compare, layer_fuzz.note = self._saved


def replay(c: dict[str, Any], exact: bool = True) -> dict[str, Any]:
    """The case's calls with the three distances each (`exact`: also the CPU oracle and the
    float64 loop, for calls of at most 64 tokens)."""
    with _Recorder() as rec, poisoned():
        pipe = layer_fuzz._check(c)
    cfg, quant = layer_fuzz._config(c), QuantScheme.parse(c["quant"])
    tol = tolerance_for(quant, cfg.dtype)
    rows = []
    for n, call in enumerate(rec.calls):
        t = call["x"].shape[0]
        row: dict[str, Any] = dict(call=n, tokens=t, vs_oracle=compare(call["out"], call["want"], tol).rel_l2)
        if exact and t <= 64 and not call["kwargs"]:
            w = rec.layers[call["layer"]]
            cpu = reference_layer(cfg, quant, torch.device("cpu"), registry=layer_fuzz._registry())
            cpu.load_weights(moehal.ExpertWeights(**{k: v.cpu() for k, v in w.tensors().items()}))
            x, (ids, wts) = call["x"].cpu(), (a.cpu() for a in call["args"])
            with torch.no_grad():
                want_cpu = cpu(x, ids, wts)
            loop = float64_oracle(cfg, quant, moehal.ExpertWeights(**{k: v.cpu() for k, v in w.tensors().items()}),
                                  x, ids, wts.double())  # fmt: skip
            row.update(
                oracle_vs_cpu_oracle=compare(call["want"].cpu(), want_cpu, tol).rel_l2,
                vs_float64=compare(call["out"].cpu(), loop, tol).rel_l2,
                oracle_vs_float64=compare(call["want"].cpu(), loop, tol).rel_l2,
                cpu_oracle_vs_float64=compare(want_cpu, loop, tol).rel_l2,
            )
            call["loop"] = loop
        rows.append(row)
    return dict(pipeline=pipe, tolerance=tol.rel_l2, rows=rows, calls=rec.calls, weights=rec.layers)


def _fmt(row: dict[str, Any]) -> str:
    keys = ("vs_oracle", "vs_float64", "oracle_vs_float64", "oracle_vs_cpu_oracle")
    return f"call {row['call']} ({row['tokens']} tokens): " + ", ".join(f"{k} {row[k]:.3e}" for k in keys if k in row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=Path, required=True, help="a JSON file holding the failing case's dict")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--seeds", type=int, default=0, help="draw the case again with seeds 0..N-1")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    case = json.loads(a.case.read_text())
    r = replay(case)
    print(r["pipeline"], "tolerance", r["tolerance"])
    for row in r["rows"]:
        print(" ", _fmt(row))
    calls = [
        {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in c.items() if k != "args"}
        | {"args": [t.cpu() for t in c["args"]]}
        for c in r["calls"]
    ]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    weights = [{n: t.cpu() for n, t in w.tensors().items()} for w in r["weights"]]
    torch.save(
        dict(case=case, pipeline=r["pipeline"], device_name=device_name, calls=calls, weights=weights),
        a.out / "case.pt",
    )
    report: dict[str, Any] = dict(case=case, pipeline=r["pipeline"], rows=r["rows"], sweep=[])
    for s in range(a.seeds):
        rs = replay(dict(case, seed=s))
        report["sweep"].append(dict(seed=s, pipeline=rs["pipeline"], rows=rs["rows"]))
        print(f"seed {s:3d} {rs['pipeline']}")
        for row in rs["rows"]:
            print("   ", _fmt(row))
    (a.out / "probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
