#!/usr/bin/env bash
# Session 42, call 3 (a fresh H200): call 1's failing part of the GPU suite again, tests/cuda in
# the same order, after the two test fixes (the static-fp8 glue bound; the graph test accepting
# a graph captured earlier at out's address).
#   usage (repo root, .whl partly carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step pytest-cuda 370 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/cuda
tail -n 8 "$OUT/pytest-cuda.log"
cat "$OUT/steps.txt"
