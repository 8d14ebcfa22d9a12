import re,torch
from moehal.kernels import triton_token_moe as M
E,K,H,I=128,8,2048,768
d="cuda"
torch.manual_seed(0)
w2=(torch.randn(E,H,I,device=d)/I**.5).bfloat16()
for t,s in [(1,4),(4,4),(8,2)]:
 ids=torch.stack([torch.randperm(E,device=d)[:K] for _ in range(t)]).int()
 a=torch.randn(t*K,I,device=d).bfloat16();w=torch.rand(t,K,device=d)
 o=torch.empty(t,H,device=d,dtype=torch.bfloat16)
 L=M.bind_token_gemm_combine(a,ids,w,w2,None,o,split=s)
 for _ in range(3):L(a,ids,w,o)
 ref=o.clone();res=[]
 for i in range(4000):L(a,ids,w,o);res.append(o.clone())
 r=torch.stack(res);print(t,s,"differ:",(r!=ref).flatten(1).any(1).sum().item(),flush=True)
k=list(M._token_gemm_combine_kernel._cache.values())[0][5]
ls=k.asm["ptx"].splitlines()
kp=[f"{i}: {l.strip()}" for i,l in enumerate(ls) if re.search(r"bar\.sync|barrier|st\.global|atom\.|fence|membar|ld\.global",l)]
print(k.metadata.num_warps,"warps");print("\n".join(kp[-45:]))
