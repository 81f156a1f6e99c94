"""Batch invariance: which row counts make this machine's matmul kernels give every row the same bits.

Brine promises that a request's tokens and logprobs do not depend on what shares its step (DESIGN.md, "Same
answer, cached or not"). The model computes each row of a step with a matmul whose row count M changes with
the batch, and CPU GEMM libraries pick kernels by M. What this project's machines showed (torch 2.13):

- oneDNN with pre-packed weights (`layers.linear.PackedLinear`), AMD EPYC with AVX512-BF16: in bfloat16 and
  float32, every row count from 2 to 2,100 gives each row the same bits, and so does a row's position in the
  product; M = 1 takes a matrix-vector path that rounds differently.
- An AMX Xeon, bfloat16, probed with `sensitize`d inputs: K = 576 agrees at every M from 1 to 700, but K =
  1,536 (the down projection) sums K in another order at M = 150-256 with two threads and at M = 1-192 with
  one (the kernel's blocking follows M and the threads): no padding multiple helps, calls of at most 128 rows
  do (`row_rule`). Earlier, unsensitized probes up to M = 299 had seen nothing.
- Plain `F.linear` in float32 (MKL) gives a row different bits depending on its position in the product:
  no padding rule fixes that, which is why the model runs on packed weights in both dtypes.
- `torch.matmul` on float32 batches (attention): M in 1-3, 5-7 and 9-11 round differently from the rest;
  multiples of 4 and everything from 12 up agree.

Rather than trusting a table, each kernel is probed once per process on the shapes the model uses: every row
count from 1 to 40 and a spread of larger ones, each compared row by row with one large product, at two
offsets. A linear's probe inputs carry cancelling pairs (`sensitize`), so that another summation order shows
even through bfloat16 rounding, which hides it for plain random inputs. The probe yields the smallest row multiple (1, 2, 4, 8 or 16) whose padded products agree
everywhere; callers pad their rows up to it (pad rows never touch real ones: a row of a matmul reads only
itself). Where no multiple agrees, `row_rule` also tries capping the rows per call, each call size up to the cap
probed. Where nothing agrees, the strictest rule is used and a warning says invariance is not guaranteed here
(or, `strict`, a NotInvariantError).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ROW_MULTIPLES = (1, 2, 4, 8, 16)
# Row caps `row_rule` tries, largest first, where no multiple is enough (each a multiple of every ROW_MULTIPLE).
ROW_CAPS = (128, 64, 32, 16)
# Row counts probed: all small ones (where kernels switch) and a spread of larger ones around powers of two.
PROBE_ROWS = (*range(1, 41), 47, 48, 63, 64, 65, 96, 127, 128, 129, 200, 255, 256, 257, 300)


class NotInvariantError(ValueError):
    """No row padding makes a kernel row-count invariant on this CPU (raised where invariance is required)."""


def _agreeing_multiple(
    fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, counts: tuple[int, ...] | range
) -> tuple[int | None, set[int]]:
    """(the smallest of ROW_MULTIPLES whose multiples among `counts` all give every row the bits it gets in
    `fn(rows)`, at two offsets, or None; the row counts that differ)."""
    with torch.inference_mode():
        ref = fn(rows)
        bad: set[int] = set()
        for m in counts:
            for offset in (0, 5):
                if offset + m > rows.shape[0]:
                    continue
                if not torch.equal(fn(rows[offset : offset + m]), ref[offset : offset + m]):
                    bad.add(m)
    multiple = next((k for k in ROW_MULTIPLES if not any(m % k == 0 for m in bad)), None)
    return multiple, bad


def row_multiple(
    fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, what: str, strict: bool = False
) -> int:
    """Smallest row multiple m for which `fn` (a row-wise map [M, ...] -> [M, ...]) gives every row the
    same bits whatever M is, once M is padded up to a multiple of m. `rows`: a sample input; row counts
    up to its length (less the offset) are probed. Where none agrees: NotInvariantError if `strict`, else
    a warning and the largest multiple."""
    multiple, bad = _agreeing_multiple(fn, rows, PROBE_ROWS)
    if multiple is not None:
        return multiple
    return _not_invariant(what, bad, strict).multiple


@dataclass(frozen=True, slots=True)
class RowRule:
    """How a row-wise kernel is called so that a row gets the same bits in every batch: its rows padded with
    zeros to a multiple of `multiple`, in calls of at most `cap` rows (None: one call, whatever M is)."""

    multiple: int = 1
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap % self.multiple:
            raise ValueError(
                f"a row cap ({self.cap}) must be a multiple of the row multiple ({self.multiple})"
            )

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn(x) as this rule calls it: [M, ...] -> [M, ...]."""
        m = x.shape[0]
        if self.cap is None or m <= self.cap:
            y = fn(pad_rows(x, self.multiple))
            return y if y.shape[0] == m else y[:m]
        return torch.cat([self.apply(fn, x[i : i + self.cap]) for i in range(0, m, self.cap)])

    def and_(self, other: RowRule) -> RowRule:
        """A rule both kernels accept (multiples and caps are powers of two): the larger multiple, the
        smaller cap."""
        caps = [c for c in (self.cap, other.cap) if c is not None]
        return RowRule(max(self.multiple, other.multiple), min(caps) if caps else None)


