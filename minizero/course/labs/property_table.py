"""Every property a lab can name, by the name its catalogue entry uses: the core ones and each new lab's.

Adding a lab's properties is one module of its own (``properties_<lab>.py``, a ``PROPERTIES`` dict of
``name: (title, function)``) and one line here.
"""
from __future__ import annotations

from .properties import PROPERTIES as CORE
from .properties_hierarchical import PROPERTIES as HIERARCHICAL
from .properties_local_sgd import PROPERTIES as LOCAL_SGD
from .properties_powersgd import PROPERTIES as POWERSGD
from .properties_precision import PROPERTIES as MIXED_PRECISION
from .properties_reshard import PROPERTIES as RESHARD
from .properties_tree import PROPERTIES as TREE

PROPERTIES: dict = {**CORE, **TREE, **MIXED_PRECISION, **RESHARD, **LOCAL_SGD, **POWERSGD, **HIERARCHICAL}
assert len(PROPERTIES) == (len(CORE) + len(TREE) + len(MIXED_PRECISION) + len(RESHARD) + len(LOCAL_SGD) + len(POWERSGD)
                           + len(HIERARCHICAL)), "two labs name a property alike"
