#!/usr/bin/env bash
# One GPU call of diagnostics: the host's floor costs beside one forward's host time
# (tools/host_floor.py), and DeepGEMM's expected_m hint at prefill sizes (tools/expected_m_sweep.py).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_host.sh
set -u
source tools/device_setup.sh
record_env
step host-floor "${HOST_LIMIT:-150}" python3 tools/host_floor.py ${HOST_ARGS:---profile}
step expected-m "${SWEEP_LIMIT:-200}" python3 tools/expected_m_sweep.py ${SWEEP_ARGS:-}
cat "$OUT/steps.txt"
grep -v "^ " "$OUT/host-floor.log" | head -40
cat "$OUT/expected-m.log"
