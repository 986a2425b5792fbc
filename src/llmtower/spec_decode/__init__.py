"""Speculative decoding: proposers (ngram, suffix), the per-request adaptive draft length, the
batch gate and the step-cost model. They import nothing above ``core``.

The scheduler's side (counting and allocating drafts, taking back rejected ones) is
``core/sched/spec_drafts.py``; the runner's side (writing drafts into the batch, verifying them
with ``executor/rejection_sampler.py``, the draft model) is ``executor/spec_decode_step.py`` and
``executor/draft_model.py``. See docs/spec_decode.md.
"""
