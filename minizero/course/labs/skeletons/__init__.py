"""The labs' skeletons, at two levels: ``contract/`` (what must hold, and the properties the checker holds it to)
and ``guided/`` (what to do, and which parts of minizero exist for it).  Copy one with
``python -m minizero lab NAME FILE [--level contract|guided]`` and fill in its methods.

Packages so that installs carry the files, and so that a solution may subclass a skeleton."""
