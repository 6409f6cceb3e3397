"""Every stage in mixed precision on one GPU: peak CUDA memory per rank beside the model-state formula.

    torchrun --nproc-per-node 1 scripts/gpu_precision.py --backend nccl   # world size 1, NCCL
    torchrun --nproc-per-node 2 scripts/gpu_precision.py --backend gloo   # two ranks sharing the GPU, gloo

Each rank trains the benchmarks' GPT for a few steps with ``precision=bf16`` on
``cuda``, and reports ``torch.cuda.max_memory_allocated()`` (the allocator's
peak: model states + activations + temporaries) beside the stage's model-state
formula and the model-state bytes it held (:mod:`minizero.observe.memory`).  Rank 0
prints one JSON list; the table in ``docs/gpu-results.md`` is made from it.
"""
from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist

from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.models import BENCH_GPT
from minizero.course.harness.optimizers import STATE_TENSORS
from minizero.run.torchrun import init_from_env
from minizero.stages import STAGES, distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--stages", default=",".join(distributed()),
                        help="one per process gives each its own allocator peak (see docs/gpu-results.md)")
    args = parser.parse_args()
    me = init_from_env(args.backend)
    torch.cuda.set_device(0 if args.backend == "gloo" else torch.cuda.current_device())  # gloo: ranks share GPU 0
    rows = []
    for stage in args.stages.split(","):
        exp = Experiment(stage=stage, task="gpt", model=BENCH_GPT, optimizer="adam", steps=args.steps,
                         micro_batch=args.micro_batch, dtype="float32", backend="native", device="cuda",
                         options={"precision": args.precision}, check=args.backend == "gloo")
        gc.collect()  # the previous stage's model and hooks (reference cycles) go before this one is measured
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        result = run_experiment(me, exp)
        mine = {"stage": stage, "rank": me.rank, "world_size": me.world_size, "backend": args.backend,
                "precision": args.precision, "psi": result.psi, "held_bytes": result.held_bytes["total"],
                "formula_bytes": STAGES[stage].state_bytes(result.psi, me.world_size, 4, STATE_TENSORS["adam"],
                                                           args.precision),
                "formula": STAGES[stage].state_formula(4, STATE_TENSORS["adam"], args.precision),
                "cuda_peak_bytes": result.cuda_peak_bytes,
                "cuda_baseline_bytes": baseline, "gathered_peak_bytes": result.gathered_peak_bytes,
                "final_loss": sum(result.losses[-1:]), "skipped_steps": result.skipped_steps}
        del result
        everyone = [None] * me.world_size
        dist.all_gather_object(everyone, mine)
        rows += everyone
    if me.rank == 0:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
