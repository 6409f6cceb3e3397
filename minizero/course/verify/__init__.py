"""``python -m minizero verify path.py:make_wrapper``: the equivalence suite pointed at anyone's data-parallel code.

A factory (:mod:`.convention`) wraps a model as its author would -- torch's DDP or FSDP2, a course's DDP, a
custom sharded wrapper -- and :func:`verify` runs it through the experiments the suite draws for minizero's own
stages, against single-device training, shrinking the first difference to the smallest case (:mod:`.run`).
"""
from .convention import Wrapped, load_factory
from .run import Verdict, verify

__all__ = ["Verdict", "Wrapped", "load_factory", "verify"]
