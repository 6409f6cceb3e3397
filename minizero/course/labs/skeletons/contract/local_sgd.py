"""Lab local-sgd -- local SGD and DiLoCo's outer step (lessons/13_parameter_server_async_local_sgd.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab local-sgd FILE --level guided``.)

Every rank trains its own replica on its own data with its own optimizer -- nothing is synchronised after
backward -- and every H optimizer steps the ranks combine their parameters: plain local SGD averages them;
DiLoCo (``outer_lr`` given) treats the averaged change since the last combination as a gradient and steps an
outer Nesterov SGD with it.  You write ``LocalSGD.step`` (when) and ``LocalSGD.average`` (how).  Your base,
``minizero.course.labs.given``'s ``LocalSGD``, is the package's stage without them.

The state the contract speaks of (all given, on ``self``):
  * ``average_every``: H; ``steps_taken``: optimizer steps finished before this one (counted by ``stepping()``);
  * ``stepping()``: the context every stage's step runs in (refuses a step on gradients never synchronised,
    requires the optimizer, counts the step when it ends); ``optimizer_step()``: this rank's optimizer step;
  * ``trainable()``: the trainable parameters, ``(name, parameter)``, tied ones once, the same list on every rank;
  * ``comm``: the ranks' communication layer (``all_reduce(tensor, ReduceOp.AVG, tag=...)``), ``tag(what)``;
  * ``outer``: None for plain averaging, or DiLoCo's outer optimizer (torch SGD, Nesterov momentum, lr
    ``outer_lr``) over ``anchor`` -- one tensor per trainable parameter, in ``trainable()``'s order: the parameters
    as they were after the last combination (at first, as wrapped).

The checker's properties, in order:
  1. your methods are what runs: both defined here and called in a step (H = 1, K = 2);
  2. H = 1 with plain SGD is single-device training (mean_r(p - lr g_r) = p - lr mean_r(g_r)): world sizes 1-4,
     K up to 3, uneven and empty batches, the edge model, float64 and float32;
  3. every rank's parameters after every step equal the package's local SGD on the same run: H from 1 to 3,
     plain averaging and DiLoCo (outer lr 0.7 with momentum 0.9, 1.0 with none, 0.5 with 0.5), SGD, momentum and
     Adam -- the replicas agree right after each combination, and only then;
  4. bytes: one all-reduce of the parameters every H steps, 2(N-1)/N x Psi x b / H per step (N = 2, 3; K = 1, 2;
     the outer step sends nothing more; the edge model's frozen parameters not averaged; a model of two dtypes,
     each parameter averaged in its own).

Check it:   python -m minizero check local-sgd --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import LocalSGD as GivenLocalSGD


class LocalSGD(GivenLocalSGD):
    def step(self) -> None:
        """This rank's optimizer step on its own gradient; after the H-th, 2H-th, ... step (counting from 1) the
        ranks combine their parameters (:meth:`average`), and after no other.  Every stage's step runs inside
        ``stepping()``."""
        raise NotImplementedError("write LocalSGD.step: step this rank's optimizer; every H-th step, average")

    def average(self) -> None:
        """Called on every rank at once.  After it, without ``outer``: every replica's trainable parameters equal
        the mean over ranks (in place: the parameters stay the model's objects).  With ``outer``: the outer
        optimizer has taken one step, with each anchor's ``.grad`` = anchor - (that mean), and every replica's
        parameters equal the stepped anchor.  Cost: one all-reduce of the parameters (the outer step is local)."""
        raise NotImplementedError("write LocalSGD.average: the mean over ranks (DiLoCo: the outer step)")
