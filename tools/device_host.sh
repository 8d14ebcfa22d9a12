#!/usr/bin/env bash
# One GPU call for the host-overhead work: the host's floor costs beside one forward's host time
# (tools/host_floor.py), GPU tests of the kernels and of graph replay, and optionally DeepGEMM's
# expected_m hint at prefill sizes (tools/expected_m_sweep.py, SWEEP=1).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_host.sh
set -u
source tools/device_setup.sh
record_env
step host-floor "${HOST_LIMIT:-150}" python3 tools/host_floor.py ${HOST_ARGS:---profile}
if [ -d ab_old ]; then  # A/B in one call: the same diagnostic on an older tree (an untracked copy)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old ./ab_old
  step host-floor-old "${HOST_LIMIT:-150}" env PYTHONPATH=/tmp/site_old:/tmp/site python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,16
  step host-floor-new "${HOST_LIMIT:-150}" python3 tools/host_floor.py --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1,16
fi
step pytest-gpu "${TEST_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda tests/integrations/test_custom_op.py
if [ "${SWEEP:-0}" = 1 ]; then
  step expected-m "${SWEEP_LIMIT:-200}" python3 tools/expected_m_sweep.py ${SWEEP_ARGS:-}
fi
cat "$OUT/steps.txt"
grep " us " "$OUT"/host-floor*.log
tail -n 5 "$OUT/pytest-gpu.log"
[ -f "$OUT/expected-m.log" ] && cat "$OUT/expected-m.log"
exit 0
