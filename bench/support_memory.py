# Support sizes of truncated sampling (top-k, top-p, min-p) on Zipf-shaped next-token
# distributions at GPT-2's vocabulary, and what storing them costs (docs/running.md, `[generation]`).
# Usage: python bench/support_memory.py LO HI  (Zipf exponents drawn uniformly in [LO, HI]; needs numpy)
import numpy as np
V=50257; rng=np.random.default_rng(0)
ranks=np.arange(1,V+1)
def support(s, top_k=0, top_p=1.0, min_p=0.0):
    lg=-s*np.log(ranks)            # sorted descending already
    p=np.exp(lg-lg.max()); p/=p.sum()
    keep=np.ones(V,bool)
    if top_k: keep[top_k:]=False
    q=np.where(keep,p,0); q/=q.sum()
    if top_p<1:
        # remove where ascending cumulative <= 1-top_p (computed over ascending order)
        cum_asc=np.cumsum(q[::-1])
        rem=(cum_asc<=1-top_p)[::-1]; rem[0]=False
        keep&=~rem
    q=np.where(keep,p,0); q/=q.sum()
    if min_p>0: keep&= q>=min_p*q.max()
    return keep.sum()
# Peakedness: s in [0.7, 1.5] covers flat (creative) to peaked (factual) positions.
import sys; lo,hi=map(float,sys.argv[1:3]); S=rng.uniform(lo,hi,2000)
for name,kw in [("top_k=50",dict(top_k=50)),("top_p=0.9",dict(top_p=0.9)),("top_p=0.95",dict(top_p=0.95)),("min_p=0.05",dict(min_p=0.05)),("top_p=0.95,min_p=0.05",dict(top_p=0.95,min_p=0.05))]:
    k=np.array([support(s,**kw) for s in S])
    B,T=64,128
    ids=4*k.mean()*B*T
    K=k.max()
    print(f"{name:24s} support mean {k.mean():8.0f} p50 {np.median(k):7.0f} p99 {np.percentile(k,99):7.0f} max {K:6d} | "
          f"ids for 64x128 tokens {ids/2**20:7.1f} MiB, bitsets {B*T*V/8/2**20:5.1f} MiB, dense (B,L-1,K) idx+mask {8*B*T*K/2**20:8.1f} MiB")
