import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "/work/main/tests/rocm")
sys.path.insert(0, "/work/main/tests")
import torch, moehal
from _rocm_testing import problem, rel_err, triton_registry
from moehal.reference.oracle import reference_layer

def run_pair(cfg, quant, t, seed=0, ids=None):
    w, x, ids0, wts = problem(cfg, quant, t, seed)
    if ids is not None: ids0 = ids
    reg = triton_registry()
    ours = moehal.MoELayer(cfg, quant, backend="tritonmoe", device="cpu", registry=reg)
    ref = reference_layer(cfg, quant, "cpu", registry=reg)
    ours.load_weights(w); ref.load_weights(w)
    return ours(x, ids0, wts), ref(x, ids0, wts), ours
