"""torch finding (docs/verify.md): DistributedDataParallel with two forwards and then their two backwards -- or one
backward run twice on a retained graph, or a forward inside no_sync() and one outside with both backwards after
them -- gives each rank a different gradient, none of them the average: silently.

    python scripts/torch_findings/ddp_backward_twice.py     # 2 processes, gloo, CPU

The second backward finds the reducer finalised (``prepare_for_backward`` runs in forward), so its gradients stay
local.  Known upstream: pytorch#47260 (open since 2020).  minizero's stages average both backwards, as ``.grad``
adds on one device (tests/test_sync_patterns.py).
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def batch(rank: int) -> torch.Tensor:
    return torch.full((1, 2), float(rank + 1))


def rank_main(rank: int, case: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
    if case == "retained":
        loss = model(batch(rank)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        with model.no_sync() if case == "inside no_sync, then outside" else contextlib.nullcontext():
            first = model(batch(rank)).sum()
        second = model(2 * batch(rank)).sum()
        first.backward()
        second.backward()
    # One device, both ranks' samples: the gradient of the mean over ranks, each backward counted.
    want = sum(batch(r) for r in range(2)) / 2 * (2 if case == "retained" else 3)
    print(f"{case}: rank {rank}'s gradient {model.module.weight.grad.tolist()}, single device {want.tolist()}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29519"))
    for case in ("two forwards, two backwards", "retained", "inside no_sync, then outside"):
        mp.spawn(rank_main, args=(case,), nprocs=2)
