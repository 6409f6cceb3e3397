"""The labs' skeletons: copy one with ``python -m minizero lab NAME FILE`` and fill in its methods.

A package so that installs carry the files, and so that a solution may subclass a skeleton."""
