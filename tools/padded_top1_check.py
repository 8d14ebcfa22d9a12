"""Conformance's top-1 padded_ids cases on this device, with the session-40 fix and without it
(`--without-fix`: the portable Triton experts treat every layer on one device as free of -1 ids,
as before, so top-1 GEMM2 writes output rows itself and padded tokens' rows keep what the output
buffer held). A GPU check that the new cases catch the fault and pass on the fix.

    python3 tools/padded_top1_check.py [--backend cuda] [--without-fix]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import moehal
    from moehal.kernels import triton_experts
    from moehal_conformance.suite import Suite

    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cuda")
    p.add_argument("--without-fix", action="store_true")
    a = p.parse_args()
    if a.without_fix:
        init = triton_experts.TritonExpertsRunner.__init__

        def old_rule(self, req, fmt):  # noqa: ANN001, ANN202
            init(self, req, fmt)
            self.all_local = req.config.ep_size == 1

        triton_experts.TritonExpertsRunner.__init__ = old_rule  # type: ignore[method-assign]
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    suite = Suite(a.backend, reg, torch.device("cuda"), profile="quick")
    suite.run([c for c in suite.cases() if c.check == "padded_ids" and "/top1" in c.id])
    print("without the fix" if a.without_fix else "with the fix")
    for r in suite.results:
        print(f"  {r.id:70s} {r.status:8s} {r.detail[:160]}")


if __name__ == "__main__":
    main()
