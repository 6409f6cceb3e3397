"""Lesson 8's picture of ZeRO-2's backward says what the stage does: each bucket's full gradients are freed when
its reduce-scatter is queued, no full gradient outlives the step, only the shards remain after backward -- and
ddp-bucketed holds all its buckets throughout.  Bytes only: nothing here depends on how long anything took."""
from minizero.course.figures.zero2_backward import record_backward, summary
from minizero.course.harness.experiment import Experiment

EXP = Experiment(stage="zero2", task="gpt", model={"n_layer": 2}, optimizer="adamw", steps=1, dtype="float32",
                 check=False, options={"bucket_mb": 0.02})


def test_zero2_frees_each_bucket_at_its_launch_and_keeps_only_shards(pools):
    zero2 = pools.run(2, record_backward, EXP)
    ddp = pools.run(2, record_backward, Experiment(**{**EXP.__dict__, "stage": "ddp-bucketed"}))
    for z, d in zip(zero2, ddp, strict=True):
        s = summary(z, d)
        assert s["buckets"] >= 3 and s["all_freed_at_take"]  # every bucket taken in backward, its .grads gone
        assert [i for i, _ in z.launches] == list(range(s["buckets"]))  # in index order on every rank
        assert z.grad_bytes_after_backward() == z.shard_bytes  # only the averaged shards: 4Ψ/N, padding included
        # each packed copy is freed when its reduce-scatter has run: none is left once post_backward returns
        assert next(packed for _, _, packed, why in z.memory if why == "backward done") == 0
        assert z.memory[-1][2] == 0  # and none outlives the step
        assert s["zero2_grad_peak"] < 4 and s["ddp_min"] == s["ddp_max"] == 4  # ddp-bucketed: 4Ψ at every sample
