source tools/device_setup.sh
record_env
step sweep 330 python3 tools/token_moe_sweep.py --tiles --json "$OUT/sweep.json"
step pytest-gpu 200 python3 -m pytest -q -x -p no:cacheprovider -o addopts="--import-mode=importlib" tests/cuda/test_gpu.py tests/core/test_token_moe.py
cat "$OUT/sweep.log"; tail -5 "$OUT/pytest-gpu.log"; cat "$OUT/steps.txt"
