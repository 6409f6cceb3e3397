"""``compress-study``: the same training under each wire; and the case error feedback exists for -- PowerSGD at
rank 1 without it stops learning (its loss flat over the second half) while with it the loss keeps falling."""
from __future__ import annotations

import pytest
import torch

from minizero.formulas import all_reduce_bytes
from minizero.lab.compress_study import SETTINGS, format_table, parse_settings, study
from minizero.lab.models import GPT_SIZES, count_params
from minizero.lab.tasks import TASKS


def test_error_feedback_is_what_keeps_rank_one_powersgd_learning():
    """100 steps, the two runs alone (the fp32 baseline is lesson 15's and the study's: here its bytes are the
    formula's).  Without error feedback the loss is flat from the middle on; with it, it still falls."""
    rows = study([("powersgd:rank=1", True), ("powersgd:rank=1", False)], steps=100)
    with_ef, without = rows
    assert without["second_half_drop"] < 0.05 < 0.1 < with_ef["second_half_drop"], format_table(rows, 2, 100, "small",
                                                                                                 "momentum")
    assert with_ef["final_loss"] < without["final_loss"] - 0.1
    fp32 = all_reduce_bytes(4 * count_params(TASKS["gpt"].make_model(0, torch.float32, **GPT_SIZES["small"])), 2)
    assert with_ef["sent_per_step"] == without["sent_per_step"] < fp32 / 50  # (n + m) 1 per matrix


def test_compressors_are_read_with_their_settings_and_the_baseline_first():
    assert parse_settings("int8,powersgd:rank=2,start=10+ef,topk:0.01") == [
        ("none", False), ("int8", False), ("powersgd:rank=2,start=10", True), ("topk:0.01", False)]
    assert parse_settings(None) == SETTINGS and SETTINGS[0] == ("none", False)
    with pytest.raises(ValueError, match="compress must be one of"):
        parse_settings("int9")
