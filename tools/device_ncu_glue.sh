#!/usr/bin/env bash
# One GPU call: Nsight Compute's counters for the glue kernels of a prefill forward
# (tools/ncu_glue.py), per case SHAPE:TOKENS:QUANT; optionally GPU tests first (PYTEST="paths")
# and graph traces of replayed forwards after (TRACES="SHAPE:TOKENS ...", TRACE_QUANT).
# At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_ncu_glue.sh
set -u
source tools/device_setup.sh
record_env
export OUT
if [ -n "${PYTEST:-}" ]; then
  step pytest-gpu "${TEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" $PYTEST
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" >> "$OUT/env.txt"
cd /tmp
for spec in ${CASES:-qwen3_30b_a3b:4096:fp8_block qwen3_30b_a3b:4096:bf16 deepseek_v3_ep8:1024:fp8_block}; do
  IFS=: read -r shape tokens quant <<< "$spec"
  step "ncu-$shape-$tokens-$quant" "${NCU_LIMIT:-150}" "$NCU" --clock-control none --profile-from-start off \
    --kernel-name "regex:${KERNELS:-_expert_positions|_scatter_rows|_act_rows|_combine_rows}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    python3 "$repo/tools/ncu_glue.py" --shape "$shape" --tokens "$tokens" --quant "$quant"
done
for spec in ${TRACES:-}; do  # SHAPE:TOKENS
  step "trace-${spec%%:*}" 150 python3 "$repo/tools/graph_trace.py" --shape "${spec%%:*}" --tokens "${spec#*:}" \
    --quant "${TRACE_QUANT:-fp8_block}" --max-tokens 4096
  cat "$OUT/trace-${spec%%:*}.log" >> "$OUT/graph-trace.log" && rm -f "$OUT/trace-${spec%%:*}.log"
done
cat "$OUT/steps.txt"
[ -f "$OUT/pytest-gpu.log" ] && tail -n 3 "$OUT/pytest-gpu.log"
[ -f "$OUT/graph-trace.log" ] && grep -v "^ *$" "$OUT/graph-trace.log" | grep -E "==|_rows|deep_gemm|_expert|kernels" | head -60
for f in "$OUT"/ncu-*.log; do
  echo "=== $f"
  grep -E "^  [_a-z]|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Executed Ipc A|Theoretical Occ|Block Limit Reg|Mem Busy|Max Bandwidth|L1/TEX Hit|L2 Hit|Mem Pipes Busy|SM Busy|ERROR|==PROF==|Error" "$f" | head -120
done
exit 0
