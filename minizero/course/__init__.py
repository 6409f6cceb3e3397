"""The course: what teaches, judges and measures the library.  ``harness/`` (experiments, the reference, oracles),
``commands/`` (compare, bench, memory, train, ...), ``figures/`` (the lessons' pictures), ``labs/`` (the
exercises and their checker).  Nothing in the library imports it."""
