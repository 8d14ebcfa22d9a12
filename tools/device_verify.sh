#!/usr/bin/env bash
# One GPU call: correctness first. GPU tests, conformance of the CUDA backend (quick), and the
# host cost of one forward beside this host's floor costs (tools/host_floor.py). At most 8 files
# land in $OUT (the device tool returns no more).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_verify.sh
#   env: TESTS (pytest arguments), HOST=0 (no host-floor step), HOST_ARGS, TEST_LIMIT, CONF_LIMIT, HOST_LIMIT
set -u
source tools/device_setup.sh
record_env
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
step pytest-gpu "${TEST_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  ${TESTS:-tests/cuda tests/integrations/test_custom_op.py}
cd /tmp
step conformance "${CONF_LIMIT:-220}" python3 -m moehal.cli.main conformance --backend cuda --quick --report "$OUT/conformance-cuda"
if [ "${HOST:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # HOST_ARGS is a list of arguments
  step host-floor "${HOST_LIMIT:-120}" python3 "$repo/tools/host_floor.py" ${HOST_ARGS:---shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,16}
fi
if [ "${TRACE:-0}" = 1 ]; then  # where a replayed decode step's time goes, beside SGLang's
  step graph-trace 120 python3 "$repo/tools/graph_trace.py" --tokens 1,4
fi
tail -n 3 "$OUT/pytest-gpu.log" "$OUT/conformance.log"
[ -f "$OUT/host-floor.log" ] && grep -E " us |direct" "$OUT/host-floor.log"
[ -f "$OUT/graph-trace.log" ] && grep -v "^ *$" "$OUT/graph-trace.log" | tail -40
cat "$OUT/steps.txt"
rm -f "$OUT/conformance.log"  # its table is in conformance-cuda.md; the tool returns at most 8 files
