#!/usr/bin/env bash
# Session 30, call 5 (H200): the 8 GPU tests call 4's step limit cut off (the end of
# tests/integrations/test_custom_op.py), so the final code's GPU suite is complete.
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-custom-op 200 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/integrations/test_custom_op.py
tail -n 3 "$OUT/pytest-custom-op.log"
cat "$OUT/steps.txt"
