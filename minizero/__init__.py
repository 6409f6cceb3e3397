"""minizero: data-parallel training built from send/recv, one stage at a time.

Read in this order: ``comm`` (collectives from send/recv, the byte ledger),
``launch`` (ranks), ``train`` (the one training loop), ``flat``/``buckets``/
``layout`` (the flat buffers, buckets and shards every stage shares),
``stages`` (reference, ddp, ... zero3), and ``lab`` (experiments, the proof
against the reference, benchmarks).  The core never imports ``lab``.
"""
from .comm import Ledger, ReduceOp, make_comm
from .parts.sharded_optimizer import ShardedOptimizer
from .run.launch import Rank, RankError, RankPool, run
from .run.train import Step, shard_step, train_step
from .stages import STAGES, make_stage

__version__ = "0.1.0"
__all__ = ["Ledger", "Rank", "RankError", "RankPool", "ReduceOp", "STAGES", "ShardedOptimizer", "Step", "make_comm", "make_stage",
           "run", "shard_step", "train_step"]
