#!/usr/bin/env bash
# Session 30, call 6 (H200): the DeepGEMM experts' GPU tests on the final code (606e2cd changed
# DeepGemmExpertsRunner.load, which these tests call with canonical weights on SM90).
#   usage (repo root, .whl carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-deepgemm 300 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/cuda/test_deepgemm_glue.py tests/cuda/test_gpu.py
tail -n 3 "$OUT/pytest-deepgemm.log"
cat "$OUT/steps.txt"
