#!/usr/bin/env bash
# Session 39, call 7 (one GPU): brings the DeepGEMM wheels and SGLang's small dependencies to a
# fresh machine and checks that DeepGEMM imports. With the repository's tracked files, all eight
# wheels exceed the device tool's 64 MiB carry, so call 8 carries the two SGLang wheels and
# relies on this machine keeping these (ignored files stay on a warm machine between calls).
#   usage (repo root, .whl partly carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
step import 120 python3 -c "import deep_gemm, moehal_cuda; print('deep_gemm', deep_gemm.__file__)"
cat "$OUT/import.log" "$OUT/steps.txt"
