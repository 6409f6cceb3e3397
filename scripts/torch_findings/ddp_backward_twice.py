"""torch finding (docs/verify.md): DistributedDataParallel with two forwards and then their two backwards -- or one
backward run twice on a retained graph -- gives each rank a different gradient, neither the average: silently.

    python scripts/torch_findings/ddp_backward_twice.py     # 2 processes, gloo, CPU

The second backward finds the reducer finalised (``prepare_for_backward`` runs in forward), so its gradients stay
local.  Known upstream: pytorch#47260 (open since 2020).  minizero's stages average both backwards, as ``.grad``
adds on one device (tests/test_sync_patterns.py).
"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def batch(rank: int) -> torch.Tensor:
    return torch.full((1, 2), float(rank + 1))


def rank_main(rank: int, retained: bool) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
    if retained:
        loss = model(batch(rank)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        first, second = model(batch(rank)).sum(), model(2 * batch(rank)).sum()
        first.backward()
        second.backward()
    # One device, both ranks' samples: the gradient of the mean over ranks, each backward counted.
    want = sum(batch(r) for r in range(2)) / 2 * (2 if retained else 3)
    print(f"{'retained' if retained else 'two forwards, two backwards'}: rank {rank}'s gradient "
          f"{model.module.weight.grad.tolist()}, single device {want.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29519"))
    for retained in (False, True):
        mp.spawn(rank_main, args=(retained,), nprocs=2)
