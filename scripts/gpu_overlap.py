"""Issue 48 on one GPU, in one command: ``python scripts/gpu_overlap.py --out DIR``.

1. **NCCL at N = 1 for every stage**, the collectives on their own stream and on the communication thread: each
   trains the bench GPT (fp32) a few steps; its parameters are compared with the other path's and with
   single-device training (the contrast stages are not expected to equal it, and say so);
2. **the overlap table** (``bench gpu-efficiency``): ddp-bucketed, zero2 and zero3 (prefetch on and off), each on
   both paths, on one GPU standing for a ring of two on a dialled wire, against the α–β bound;
3. **the streams' picture**: one dialled step of each path under ``torch.profiler``, kernels by stream;
4. the GPU tests (``tests/test_gpu_streams.py``).

Everything goes to ``DIR/gpu-overlap.json`` (with the machine) and ``DIR/gpu-streams.png``; a part that fails is
recorded with its error and the others still run.  Without CUDA it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from gpu_run import machine  # noqa: E402

from minizero.comm import make_comm  # noqa: E402
from minizero.course.commands.efficiency import OVERLAP_OPTIONS  # noqa: E402
from minizero.course.commands.gpu_efficiency import (  # noqa: E402
    GPU_DIAL,
    _experiment,
    bench_gpu_efficiency,
    format_gpu_efficiency,
    one_rank_group,
    run_steps,
)
from minizero.course.figures import gpu_streams  # noqa: E402
from minizero.course.harness.models import BENCH_GPT, GPT_SIZES  # noqa: E402
from minizero.course.harness.tasks import TASKS  # noqa: E402
from minizero.run.train import Step, train_step  # noqa: E402
from minizero.stages import REFERENCE, STAGES, distributed, make_stage  # noqa: E402

WIRES = [("ddp-bucketed", {"bucket_mb": 0.5, "compress": "fp16"}), ("ddp", {"compress": "int8"}),
         ("ddp-bucketed", {"bucket_mb": 0.5, "compress": "topk:0.05"}), ("zero2", {"bucket_mb": 0.5, "compress": "int4"})]


def _params(stage_name: str, options: dict, own_stream: bool | None, steps: int = 4) -> torch.Tensor:
    model = TASKS["gpt"].make_model(0, torch.float32, **BENCH_GPT).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if own_stream is None:
        stage = make_stage(REFERENCE, model, optimizer)
    else:
        comm = make_comm("native", network="nodes=1x1" if stage_name == "hsdp" else None)  # hsdp: the nodes
        comm.own_stream = own_stream
        stage = make_stage(stage_name, model, optimizer, comm, **options)
    for s in range(steps):
        x, y = (t.cuda() for t in TASKS["gpt"].make_batch(8, 0, s, torch.float32, **BENCH_GPT))
        train_step(stage, Step([(x, y)], y.numel()))
    runner = type(getattr(getattr(stage, "comm", None), "_thread", None)).__name__
    state = stage.full_state_dict()
    flat = torch.cat([v.detach().float().reshape(-1).cpu() for _, v in sorted(state.items())])
    return flat, runner


#: Stages whose collectives minizero builds from send/recv: run last, so that a hang at N = 1 loses only them.
POINT_TO_POINT = ("ps", "ps-async")


def every_stage(last: bool = False) -> list[dict]:
    reference, _ = _params(REFERENCE, {}, None)
    cases = [(name, {k: v for k, v in OVERLAP_OPTIONS.items() if k in STAGES[name].option_names()})
             for name in distributed() if (name in POINT_TO_POINT) == last] + ([] if last else WIRES)
    rows = []
    for name, options in cases:
        try:
            stream, runner = _params(name, options, True)
            thread, _ = _params(name, options, False)
            rows.append({"stage": name, "options": options, "runner": runner, "contrast": STAGES[name].contrast,
                         "stream_vs_thread": (stream - thread).abs().max().item(),
                         "stream_vs_reference": (stream - reference).abs().max().item(),
                         "finite": bool(torch.isfinite(stream).all())})
        except Exception as error:  # noqa: BLE001 -- recorded, the others still run
            rows.append({"stage": name, "options": options, "error": traceback.format_exc()[-2000:]})
            print(f"{name} {options}: {error}", flush=True)
    return rows


def pictures(out: Path, network: str, model: dict, micro_batch: int, bucket_mb: float) -> dict:
    panels, summary = [], {}
    for stage, options in [("ddp-bucketed", {"bucket_mb": bucket_mb}), ("zero3", {"prefetch": 1})]:
        for own in (True, False):
            exp = _experiment(stage, options, 3, model, micro_batch)
            found = gpu_streams.profile_kernels(lambda prof: run_steps(exp, own, network, 2, profile=prof))
            title = (f"{stage} {options}, {'its own stream (issue 48)' if own else 'the communication thread (before)'}"
                     f": one dialled step ({network}, standing for N = 2)")
            panels.append((title, found))
            summary[title] = {"per_stream_us": gpu_streams.stream_summary(found), "kernels": found}
    gpu_streams.draw(panels, str(out / "gpu-streams.png"))
    return summary


def gpu_tests() -> dict:
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_gpu_streams.py")], capture_output=True, text=True, cwd=ROOT)
    return {"returncode": tests.returncode, "tail": (tests.stdout + tests.stderr)[-3000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for gpu-overlap.json and gpu-streams.png")
    parser.add_argument("--network", default=GPU_DIAL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=list(GPT_SIZES), default="small", help="the GPT of the overlap table")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=0.5)
    parser.add_argument("--skip-stages", action="store_true", help="only the table, the picture and the tests")
    parser.add_argument("--json", action="store_true", help="the results as JSON on stdout, progress on stderr "
                        "(how scripts/gpu_run.py runs it)")
    args = parser.parse_args()
    show = sys.stderr if args.json else sys.stdout
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this script measures on a GPU only; nothing was run or written", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    one_rank_group()
    result: dict = {"machine": machine(1), "network": args.network}
    failed = False
    model = GPT_SIZES[args.model]
    result["model"] = {"name": args.model, **model, "micro_batch": args.micro_batch, "bucket_mb": args.bucket_mb}
    parts = [("efficiency", lambda: bench_gpu_efficiency(args.network, rounds=args.rounds, model=model,
                                                         micro_batch=args.micro_batch, bucket_mb=args.bucket_mb)),
             ("streams", lambda: pictures(out, args.network, model, args.micro_batch, args.bucket_mb))]
    if not args.skip_stages:
        parts = [("every_stage", every_stage)] + parts + [("gpu_tests", gpu_tests),
                                                          ("point_to_point_stages", lambda: every_stage(last=True))]
    for part, run in parts:
        try:
            result[part] = run()
            shown = format_gpu_efficiency(result[part]) if part == "efficiency" else json.dumps(
                result[part], indent=1) if part != "streams" else "drawn: gpu-streams.png"
            print(f"== {part}\n{shown[:6000]}", file=show, flush=True)
            failed = failed or part == "gpu_tests" and result[part]["returncode"] != 0
        except Exception:  # noqa: BLE001
            failed = True
            result[part] = {"error": traceback.format_exc()[-3000:]}
            print(f"== {part}\n{result[part]['error']}", file=show, flush=True)
        (out / "gpu-overlap.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
