"""The scratch state of one ``Scheduler.schedule()`` call: the step's token budget and
sequence limit, and everything the step has decided so far (who runs with how many tokens, new
blocks, swaps, preemptions, drafts), from which the ``SchedulerOutput`` is built."""
from __future__ import annotations

from llmtower.core.request import Request
from llmtower.core.sched.lora_slots import LoRASlots


class Step:
    """Owns one step's budget and decisions; thrown away (kept as ``Scheduler._last`` for the
    statistics) once the step's ``SchedulerOutput`` is built."""

    __slots__ = ("budget", "scheduled", "new_blocks", "resumed", "preempted", "num_partial",
                 "swap_out", "swap_in", "num_prefill_tokens", "moves", "spec", "cached_from",
                 "provisional", "initial_budget", "max_seqs", "swap_out_int8", "swap_in_int8",
                 "reserve_for", "reserve", "loras")

    def __init__(self, budget: int, max_seqs: int = 1 << 30) -> None:
        self.budget = budget
        self.initial_budget = budget  # the step's token budget (degradation may cut it)
        self.max_seqs = max_seqs  # the step's max_num_seqs (degradation may cut it)
        self.scheduled: dict[str, int] = {}  # insertion order = batch order
        self.new_blocks: dict[str, list[int]] = {}
        self.resumed: set[str] = set()
        self.preempted: list[Request] = []
        self.num_partial = 0
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.swap_out_int8: list[int] = []  # device blocks whose swap copy is int8
        self.swap_in_int8: list[int] = []
        self.num_prefill_tokens = 0
        self.moves: list[tuple[int, int]] = []  # the relocator's block moves
        self.spec: dict[str, list[int]] = {}  # draft tokens scheduled per request
        # Prefix caching of blocks this step computes, registered when scheduled so that a
        # request admitted later in the same step hits them (the runner writes the whole
        # batch's K/V before anyone attends): each request's first block cached this step,
        # and the owner of every such block (see Scheduler._same_step_hits).
        self.cached_from: dict[str, int] = {}
        self.provisional: dict[int, Request] = {}
        # Budget reservation (phase 1 only): the waiting head that running prefills the
        # policy puts after it leave room for, and how much (-1: not sized yet).
        self.reserve_for: Request | None = None
        self.reserve = -1
        # The adapters in use (None: LoRA off), counted from the running requests when swap-ins
        # or admissions begin, and grown by each request they start.
        self.loras: LoRASlots | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled so far (the budget spent)."""
        return self.initial_budget - self.budget
