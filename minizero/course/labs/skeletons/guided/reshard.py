"""Lab reshard -- a ZeRO checkpoint saved by N ranks, loaded by M (lessons/12_training_runs.ipynb, its end).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

A ZeRO checkpoint in DeepSpeed's layout holds what each rank owned: for each flat group (one param group's
parameters end to end, padded with zeros to a multiple of N), its shard and the optimizer's state for exactly
that shard.  It fits only the N that wrote it; write the conversion to M ranks (DeepSpeed's ``ds_to_universal``
does it through files).  Given: ``reshard_all``, which calls your ``reshard`` once per flat group; the saving and
the loading.

Check it:   python -m minizero check reshard --impl THIS_FILE
(or, in a notebook:  from minizero.course.labs import check; check("reshard", impl="THIS_FILE"))
The checker trains ZeRO-1 on N ranks and saves; builds each of M ranks' shards with your class and compares
them, element for element, with the ranges they must hold (N and M drawn from 1-4, 3 included); then loads them,
trains on, and compares every step with single-device training.
"""
from __future__ import annotations

from minizero.checkpoint.flat import FlatShard
from minizero.course.labs.given import Reshard as GivenReshard


class Reshard(GivenReshard):
    def owned_range(self, numel: int, world_size: int, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the flat group that rank ``rank`` of ``world_size`` owns.

        The group's ``numel`` elements are padded with zeros to the next multiple of ``world_size``, then cut
        into ``world_size`` equal shards; rank r owns the r-th.  (``minizero.parts.layout`` has the padding rule.)
        """
        raise NotImplementedError("write Reshard.owned_range: [start, stop) of the padded flat buffer that the "
                                  "rank owns at this world size")

    def reshard(self, saved: list[FlatShard], world_size: int, rank: int) -> FlatShard:
        """Rank ``rank`` of ``world_size``'s shard of one flat group, from ``saved``: the N shards it was saved as,
        rank k's at ``saved[k]``.

        Each ``FlatShard`` has ``numel`` (the group's real elements), ``values`` (the shard of the parameters,
        padding included) and ``state`` (Adam's ``exp_avg`` and ``exp_avg_sq``, one value per element like
        ``values``, and ``step``, a 0-dim count).  Lay the N shards of a tensor end to end: that is the padded flat
        group at N; drop what is past ``numel`` and you have the group itself, whatever N was.  Cut your range of it
        at ``world_size`` (``owned_range``), padding the last shards with zeros to the full shard size.  Do the
        same for each per-element state; a 0-dim one is not cut -- every shard holds the whole count.  Return a
        new ``FlatShard(rank, world_size, numel, values, state)``; leave the saved ones as they are.
        """
        raise NotImplementedError("write Reshard.reshard: this rank's shard of the group at the new world size, "
                                  "from the N saved shards")
