"""The GPU run in one command: ``python scripts/gpu_run.py`` on a machine with CUDA.

Why a script: the GPU measurements in ``docs/gpu-results.md`` were a list of commands to type and a table
to fill by hand, and a GPU is lent for minutes.  This runs them all and writes one results file
(markdown + json) with the machine at the top, so the minutes go to measuring:

1. ``python -m minizero bench all --device cuda --json``: every stage beside its torch counterpart, in rounds
   with its ratio's interval (N = 2 sharing GPU 0: bench all's pool is gloo on the current device);
2. every distributed stage through ``train --json``: with G >= 2 GPUs under NCCL at N = G (one rank per
   GPU); with one GPU, CUDA compute with gloo at N = 2 (the two ranks share GPU 0, which the file says);
3. the peak CUDA memory per rank (train's summary) beside the stage's model-state formula.

Without CUDA it says so and exits 1, writing nothing.  ``--dry-run`` prints the commands it would run;
``--gpus`` sets the GPU count instead of asking torch (so the plan for 8 GPUs can be read on a laptop).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the commands run here, so `-m minizero` is this checkout
sys.path.insert(0, str(ROOT))
from minizero.course.harness.registry import stage_class  # noqa: E402  (after the path: the script runs from anywhere)
from minizero.stages import distributed  # noqa: E402

PY = [sys.executable, "-m", "minizero"]
NO_GPU = ("no CUDA GPU here (torch.cuda.is_available() is False, or --gpus 0): this script measures on GPUs "
          "only; run it on a machine with a GPU and a CUDA build of torch. Nothing was run or written.")


#: Issue 48's checks on one GPU (scripts/gpu_overlap.py): a model big enough that its kernels, not the host's
#: launches, set the step, and a wire whose all-reduce takes about as long as that compute.
OVERLAP = ["--model", "100m", "--micro-batch", "16", "--bucket-mb", "25", "--network", "alpha=50us,bandwidth=10GB/s"]


def plan(gpus: int, model: str = "small", precision: str = "bf16", steps: int = 50, figures: str = ".") -> list[dict]:
    """The commands for ``gpus`` GPUs, each with what it measures.  Refuses 0: nothing here runs on a CPU.
    ``figures``: the folder for the streams' picture."""
    if gpus < 1:
        raise SystemExit(NO_GPU)
    if gpus == 1:
        world, backend = 2, "gloo"
        how = "one GPU: CUDA compute with gloo at N = 2, both ranks on GPU 0 (NCCL needs a GPU per rank)"
    else:
        world, backend = gpus, "nccl"
        how = f"NCCL at N = {gpus}, one rank per GPU"
    shared = ("N = 2 (its default), gloo between the ranks, both on GPU 0 (bench all starts its ranks with gloo "
              "on the current device, whatever the GPU count)")
    commands = [{"kind": "bench", "what": "bench all", "how": shared,
                 "argv": PY + ["bench", "all", "--device", "cuda", "--json"]}]
    commands.append({"kind": "overlap", "what": "overlap on a stream of its own", "how":
                     "one GPU standing for N = 2 on a dialled wire; NCCL at N = 1 for every stage, both paths",
                     "argv": [sys.executable, "scripts/gpu_overlap.py", "--json", "--out", figures] + OVERLAP})
    for stage in distributed():  # the registry's stages: a new one is measured without editing this
        # A stage without a precision option (local-sgd) trains in fp32: train refuses --precision for it.
        takes = "precision" in stage_class(stage).option_names()
        commands.append({"kind": "train", "what": stage, "how": how,
                         "argv": PY + ["train", "--stage", stage, "--device", "cuda", "--backend", backend,
                                       "--world-size", str(world), "--model", model]
                         + (["--precision", precision] if takes else []) + ["--steps", str(steps), "--json"]})
    return commands


