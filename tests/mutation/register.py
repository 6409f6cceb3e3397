"""The mutants: single realistic bugs in every module, and the part of the suite that must catch each.

A patch mutant replaces one function or method (``"module:Class.attr"``) by a broken copy -- in the test
process and in every rank (``conftest.Pools.patched`` calls :func:`apply` and :func:`undo`).  Some are wrong in
value; others right in value but wrong in *cost* -- bytes sent, memory held, overlap lost -- and only a test
that measures the cost can catch them.  ``test_mutants.py`` applies each and requires its catch to fail by an
assertion, or by the named error its entry expects (``expect=``): a crash is not a catch.

Broken *stages* (whole classes) live in the package, :mod:`minizero.course.labs.mistakes`, where the labs' checker also
uses them to name a learner's mistake; the very property that passes for the real stage must catch each.
"""
from __future__ import annotations

from minizero.course.labs.mistakes import HOOK_MUTANTS, MISTAKE_STAGES, ZERO_MUTANTS
from minizero.course.labs.mistakes import MUTANTS as DDP_MUTANTS
from minizero.parts.precision import Precision
from minizero.run.launch import RankError
from tests.mutation import STALL, Expected, Mutant, broken_clip_and_state, broken_comm, broken_training, patch, unpatch
from tests.mutation.catches import (
    comm_catch,
    dropout_resume_catch,
    import_catch_modules,
    property_catch,
    test_catch,
    tied_weight_owner_catch,
)

#: The broken stages, by name (a registry the experiments take as ``stages=``), and the names the property must catch.
MUTANT_STAGES = MISTAKE_STAGES
STAGE_MUTANTS = sorted({**DDP_MUTANTS, **HOOK_MUTANTS, **ZERO_MUTANTS})

FAULTS, KEPT, CLIP = "test_faults", "test_wrapped_optimizer_state", "test_clip_and_dropout_resume"
B, Z, Z3, SEM, BAD, L = "test_bucketed", "test_zero", "test_zero3", "test_optimizer_semantics", "test_bad_input", \
    "test_launch"

#: The old launcher's verdict: the run was stopped at a deadline, healthy or not.
DEADLINE = Expected(RankError, "did not finish within the timeout", "the launcher stopped a healthy run that must complete")

