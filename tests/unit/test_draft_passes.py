# SPDX-License-Identifier: Apache-2.0
"""The draft's passes over rows it skipped (`SpeculationPause.draft_skipped`) keep to the prefill
chunk budget; `tests/engine/test_speculation_off_by_batch_size.py` checks the drafts of
split passes against an engine that never skipped (chunks of 7 tokens)."""

from runtime.speculative.speculation_pause import pass_groups


def test_draft_passes_over_skipped_rows_keep_to_the_row_budget():
    """`NextNWorker`'s catch-up passes: whole requests in order, at most `max_rows` rows a
    pass, a longer request alone."""
    assert pass_groups([5, 5, 5], None) == [range(3)]
    assert pass_groups([3, 4, 2, 9, 1], 7) == [range(2), range(2, 3), range(3, 4), range(4, 5)]
    assert pass_groups([7, 7], 7) == [range(1), range(1, 2)]
    assert pass_groups([], 7) == []
