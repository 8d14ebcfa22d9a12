#!/usr/bin/env bash
# Session 41, call 3 (call 1's machine): #4's prefill record on an H200 on the current code
# (`tools/device_prefill_record.sh`: bf16, fp8_block and SGLang rows of each cell next to each
# other, three rounds, goals). The last H200 prefill record is session 26's.
#   usage (repo root, all .whl present): bash <this file>
set -u
ls .whl
OUT=${OUT:-/tmp/moehal-device-out} bash tools/device_prefill_record.sh
