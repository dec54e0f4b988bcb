"""A/B of the fused decode kernel: the one before d9f1274 (its source with the op namespace renamed kvreuse_old,
built into /tmp/oldk/kvreuse_old.so) against the working tree's, one layer at SmolLM2's shape (9 heads, 3 KV heads,
head_dim 64), B sequences of L keys in randomly placed blocks, interleaved; wall ms and CPU ms (process_time) per call.

    git show d9f1274~1:kvreuse/kernels/decode_attention.cpp | sed 's/kvreuse_cpu/kvreuse_old/g' > /tmp/oldk/old.cpp
    python -c "from torch.utils.cpp_extension import load; load(name='kvreuse_old', sources=['/tmp/oldk/old.cpp'],
        extra_cflags=['-O3', '-fopenmp'], extra_ldflags=['-fopenmp'], build_directory='/tmp/oldk',
        is_python_module=False)"
    T=2 R=7 B=8 L=8192 python docs/bench/kv-dtype-kernel/ab_kernel.py
"""
import os
import statistics
import sys
import time

import torch
sys.path.insert(0, "/work/main")
from kvreuse.kernels import build as kernels
from kvreuse.layers.kv_format import FORMATS
from kvreuse.layers.attention import AttentionMetadata
kernels.load()
torch.ops.load_library("/tmp/oldk/kvreuse_old.so")
T = int(os.environ.get("T", 2)); torch.set_num_threads(T)
cpu = [l for l in open("/proc/cpuinfo") if l.startswith("model name")][0].split(":")[1].strip()
flags = set([l for l in open("/proc/cpuinfo") if l.startswith("flags")][0].split())
print(f"CPU {cpu}; flags {sorted(f for f in flags if f in {'avx2','avx512f','avx512bw','avx512_vnni','f16c','fma','avx512_bf16'})}; threads {T}; ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')}")
B, L = int(os.environ.get("B", 8)), int(os.environ.get("L", 8192))
H, Hkv, D, bs = 9, 3, 64, 16
nb = B * (L // bs + 1) + 1
gen = torch.Generator().manual_seed(0)
perm = torch.randperm(nb - 1, generator=gen) + 1
per = L // bs + 1
tables = [perm[b * per:(b + 1) * per].tolist()[: -(-L // bs)] for b in range(B)]
meta = AttentionMetadata.for_decode([L] * B, tables, bs, torch.device("cpu"))
q = torch.randn(B, H, D, generator=gen); k = torch.randn(B, Hkv, D, generator=gen)
pools = {}
for name in os.environ.get("KV", "fp32,int8,fp8").split(","):
    f = FORMATS[name]
    pools[name] = (f.encode(torch.randn(nb, bs, Hkv, D, generator=gen)), f.encode(torch.randn(nb, bs, Hkv, D, generator=gen)))
ops = {"old": torch.ops.kvreuse_old.decode_attention, "new": torch.ops.kvreuse_cpu.decode_attention}
wall = {}; cpu_t = {}
for r in range(int(os.environ.get("R", 7))):
    for n, (kc, vc) in pools.items():
        for o, op in ops.items():
            t, c = time.perf_counter(), time.process_time()
            for _ in range(2):
                op(q, k, k, kc, vc, meta.slot_mapping, meta.context_slots, meta.context_lens, 0.125)
            wall.setdefault((o, n), []).append((time.perf_counter() - t) / 2 * 1e3)
            cpu_t.setdefault((o, n), []).append((time.process_time() - c) / 2 * 1e3)
med = lambda d, key: statistics.median(d[key])
print(f"B={B} L={L}: ms per layer call, medians of {len(wall[('old', n)])} interleaved rounds (wall / CPU)")
for n in pools:
    for o in ops:
        print(f"  {o} {n}: wall {med(wall,(o,n)):.2f}  cpu {med(cpu_t,(o,n)):.2f}   rate vs old fp32: wall {med(wall,('old','fp32'))/med(wall,(o,n)):.2f}x cpu {med(cpu_t,('old','fp32'))/med(cpu_t,(o,n)):.2f}x; vs new fp32 wall {med(wall,('new','fp32'))/med(wall,(o,n)):.2f}x")
