"""``python -m minizero compress-study``: does it still train?  The sonnets GPT under each compressor.

The property suite proves each compressor does exactly what it says, on every rank; it cannot say whether
what it says is good enough to train.  This runs the same training -- the shipped text, the same seed, the
same batches, ``ddp-bucketed`` on N ranks, momentum SGD by default -- once per wire, and sets the loss curves
side by side, with the bytes each sent per step as the ledger counted them.  The final loss is the mean of the
last tenth of the steps (one step's loss is noisy), the gap is against the uncompressed run, and the
*second-half drop* (the mean loss of the tenth before the middle step, minus the final loss) says whether a
run was still learning: a run that stalled drops by about nothing.

Error feedback is what lets a biased compressor (top-k, sign, nearest rounding, PowerSGD) deliver everything
eventually; without it, what the compressor drops each step is lost for good -- PowerSGD at rank 1 sends the
same one direction of each matrix and nothing else -- so the default list runs the biased ones both ways.
Error feedback was designed for SGD; under Adam, which rescales every coordinate itself, its absence shows less
(``--optimizer adamw``).
"""
from __future__ import annotations

import json
import statistics

from ...compress import split_specs
from ...run.launch import RankPool
from ..harness.preflight import check_plot
from ..harness.registry import accepting, sharding
from .training_run import Run, train_on_rank

#: (compress, error_feedback): the default comparison -- every family, and the biased ones without feedback.
SETTINGS = [("none", False), ("fp16", False), ("int8", False), ("int4", False), ("int4:stochastic=1", False),
            ("topk:0.01", True), ("topk:0.01", False), ("sign", True), ("sign", False),
            ("powersgd:rank=1", True), ("powersgd:rank=1", False), ("powersgd:rank=4", True)]


def parse_settings(text: str | None) -> list[tuple[str, bool]]:
    """``int8,topk:0.01+ef,powersgd:rank=2,start=10+ef`` (``+ef``: with error feedback); always with the
    uncompressed run first, the baseline of every gap."""
    if not text:
        return list(SETTINGS)
    out = [("none", False)]
    for item in split_specs(text):
        setting = (item[:-3], True) if item.endswith("+ef") else (item, False)
        if setting not in out:
            out.append(setting)
    return out


def bucketed_stage() -> str:
    """The stage every wire fits and that overlaps its all-reduces with backward: unsharded, with buckets."""
    return next(s for s in sharding() if s in accepting("bucket_mb"))


def label(compress: str, error_feedback: bool) -> str:
    return "fp32 (uncompressed)" if compress == "none" else compress + (" + EF" if error_feedback else "")


def study(settings: list[tuple[str, bool]], world_size: int = 2, steps: int = 300, model: str = "small",
          lr: float = 0.03, batch_size: int = 16, seed: int = 0, optimizer: str = "momentum") -> list[dict]:
    """One training run per setting, on one pool of ranks; a row per setting, the uncompressed one first."""
    rows = []
    with RankPool(world_size) as pool:
        for compress, ef in settings:
            options = () if compress == "none" else (("compress", compress), ("error_feedback", ef))
            run = Run(stage=bucketed_stage(), model=model, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                      optimizer=optimizer, options=options, progress_to="none")
            ranks = pool.run(train_on_rank, run)
            losses = ranks[0]["losses"]
            tail = losses[-max(1, steps // 10):]
            tenth = max(1, steps // 10)
            middle = losses[max(0, steps // 2 - tenth):steps // 2] or losses[:1]
            final = statistics.fmean(tail) if all(map(_finite, tail)) else float("nan")
            rows.append({"compress": compress, "error_feedback": ef, "label": label(compress, ef), "losses": losses,
                         "final_loss": final, "second_half_drop": statistics.fmean(middle) - final,
                         "sent_per_step": statistics.fmean(r["sent_bytes"] for r in ranks) / steps,
                         "step_ms": 1e3 * statistics.median(ranks[0]["step_s"]), "diverged": ranks[0]["diverged"]})
    base = rows[0]
    for r in rows:
        r["gap"] = r["final_loss"] - base["final_loss"]
        r["fewer_bytes"] = base["sent_per_step"] / r["sent_per_step"] if r["sent_per_step"] else float("inf")
    return rows


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def format_table(rows: list[dict], world_size: int, steps: int, model: str, optimizer: str) -> str:
    lines = [f"compress-study: the {model} sonnets GPT, {bucketed_stage()} on {world_size} ranks, {steps} steps of {optimizer}; "
             f"final loss = mean of the last {max(1, steps // 10)} steps",
             f"{'wire':<26}{'first':>8}{'final':>9}{'gap':>9}{'2nd-half drop':>15}{'sent B/step/rank':>18}"
             f"{'fewer bytes':>13}{'step ms':>9}"]
    for r in rows:
        lines.append(f"{r['label']:<26}{r['losses'][0]:>8.3f}{r['final_loss']:>9.3f}{r['gap']:>+9.3f}"
                     f"{r['second_half_drop']:>15.3f}"
                     f"{r['sent_per_step']:>18,.0f}{r['fewer_bytes']:>12.1f}x{r['step_ms']:>9.1f}"
                     + (f"  diverged: {r['diverged']}" if r["diverged"] else ""))
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        style = "-" if r["error_feedback"] or r["compress"] in ("none", "fp16") else "--"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, lw=1.6 if r["compress"] == "none" else 1.0,
                color="black" if r["compress"] == "none" else None, label=r["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> tuple[int, str]:
    settings = parse_settings(args.compressors)
    if args.plot:
        check_plot(args.plot)  # before the study trains, not after (a missing folder once cost the whole study)
    rows = study(settings, args.world_size, args.steps, args.model, args.lr, args.batch_size, args.seed,
                 args.optimizer)
    if args.plot:
        plot(rows, args.plot, f"{args.model} GPT, {bucketed_stage()}, N={args.world_size}, {args.optimizer}: loss under "
                              f"each wire")
    if args.json:
        return 0, json.dumps({"world_size": args.world_size, "steps": args.steps, "model": args.model, "rows": rows},
                             indent=2)
    text = format_table(rows, args.world_size, args.steps, args.model, args.optimizer)
    return 0, text + (f"\nloss curves: {args.plot}" if args.plot else "")


def add_parser(sub, positive_int, positive_float) -> None:
    p = sub.add_parser("compress-study", help="train the sonnets GPT under each compressor: loss curves, gap, bytes")
    p.add_argument("--compressors", default=None,
                   help="'int8,topk:0.01+ef,powersgd:rank=2+ef' ('+ef': with error feedback); default: every "
                        "family, the biased ones with and without error feedback")
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--model", choices=["tiny", "small", "medium"], default="small")
    p.add_argument("--optimizer", choices=["momentum", "adamw", "sgd"], default="momentum",
                   help="error feedback was designed for SGD: under momentum SGD its absence shows most")
    p.add_argument("--lr", type=positive_float, default=0.03)
    p.add_argument("--batch-size", type=positive_int, default=16, help="global: samples per step, all ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="the loss curves, one per wire")
    p.add_argument("--json", action="store_true")
