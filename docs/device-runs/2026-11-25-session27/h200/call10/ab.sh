# Session 27, call 10: the old code (862cbc6, made with `git archive 862cbc6 pyproject.toml core backends_cuda backends_npu backends_rocm conformance README.md | tar -x -C abold`) against this session's, one process after the other, twice.
source tools/device_setup.sh; record_env
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old ./abold || exit 1
cd /tmp
for i in 1 2; do for v in old new; do
  if [ $v = old ]; then P=/tmp/site_old:/tmp/site; else P=/tmp/site; fi
  PYTHONPATH=$P step bench-$v-$i 120 python3 -m moehal.cli.main bench --shapes deepseek_v3_ep8 --tokens 8,16,128 --backends cuda --quant bf16 --rounds 1 --out $OUT/bench-$v-$i
done; done
PYTHONPATH=/tmp/site_old:/tmp/site python3 -c "import moehal.kernels.triton_fused_moe as k; print('old has bind_fused_moe:', hasattr(k, 'bind_fused_moe'))" 2>&1 | tail -1
python3 - <<'PY'
import json, glob, os
out = os.environ["OUT"]
for f in sorted(glob.glob(out + "/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(os.path.basename(f), r["shape"], r["tokens"], "gpu %.1f" % r["time_us"], " ".join("%s=%.1f" % (c, r[c]) for c in ("host_us", "host_graph_us", "host_graph_out_us", "host_graph_out_b2b_us")))
PY
rm -f $OUT/*.png $OUT/bench-*.log
cat $OUT/steps.txt
