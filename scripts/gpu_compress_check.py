"""Compression beyond 16 bits on a GPU, in one command: ``python scripts/gpu_compress_check.py [--out FILE]``.

Each case trains on CUDA (two ranks sharing GPU 0 over gloo, whose send/recv detours through host memory;
with ``--nccl`` and one GPU, one NCCL rank) and is compared with the same-rounding reference computed on the
CPU: the codecs encode on the host, PowerSGD's products run on the GPU, so this is where a device mix-up
would show.  Prints one line per case and writes the JSON to ``--out``.  Without CUDA it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from minizero.course.harness.equivalence import max_diff  # noqa: E402
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment  # noqa: E402
from minizero.run.launch import RankPool  # noqa: E402

CASES = [("ddp-bucketed", {"compress": "powersgd:rank=2", "error_feedback": True, "bucket_mb": 0.05}),
         ("ddp", {"compress": "int8", "error_feedback": True}),
         ("ddp-bucketed", {"compress": "topk:0.05", "error_feedback": True, "bucket_mb": 0.05}),
         ("zero2", {"compress": "int4", "bucket_mb": 0.05}),
         ("zeropp", {"compress": "int8", "quantized_weights": "int8", "error_feedback": True})]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--nccl", action="store_true", help="one NCCL rank per GPU instead of gloo ranks on GPU 0")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64: the GPU's gradients then differ from the CPU's far below any rounding level "
                             "of a codec, so a mismatch is a bug, not a flipped rounding")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA here: nothing was run", file=sys.stderr)
        return 1
    backend = "nccl" if args.nccl else "gloo"
    rows, status = [], 0
    with RankPool(args.world_size, start_method="spawn", backend=backend) as pool:
        for stage, options in CASES:
            exp = Experiment(stage=stage, task="gpt", steps=3, accum=2, dtype=args.dtype, optimizer="adam",
                             device="cuda", backend="ring" if backend == "gloo" else "native", options=options)
            start = time.perf_counter()
            try:
                results = pool.run(run_experiment, exp)
            except Exception as error:  # noqa: BLE001 -- recorded, and the next case gets a fresh pool
                rows.append({"stage": stage, "options": options, "error": str(error)[-2000:]})
                print(f"{stage:<13} {options}: FAILED {str(error).splitlines()[-1][:200]}", flush=True)
                status = 1
                pool = RankPool(args.world_size, start_method="spawn", backend=backend)
                continue
            diff = max_diff(results, reference_of(replace(exp, device="cpu"), args.world_size))
            ok = diff[1] < (1e-4 if args.dtype == "float32" else 1e-9)
            status |= not ok
            rows.append({"stage": stage, "options": options, "max_abs_diff": diff[0], "max_rel_diff": diff[1],
                         "ok": ok, "sent_by_kind": results[0].sent_by_kind, "cuda_peak_bytes": results[0].cuda_peak_bytes,
                         "seconds": time.perf_counter() - start})
            print(f"{stage:<13} {str(options):<86} vs CPU reference {diff[0]:.2e} (rel {diff[1]:.1e}) "
                  f"{'ok' if ok else 'DIFFERS'}  sent {results[0].sent_by_kind}", flush=True)
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": backend, "dtype": args.dtype,
              "world_size": args.world_size, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
