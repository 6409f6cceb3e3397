"""The ``train`` command line: check everything that can be checked before a rank starts, then run the
ranks here (``--world-size N``) or join torchrun's, and print the summary on rank 0."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ... import checkpoint
from ...comm import BACKENDS
from ...comm.network import TwoLevel, parse_network
from ...parts.precision import PRECISIONS
from ...run.launch import RankPool
from ...run.torchrun import check_environment, init_from_env, under_torchrun
from ...stages import DEFAULT_STAGE, STAGES, distributed
from ..harness import option_flags, preflight
from ..harness.registry import stage_class
from .training_run import MODELS, Run, as_json, format_summary, plot_losses, summary, train_on_rank


def add_parser(sub, positive_int, natural_int, positive_float) -> None:
    p = sub.add_parser("train", help="train a stage for real: progress, checkpoints that resume and reshard, a "
                                     "summary beside the formulas; here on N ranks or under torchrun")
    p.add_argument("--stage", default=DEFAULT_STAGE, help=f"one of: {', '.join(distributed())}")
    p.add_argument("--model", choices=MODELS, default="small", help="GPT sizes (tiny 28K ... 100m 99M parameters) "
                   "on the shipped sonnets, or an MLP")
    p.add_argument("--steps", type=positive_int, default=100, help="train up to this step (a resumed run included)")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="samples per optimizer step over all ranks and micro-batches (kept when resuming at another N)")
    p.add_argument("--accum", type=positive_int, default=1, help="K micro-batches per step on each rank")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="torch.distributed backend "
                   "(default: nccl with --device cuda, else gloo)")
    p.add_argument("--collectives", choices=list(BACKENDS), default="native",
                   help="native: torch's collectives; ring: minizero's own, from send/recv")
    p.add_argument("--network", default=None,
                   help="where the ranks sit, for hsdp, zeropp --hpz and --collectives hierarchical: 'nodes=MxG' (M "
                        "nodes of G ranks); with intra=/inter= (or a flat preset, 'alpha=..,bandwidth=..') each "
                        "message also waits as that network would make it")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=positive_int, default=None, help="ranks to start here (not under torchrun)")
    p.add_argument("--seed", type=preflight.seed, default=0)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--warmup", type=natural_int, default=0, help="steps of linear learning-rate warmup")
    p.add_argument("--save", default=None, help="checkpoint directory (a step-N directory per save)")
    p.add_argument("--save-every", type=natural_int, default=0, help="also save every S steps (0: only at the end)")
    p.add_argument("--consolidated", action="store_true",
                   help="save one torch.load-able file (gathered) instead of one file per rank")
    p.add_argument("--resume", default=None, help="a checkpoint: a --save directory (its latest) or a step-N one")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="keep each transformer block's input only and replay its forward in backward")
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument("--timeout", type=preflight.timeout_s, default=300.0,
                   help=f"seconds a collective may go without progress before the run is ended as stalled "
                        f"(at least {preflight.MIN_TIMEOUT_S:g})")
    p.add_argument("--plot", default=None, help="write the loss curve to this PNG")
    p.add_argument("--json", action="store_true", help="the summary as JSON on stdout (progress goes to stderr)")
    p.add_argument("--debug", action="store_true", help="a failure on the ranks: print every traceback, not only "
                                                        "the verdict")
    # A flag per option the stages declare (--compress, --bucket-mb, --prefetch, --servers, ...): given only to
    # a stage that takes it, else refused, named (make_run).
    option_flags.add_flags(p, {name: STAGES[name] for name in distributed()}, leave_out=("precision",),
                           command=p.prog)


def make_run(args) -> Run:
    """The run, with each stage option checked against what the stage accepts."""
    if args.stage not in distributed():
        raise ValueError(f"--stage {args.stage!r}: choose one of {', '.join(distributed())}")
    cls = stage_class(args.stage)
    accepted = cls.option_names()
    options = option_flags.given(args)
    if args.precision != "fp32" or "precision" in accepted:  # fp32, the default, is no option of local-sgd's
        options = {"precision": args.precision, **options}
    for key in options:
        if key not in accepted:
            raise ValueError(f"--stage {args.stage} takes no --{key.replace('_', '-')} "
                             f"(its options: {', '.join(accepted)})")
    check_placement(args, cls, options)
    if args.save_every and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save DIR: where the checkpoints go")
    if args.save:
        cls.check_checkpointable()  # before training, not after it
        preflight.check_output_dir("--save", args.save)
    if args.plot:
        preflight.check_plot(args.plot)  # savefig comes after the last step: a bad path would waste the run
    preflight.check_lr(args.lr, "adamw")  # train_on_rank's optimizer, over fp32 masters
    return Run(stage=args.stage, model=args.model, steps=args.steps, batch_size=args.batch_size, accum=args.accum,
               lr=args.lr, schedule=args.schedule, warmup=args.warmup, seed=args.seed,
               options=tuple(options.items()), collectives=args.collectives, device=args.device, save=args.save,
               save_every=args.save_every, consolidated=args.consolidated, resume=args.resume,
               log_every=args.log_every, progress_to="stderr" if args.json else "stdout",
               checkpoint_activations=args.checkpoint_activations, network=args.network)


def check_placement(args, cls, options: dict) -> None:
    """What needs to know where the ranks sit -- HSDP's mesh, ZeRO++'s hpZ, the two-level collectives -- is told by
    ``--network`` before any rank starts (once each rank failed, its advice naming a ``network=`` that the command
    had no flag for); a network is parsed here, its nodes held to the world size."""
    network = parse_network(args.network)
    needs = ("--stage hsdp" if getattr(cls, "needs_nodes", False) else "--hpz" if options.get("hpz") else
             "--collectives hierarchical" if args.collectives == "hierarchical" else None)
    if needs and not isinstance(network, TwoLevel):
        raise ValueError(f"{needs} needs to know where the ranks sit: give --network nodes=MxG (M nodes of G ranks; "
                         f"add intra=/inter= to dial their links)" + (f", not the flat {args.network!r}" if network
                                                                     else ""))
    if isinstance(network, TwoLevel) and args.world_size and network.nodes.world_size != args.world_size:
        raise ValueError(f"--network {args.network}: {network.nodes.count} nodes of {network.nodes.per_node} are "
                         f"{network.nodes.world_size} ranks, and --world-size is {args.world_size}")


def check_hardware(args, backend: str, world_size: int) -> None:
    if (args.device == "cuda" or backend == "nccl") and not torch.cuda.is_available():
        raise ValueError(f"--{'device cuda' if args.device == 'cuda' else 'backend nccl'}: no CUDA GPU here "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu "
                         f"--backend gloo")
    if backend == "nccl" and args.device != "cuda":
        raise ValueError("--backend nccl moves CUDA tensors only; add --device cuda, or use --backend gloo on CPU")
    if backend == "nccl" and not under_torchrun() and world_size > torch.cuda.device_count():
        raise ValueError(f"--world-size {world_size} with NCCL needs one GPU per rank, and this machine has "
                         f"{torch.cuda.device_count()}; use --world-size {torch.cuda.device_count()}, or --backend gloo "
                         f"to let ranks share a GPU")


def check_resume(run: Run) -> None:
    """Refuse a checkpoint this run cannot continue, before any rank starts (each rank checks again)."""
    model = run.make_model()
    shapes = {k: (list(v.shape), str(v.dtype)) for k, v in model.state_dict().items()}
    manifest = checkpoint.inspect(run.resume, shapes, dict(run.options).get("precision", "fp32"),
                                  torch.optim.AdamW)  # train_on_rank's optimizer
    for key, value in run.data().items():
        saved = manifest["data"].get(key)
        if key in manifest["data"] and saved != value:
            flag = "--" + key.replace("_", "-")
            why = ("step s trains on batch s of that run's data" if key in ("batch_size", "seed") else
                   "the learning rate at each step follows from them")
            raise ValueError(f"{manifest['directory']}: saved by a run with {flag} {saved}, this one has {value}; "
                             f"resume with {flag} {saved} ({why})")
    if manifest["step"] >= run.steps:
        raise ValueError(f"{manifest['directory']} is at step {manifest['step']} and --steps is {run.steps}: nothing "
                         f"to train; pass --steps greater than {manifest['step']}")


def main(args) -> tuple[int, str]:
    run = make_run(args)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if under_torchrun() or any(v in os.environ for v in ("RANK", "WORLD_SIZE")):
        check_environment(backend)
        if args.world_size is not None and args.world_size != int(os.environ["WORLD_SIZE"]):
            raise ValueError(f"--world-size {args.world_size}, but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} "
                             f"ranks; drop --world-size under torchrun (its --nnodes x --nproc-per-node decide)")
    world_size = int(os.environ.get("WORLD_SIZE", 0)) or args.world_size or 1
    check_hardware(args, backend, world_size)
    preflight.check_design_options(world_size, args.steps, option_flags.given(args), getattr(args, "registry", None),
                                   [args.stage], args.precision)
    if run.resume:
        check_resume(run)
    if under_torchrun():
        me = init_from_env(backend, args.timeout)
        mine = train_on_rank(me, run)
        ranks = [None] * me.world_size if me.rank == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        if me.rank != 0:  # every rank knows a divergence: torchrun reports each rank's exit
            return (1 if mine["diverged"] else 0), ""
    else:
        # CUDA cannot be used in a forked child once the parent asked torch.cuda anything: spawn for GPU runs.
        with RankPool(world_size, timeout_s=args.timeout, backend=backend,
                      start_method="spawn" if args.device == "cuda" else None) as pool:
            ranks = pool.run(train_on_rank, run)
    result = summary(run, ranks, world_size, backend)
    if args.plot:
        plot_losses(result, args.plot)
        print(f"loss curve: {args.plot}", file=sys.stderr if args.json else sys.stdout, flush=True)
    text = as_json(result) if args.json else format_summary(result)
    if not result["diverged"]:
        return 0, text
    # NaN or inf is a failure, never a finished run: the summary, then the verdict last, and exit 1.
    print(text, flush=True)
    print(f"error: {result['diverged']}; training stopped there, and nothing was saved from that step on. "
          f"Lower --lr ({args.lr:g}), or add --warmup steps", file=sys.stderr, flush=True)
    return 1, ""

