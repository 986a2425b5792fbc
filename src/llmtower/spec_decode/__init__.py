"""Speculative decoding: proposers (ngram, suffix, draft model), the per-request adaptive
draft length, and the runner-side step that verifies drafts and proposes the next ones.

The scheduler only counts and allocates the draft tokens; the rejection sampler lives beside
the sampler in ``executor/rejection_sampler.py``. See docs/spec_decode.md.
"""
