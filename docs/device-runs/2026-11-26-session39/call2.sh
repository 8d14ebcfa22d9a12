#!/usr/bin/env bash
# Session 39, call 2 (the same two-GPU machine): the stream order's host cost on a GPU host now
# that it also guards the device (session 38 measured it before the guard), the other-GPU probe,
# then #4's decode records beside SGLang (two rounds, with goals) on this session's code: the
# last ones (session 29) predate the order.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step order-cost 120 python3 tools/two_streams_probe.py --skip-race
tail -n 12 "$OUT/order-cost.log"
step other-device 120 python3 tools/other_device_probe.py
tail -n 8 "$OUT/other-device.log"
step bench 330 python3 tools/sglang_peer.py bench --shapes qwen3_30b_a3b,deepseek_v3_ep8,mixtral_8x7b \
  --tokens 1,8,16,128 --quant bf16 --backends cuda,sglang --rounds 2 --goals --out "$OUT/bench"
grep -A30 "goals:" "$OUT/bench.log" | head -40
cat "$OUT/steps.txt"
