"""Gradients a step must not take: ones that were never averaged across ranks.

Two ways to get them, both silent in a loop that does not look: backward passes inside ``no_sync()`` only, and a
backward that raised part-way (an out-of-memory error, say) and was caught -- its queued synchronisation never
ran, though the buckets it had filled were launched.  Stepping on either lets the replicas drift apart with no
error anywhere, so :meth:`Stage.step` refuses, and keeps refusing until ``zero_grad()`` (a caught refusal
followed by a second ``step()`` must not slip through).
"""
from __future__ import annotations


def let_go_of_a_failed_backward(stage) -> bool:
    """A backward that raised part-way never ran its queued synchronisation, but the buckets it had filled were
    launched and may still be writing into the gradient buffers: wait for them before anything (zero_grad, a
    forward, a step) touches those buffers again, and forget what it marked.  True if there was one."""
    if not stage._sync_queued:
        return False
    stage._sync_queued = False
    stage._used.clear()
    if stage.pipeline is not None:
        stage.pipeline.abandon()
    return True


def refuse_unsynchronised_step(stage) -> None:
    """Raise if ``stage``'s gradients were never (or only partly) averaged; the message says what to do."""
    if stage.comm is None:  # the reference: there is nothing to average
        return
    if stage._failed_backward:
        raise RuntimeError(
            f"rank {stage.rank}: step() after a backward that raised part-way or at its end: its gradients were "
            f"only partly averaged across ranks (the buckets launched before the error), or hold an inf/NaN, so "
            f"stepping on them would let the replicas drift apart. Call zero_grad() and run the step's forward and "
            f"backward again.")
    if stage._local_grads:
        raise RuntimeError(
            f"rank {stage.rank}: step() after backward passes inside no_sync() only: those gradients were "
            f"never averaged across ranks, so the replicas would drift apart silently. Run the last "
            f"micro-batch of each step outside no_sync() (train_step does), or call zero_grad() first"
            + (" -- synchronisation is still off (require_backward_grad_sync is False) outside any no_sync() "
               "block: a no_sync() that does not put back the value it found leaves it so"
               if not stage.require_backward_grad_sync else "") + ".")


def no_optimizer_error(rank: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"rank {rank}: stage.{what}() needs the optimizer the stage was wrapped with, and this one was wrapped "
        f"without. Call {what}() on the optimizer you built over stage.parameters(), or pass yours to "
        f"make_stage(name, model, optimizer, comm).")
