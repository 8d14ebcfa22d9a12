#!/usr/bin/env bash
# Session 39, call 8 (call 7's machine): #4's prefill record on this session's code, as session 25
# took it on an H100 (`tools/device_prefill_record.sh`: bf16, fp8_block and SGLang rows of each
# cell next to each other, three rounds, goals). Sessions 30-38 changed the prefill machinery
# (the contiguous layout's scatter and DeepGEMM's segment ends, fused tiles), and no prefill
# record has been taken since session 26.
#   usage (repo root, all .whl present): bash <this file>
set -u
ls .whl
OUT=${OUT:-/tmp/moehal-device-out} bash tools/device_prefill_record.sh
