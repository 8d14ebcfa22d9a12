# Run on the device with TRITON_INTERPRET=1 (H200): plan has no 'mode INTERPRETED' line,
# execution_mode 'native', 'graphs capturable', kernel is triton InterpretedFunction, forward ran.
import torch,moehal
from moehal.kernels import triton_fused_moe as F
cfg=moehal.MoEConfig(num_experts=4,top_k=2,hidden_size=128,intermediate_size=64)
L=moehal.MoELayer(cfg,"bf16",backend="cuda",device="cuda")
print(L.plan); print("execution_mode:",L.plan.pipeline.execution_mode(L.request)); print(type(F._fused_moe_kernel).__name__)
