"""torch finding (docs/verify.md): DistributedDataParallel(static_graph=True) with gradient accumulation through
no_sync() fails on its first backward: "expect_autograd_hooks_ INTERNAL ASSERT FAILED at reducer.cpp".

    python scripts/torch_findings/ddp_static_graph_no_sync.py     # 1 process, gloo, CPU

Known upstream: pytorch#143580 (open); the fix under review, pytorch#187732, says that once the assert is passed
the gradients also stop being all-reduced from the second iteration on.
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    print("torch", torch.__version__)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29518"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = DistributedDataParallel(torch.nn.Linear(2, 2), static_graph=True)
    with model.no_sync():  # the first micro-batch of a step of K = 2
        model(torch.ones(1, 2)).sum().backward()
    model(torch.ones(1, 2)).sum().backward()  # the last one synchronises
    print("no error")
    dist.destroy_process_group()
