"""The peer of a reconfiguration: what any torchrun job pays to start its ranks. Imports torch, forms a gloo
process group, meets at a barrier; rank 0 prints the time it got there."""

import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print(f"UP {time.time():.6f}", flush=True)
dist.destroy_process_group()
