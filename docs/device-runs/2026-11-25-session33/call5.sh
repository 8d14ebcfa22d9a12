#!/usr/bin/env bash
# Session 33, call 5 (H200): the final code. Conformance of the CUDA backend in full (call 4's
# ran out of its time on the H100, 55 cases short), then DeepGEMM's psum layout against m_indices
# for Mixtral-8x7B fp8_block at 1024 and 4096 tokens, the rows call 4's check did not reach.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
step conformance 330 python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
cd "$repo"
step psum-check 150 python3 tools/psum_check.py --shapes mixtral_8x7b --quants fp8_block --tokens 1024,4096 --calls 3
tail -n 3 "$OUT/conformance.log"
grep -i "^| padding" "$OUT/conformance-cuda.md" | cut -c1-160
grep -v Warn "$OUT/psum-check.log" | tail -n 6
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"
