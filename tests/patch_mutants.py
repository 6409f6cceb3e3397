"""Single realistic bugs in every module, and the part of the suite that must catch each.

A mutant replaces one function or method (``"module:Class.attr"``) by a broken
copy -- in the test process and in every rank (see ``Pools.patched``).  Some
are wrong in value; others right in value but wrong in *cost* -- bytes sent,
memory held, overlap lost -- and only a test that measures the cost can catch
them.  ``test_mutants.py`` applies each and requires its catch to fail.
Broken *stages* (classes) live in ``mutants.py``.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from minizero.precision import Precision
from tests import clip_and_state_bugs, comm_bugs, training_bugs
from tests.mutation import Mutant, comm_catch, import_catch_modules, patch, property_catch, test_catch, unpatch

FAULTS, KEPT, CLIP = "test_faults", "test_wrapped_optimizer_state", "test_clip_and_dropout_resume"
B, Z, Z3, SEM, BAD, L = "test_bucketed", "test_zero", "test_zero3", "test_optimizer_semantics", "test_bad_input", \
    "test_launch"

def dropout_resume_catch(stage: str):
    """The dropout resume test of ``stage``, in a directory of its own (the test takes pytest's tmp_path)."""
    test_catch(CLIP, "test_resume_with_dropout_is_bit_exact")  # its module imported before any pool forks

    def catch(pools):
        with tempfile.TemporaryDirectory() as directory:
            test_catch(CLIP, "test_resume_with_dropout_is_bit_exact", Path(directory), stage)(pools)
    return catch


MUTANTS: dict[str, Mutant] = {
    # comm: the collectives, their bytes, their fingerprints
    "ring: reduce-scatter forgets its own chunk": Mutant("minizero.comm.ring:RingComm._ring_reduce_scatter",
                                                         comm_bugs.rs_forgets_own_chunk, comm_catch),
    "ring: all-gather forwards the wrong chunk": Mutant("minizero.comm.ring:RingComm._ring_all_gather",
                                                        comm_bugs.ag_forwards_wrong_chunk, comm_catch),
    "ring: AVG reduce-scatter not divided": Mutant("minizero.comm.ring:RingComm.reduce_scatter",
                                                   comm_bugs.rs_avg_not_divided, comm_catch),
    "ring: broadcast ignores src": Mutant("minizero.comm.ring:RingComm.broadcast", comm_bugs.broadcast_from_zero, comm_catch),
    "ring: all-reduce through a root": Mutant("minizero.comm.ring:RingComm.all_reduce", comm_bugs.all_reduce_through_root,
                                              test_catch("test_comm", "test_ring_all_reduce_sends_2_n_minus_1_over_n", 3),
                                              cost=True),
    "ring: sends unreported to the ledger": Mutant("minizero.comm.ring:RingComm._send_right_recv_left",
                                                   comm_bugs.p2p_unreported, comm_catch, cost=True),
    "native: byte model ignores uneven chunks": Mutant("minizero.comm.native:ring_messages",
                                                       comm_bugs.modelled_bytes_ignore_uneven_chunks, comm_catch, cost=True),
    "fingerprint: tag left out": Mutant("minizero.comm.fingerprint:encode", comm_bugs.fingerprint_without_tag,
                                        test_catch(B, "test_no_sync_on_some_ranks_is_caught_at_the_first_bucket")),
    "comm: goes on after a collective failed part-way": Mutant(
        "minizero.comm.base:Comm._run", comm_bugs.keeps_going_after_failure,
        test_catch(FAULTS, "test_a_failed_rank_ends_the_run_naming_it", "raise", "bucket")),
    # the launcher and the watchdog
    "stall: blames the rank that waits": Mutant("minizero.comm.stall:blame", comm_bugs.blames_the_waiter,
                                                test_catch(L, "test_stall_names_the_rank_that_stopped_not_the_one_that_waits")),
    "board: progress only at entry": Mutant("minizero.comm.progress:ProgressBoard._set", comm_bugs.progress_only_at_entry,
                                            test_catch(L, "test_a_slow_collective_that_keeps_moving_is_not_a_stall")),
    "pool: the timeout bounds the run": Mutant("minizero.launch:RankPool.run", comm_bugs.run_with_a_deadline,
                                               test_catch(L, "test_a_healthy_run_longer_than_the_timeout_completes")),
    "pool: swallows a rank's exception": Mutant("minizero.launch:RankPool.run", comm_bugs.swallows_errors,
                                                test_catch(L, "test_exception_names_rank_and_carries_traceback")),
    # buckets
    "buckets: registration order": Mutant("minizero.stages.ddp_bucketed:assign_buckets", training_bugs.buckets_in_registration_order,
                                          test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                          cost=True),
    "buckets: cap in elements": Mutant("minizero.stages.ddp_bucketed:assign_buckets", training_bugs.cap_in_elements,
                                       test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                       cost=True),
    "buckets: launched when any gradient is ready": Mutant("minizero.buckets:ReadyOrder.mark", training_bugs.launch_when_any_ready,
                                                           test_catch(B, "test_a_bucket_is_sent_only_when_all_its_gradients_are_final")),
    # compression
    "compress: divide by N before the cast": Mutant("minizero.compress:split_division", training_bugs.divide_by_n_first,
                                                    property_catch("ddp", compress=True, backends=("ring",))),
    "compress: error feedback of the wrong sign": Mutant(
        "minizero.compress:Wire._to_wire", training_bugs.feedback_of_wrong_sign,
        property_catch("ddp-bucketed", compress=True, backends=("ring",), examples=60)),
    "compress: no overflow check": Mutant("minizero.compress:Wire._from_wire", training_bugs.no_overflow_check,
                                          test_catch("test_compression", "test_fp16_overflow_is_reported_and_weights_untouched")),
    "compress: sends fp32": Mutant("minizero.compress:Wire._to_wire", training_bugs.no_cast,
                                   test_catch("test_compression", "test_compressed_bytes_are_half", "ddp", "fp16")),
    # layout and the sharded optimizer
    "layout: pieces one element short": Mutant("minizero.layout:FlatGroup._cut_pieces", training_bugs.pieces_one_short,
                                               property_catch("zero1")),
    "optimizer: zero gradient instead of None": Mutant("minizero.stages.zero:ZeRO._accumulate", training_bugs.zero_grads_for_unused,
                                                       test_catch(SEM, "test_a_parameter_without_a_gradient_is_not_stepped", "zero2", "c unused",
                                                                  "stage.zero_grad()")),
    "optimizer: state consolidated at the wrong offset": Mutant("minizero.sharded_optimizer:_gather_element_state",
                                                                training_bugs.state_at_the_parameters_offset, property_catch("zero2")),
    "optimizer: state given at wrap dropped": Mutant("minizero.sharded_optimizer:keep_state",
                                                     clip_and_state_bugs.drops_the_state,
                                                     test_catch(KEPT, "test_state_given_at_wrap_is_kept_and_training_goes_on",
                                                                "zero2", "adamw", 3, "mlp")),
    "precision: masters' optimizer starts empty": Mutant("minizero.stages.base:keep_state", clip_and_state_bugs.drops_the_state,
                                                         test_catch(KEPT, "test_mixed_precision_keeps_the_state_in_its_masters",
                                                                    "ddp", Precision("bf16"))),
    # clipping: the coefficient max_norm / (norm + eps) capped at 1 -- only a max_norm above the norm tells
    "clip: sharded coefficient not capped at 1": Mutant("minizero.stages.zero:clip_sharded_grad_norm_",
                                                        clip_and_state_bugs.sharded_clip_uncapped, property_catch("zero2")),
    "clip: by hand, not capped at 1": Mutant("minizero.stages.base:Stage.clip_grad_norm_",
                                             clip_and_state_bugs.clip_by_hand_uncapped,
                                             test_catch(CLIP, "test_clipping_is_torch_s_on_both_sides_of_the_norm", "ddp",
                                                        "never clips", (1e6, 2.0))),
    # checkpoints: each rank's generator, which dropout draws from
    "checkpoint: no rank's own generator saved": Mutant("minizero.checkpoint:_rng_state", clip_and_state_bugs.no_rank_rng,
                                                        dropout_resume_catch("zero3")),
    # the stages
    "ddp: packs whatever has a gradient": Mutant("minizero.stages.ddp:DDP._with_gradient", training_bugs.ddp_packs_what_exists,
                                                 test_catch(BAD, "test_parameters_used_on_some_ranks_only_are_named",
                                                            "ddp", 2)),
    "zero1: all-gathers before stepping": Mutant("minizero.stages.zero1:ZeRO1._step", training_bugs.zero1_gathers_before_stepping,
                                                 property_catch("zero1")),
    "zero2: keeps the full gradients": Mutant("minizero.stages.zero2:ZeRO2._reduce_scatter", training_bugs.zero2_keeps_full_gradients,
                                              test_catch(Z, "test_measured_memory_matches_the_formula", 3, "zero2"),
                                              cost=True),
    "zero3: never reshards after forward": Mutant("minizero.stages.zero3:ZeRO3._after_forward", training_bugs.zero3_never_reshards,
                                                  test_catch(Z3, "test_bytes_are_one_and_a_half_ddps_with_resharding",
                                                             3, True), cost=True),
    "zero3: keeps prefetches across the step": Mutant("minizero.units:Unit.drop_prefetch",
                                                      training_bugs.zero3_keeps_prefetches,
                                                      test_catch(Z3, "test_a_prefetch_left_from_the_last_forward_is_dropped_at_the_step")),
    "zero3: tied weight in the first unit": Mutant("minizero.units:assign_parameters", training_bugs.tied_weight_in_first_unit,
                                                   test_catch(Z3, "test_weights_tied_across_units_under_uneven_sharding", 3)),
    "zero: no bitmap for unused parameters": Mutant("minizero.stages.synchronised:Synchronised._agree_on_use", training_bugs.agrees_on_nothing,
                                                    test_catch(SEM, "test_a_parameter_without_a_gradient_is_not_stepped",
                                                               "zero1", "c on rank 0", "stage.zero_grad()")),
    "stage: steps on local gradients after no_sync": Mutant("minizero.stages.synchronised:Synchronised.step",
                                                            training_bugs.steps_on_local_gradients,
                                                            test_catch(SEM, "test_step_after_no_sync_only_is_refused", "ddp")),
    # the one training loop
    "loop: scaled by 1 / global count": Mutant("minizero.lab.experiment:train_step",
                                               training_bugs.loop(lambda stage, step: 1 / step.global_count), property_catch("ddp")),
    "loop: no zero_grad between steps": Mutant("minizero.lab.experiment:train_step", training_bugs.loop(training_bugs.right_scale, clear=False),
                                               test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: every micro-batch synchronises": Mutant("minizero.lab.experiment:train_step", training_bugs.loop(training_bugs.right_scale, sync_every=True),
                                                   test_catch("test_ddp_equivalence",
                                                              "test_ddp_syncs_once_per_optimizer_step_under_accumulation"),
                                                   cost=True),
    "loop: clips after the step": Mutant("minizero.lab.experiment:train_step", training_bugs.loop(training_bugs.right_scale, clip_after=True),
                                         test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: rank slice off by one": Mutant("minizero.lab.experiment:shard_step", training_bugs.shard_step_off_by_one,
                                          property_catch("ddp")),
    # the comparison itself
    "compare: NaN counted as no difference": Mutant("minizero.lab.equivalence:parameter_errors", training_bugs.nan_errors_pass_through,
                                                    test_catch("test_cli",
                                                               "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
    "equivalence: NaN counted as no difference": Mutant("minizero.lab.equivalence:max_diff", training_bugs.max_diff_ignores_nan,
                                                        test_catch("test_cli", "test_a_nan_difference_is_an_infinite_one")),
    "compare: non-finite values not looked for": Mutant("minizero.lab.equivalence:first_nonfinite", training_bugs.nothing_is_nonfinite,
                                                        test_catch("test_cli",
                                                                   "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
}

_ORIGINALS: dict[str, object] = {}


def apply(name: str) -> None:
    _ORIGINALS[name] = patch(MUTANTS[name])


def undo(name: str) -> None:
    unpatch(MUTANTS[name], _ORIGINALS.pop(name))


import_catch_modules()
