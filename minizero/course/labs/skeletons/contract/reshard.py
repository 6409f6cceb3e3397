"""Lab reshard -- a ZeRO checkpoint saved by N ranks, loaded by M (lessons/12_training_runs.ipynb, its end).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says how: ``python -m minizero lab reshard FILE --level guided``.)

A ZeRO checkpoint in DeepSpeed's layout holds, per rank, what the rank owns: for each flat group (the
parameters of one param group laid end to end, ``numel`` elements, padded with zeros to a multiple of the world
size), the rank's shard of it and the optimizer's state for that shard.  It fits only the N ranks that wrote it.
You write the conversion to M ranks.  Your base, ``minizero.course.labs.given.Reshard``, is the package's resharder
without its two methods; its ``reshard_all(saved, world_size, rank)`` calls your ``reshard`` once per flat group.

A shard is a ``FlatShard(rank, world_size, numel, values, state)``: rank ``rank`` of
``world_size`` ranks, a group of ``numel`` elements; ``values``, its shard of the padded flat parameters;
``state``, the optimizer's -- Adam's ``exp_avg`` and ``exp_avg_sq`` (per element, cut like ``values``) and
``step`` (a 0-dim tensor: the count of steps taken, the same for every element).

The checker's properties, in order:
  1. your methods are what runs: both are defined in this file and called while a rank builds its shards;
  2. every rank's new shard holds exactly its range: the package's ZeRO-1 trains an MLP with Adam(W) on N ranks
     (drawn 1-4, 3 included; groups of sizes that rarely divide by N or M) and saves; each of M ranks (drawn
     1-4) builds its shards -- parameters, exp_avg, exp_avg_sq, step -- and each must equal, element for
     element, its range of the flat group laid out at M, zeros in the padding;
  3. resumed on M ranks: the shards loaded into a fresh ZeRO-1 at M ranks, training goes on exactly as
     single-device training on the same global batch (float64, to 1e-9: every parameter and every optimizer
     state after every step).

Check it:   python -m minizero check reshard --impl THIS_FILE
"""
from __future__ import annotations

from minizero.checkpoint.flat import FlatShard
from minizero.course.labs.given import Reshard as GivenReshard


class Reshard(GivenReshard):
    def owned_range(self, numel: int, world_size: int, rank: int) -> tuple[int, int]:
        """``(start, stop)``: the range of a flat group of ``numel`` elements, padded to a multiple of
        ``world_size``, that rank ``rank`` owns -- the rank-th of ``world_size`` equal shards."""
        raise NotImplementedError("write Reshard.owned_range: [start, stop) of the padded flat buffer that the "
                                  "rank owns at this world size")

    def reshard(self, saved: list[FlatShard], world_size: int, rank: int) -> FlatShard:
        """One flat group: ``saved[k]`` is the shard rank k of N saved (all N of them, in rank order).  Returns rank
        ``rank`` of ``world_size``'s shard of the same group, as the saving ranks would have held it had they
        been ``world_size``: values and every per-element state its range (from ``owned_range``), zeros past
        ``numel``; a 0-dim state the same as the saved shards'.  The saved shards are only read.
        """
        raise NotImplementedError("write Reshard.reshard: this rank's shard of the group at the new world size, "
                                  "from the N saved shards")
