"""The labs' contract skeletons: each method states only what must hold after it runs and what the checker
holds it to -- no recipe.  ``python -m minizero lab NAME FILE`` copies one (the default level); the guided level
(:mod:`minizero.course.labs.skeletons.guided`) adds hints.

A package so that installs carry the files, and so that a solution may subclass a skeleton."""
