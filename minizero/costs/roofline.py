"""The compute-communication roofline of data parallelism: how many tokens a GPU must compute per step for its
arithmetic to take as long as the stage's communication -- and the batch size beyond which more data parallelism
stops paying at all.

**Arithmetic.**  Training a transformer costs about 6 FLOPs per parameter per token: 2 in the forward (a multiply
and an add per weight), 4 in the backward (the gradients of the activations and of the weights) -- Kaplan et al.
2020 (arXiv:2001.08361), section 2.1, leaving out the attention's 6 n_layer n_ctx d_model, small beside 6 Psi until
the context is long.  A GPU of peak P FLOP/s running at model FLOPs utilisation u (the share of the peak the model's
own FLOPs reach: Chowdhery et al. 2022, PaLM, arXiv:2204.02311, appendix B) computes T tokens of a step in
6 Psi T / (u P) seconds: 2 Psi T / (u P) of forward, 4 Psi T / (u P) of backward.

**Communication.**  A stage sends S bytes per rank per step (its own formula, ``Stage.sent_bytes_per_step``): on a
link of beta bytes/s per GPU, S / beta seconds (the bandwidth term; the latency term, 2(N - 1) alpha per ring, is
left out here: :mod:`minizero.costs.cost_model` has it).  Gradients are ready only during backward, so what DDP
sends hides behind 4 Psi T FLOPs at most:

    T >= S u P / (4 Psi beta),  for DDP's S = 2 (N - 1)/N Psi b:  T >= (N - 1)/N * b u P / (2 beta).

Psi cancels: the tokens a GPU needs depend on the hardware's ratio of FLOPs to bytes, not on the model.  ZeRO-3
sends 3 (N - 1)/N Psi b, 1.5x DDP's -- but a third of it (the forward's all-gather, prefetched) can hide behind the
forward's 2 Psi T: behind the whole step's 6 Psi T it needs exactly DDP's T.  ``tokens_to_hide`` gives both bounds.

**The critical batch size.**  Adding GPUs at a fixed T grows the global batch N T.  Beyond about the gradient noise
scale B_noise = tr(Sigma) / |G|^2 (Sigma the per-example gradients' covariance, G the true gradient) a larger batch
no longer cuts the steps a run needs in proportion: McCandlish et al. 2018 (arXiv:1812.06162), section 2.2.  Their
Appendix A.1 estimates the simple noise scale B_simple = tr(Sigma) / |G|^2 from gradients at two batch sizes -- what a
data-parallel step has for free: each rank's own gradient (batch b) and the averaged one (batch N b).
"""
from __future__ import annotations

from dataclasses import dataclass

#: FLOPs per parameter per token in a forward, a backward, and a whole training step (Kaplan et al. 2020).
FORWARD_FLOPS, BACKWARD_FLOPS = 2, 4
STEP_FLOPS = FORWARD_FLOPS + BACKWARD_FLOPS


def step_flops(psi: float, tokens: float) -> float:
    """FLOPs of a training step over ``tokens`` tokens: 6 Psi per token."""
    return STEP_FLOPS * psi * tokens


def compute_s(psi: float, tokens: float, peak_flops: float, mfu: float) -> float:
    """Seconds of arithmetic for ``tokens`` tokens on a GPU of ``peak_flops`` at utilisation ``mfu``."""
    return step_flops(psi, tokens) / (mfu * peak_flops)


def mfu(psi: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's own 6 Psi FLOPs per token at ``tokens_per_s``, over the peak."""
    return step_flops(psi, tokens_per_s) / peak_flops


@dataclass(frozen=True)
class Hide:
    """Tokens per GPU per step at which a stage's arithmetic takes as long as its communication: with all of it
    behind the backward (``backward``), and behind the whole step (``step``: a stage that also overlaps the forward
    -- ZeRO-3's prefetched gathers).  Fewer tokens than these, and communication shows in the step time."""

    sent_bytes: float
    backward: float
    step: float


def tokens_to_hide(stage, psi: float, world_size: int, bandwidth: float, peak_flops: float, mfu: float,
                   grad_bytes: int = 2, param_bytes: int = 2, **options) -> Hide:
    """:class:`Hide` for ``stage`` (a stage class: its own bytes formula) on a link of ``bandwidth`` bytes/s per GPU."""
    sent = stage.sent_bytes_per_step(psi, world_size, grad_bytes, param_bytes, **options)
    def tokens_at(flops_per_parameter: float) -> float:
        """Tokens the GPU computes while the bytes travel, at c FLOPs per parameter per token: (S / beta) u P / (c Psi)."""
        return sent / bandwidth * mfu * peak_flops / (flops_per_parameter * psi)

    return Hide(sent, tokens_at(BACKWARD_FLOPS), tokens_at(STEP_FLOPS))


@dataclass(frozen=True)
class NoiseScale:
    """McCandlish et al.'s estimates from gradients at two batch sizes (Appendix A.1): ``true_norm2`` the unbiased
    |G|^2, ``trace`` the unbiased tr(Sigma), and ``simple`` their ratio B_simple (examples per step)."""

    true_norm2: float
    trace: float

    @property
    def simple(self) -> float:
        return self.trace / self.true_norm2 if self.true_norm2 > 0 else float("inf")


def noise_scale(small_norm2: float, big_norm2: float, b_small: float, b_big: float) -> NoiseScale:
    """From E|G_B|^2 = |G|^2 + tr(Sigma)/B at two batch sizes: ``small_norm2`` the mean squared norm of gradients
    over ``b_small`` examples (each rank's own), ``big_norm2`` that over ``b_big`` (the ranks' average)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"the two batch sizes must be 0 < small < big, got {b_small} and {b_big}")
    true_norm2 = (b_big * big_norm2 - b_small * small_norm2) / (b_big - b_small)
    trace = (small_norm2 - big_norm2) / (1 / b_small - 1 / b_big)
    return NoiseScale(true_norm2, trace)
