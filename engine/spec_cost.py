"""What a draft token costs on this machine, measured from the engine's own decode steps: the least chance of
acceptance a draft token needs to be worth drafting (engine.spec_decode), where `min_draft_acceptance` is left
to "auto".

A draft row of a verified chunk costs a fraction of what a sequence's own row of the step costs, and the
fraction depends on the CPU, the model, the batch size and the context (benchmarks/spec_step_cost.py, 2,000
cached tokens): an AMX Xeon ~0.07 at one sequence, 0.12-0.15 at 4 and ~0.25 at 16; an AVX512-BF16 EPYC 0.15-0.18
at one sequence and 0.25-0.4 at 4 to 32. A token whose chance of acceptance is below that fraction costs more
than it is expected to save, above it less: that fraction is the threshold, and one fixed number is too timid
where drafts are cheap (single-stream extraction over 16 prompts on the AMX Xeon: 1.86x with 0.3, 2.04x with
the measured ~0.06) and too bold where they are dear.

Per class of batch size (1, 2-3, 4-7, 8-15, 16-31, 32 or more sequences), from decode-only steps (every sequence
computing its last known token, some with drafts; no prefill, which would dwarf them): a least-squares line
through (drafts per sequence, seconds per sequence) over the class's recent steps (each step's weight decays by
DECAY per step after it: ~20 steps), whose intercept is a sequence's own row and whose slope a draft's; their
ratio is the threshold. A line, not an average of the steps without drafts, since a request that quotes its
prompt drafts in every step, and no step alone says what its drafts cost. Until a class has enough steps, with
enough spread in their drafts to draw a line through, its threshold is FALLBACK, the number measured on the
first CPUs this ran on. A step far slower than the line says (a page fault, a neighbour) is left out. Wall-clock
time on a shared machine is noisy; a wrong threshold only costs speed, never output (the verifier keeps exactly
the tokens plain decoding would). Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FALLBACK = 0.3  # a draft row's cost over a sequence's, on an AVX512-BF16 EPYC at every batch size measured
LOWEST, HIGHEST = 0.02, 0.95  # what a measured threshold is held within
CLASSES = 6  # batch-size classes: 1, 2-3, 4-7, 8-15, 16-31, 32+
DECAY = 0.95  # each step's weight, one step later
MIN_WEIGHT = 8.0  # the steps' weight a line needs (8 recent steps)
MIN_SPREAD = 0.05  # the weighted variance of drafts per sequence a line needs (a batch averages its drafts)
OUTLIER = 3.0  # a step more than this many times slower than the line says is left out


@dataclass(slots=True)
class _Class:
    """Decayed sums over (d, t): drafts per sequence, seconds per sequence."""

    w: float = 0.0
    d: float = 0.0
    t: float = 0.0
    dd: float = 0.0
    dt: float = 0.0
    steps: int = 0  # steps taken in
    # The last threshold its line gave: kept while the recent steps are too alike to draw one (a request that
    # drafts K in every step), rather than falling back to FALLBACK and drafting differently until they differ.
    last: float | None = None

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of t over d, or None while the steps say too little."""
        if self.w < MIN_WEIGHT:
            return None
        md, mt = self.d / self.w, self.t / self.w
        var = self.dd / self.w - md * md
        if var < MIN_SPREAD:
            return None
        slope = (self.dt / self.w - md * mt) / var
        return mt - slope * md, slope


@dataclass(slots=True)
class DraftCost:
    classes: list[_Class] = field(default_factory=lambda: [_Class() for _ in range(CLASSES)])

    @staticmethod
    def _class(num_seqs: int) -> int:
        return min(CLASSES - 1, max(1, num_seqs).bit_length() - 1)

    def observe(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """One decode-only step of `num_seqs` sequences carrying `num_drafts` drafts, which took `seconds`."""
        if num_seqs < 1 or num_drafts < 0 or seconds <= 0.0:
            return
        c = self.classes[self._class(num_seqs)]
        d, t = num_drafts / num_seqs, seconds / num_seqs
        line = c.line()
        if line is not None and line[0] > 0.0 and t > OUTLIER * (line[0] + max(0.0, line[1]) * d):
            return
        c.w, c.d, c.t = c.w * DECAY + 1.0, c.d * DECAY + d, c.t * DECAY + t
        c.dd, c.dt = c.dd * DECAY + d * d, c.dt * DECAY + d * t
        c.steps += 1
        line = c.line()
        if line is not None and line[0] > 0.0:
            c.last = min(HIGHEST, max(LOWEST, line[1] / line[0]))

    def threshold(self, num_seqs: int) -> float:
        """The least chance of acceptance a draft token needs in a step of `num_seqs` sequences."""
        last = self.classes[self._class(num_seqs)].last
        return FALLBACK if last is None else last
