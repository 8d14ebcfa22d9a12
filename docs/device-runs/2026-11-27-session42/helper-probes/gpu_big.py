import torch,time
from moehal.kernels import triton_fused_moe as F
from moehal.kernels.triton_token_moe import TokenMoE
E,H,I,K=256,7168,2048,8;d="cuda";bf=torch.bfloat16
torch.manual_seed(0)
w13=torch.randn(E,2*I,H,device=d,dtype=bf).mul_(H**-.5)
w2=torch.randn(E,H,I,device=d,dtype=bf).mul_(I**-.5)
print(w13.numel()>2**31,w13.stride())
def ref(x,ids,wt):
 o=[]
 for t in range(x.shape[0]):
  acc=torch.zeros(H,device=d)
  for k in range(K):
   e=int(ids[t,k]);h=(x[t].float()@w13[e].float().T).to(bf).float()
   a=(torch.nn.functional.silu(h[:I])*h[I:]).to(bf).float()
   acc+=wt[t,k]*(a@w2[e].float().T).to(bf).float()
  o.append(acc)
 return torch.stack(o).to(bf)
def err(a,b):return ((a.float()-b.float()).abs().max()/b.float().abs().max()).item()
for w in(F.TritonMoEWeights(w13,w2),F.TritonMoEWeights(F.pair_gate_up(w13),w2,w13_paired=True)):
 for T in (4,40000):
  x=torch.randn(T,H,device=d,dtype=bf)
  ids=torch.rand(T,E,device=d).topk(K).indices.int()
  ids[-4:]=torch.arange(E-K,E,device=d,dtype=torch.int32)
  wt=torch.rand(T,K,device=d)
  t0=time.time();y=F.fused_moe(x,ids,wt,w,all_local=True,device_name=torch.cuda.get_device_name());torch.cuda.synchronize()
  print(T,"tok: T*K*H>2^31:",T*K*H>2**31,"fused err first/last:",err(y[:4],ref(x[:4],ids[:4],wt[:4])),err(y[-4:],ref(x[-4:],ids[-4:],wt[-4:])),f"{time.time()-t0:.1f}s",flush=True)
tm=TokenMoE(w13,None,w2,None,activation=1,gated=True,alpha=0.,limit=0.,scaling=1.)
x=torch.randn(2,H,device=d,dtype=bf);ids=torch.stack([torch.arange(E-K,E),torch.arange(0,K)]).int().to(d);wt=torch.rand(2,K,device=d)
o=torch.empty(2,H,device=d,dtype=bf);tm(x,ids,wt,o);print("token-major err:",err(o,ref(x,ids,wt)))
