#!/usr/bin/env bash
# One call on a 2-GPU machine (nvidia-h200-x2): the EP suite over NCCL on the final code, with
# the reference experts and with the `cuda` experts; optionally DeepGEMM's Mega MoE across the
# two GPUs (tools/mega_moe_ep_probe.py), and on GPU 0 alone the `cuda` conformance suite and
# the host-time probe (tools/host_wait_probe.py). At most 8 files land in $OUT.
#   usage (from the repo root, .whl carried): bash tools/device_ep2.sh
#   env: BENCH=1 (dispatch+combine timings), MEGA=1, CONF=1, WAIT=1, MEGA_ARGS, EP_LIMIT, MEGA_LIMIT
set -u
source tools/device_setup.sh
record_env
run2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"  # a command: `timeout` runs no shell function
bench=""
[ "${BENCH:-0}" = 1 ] && bench="--bench"
# shellcheck disable=SC2086  # run2 is a list of words
step ep-reference "${EP_LIMIT:-200}" $run2 tools/ep_gpu_check.py --out "$OUT/ep-nccl-reference.md" $bench
# shellcheck disable=SC2086
step ep-cuda "${EP_LIMIT:-200}" $run2 tools/ep_gpu_check.py --backend cuda --out "$OUT/ep-nccl-cuda.md"
if [ "${MEGA:-0}" = 1 ]; then
  # shellcheck disable=SC2086  # MEGA_ARGS is a list of arguments
  step mega-ep "${MEGA_LIMIT:-240}" $run2 tools/mega_moe_ep_probe.py ${MEGA_ARGS:-}
fi
if [ "${CONF:-0}" = 1 ]; then
  (cd /tmp && CUDA_VISIBLE_DEVICES=0 step conformance 220 python3 -m moehal.cli.main conformance --backend cuda \
    --quick --report "$OUT/conformance-cuda")
  tail -n 3 "$OUT/conformance.log"
  rm -f "$OUT/conformance.log"  # its table is in conformance-cuda.md
fi
if [ "${WAIT:-0}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 step wait 300 python3 tools/host_wait_probe.py
fi
cat "$OUT/steps.txt"
tail -n 5 "$OUT"/ep-nccl-*.md
for s in ep-reference ep-cuda; do  # a passing step's table is in its .md
  grep -q "^$s rc=0" "$OUT/steps.txt" && rm -f "$OUT/$s.log"
done
[ -f "$OUT/mega-ep.log" ] && grep -v "^W\|^ *$" "$OUT/mega-ep.log" | tail -40
[ -f "$OUT/wait.log" ] && grep " us " "$OUT/wait.log"
exit 0
