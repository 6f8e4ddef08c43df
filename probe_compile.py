import sys, time, torch
sys.path.insert(0, "examples")
from sac_update import SAC, batches
from torch._dynamo.utils import counters
from cudagraph_td import CudaGraphModule
dev = torch.device("cuda")
data = batches(6, dev)
for warmup in (1, 2, 3):
    torch._dynamo.reset(); counters.clear()
    agent = SAC(dev)
    g = CudaGraphModule(torch.compile(agent.update), warmup=warmup)
    t = time.time()
    for i, b in enumerate(data):
        try:
            g(b)
            status = "ok"
        except Exception as e:
            status = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"warmup={warmup} call {i+1}: graphs={counters['stats']['unique_graphs']} t={time.time()-t:.1f}s {status}", flush=True)
