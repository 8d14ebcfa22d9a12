#!/usr/bin/env bash
# Session 58, call 4 (the same H200, still warm): the 9 tests of call 3's suite that its 400 s
# limit stopped before (457 of 466 had passed, none failed), listed in call4-nodes.txt, the
# tail of the collected order.
#   usage (repo root, .whl present): bash <this file>
set -u
source tools/device_setup.sh
record_env
step tests-rest 240 python3 -m pytest -q -p no:cacheprovider -rfE -o addopts="--import-mode=importlib" \
  $(cat docs/device-runs/2026-11-29-session58/call4-nodes.txt)
tail -n 3 "$OUT/tests-rest.log"
cat "$OUT/steps.txt"
exit 0