def row_rule(
    fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, what: str, strict: bool = False
) -> RowRule:
    """How to call `fn` so that every row keeps its bits: `row_multiple`'s padding where that is enough, else
    calls of at most ROW_CAPS[i] rows, the largest cap for which every call size up to it (each one probed)
    agrees with a call of the cap's size. oneDNN's AMX bfloat16 linear needs that: with K = 1,536 its
    products of 150-256 rows (two threads; 1-192 with one) sum K in another order than those of other sizes,
    so no padding multiple fixes it, while every call of up to 128 rows agrees. `rows` needs at least
    ROW_CAPS[-1] + 5 rows; a cap is only tried if it has cap + 5. Where nothing agrees: NotInvariantError if
    `strict`, else a warning and the strictest rule."""
    multiple, bad = _agreeing_multiple(fn, rows, PROBE_ROWS)
    if multiple is not None:
        return RowRule(multiple)
    for cap in ROW_CAPS:
        if cap + 5 > rows.shape[0]:
            continue
        capped = functools.partial(RowRule(1, cap).apply, fn)
        multiple, _ = _agreeing_multiple(capped, rows, range(1, cap + 1))
        if multiple is not None:
            return RowRule(multiple, cap)
    return _not_invariant(what, bad, strict)


def _not_invariant(what: str, bad: set[int], strict: bool) -> RowRule:
    if strict:
        raise NotInvariantError(
            f"{what}: no row padding makes this CPU's kernel give a row the same bits in every batch "
            f"(differing row counts {sorted(bad)[:8]}; {isa_summary()})"
        )
    logger.warning(
        "%s: batch invariance is not guaranteed on this CPU: no row padding makes the kernel agree "
        "(differing row counts %s); "
        "a request's results may depend on what shares its step here (%s)",
        what,
        sorted(bad)[:8],
        isa_summary(),
    )
    return RowRule(ROW_MULTIPLES[-1], ROW_CAPS[-1])


# A probe's cancelling pairs: a large input at two positions of K whose weight columns are equal, +B and -B.
# Exact arithmetic cancels them; a float32 sum carries B while it holds one of them and drops the low bits of
# whatever it adds meanwhile, so the result depends on where the reduction's blocks and partial sums fall.
SENSITIVE_B = 2.0**20


def sensitize(weight: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, rows) for a linear's probe (float32 in, before any cast), made so that a kernel that sums K in
    another order for some row count shows it even in bfloat16 outputs. Random products round to bfloat16
    the same way whatever their float32 order in all but a few rows (an Ice Lake's emulated bfloat16 kernel:
    one row of 700 differed, and the plain probe saw none); with B's absorbed bits, most outputs differ.
    Two rows in three get a cancelling pair, the pairs at K's ends or at its middle; the third keeps plain
    random inputs. `weight` [out, in] and `rows` [M, in] are copied, not changed."""
    weight, rows = weight.clone(), rows.clone()
    k = weight.shape[1]
    pairs = [(0, k - 1), (k // 2 - 1, k // 2)]
    for a, b in pairs:
        weight[:, b] = weight[:, a]
    for r in range(rows.shape[0]):
        if r % 3 < 2:
            a, b = pairs[r % 3]
            rows[r, a], rows[r, b] = SENSITIVE_B, -SENSITIVE_B
    return weight, rows


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of `multiple` rows (x itself when it already is one)."""
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if line else frozenset()


@functools.cache
def isa_summary() -> str:
    """One line naming what decides the kernels: torch's CPU capability, AMX, AVX512-BF16, threads."""
    flags = cpu_flags()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return (
        f"torch {torch.__version__} cpu_capability={torch.backends.cpu.get_cpu_capability()} "
        f"amx={'amx_bf16' in flags or 'amx_tile' in flags} avx512_bf16={'avx512_bf16' in flags} "
        f"threads={torch.get_num_threads()} cpu={model!r}"
    )
