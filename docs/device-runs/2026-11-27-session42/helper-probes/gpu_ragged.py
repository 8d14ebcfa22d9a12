import torch,moehal
from moehal.reference.oracle import reference_layer
T={"bf16":2e-2,"fp8_block":.035,"fp8_tensor":.035,"w8a8_int8":.065}
for kw in [dict(hidden_size=2880,intermediate_size=2880,activation="swiglu_oai",has_w13_bias=True,has_w2_bias=True,num_experts=32,top_k=4),dict(hidden_size=2048,intermediate_size=1408,num_experts=64,top_k=6),dict(hidden_size=1000,intermediate_size=200,num_experts=16,top_k=1,activation="gelu",gated=False,has_w2_bias=True,dtype=torch.float16)]:
 cfg=moehal.MoEConfig(**kw);E,H,I=cfg.num_experts,cfg.hidden_size,cfg.intermediate_size
 g=torch.Generator().manual_seed(0)
 w13=torch.randn(E,cfg.w13_rows,H,generator=g)/H**.5;w2=torch.randn(E,H,I,generator=g)/I**.5
 b13=torch.randn(E,cfg.w13_rows,generator=g)*.1 if cfg.has_w13_bias else None;b2=torch.randn(E,H,generator=g)*.1 if cfg.has_w2_bias else None
 for q in T:
  for t in (1,7,300):
   x=torch.randn(t,H,generator=g)
   try:
    w=moehal.quantize_weights(cfg,moehal.QuantScheme.parse(q),w13,w2,w13_bias=b13,w2_bias=b2,calibration_input=x).to("cuda")
    ids=torch.rand(t,E,generator=g).topk(cfg.top_k).indices.int().cuda();wt=(torch.rand(t,cfg.top_k,generator=g)+.1).cuda();xx=x.to(cfg.dtype).cuda()
    L=moehal.MoELayer(cfg,q,backend="cuda",device="cuda");R=reference_layer(cfg,q,"cuda");L.load_weights(w);R.load_weights(w)
    a,r=L(xx,ids,wt),R(xx,ids,wt);e=((a.float()-r.float()).abs().max()/r.float().abs().max()).item()
    print(H,I,q,t,L.plan.pipeline.experts.name,f"{e:.4f}","BAD" if not e<T[q] else "",flush=True)
   except Exception as ex:print(H,I,q,t,"ERR",repr(ex)[:200],flush=True)
