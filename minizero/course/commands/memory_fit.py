"""``memory --params``'s second table: each stage's step peak per rank by component, predicted for a GPT shaped as
GPT-3's nearest, and with ``--gpu`` whether it fits and the smallest change that makes it fit
(:func:`minizero.course.harness.step_memory.fits`).  The rows are what ``--json`` holds; the lines, what is printed.
"""
from __future__ import annotations

from ...stages import STAGES, distributed
from ..harness.step_memory import Plan, Shape, fits, offloads


def gb(nbytes: float) -> str:
    """The paper's unit: GB = 1e9 bytes (Table 1); small models in kB."""
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e3:,.1f} kB"


def predicted_step_rows(args, psi: float) -> list[dict]:
    """Each equivalent stage's predicted step at ``--world-size`` by component; with ``--gpu``, ``fits`` and, if it
    does not, ``smallest_change`` (None: no one or two changes tried make it fit)."""
    shape = Shape.of_params(psi, args.seq)
    rows = []
    for stage in args.stages or distributed():
        if not STAGES[stage].equivalent:
            continue
        plan = Plan(stage, args.world_size, args.micro_batch, args.checkpoint_activations,
                    args.offload_optimizer and offloads(stage))
        here, fitting = fits(psi, shape, plan, args.gpu or float("inf"), args.precision, args.optimizer,
                             args.bucket_mb, args.reduce_scatter_buffers)
        row = {"stage": stage, **here, "at_step": here["step_gradients"] + here["optimizer_temporaries"]}
        if args.gpu:
            row.update(gpu_bytes=args.gpu, fits=fitting == plan,
                       smallest_change=None if fitting is None or fitting == plan else fitting.change_from(plan))
        rows.append(row)
    return rows


def predicted_step_lines(args, psi: float) -> list[str]:
    """Each stage's peak per rank at ``--world-size``, by component, for a GPT-3-shaped model of ``psi``
    parameters; with ``--gpu``, whether it fits and the smallest change that makes it fit."""
    shape = Shape.of_params(psi, args.seq)
    lines = [f"The step's peak per rank at N={args.world_size}: a GPT shaped as GPT-3's nearest ({shape.layers} layers, "
             f"hidden {shape.hidden}, {shape.heads} heads, vocabulary {shape.vocab:,}), {args.micro_batch} x "
             f"{shape.seq} tokens per micro-batch{', blocks checkpointed' if args.checkpoint_activations else ''}",
             f"{'stage':<14}{'model states':>14}{'activations':>14}{'gathered':>12}{'buckets':>10}{'after bw':>10}"
             f"{'at step':>10}{'peak':>12}" + (f"{'host':>12}" if args.offload_optimizer else "")
             + (f"   on {gb(args.gpu)}" if args.gpu else "")]
    for here in predicted_step_rows(args, psi):
        line = (f"{here['stage']:<14}{gb(here['model_states']):>14}{gb(here['activations']):>14}"
                + "".join(f"{gb(v) if v else '-':>{w}}" for v, w in ((here["gathered_units"], 12), (here["buckets"], 10),
                                                                     (here["after_backward"], 10), (here["at_step"], 10)))
                + f"{gb(here['total']):>12}"
                + (f"{gb(here['host']) if here['host'] else '-':>12}" if args.offload_optimizer else ""))
        if args.gpu:
            line += ("   fits" if here["fits"] else f"   does not fit; smallest change: {here['smallest_change']}"
                     if here["smallest_change"] else "   does not fit, nor with any one or two changes tried")
        lines.append(line)
    lines.append("peak: model states + the most of four moments (minizero.course.harness.step_memory): backward's start (every "
                 "activation, the loss's gradient), backward itself (activations freed block by block as gradients are "
                 "born -- each counted without the gradients zero_grad() freed -- ZeRO-2's and -3's packed buckets, "
                 f"{args.bucket_mb:g} MiB, at most {args.reduce_scatter_buffers} in flight: 'buckets'), after backward "
                 "(DDP's flat copy of the "
                 "gradients: 'after bw') and the step ('at step': mixed precision's fp32 gradients and the foreach "
                 "optimizer's intermediates -- Adam's sqrt(v)). activations: Korthikanti et al. 2022, eq. 1 (16-bit: "
                 "s*b*h*(34 + 5*a*s/h) per layer; checkpointed, 2sbh per layer and one layer replayed) plus the head's "
                 "logits; not included: fragmentation, the CUDA context, and what CUDA's libraries keep (cuBLAS's "
                 "workspaces; 94 MB beside DDP's model states on an H100, docs/gpu-results.md).")
    return lines
