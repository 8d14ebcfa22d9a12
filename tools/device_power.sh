#!/usr/bin/env bash
# One GPU call: power, clock and energy per forward of moehal's layer beside SGLang's under
# sustained replays (tools/power_probe.py).
#   usage (from the repo root, .whl carried): OUT=/tmp/out bash tools/device_power.sh
set -u
source tools/device_setup.sh
record_env
cd /tmp
step power "${POWER_LIMIT:-300}" python3 "$repo/tools/power_probe.py" --seconds "${SECONDS_PER_PATH:-3}" \
  --cases ${CASES:-qwen3_30b_a3b:4096 qwen3_30b_a3b:1024 deepseek_v3_ep8:1024 mixtral_8x7b:1024}
cat "$OUT/steps.txt"
grep -v "^ *$\|Using default\|Config file\|TMA is enabled" "$OUT/power.log" | tail -30
exit 0
