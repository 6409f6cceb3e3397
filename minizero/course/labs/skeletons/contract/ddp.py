"""Lab 3 -- DDP's gradient synchronisation (lessons/03_ddp_allreduce.ipynb).

Contract level: the method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab ddp FILE --level guided``.)

You write ``DDP.post_backward`` -- the one idea of DDP.  Your base, ``minizero.course.labs.given.DDP``, is the
package's DDP stage without it: wrapping (rank 0's parameters broadcast to every rank), the hook that calls
``post_backward`` once a synchronising backward has finished (not inside ``no_sync()``), and ``step`` (the
user's optimizer, identically on every rank).  Any part of minizero is yours to use.

The state the contract speaks of: ``self.module`` (the model), ``self.comm`` (this rank's Comm: every
collective of the stage goes through it -- the byte ledger counts what it sends; the ranks' collectives pair
up in the order they are called), ``self.find_unused_parameters`` (the option of that name), ``self.wire``
(the wire gradients are averaged over: None unless compression or a mixed-precision reduce dtype is on; a
collective that averages takes it as ``wire=``, with ``key=`` naming the buffer), ``self.rank``,
``self.world_size`` (N).

What the stage promises: after every optimizer step every rank's parameters and optimizer states equal those
of one device trained on the global batch -- every rank's micro-batches in rank order, the loss averaged over
all of them.  Replicas that start equal and apply the same update stay equal; the update is one device's when
it uses the *mean* of the ranks' gradients.

The checker's properties, in order:
  1. your methods are what runs: post_backward is defined in this file and called during a step;
  2. equivalence to single-device training, every parameter after every step, on drawn examples: world sizes 1-4,
     K = 1-3 micro-batches (the first K-1 inside no_sync()), uneven batches (a rank may have no sample),
     SGD/momentum/Adam, float64 (relative error <= 1e-9) and float32 (<= 1e-5), two param groups, clipping, the edge
     model (frozen, unused with find_unused_parameters, zero-size and tied parameters), backwards inside and outside
     no_sync() in every order (their averages add), the routed model (a branch used by some ranks' micro-batches
     only, or by none), the optimizer built before or after wrapping;
  3. bytes per step: each rank sends what one ring all-reduce of every gradient sends, 2(N-1)/N x Psi x b (Psi
     trainable parameters of b bytes each), as all-reduces only -- at N = 2 and 3; under the fp16 and int8 wires
     (``compress=``) each rank's bytes in each step equal the package's stage's: a collective that averages
     gradients without the stage's ``wire=self.wire`` sends them at full width.  The number of messages is not
     judged: one all-reduce per parameter passes, and pays the ring's latency once per parameter (the package's
     answer packs one buffer per dtype: one message per ring step).

Check it:   python -m minizero check ddp --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import DDP as GivenDDP


class DDP(GivenDDP):
    def post_backward(self) -> None:
        """Runs once per synchronising backward, on every rank, after the whole backward.

        Before: each trainable parameter (``requires_grad``; a tied one once) has as ``.grad`` this rank's
        gradient, summed over the micro-batches since the last synchronisation -- or None if it got none here.
        After, on every rank alike:
          * every trainable parameter that has a ``.grad`` on some rank holds the mean over the N ranks of their
            ``.grad`` (a rank without one counts zeros): the gradient of the mean loss over the global batch;
          * a parameter with a ``.grad`` on no rank keeps ``.grad = None`` (the optimizer skips it, as on one
            device).  Which parameters have one anywhere, the ranks must agree on when
            ``self.find_unused_parameters`` is set; without it every trainable parameter has a ``.grad`` on
            every rank (the package's stage raises, naming it, when one does not);
          * cost: every gradient element crosses the ring once as part of an all-reduce -- 2(N-1)/N x Psi x b
            bytes -- in few messages (one per dtype, not one per parameter: latency is paid per message).
        """
        raise NotImplementedError("write DDP.post_backward: every .grad the mean over ranks")
