#!/usr/bin/env bash
# Session 52, call 2 (H200): NVFP4 masked batches keep their input quantizer and activation
# launches (bound once per row bound; call 1 measured the masked experts at 131 us of host time
# per eager call, bf16's at 28). The NVFP4 kernel tests, conformance's nvfp4 cases, the host
# profile of the masked path at 16 and 128 tokens, and an interleaved A/B with host columns
# against binding per call (`nvfp4-rebind-masked`, the code before), bf16 beside.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests 90 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_deepgemm_glue.py -k "nvfp4 or tile"
tail -n 1 "$OUT/tests.log"
step conformance 90 python3 -m moehal.cli.main conformance --backend cuda -k nvfp4 --report "$OUT/conformance-nvfp4"
tail -n 1 "$OUT/conformance.log"
cd /tmp && export COLUMNS=220
for t in 16 128; do
  step host-nvfp4-$t 60 python3 "$repo/tools/host_profile.py" --quant nvfp4 \
    --pipelines cuda.deepgemm_nvfp4_dequant:masked --tokens $t --calls 300 --top 14
done
step ab 240 python3 "$repo/tools/bench_ab.py" --host --rounds 2 \
  --cases "qwen3_30b_a3b:nvfp4:1,4,16,128 qwen3_30b_a3b:bf16:1,16,128" --variants shipped,nvfp4-rebind-masked
cat "$OUT/ab.log"
grep -h "host us/call" "$OUT"/host-*.log
rm -f "$OUT/conformance.log"
cat "$OUT/steps.txt"
