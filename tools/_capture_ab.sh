source tools/device_setup.sh >/dev/null 2>&1
record_env
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/cuda/test_gpu.py -k "dead_cycle or graph" > $OUT/pytest-gpu.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest-gpu.log
cat > /tmp/rowlog.py <<'PY'
import sys
import moehal.bench as b
orig = b.bench_one
def traced(shape, cfg, quant, backend, tokens, *a, **k):
    print(f"ROW {shape} {quant.name} {tokens}", flush=True)
    return orig(shape, cfg, quant, backend, tokens, *a, **k)
b.bench_one = traced
sys.exit(b.main(sys.argv[1:]))
PY
cd /tmp
for i in 1 2 3; do
  TRITON_CACHE_DIR=/tmp/tc_fix_$i timeout 150 python3 /tmp/rowlog.py --backends cuda --reps 3 --settle-s 0.2 --shapes qwen3_30b_a3b,deepseek_v3_ep8 --tokens 1024,2048,4096 --quant bf16,fp8_block > $OUT/fix$i.log 2>&1
  echo "fresh cache run $i: rc=$? $(grep -c '^ROW' $OUT/fix$i.log) rows"; grep -E "Error" $OUT/fix$i.log | head -2
done
