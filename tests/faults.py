"""Fault injection: rank 1 fails in one of five ways, at one of three places, in step 1 of a short run.

Ways: ``raise`` an exception, ``exit`` (``os._exit``), ``kill`` (SIGKILL), ``sleep`` (stops making
progress without dying), ``stop`` (SIGSTOP: the process freezes, every thread of it).  Places: in
``forward`` (a pre-hook on the first layer), in the middle of a ``bucket`` all-reduce (ddp-bucketed,
after the bucket's first message left), in the middle of a ``gather`` (a ZeRO-3 all-gather, likewise) --
the last two on the communication thread.  ``stop`` mid-collective freezes rank 1 where it is hardest to
name: *waiting* for a peer, just as its peers will wait for it (:func:`freeze_while_waiting`).

The same :func:`train_with_fault` runs on a local pool and, as a script, under torchrun:
``torchrun --nproc-per-node 2 tests/faults.py FAULT PLACE TIMEOUT [BACKEND]``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

FAULTS = ("raise", "exit", "kill", "sleep", "stop")
PLACES = ("forward", "bucket", "gather")
FAULTY_RANK = 1
#: ``stop`` mid-collective: how long the healthy ranks hold back at the start of step 1, so that rank 1 is
#: the first in the collective, blocked waiting for them, when it freezes.
HOLD_BACK_S = 1.0


def inject(fault: str) -> None:
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # "sleep": alive, silent, making no progress


def freeze_while_waiting(now: dict) -> None:
    """A thread that SIGSTOPs this process once, in step 1, it is blocked in a collective's data exchange
    waiting for a peer: its row then says "waiting", like the rows of the peers that will wait for it."""
    from minizero.comm import progress

    board = progress.installed()

    def waiting() -> bool:
        row = progress.ProgressBoard.read(board.rank, board.values, board.text)
        return now["step"] == 1 and row["state"] == progress.IN_COLLECTIVE and row["waiting_on"] != progress.NOBODY

    def watch() -> None:
        # Blocked for a while, not a glimpse: a wait that ends in microseconds (torch's data exchange once the
        # peers are there) could end between this look and the SIGSTOP.  The peers hold back HOLD_BACK_S at
        # step 1, so rank 1 waits that long in its first collective's exchange: the freeze lands inside it.
        since = None
        while since is None or time.monotonic() - since < HOLD_BACK_S / 5:
            since = (since or time.monotonic()) if waiting() else None
            time.sleep(0.002)
        print(f"rank {board.rank} freezes at {time.time()}", flush=True)  # when the clock starts, for the tests
        os.kill(os.getpid(), signal.SIGSTOP)

    threading.Thread(target=watch, name="freeze-while-waiting", daemon=True).start()


def train_with_fault(me, fault: str, place: str, steps: int = 3, backend: str = "ring") -> str:
    from minizero.comm import make_comm
    from minizero.course.harness.optimizers import make_optimizer
    from minizero.course.harness.tasks import TASKS
    from minizero.run.train import shard_step, train_step
    from minizero.stages import make_stage

    task = TASKS["gpt"]
    model = task.make_model(0, torch.float32, n_layer=2)
    stage_name, options = ("zero3", {}) if place == "gather" else ("ddp-bucketed", {"bucket_mb": 0.01})
    comm = make_comm(backend, check=True)
    stage = make_stage(stage_name, model, make_optimizer("sgd", model, 0.01), comm, **options)
    now = {"step": 0}
    mid_collective_stop = fault == "stop" and place != "forward"
    if me.rank == FAULTY_RANK and mid_collective_stop:
        freeze_while_waiting(now)
    elif me.rank == FAULTY_RANK:
        if place == "forward":
            model.blocks[0].register_forward_pre_hook(lambda *_: inject(fault) if now["step"] == 1 else None)
        else:
            kind = "all_gather" if place == "gather" else "all_reduce"
            comm.add_observer(lambda k, nbytes: inject(fault) if now["step"] == 1 and k == kind else None)
    for s in range(steps):
        now["step"] = s
        if mid_collective_stop and s == 1 and me.rank != FAULTY_RANK:
            time.sleep(HOLD_BACK_S)
        x, y = task.make_batch(4 * me.world_size, 0, s, torch.float32)
        train_step(stage, shard_step(x, y, me.rank, me.world_size))
    return "finished"


if __name__ == "__main__":  # under torchrun
    import torch._dynamo  # noqa: F401 -- the first Optimizer imports it lazily: seconds, on a busy machine
    import torch.distributed as dist

    import minizero.course.harness.tasks
    import minizero.stages  # noqa: F401
    from minizero.run.torchrun import init_from_env

    fault, place, timeout_s, *backend = sys.argv[1], sys.argv[2], float(sys.argv[3]), *sys.argv[4:]
    me = init_from_env(timeout_s=timeout_s)
    # Each torchrun rank imports on its own: on a busy machine one can reach the first collective seconds
    # after the other.  A barrier outside the board's sight lines them up, so the timeout measures the fault.
    dist.barrier()
    print(train_with_fault(me, fault, place, backend=backend[0] if backend else "ring"))
