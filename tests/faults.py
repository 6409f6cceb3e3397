"""Fault injection: rank 1 fails in one of four ways, at one of three places, in step 1 of a short run.

Ways: ``raise`` an exception, ``exit`` (``os._exit``), ``kill`` (SIGKILL), ``sleep`` (stops making
progress without dying).  Places: in ``forward`` (a pre-hook on the first layer), in the middle of a
``bucket`` all-reduce (ddp-bucketed, after the bucket's first message left), in the middle of a
``gather`` (a ZeRO-3 all-gather, likewise) -- the last two on the communication thread.

The same :func:`train_with_fault` runs on a local pool and, as a script, under torchrun:
``torchrun --nproc-per-node 2 tests/faults.py FAULT PLACE TIMEOUT``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

FAULTS = ("raise", "exit", "kill", "sleep")
PLACES = ("forward", "bucket", "gather")
FAULTY_RANK = 1


def inject(fault: str) -> None:
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # "sleep": alive, silent, making no progress


def train_with_fault(me, fault: str, place: str, steps: int = 3) -> str:
    from minizero.comm import make_comm
    from minizero.lab.optimizers import make_optimizer
    from minizero.lab.tasks import TASKS
    from minizero.stages import make_stage
    from minizero.train import shard_step, train_step

    task = TASKS["gpt"]
    model = task.make_model(0, torch.float32, n_layer=2)
    stage_name, options = ("zero3", {}) if place == "gather" else ("ddp-bucketed", {"bucket_mb": 0.01})
    comm = make_comm("ring", check=True)
    stage = make_stage(stage_name, model, make_optimizer("sgd", model, 0.01), comm, **options)
    now = {"step": 0}
    if me.rank == FAULTY_RANK:
        if place == "forward":
            model.blocks[0].register_forward_pre_hook(lambda *_: inject(fault) if now["step"] == 1 else None)
        else:
            kind = "all_gather" if place == "gather" else "all_reduce"
            comm.add_observer(lambda k, nbytes: inject(fault) if now["step"] == 1 and k == kind else None)
    for s in range(steps):
        now["step"] = s
        x, y = task.make_batch(4 * me.world_size, 0, s, torch.float32)
        train_step(stage, shard_step(x, y, me.rank, me.world_size))
    return "finished"


if __name__ == "__main__":  # under torchrun
    from minizero.torchrun import init_from_env

    fault, place, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    print(train_with_fault(init_from_env(timeout_s=timeout_s), fault, place))
