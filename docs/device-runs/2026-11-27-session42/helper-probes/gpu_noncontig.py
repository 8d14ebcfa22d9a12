# Run on the device (H200, 2026 session): MoELayer(backend="cuda") -> cuda.permute -> cuda.triton.
# Observed: bf16 0.0; fp8_block 1.21; fp8_tensor 1.26; w8a8_int8 1.41 (rel diff col-major vs contiguous)
import torch,moehal
for q in ["bf16","fp8_block","fp8_tensor","w8a8_int8"]:
 cfg=moehal.MoEConfig(num_experts=8,top_k=2,hidden_size=512,intermediate_size=256)
 g=torch.Generator().manual_seed(0)
 w13=torch.randn(8,512,512,generator=g)/512**.5;w2=torch.randn(8,512,256,generator=g)/16
 x=torch.randn(6,512,generator=g)
 w=moehal.quantize_weights(cfg,moehal.QuantScheme.parse(q),w13,w2,calibration_input=x).to("cuda")
 x=x.bfloat16().cuda();ids=torch.randint(0,8,(6,1)).repeat(1,2).cuda().int();ids[:,1]=(ids[:,0]+1)%8
 wt=torch.rand(6,2).cuda()
 L=moehal.MoELayer(cfg,q,backend="cuda",device="cuda");L.load_weights(w)
 a=L(x,ids,wt);b=L(x.t().contiguous().t(),ids,wt)
 print(q,L.plan.pipeline.experts.name,((a.float()-b.float()).abs().max()/a.float().abs().max()).item())
