"""The whole step's memory on a GPU, in one command: ``python scripts/gpu_memory.py [--out FILE]`` (issue 31).

1. ``memory --model large --device cuda --stages ddp,zero1,zero2,zero3``: each stage's last step on four ranks
   sharing GPU 0 (gloo between them), its peak by ``torch.cuda.max_memory_allocated`` beside the prediction of
   :mod:`minizero.course.harness.step_memory` -- ``large`` is where activations outweigh what CUDA's libraries keep -- with
   and without checkpointing;
2. optimizer offload on CUDA: each ZeRO stage trained with its optimizer in pinned host memory against the same
   run without offload, how far apart (losses, parameters after every step, optimizer state: the offloaded step
   is the CPU's for-loop Adam, the other the GPU's foreach kernels, so rounding apart), in fp32 (a float64 model)
   and bf16, with clipping (whose coefficient must reach gradients on two devices) and accumulation, at N = 3
   (uneven shards); zero2 also with the optimizer built after wrapping; and whether the host masters are pinned;
3. then, as time allows, ``large`` with the optimizer offloaded and the lab's GPT (the issue's command).

Writes what each case printed and measured to ``--out`` (JSON) after every case, so a run cut short keeps what
it measured.  Without CUDA it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from minizero.course.harness.experiment import Experiment, build, run_experiment  # noqa: E402
from minizero.parts.offload import HOST_KIND  # noqa: E402
from minizero.run.launch import RankPool  # noqa: E402
from minizero.stages import STAGES, distributed  # noqa: E402

MEMORY_CASES = [["--model", "large", "--micro-batch", "8", "--stages", "ddp,zero1,zero2,zero3"],
                ["--model", "large", "--micro-batch", "8", "--checkpoint-activations", "--stages", "ddp,zero1,zero2,zero3"],
                ["--model", "large", "--micro-batch", "8", "--offload-optimizer", "--stages", "zero2,zero3"],
                ["--model", "gpt", "--micro-batch", "8", "--checkpoint-activations"]]
OFFLOADING = [s for s in distributed() if "offload_optimizer" in STAGES[s].option_names()]


def memory_case(argv: list[str]) -> dict:
    """One ``memory --json`` command on the GPU (its table is printed from the rows: ``measured_step_lines``)."""
    command = [sys.executable, "-m", "minizero", "memory", "--world-size", "4", "--precision", "bf16", "--device",
               "cuda", *argv, "--json"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    rows = json.loads(done.stdout) if done.returncode == 0 else None
    print(" ".join(argv), f"rc {done.returncode} in {time.monotonic() - started:.0f} s", done.stderr[-3000:], flush=True)
    for row in rows or []:
        print(f"  {row['stage']:<14} held {row.get('cuda_held'):>14,} resident {row.get('cuda_resident'):>14,} "
              f"peak {row.get('cuda_peak'):>14,} predicted {row['step_predicted']['total']:>14,.0f}", flush=True)
    return {"argv": argv, "rc": done.returncode, "stderr": done.stderr[-3000:], "rows": rows,
            "s": time.monotonic() - started}


def pinned(me, exp: Experiment) -> dict:
    """On one rank: the stage built with offload holds its host state in pinned memory, off the GPU."""
    stage, _, comm, _ = build(me, exp)
    try:
        host = [t for kind, ts in stage.held_tensors().items() if kind.startswith(HOST_KIND) for t in ts]
        return {"host_tensors": len(host), "pinned": sum(t.is_pinned() for t in host),
                "on_cpu": sum(t.device.type == "cpu" for t in host)}
    finally:
        if comm:
            comm.close()


def largest_difference(a, b) -> float:
    """The largest absolute difference between two nests of dicts, lists, tensors and numbers (inf if they differ in
    shape, dtype or keys)."""
    if torch.is_tensor(b):
        if not (torch.is_tensor(a) and a.dtype == b.dtype and a.shape == b.shape):
            return float("inf")
        return (a.cpu().double() - b.cpu().double()).abs().max().item() if b.numel() else 0.0
    if isinstance(b, dict):
        return max([largest_difference(a[k], b[k]) for k in b], default=0.0) if set(a) == set(b) else float("inf")
    if isinstance(b, (list, tuple)):
        return max([largest_difference(x, y) for x, y in zip(a, b, strict=True)], default=0.0) \
            if len(a) == len(b) else float("inf")
    if isinstance(b, (int, float)):
        return abs(a - b)
    return 0.0 if a == b else float("inf")


def offload_cases(pool: RankPool, device: str = "cuda") -> list[dict]:
    """Offloaded against not, on ``device``: the step then runs on the CPU (torch's for-loop Adam) where it ran on
    the GPU (the foreach kernels), so in float64 the two agree to rounding, and a device mix-up would not."""
    out = []
    cases = [(stage, precision, dtype, False) for stage in OFFLOADING
             for precision, dtype in (("fp32", "float64"), ("bf16", "float32"))] + [("zero2", "bf16", "float32", True)]
    for stage, precision, dtype, wrap_first in cases:
        options = {} if precision == "fp32" else {"precision": precision}
        base = Experiment(stage=stage, device=device, dtype=dtype, steps=3, accum=2, micro_batch=3,
                          clip=(1.0, 2.0), wrap_first=wrap_first, options=options, lr=1e-2)
        off = replace(base, options={**options, "offload_optimizer": True})
        want, got = pool.run(run_experiment, base), pool.run(run_experiment, off)
        case = {"stage": stage, "precision": precision, "dtype": dtype, "wrap_first": wrap_first,
                "same_to_the_bit": all(largest_difference(g.params, w.params) == 0
                                       and largest_difference(g.losses, w.losses) == 0 for g, w in zip(got, want, strict=True)),
                "largest_parameter_difference": max(largest_difference(g.params, w.params) for g, w in zip(got, want, strict=True)),
                "largest_loss_difference": max(largest_difference(g.losses, w.losses) for g, w in zip(got, want, strict=True)),
                "largest_state_difference": max(largest_difference(g.optimizer_state, w.optimizer_state)
                                                for g, w in zip(got, want, strict=True)),
                "losses": [r.losses for r in got], "device_held": [r.held_bytes["total"] for r in got],
                "device_held_without": [r.held_bytes["total"] for r in want],
                "host_held": [r.held_bytes["host"] for r in got], "copied": [r.host_copied for r in got],
                "pinned": pool.run(pinned, off)}
        print(stage, precision, dtype, "wrap_first" if wrap_first else "at wrap",
              f"params {case['largest_parameter_difference']:.3g} losses {case['largest_loss_difference']:.3g} "
              f"state {case['largest_state_difference']:.3g}", case["pinned"][0], flush=True)
        out.append(case)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-memory.json")
    parser.add_argument("--cpu", action="store_true", help="try the offload cases on the CPU (the script's own check)")
    args = parser.parse_args()
    if args.cpu:
        with RankPool(3, timeout_s=300) as pool:
            cases = offload_cases(pool, "cpu")
        return 0 if all(c["same_to_the_bit"] for c in cases) else 1  # on one device, to the bit
    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing was run or written", file=sys.stderr)
        return 1
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "memory": [], "offload": []}

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))

    for argv in MEMORY_CASES[:2]:
        results["memory"].append(memory_case(argv))
        save()
    with RankPool(3, start_method="spawn", timeout_s=300) as pool:
        results["offload"] = offload_cases(pool)
    save()
    for argv in MEMORY_CASES[2:]:
        results["memory"].append(memory_case(argv))
        save()
    failed = [c for c in results["memory"] if c["rc"] != 0]
    print(f"{len(failed)} case(s) failed" if failed else "every case ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
