import torch
from mucudnn.torch.offload_session import OffloadSession
from mucudnn.torch.planner import KEEP
from mucudnn.torch import rescue as R
dev = torch.device("cuda", 0)
torch.manual_seed(0)
layers=[]
for _ in range(6): layers += [torch.nn.Linear(4096,4096), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).to(dev)
x = torch.randn(16384, 4096, device=dev)
def step(session=None):
    model.zero_grad(set_to_none=True)
    if session is None:
        model(x).square().mean().backward()
    else:
        with session:
            loss = model(x).square().mean()
        loss.backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()]
ref = step()
before = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats(); step()
rise = torch.cuda.max_memory_allocated() - before
torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(dev).total_memory
cap = torch.cuda.memory_allocated() + rise - 3 * 2**30 // 4
print("before", before/2**30, "rise", rise/2**30, "cap", cap/2**30, flush=True)
said=[]; trace=[]
s = OffloadSession(modes=[KEEP]*16, trace=trace, say=lambda t: (said.append(t), print("SAY", t, flush=True)))
orig = s.rescue
def rescue(func, want, err):
    st = s._step
    cands = R.eviction_order(st, s._first_unpacks)
    print("RESCUE", func, "want", want/2**20, "alloc", torch.cuda.memory_allocated()/2**30, "reserved", torch.cuda.memory_reserved()/2**30,
          "stream", torch.cuda.current_stream(), "cands", [g.gid for g in cands],
          "groups", [(g.gid, g.mode, g.tensor is not None, g.live_packs, g.unpacks, g.offloadable, g.readers, g.fetch is not None) for g in st.groups], flush=True)
    m = orig(func, want, err)
    torch.cuda.synchronize()
    print("  moved", m/2**20, "alloc after", torch.cuda.memory_allocated()/2**30, "reserved", torch.cuda.memory_reserved()/2**30, flush=True)
    return m
s.rescue = rescue
torch.cuda.set_per_process_memory_fraction(cap / total, dev)
try:
    g = step(s)
    print("OK equal", all(torch.equal(a,b) for a,b in zip(ref,g)))
except Exception as e:
    print("FAILED", str(e)[:300])
print(torch.cuda.memory_summary()[:3000])
