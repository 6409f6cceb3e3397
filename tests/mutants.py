"""Broken stages, each with one classic bug: the equivalence suite must catch every one.

They live in the package (:mod:`minizero.labs.mistakes`), where the labs' checker
also uses them to name a learner's mistake; here they are the suite's mutants.
"""
from minizero.labs.mistakes import HOOK_MUTANTS, MISTAKE_STAGES, MUTANTS, ZERO_MUTANTS

MUTANT_STAGES = MISTAKE_STAGES

__all__ = ["HOOK_MUTANTS", "MUTANTS", "MUTANT_STAGES", "ZERO_MUTANTS"]
