"""torch finding (docs/verify.md): clip_grad_norm_(..., norm_type=inf) raises on a rank whose FSDP2 shard of some
parameter is empty, and the other ranks wait for it in a collective.

    python scripts/torch_findings/fsdp2_clip_inf_empty_shard.py     # 2 processes, gloo, CPU

Linear(1, 1) sharded over 2 ranks: rank 1 holds none of the weight's one element.  With norm_type=2 both ranks
agree on the norm; with inf, rank 1 raises "_foreach_norm cannot compute the infinity norm on an empty tensor"
(the check pytorch#173238 added) and rank 0 is left in the norm's all-reduce.  A single-device model with a
zero-size parameter raises the same way.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def rank_main(rank: int, norm_type: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29517"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    model(torch.ones(2, 1)).sum().backward()
    try:
        total = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.02, norm_type)
        print(f"rank {rank}: norm {total.full_tensor().item():.4f}", flush=True)
    except RuntimeError as error:
        print(f"rank {rank}: {error}", flush=True)
        os._exit(1)  # the other rank waits in the all-reduce of the norm: end it
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    mp.spawn(rank_main, args=(float(sys.argv[1]) if len(sys.argv) > 1 else float("inf"),), nprocs=2)