MUTANTS: dict[str, Mutant] = {
    # comm: the collectives, their bytes, their fingerprints
    "ring: reduce-scatter forgets its own chunk": Mutant("minizero.comm.ring:RingComm._ring_reduce_scatter",
                                                         broken_comm.rs_forgets_own_chunk, comm_catch),
    "ring: all-gather one step short": Mutant("minizero.comm.ring:RingComm._ring_all_gather",
                                              broken_comm.ag_one_step_short, comm_catch),
    "ring: AVG reduce-scatter not divided": Mutant("minizero.comm.ring:RingComm.reduce_scatter",
                                                   broken_comm.rs_avg_not_divided, comm_catch),
    "ring: broadcast ignores src": Mutant("minizero.comm.ring:RingComm.broadcast", broken_comm.broadcast_from_zero, comm_catch),
    "ring: all-reduce through a root": Mutant("minizero.comm.ring:RingComm.all_reduce", broken_comm.all_reduce_through_root,
                                              test_catch("test_comm", "test_ring_all_reduce_sends_2_n_minus_1_over_n", 3),
                                              cost=True),
    "ring: sends unreported to the ledger": Mutant("minizero.comm.ring:RingComm._send_right_recv_left",
                                                   broken_comm.p2p_unreported, comm_catch, cost=True),
    "native: byte model ignores uneven chunks": Mutant("minizero.comm.native:ring_messages",
                                                       broken_comm.modelled_bytes_ignore_uneven_chunks, comm_catch, cost=True),
    "fingerprint: tag left out": Mutant("minizero.comm.fingerprint:encode", broken_comm.fingerprint_without_tag,
                                        test_catch(B, "test_no_sync_on_some_ranks_is_caught_at_the_first_bucket")),
    "comm: goes on after a collective failed part-way": Mutant(
        "minizero.comm.base:Comm._run", broken_comm.keeps_going_after_failure,
        test_catch(FAULTS, "test_a_failed_rank_ends_the_run_naming_it", "raise", "bucket")),
    # the launcher and the watchdog
    "stall: blames the rank that waits": Mutant("minizero.comm.stall:blame", broken_comm.blames_the_waiter,
                                                test_catch(L, "test_stall_names_the_rank_that_stopped_not_the_one_that_waits")),
    "board: progress only at entry": Mutant("minizero.comm.progress:ProgressBoard._set", broken_comm.progress_only_at_entry,
                                            test_catch(L, "test_a_slow_collective_that_keeps_moving_is_not_a_stall"),
                                            expect=(STALL,)),
    "pool: the timeout bounds the run": Mutant("minizero.run.launch:RankPool.run", broken_comm.run_with_a_deadline,
                                               test_catch(L, "test_a_healthy_run_longer_than_the_timeout_completes"),
                                               expect=(DEADLINE,)),
    "pool: swallows a rank's exception": Mutant("minizero.run.launch:RankPool.run", broken_comm.swallows_errors,
                                                test_catch(L, "test_exception_names_rank_and_carries_traceback")),
    # buckets
    "buckets: registration order": Mutant("minizero.stages.ddp_bucketed:assign_buckets", broken_training.buckets_in_registration_order,
                                          test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                          cost=True),
    "buckets: cap in elements": Mutant("minizero.stages.ddp_bucketed:assign_buckets", broken_training.cap_in_elements,
                                       test_catch(B, "test_grads_are_views_into_buckets_and_buckets_start_during_backward"),
                                       cost=True),
    "buckets: launched when any gradient is ready": Mutant("minizero.parts.buckets:ReadyOrder.mark", broken_training.launch_when_any_ready,
                                                           test_catch(B, "test_a_bucket_is_sent_only_when_all_its_gradients_are_final")),
    # compression
    "compress: divide by N before the cast": Mutant("minizero.compress.sixteen_bit:split_division", broken_training.divide_by_n_first,
                                                    property_catch("ddp", compress=True, backends=("ring",))),
    "compress: error feedback of the wrong sign": Mutant(
        "minizero.compress.sixteen_bit:Wire.encode", broken_training.feedback_of_wrong_sign,
        property_catch("ddp-bucketed", compress=True, backends=("ring",), examples=60)),
    "compress: no overflow check": Mutant("minizero.compress.sixteen_bit:Wire.decode", broken_training.no_overflow_check,
                                          test_catch("test_compression", "test_fp16_overflow_is_reported_and_weights_untouched")),
    "compress: sends fp32": Mutant("minizero.compress.sixteen_bit:Wire.encode", broken_training.no_cast,
                                   test_catch("test_compression", "test_compressed_bytes_are_half", "ddp", "fp16")),
    # layout and the sharded optimizer
    "powersgd: Q not divided by N": Mutant("minizero.compress.powersgd:power_step", broken_training.powersgd_q_not_averaged,
                                           test_catch("test_oracle", "test_powersgd_matches_torch_powersgd_hook", 2,
                                                      "powersgd:rank=1,start=2", True)),
    "powersgd: warm start forgotten": Mutant("minizero.compress.powersgd:PowerState.keep", broken_training.powersgd_cold_start,
                                             test_catch("test_oracle", "test_powersgd_matches_torch_powersgd_hook", 2,
                                                        "powersgd:rank=1,start=2", True)),
    "powersgd: factors not all-reduced": Mutant("minizero.compress.powersgd:PowerSGDWire._sum",
                                                broken_training.powersgd_nothing_summed,
                                                test_catch("test_powersgd", "test_powersgd_on_a_gpt_matches_its_reference",
                                                           "ddp-bucketed", 3)),
    "qwZ: the owner's shard kept exact": Mutant("minizero.compress.weights:QuantizedWeights.all_gather",
                                                broken_training.qwz_own_shard_exact,
                                                test_catch("test_quantized_weights",
                                                           "test_a_gpt_with_int8_weights_matches_its_reference", 2)),
    "qgZ: a shard's message to the wrong rank": Mutant("minizero.compress.gathered:split", broken_training.split_rotated,
                                                       test_catch("test_codecs", "test_fixed_cases_match_their_references", 3, "zero2",
                                                                  "int8:block=64")),
    "layout: pieces one element short": Mutant("minizero.parts.layout:FlatGroup._cut_pieces", broken_training.pieces_one_short,
                                               property_catch("zero1")),
    "optimizer: zero gradient instead of None": Mutant("minizero.stages.zero:ZeRO.accumulate", broken_training.zero_grads_for_unused,
                                                       test_catch(SEM, "test_a_parameter_without_a_gradient_is_not_stepped", "zero2", "c unused",
                                                                  "stage.zero_grad()")),
    "optimizer: state consolidated at the wrong offset": Mutant("minizero.parts.optimizer_state:_gather_element_state",
                                                                broken_training.state_at_the_parameters_offset, property_catch("zero2")),
    "optimizer: state given at wrap dropped": Mutant("minizero.parts.sharded_optimizer:keep_state",
                                                     broken_clip_and_state.drops_the_state,
                                                     test_catch(KEPT, "test_state_given_at_wrap_is_kept_and_training_goes_on",
                                                                "zero2", "adamw", 3, "mlp")),
    "precision: masters' optimizer starts empty": Mutant("minizero.stages.mixed:keep_state", broken_clip_and_state.drops_the_state,
                                                         test_catch(KEPT, "test_mixed_precision_keeps_the_state_in_its_masters",
                                                                    "ddp", Precision("bf16"))),
    # clipping: the coefficient max_norm / (norm + eps) capped at 1 -- only a max_norm above the norm tells
    "clip: sharded coefficient not capped at 1": Mutant("minizero.stages.clip:clip_sharded_grad_norm_",
                                                        broken_clip_and_state.sharded_clip_uncapped, property_catch("zero2")),
    "clip: by hand, not capped at 1": Mutant("minizero.stages.base:Stage.clip_grad_norm_",
                                             broken_clip_and_state.clip_by_hand_uncapped,
                                             test_catch(CLIP, "test_clipping_is_torch_s_on_both_sides_of_the_norm", "ddp",
                                                        "never clips", (1e6, 2.0))),
    # checkpoints: each rank's generator, which dropout draws from
    "checkpoint: no rank's own generator saved": Mutant("minizero.checkpoint:_rng_state", broken_clip_and_state.no_rank_rng,
                                                        dropout_resume_catch("zero3")),
    # the stages
    "ddp: packs whatever has a gradient": Mutant("minizero.stages.ddp:DDP._with_gradient", broken_training.ddp_packs_what_exists,
                                                 test_catch(BAD, "test_parameters_used_on_some_ranks_only_are_named",
                                                            "ddp", 2)),
    # (The property reads parameters through full_state_dict, which re-shares a shard stepped since the last
    # all-gather: only a read straight from the module, as a user does after step(), sees the stale shards.)
    "zero1: all-gathers before stepping": Mutant("minizero.stages.zero1:ZeRO1.step", broken_training.zero1_gathers_before_stepping,
                                                 test_catch(SEM, "test_whichever_zero_grad_the_user_calls_training_equals_torch",
                                                            "zero1", "stage.zero_grad()")),
    "zero2: keeps the full gradients": Mutant("minizero.stages.zero2:ZeRO2.deferred_reduce_scatter", broken_training.zero2_keeps_full_gradients,
                                              test_catch(Z, "test_measured_memory_matches_the_formula", 3, "zero2"),
                                              cost=True),
    "zero3: never reshards after forward": Mutant("minizero.stages.zero3:ZeRO3.unit_post_forward", broken_training.zero3_never_reshards,
                                                  test_catch(Z3, "test_bytes_are_one_and_a_half_ddps_with_resharding",
                                                             3, True), cost=True),
    "zero3: keeps prefetches across the step": Mutant("minizero.parts.units:Unit.drop_prefetch",
                                                      broken_training.zero3_keeps_prefetches,
                                                      test_catch(Z3, "test_a_prefetch_left_from_the_last_forward_is_dropped_at_the_step")),
    "zero3: tied weight in the first unit": Mutant("minizero.parts.unit_plan:assign_parameters", broken_training.tied_weight_in_first_unit,
                                                   tied_weight_owner_catch),
    "zero: no bitmap for unused parameters": Mutant("minizero.stages.base:Stage.used_anywhere", broken_training.agrees_on_nothing,
                                                    test_catch(SEM, "test_a_parameter_without_a_gradient_is_not_stepped",
                                                               "zero1", "c on rank 1", "stage.zero_grad()")),
    "stage: steps on local gradients after no_sync": Mutant("minizero.stages.base:Stage.stepping",
                                                            broken_training.steps_on_local_gradients,
                                                            test_catch(SEM, "test_step_after_no_sync_only_is_refused", "ddp")),
    # the one training loop
    "loop: scaled by 1 / global count": Mutant("minizero.course.harness.experiment:train_step",
                                               broken_training.loop(lambda stage, step: 1 / step.global_count), property_catch("ddp")),
    "loop: no zero_grad between steps": Mutant("minizero.course.harness.experiment:train_step", broken_training.loop(broken_training.right_scale, clear=False),
                                               test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: every micro-batch synchronises": Mutant("minizero.course.harness.experiment:train_step", broken_training.loop(broken_training.right_scale, sync_every=True),
                                                   test_catch("test_ddp_equivalence",
                                                              "test_ddp_syncs_once_per_optimizer_step_under_accumulation"),
                                                   cost=True),
    "loop: clips after the step": Mutant("minizero.course.harness.experiment:train_step", broken_training.loop(broken_training.right_scale, clip_after=True),
                                         test_catch("test_train_loop", "test_the_reference_is_plain_torch_training")),
    "loop: rank slice off by one": Mutant("minizero.course.harness.experiment:shard_step", broken_training.shard_step_off_by_one,
                                          property_catch("ddp")),
    # the 16-bit wire: an overflow that exists only in the sum (issue 46)
    "fp16 wire: overflow checked on each rank's values, not the sum": Mutant(
        "minizero.compress.sixteen_bit:Wire.encode", broken_comm.sixteen_bit_checks_each_ranks_values,
        test_catch("test_compression", "test_an_overflow_that_exists_only_in_the_sum_is_refused")),
    # an inf only one rank sees: its shard of a reduce-scatter (issue 46)
    "sharded wire: an inf in one rank's shard raised by that rank alone": Mutant(
        "minizero.compress.overflow:defer", broken_comm.raises_alone,
        test_catch("test_robustness", "test_an_overflow_in_one_ranks_shard_is_refused_on_every_rank", "zero2",
                   {"bucket_mb": 1e-9}, 2, "fp16")),
    "wire: goes on after its steps failed part-way": Mutant(
        "minizero.comm.collective:_over_wire", broken_comm.over_wire_goes_on,
        test_catch("test_faults", "test_a_wire_that_raises_on_one_rank_ends_the_run_naming_that_rank_and_its_error",
                   "zero2", "topk:0.5")),
    "buckets: a failed bucket raised mid-backward, where the launch waited for it": Mutant(
        "minizero.parts.buckets:BucketPipeline._launch", broken_comm.launch_raises_the_oldest,
        test_catch("test_bucketed", "test_a_failed_bucket_surfaces_in_wait_all_whatever_the_timing", "still running")),
    # DiLoCo against a one-process replay of the paper's update (issue 46)
    "diloco: heavy-ball outer momentum, not Nesterov's": Mutant(
        "minizero.stages.local_sgd:LocalSGD.average", broken_training.diloco_heavy_ball,
        test_catch("test_contrast_stages", "test_diloco_equals_a_one_process_replay_of_the_papers_update", True)),
    # randomness in a replay path: activation checkpointing with dropout (issue 46)
    "checkpointing: the replay draws new dropout masks": Mutant(
        "minizero.parts.activations:_checkpointed", broken_training.checkpoint_forgets_the_rng,
        test_catch("test_activation_checkpointing", "test_a_replayed_block_draws_the_same_dropout_mask_as_its_forward")),
    # a codec spec's settings
    "codec spec: a switch read loosely": Mutant("minizero.compress.codec:switch", broken_training.switch_read_loosely,
                                                test_catch("test_codecs",
                                                           "test_a_switch_in_a_spec_is_read_strictly_and_echoed_as_built")),
    # the comparison itself
    "compare: NaN counted as no difference": Mutant("minizero.course.harness.equivalence:parameter_errors", broken_training.nan_errors_pass_through,
                                                    test_catch("test_cli",
                                                               "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
    "equivalence: NaN counted as no difference": Mutant("minizero.course.harness.equivalence:max_diff", broken_training.max_diff_ignores_nan,
                                                        test_catch("test_cli", "test_a_nan_difference_is_an_infinite_one")),
    "compare: non-finite values not looked for": Mutant("minizero.course.harness.equivalence:first_nonfinite", broken_training.nothing_is_nonfinite,
                                                        test_catch("test_cli",
                                                                   "test_a_diverging_run_is_a_failure_never_a_zero_difference")),
}


_ORIGINALS: dict[str, object] = {}


def apply(name: str) -> None:
    _ORIGINALS[name] = patch(MUTANTS[name])


def undo(name: str) -> None:
    unpatch(MUTANTS[name], _ORIGINALS.pop(name))


import_catch_modules()