def machine(gpus: int) -> dict:
    """What the numbers were measured on: GPU name and count, driver, torch, CUDA, Python, minizero's commit."""
    import torch

    def ask(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": gpus,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "driver": ask(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0],
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": ask(["git", "rev-parse", "--short", "HEAD"]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run(command: dict, timeout_s: float) -> dict:
    """One command; its JSON from stdout, or the failure with the end of what it printed."""
    started = time.monotonic()
    try:
        done = subprocess.run(command["argv"], capture_output=True, text=True, timeout=timeout_s,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return command | {"ok": False, "error": f"timed out after {timeout_s:g} s", "seconds": timeout_s}
    out = command | {"seconds": round(time.monotonic() - started, 1), "ok": done.returncode == 0}
    if done.returncode != 0:
        return out | {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"}
    try:
        return out | {"result": json.loads(done.stdout)}
    except json.JSONDecodeError:
        return out | {"ok": False, "error": f"no JSON on stdout: {done.stdout[-2000:]}"}


def _bench_rows(result) -> list[dict]:
    """bench all's rows: a list, or under "rows" if the bench's JSON carries more than its rows."""
    return result.get("rows", []) if isinstance(result, dict) else result


def _ratio(row: dict) -> str:
    """The ratio, with its 95% interval where the bench reports one."""
    if row.get("ratio") is None:  # the counterpart could not run here: the verdict says why
        return row.get("verdict", "not compared")
    ci = row.get("interval")
    text = f"{row['ratio']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{row['ratio']:.2f}"
    return text + (f" {row['verdict']}" if row.get("verdict") else "")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bytes(value) -> str:
    return "-" if value is None else f"{value:,}"


def shown(argv: list[str]) -> str:
    """A command as a reader types it."""
    return " ".join(["python -m minizero"] + argv[3:] if argv[1:3] == ["-m", "minizero"] else ["python"] + argv[1:])


def overlap_lines(result: dict) -> list[str]:
    """gpu_overlap.py's table as it prints it, and every stage's NCCL run at N = 1 on both paths."""
    from minizero.course.commands.gpu_efficiency import format_gpu_efficiency

    lines = ["## Overlap on one GPU: its own stream against the communication thread", ""]
    if isinstance(result.get("efficiency"), list):
        lines += ["```", format_gpu_efficiency(result["efficiency"]), "```", ""]
    stages = [r for part in ("every_stage", "point_to_point_stages") for r in result.get(part) or []
              if isinstance(r, dict)]
    if stages:
        lines += ["| stage | options | runner | max abs Δ stream vs thread | max abs Δ vs single device |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {r['stage']} | {r['options']} | " + (f"failed: {r['error'].strip().splitlines()[-1]} | | |"
                  if "error" in r else f"{r['runner']} | {r['stream_vs_thread']:.1e} | "
                  f"{r['stream_vs_reference']:.1e}{' (contrast)' if r['contrast'] else ''} |") for r in stages]
        lines.append("")
    return lines


def markdown(m: dict, results: list[dict]) -> str:
    """The results file, in the shape of ``docs/gpu-results.md``: the machine first, then each table."""
    lines = ["# GPU results: `python scripts/gpu_run.py`", "",
             f"**Machine:** {m['gpu_count']} × {m['gpu']} ({m['gpu_memory_bytes'] / 1e9:.0f} GB), driver "
             f"{m['driver']}, torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}; minizero {m['commit']}; "
             f"{m['date']}.", "", "**Commands:**", "", "```"]
    lines += [shown(r["argv"]) for r in results] + ["```", ""]
    for r in results:
        if not r["ok"]:
            lines += [f"**{r['what']} failed** ({r['how']}):", "", "```", r["error"].strip(), "```", ""]
    bench = [r for r in results if r["kind"] == "bench" and r["ok"]]
    for b in bench:
        rows = _bench_rows(b["result"])
        if rows:
            lines += [f"## bench all: gpt {rows[0]['model']} (Ψ = {rows[0]['psi']:,}), "
                      f"{b['how']}", "",
                      "| stage | vs | step ms | torch ms | ratio | held (B) | formula (B) | peak CUDA (B) | torch peak (B) |",
                      "|---|---|---:|---:|---|---:|---:|---:|---:|"]
            lines += [f"| {x['stage']} | {x['counterpart']} | {x['step_ms']:.2f} | {_ms(x['counterpart_step_ms'])} | "
                      f"{_ratio(x)} | {x['held_bytes']:,} | {x['held_bytes_formula']:,.0f} | "
                      f"{x['cuda_peak_bytes']:,} | {_bytes(x['counterpart_cuda_peak_bytes'])} |" for x in rows]
            lines.append("")
    for o in (r for r in results if r["kind"] == "overlap" and r["ok"]):
        lines += overlap_lines(o["result"])
    trained = [r for r in results if r["kind"] == "train" and r["ok"]]
    if trained:
        first = trained[0]["result"]
        lines += [f"## Every stage through `train`: {trained[0]['how']}; {first['model']} GPT "
                  f"(Ψ = {first['psi']:,}), {first['precision']} where the stage takes it", "",
                  "*Model states*: live parameter, gradient, master and optimizer-state bytes after the last step; "
                  "*formula*: the stage's own; *peak CUDA*: `torch.cuda.max_memory_allocated()` over the run; "
                  "*working set* = peak − model states.", "",
                  "| stage | formula | N, backend | rank | model states (B) | formula (B) | peak CUDA (B) | "
                  "working set (B) | ZeRO-3 gathered peak (B) | tokens/s | loss first → last |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in trained:
            s = r["result"]
            for rank, held in enumerate(s["model_state_bytes"]):
                peak = s["peak_memory"][rank]["bytes"]
                lines.append(f"| {s['stage']} | {s['model_state_formula_text']} | {s['world_size']}, {s['backend']} | "
                             f"{rank} | {held:,} | {s['model_state_formula']:,.0f} | {peak:,} | {peak - held:,} | "
                             f"{s['gathered_peak_bytes'][rank]:,} | {s['tokens_per_s']:,.0f} | "
                             f"{s['loss_first']:.4f} → {s['loss_last']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def write(out: Path, m: dict, results: list[dict]) -> tuple[Path, Path]:
    """``out``.md and ``out``.json: the table a reader reads and everything it was made from."""
    md, js = out.with_suffix(".md"), out.with_suffix(".json")
    md.write_text(markdown(m, results))
    js.write_text(json.dumps({"machine": m, "results": results}, indent=2, default=str))
    return md, js


def detect_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing, write nothing")
    p.add_argument("--gpus", type=int, default=None, help="the GPU count to plan for (default: torch's count)")
    p.add_argument("--out", default="gpu-results", help="results file stem: STEM.md and STEM.json")
    p.add_argument("--model", default="small")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    args = p.parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        p.error(f"--gpus {args.gpus}: a GPU count is 0 or more")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: train needs at least 3 steps for a median step time; pass --steps 3 or more")
    gpus = detect_gpus() if args.gpus is None else args.gpus
    try:
        commands = plan(gpus, args.model, args.precision, args.steps, str(Path(args.out).parent))
    except SystemExit as refused:
        print(f"error: {refused}", file=sys.stderr)
        return 1
    if args.dry_run:
        for c in commands:
            print(f"# {c['what']}: {c['how']}\n" + shown(c["argv"]))
        return 0
    if detect_gpus() == 0:  # --gpus given on a machine without CUDA: still nothing to run
        print(f"error: {NO_GPU}", file=sys.stderr)
        return 1
    results, m = [], machine(gpus)
    for c in commands:
        print(f"running {c['what']} ({c['how']}) ...", file=sys.stderr, flush=True)
        results.append(run(c, args.timeout))
        # Written after every command: a GPU is lent for minutes, and a run cut short keeps what it measured.
        md, js = write(Path(args.out), m, results)
    print(f"wrote {md} and {js}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
