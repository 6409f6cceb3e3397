"""``compress-study``: the same training under each wire.  The case error feedback exists for -- PowerSGD at rank 1
without it stops learning (its loss flat over the second half) while with it the loss keeps falling -- is held by
lesson 16, which runs exactly those 100 steps and asserts it under the table it prints."""
from __future__ import annotations

import pytest

from minizero.course.commands.compress_study import SETTINGS, parse_settings


def test_compressors_are_read_with_their_settings_and_the_baseline_first():
    assert parse_settings("int8,powersgd:rank=2,start=10+ef,topk:0.01") == [
        ("none", False), ("int8", False), ("powersgd:rank=2,start=10", True), ("topk:0.01", False)]
    assert parse_settings(None) == SETTINGS and SETTINGS[0] == ("none", False)
    with pytest.raises(ValueError, match="compress must be one of"):
        parse_settings("int9")
