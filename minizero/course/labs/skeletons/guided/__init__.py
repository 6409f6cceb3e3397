"""The labs' guided skeletons: each method says what to do and which parts of minizero exist for it (not the
exact calls).  ``python -m minizero lab NAME FILE --level guided`` copies one; the contract level
(:mod:`minizero.course.labs.skeletons.contract`) states only what must hold.

A package so that installs carry the files, and so that a solution may subclass a skeleton."""
