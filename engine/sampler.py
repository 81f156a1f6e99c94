"""Turns one step's logits into one token per sampling request, plus the logprobs asked for.

Order, as in vLLM: logprobs come from the raw model distribution (log-softmax of the logits before any
penalty or temperature). Then repetition penalty (prompt + output tokens), frequency and presence penalties
(output tokens), the grammar masks of structured-output rows, min_tokens (stop and EOS tokens masked, unless
a grammar allows nothing else), and either argmax (temperature 0) or temperature
-> min-p -> top-k -> top-p -> a draw. A row left with nothing to sample gets INVALID_TOKEN, never an id
outside the vocabulary: the runner fails that request alone. Every step keeps everything batched on the
device; only seeded rows loop, to draw their noise from their own generator.

Seeds: a seeded request's noise for output token i comes from a generator seeded with mix(seed, i), so the
same seed and prompt give the same tokens whatever else is in the batch, and also after a preemption that
recomputes the request (stateless: the runner keeps no per-request sampler state).

Grammar masks (structured outputs) touch only their own rows: the constrained rows are gathered, masked and
scattered back, so a free request's logits, and so its tokens, are the same bits whatever its neighbours ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar_masks import StepMasks, apply_masks
from engine.model.transfer import index_tensor, to_device
from engine.outputs import ScheduledRequest
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# The id a row gets when it has nothing to sample: the runner fails that request alone (never a real token).
INVALID_TOKEN = -1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): nearby seeds and steps give unrelated streams. Fits torch's 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class LogprobsOut:
    chosen: torch.Tensor  # [M] logprob of the chosen token
    top_ids: torch.Tensor  # [M, k] most likely tokens, best first (k = the largest asked in the batch)
    top_vals: torch.Tensor  # [M, k]


# How many [rows, vocab] elements token_logprobs takes at once (a few rows: every row's numbers are its own, so
# the parts change no bit). Why: a prefill chunk's prompt logprobs (echo, or prompt_logprobs) are up to 2,048 rows,
# and taken whole their temporaries were ~0.8 GB each of int64 (top_k_by_id's keys), mapped fresh from the OS and
# page-faulted on every step: 1.2 s for 2,048 rows of the default model's 49,152-token vocabulary, during which
# every other request waited (a 3,000-token echo held a 2-token request for 17 s). In parts of ~4 MB the memory
# stays in the allocator's heap and in cache: 0.17-0.34 s. CUDA's caching allocator keeps its memory: larger parts.
_CPU_ELEMENTS, _CUDA_ELEMENTS = 1 << 19, 1 << 25


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsOut:
    """Raw log-softmax logprobs of `token_ids` (one per row of `logits`) and the top-k alternatives."""
    rows = max(1, (_CUDA_ELEMENTS if logits.is_cuda else _CPU_ELEMENTS) // max(1, logits.shape[-1]))
    if len(logits) <= rows:
        return _token_logprobs(logits, token_ids, k)
    parts = [
        _token_logprobs(logits[i : i + rows], token_ids[i : i + rows], k) for i in range(0, len(logits), rows)
    ]
    return LogprobsOut(
        torch.cat([p.chosen for p in parts]),
        torch.cat([p.top_ids for p in parts]),
        torch.cat([p.top_vals for p in parts]),
    )


def _token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsOut:
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1)
    k = min(k, lp.shape[1])  # a vocabulary smaller than the alternatives asked for
    if k == 0:
        return LogprobsOut(chosen, token_ids.new_zeros(len(lp), 0), lp[:, :0])
    top_vals, top_ids = top_k_by_id(lp, k)
    return LogprobsOut(chosen, top_ids, top_vals)


def top_k_by_id(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, best first, equal values in token id order and the lowest ids kept where a
    tie spans the k-th place. `topk` alone breaks ties by how it was called: k is the largest any request of
    the step asks for, so a request's alternatives depended on its neighbours' (bfloat16 logits tie often: two
    tokens both at logprob -2.7026 came in another order beside a request asking for 20). One topk over an int64 key,
    the value's bits made ordered as integers above the id's complement: a total order, with no branch on the
    data (no host sync on CUDA)."""
    bits = lp.contiguous().view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # float32 order as int32 order
    ids = torch.arange(lp.shape[1], device=lp.device, dtype=torch.int64)
    key = (ordered << 32) | (0xFFFFFFFF - ids)
    top_ids = 0xFFFFFFFF - (key.topk(k, dim=-1).values & 0xFFFFFFFF)
    return lp.gather(1, top_ids), top_ids


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (rows of non-negative weights), u [N, 1] in [0, 1): per row, the first token whose
    cumulative weight exceeds u x the row's total; never a token of weight 0. INVALID_TOKEN for a row whose
    total is not a positive number."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, u * total, right=True)
    # u x total can round up to the total itself: then the last token that has any weight.
    last = torch.searchsorted(cdf, total, right=False)
    # A NaN or zero total (NaN weights, a temperature that overflowed) has no first token to exceed it:
    # searchsorted would answer the row width, an id outside the vocabulary.
    drawable = torch.isfinite(total) & (total > 0)
    return torch.minimum(drawn, last).masked_fill(~drawable, INVALID_TOKEN).squeeze(1)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _penalize_touched(
    logits: torch.Tensor, rows_idx: torch.Tensor, pairs: torch.Tensor, n_out: int, coef: torch.Tensor
) -> torch.Tensor:
    """`Sampler._apply_penalties` on the CPU, on the logits it changes only: each (row, token) that was output
    (the first n_out of `pairs`, [2, n]: row in the penalised subset, token) or seen, once, with the same
    element-wise arithmetic as the whole-row version, so the same bits. The whole-row version builds five
    [rows, vocab] tensors, whose cost grows with the vocabulary; this one's grows with the tokens a row has
    seen (`benchmarks/decode_bench.py --repetition-penalty` measures it). On CUDA the whole-row version
    stays: the unique below would cost a device sync."""
    vocab = logits.shape[1]
    # (subset row, token) pairs, flattened and made unique; each one's logit in the whole batch's
    touched, which = torch.unique(pairs[0] * vocab + pairs[1], return_inverse=True)
    row = touched // vocab
    at = rows_idx[row] * vocab + touched % vocab
    counts = torch.zeros(len(touched), dtype=logits.dtype).index_add_(
        0, which[:n_out], torch.ones(n_out, dtype=logits.dtype)
    )
    seen = torch.zeros(len(touched), dtype=torch.bool).index_fill_(0, which[n_out:], True)
    c = coef[row]
    x = logits.view(-1)[at]
    rep = c[:, 0]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - c[:, 1] * counts - c[:, 2] * (counts > 0).float()
    logits.view(-1)[at] = x
    return logits


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64, one per sampling request, in order
    logprob_rows: list[int]  # which of the N asked for logprobs
    logprobs: LogprobsOut | None  # rows of logprob_rows


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._generator = torch.Generator(device=device)  # re-seeded per seeded row

    def __call__(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], masks: StepMasks | None = None
    ) -> SamplerOutput:
        """logits: [N, vocab] float32, row i for reqs[i]. masks: the grammar masks of reqs, filled beside the
        forward (engine.grammar_masks); None fills them here."""
        params = [r.sampling_params for r in reqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        # Row subsets are selected with device index tensors (one copy), never with Python lists: indexing
        # a CUDA tensor with a list copies the list synchronously, which waits for the whole forward pass.
        lp_subset, rand_subset = 0 < len(lp_rows) < len(reqs), 0 < len(rand) < len(reqs)
        n_lp = len(lp_rows) if lp_subset else 0
        if lp_subset or rand_subset:
            idx = index_tensor(lp_rows[:n_lp] + (rand if rand_subset else []), logits.device)
            lp_idx, rand_idx = idx[:n_lp], idx[n_lp:]
        logits = logits.float()
        raw = logits  # before penalties: vLLM's raw logprobs
        if any(_has_penalty(p) for p in params):
            logits = self._apply_penalties(logits.clone(), reqs)
        constrained = [
            (i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active
        ]
        if constrained:
            logits = apply_masks(logits, constrained, self.vocab_size, masks)
        logits = self._apply_min_tokens(logits, reqs, {i for i, _ in constrained})
        # A row with no finite logit left (NaN from a penalty's overflow, +inf, or every token masked) has no
        # distribution: whatever argmax or the draw returned is not a token. Its id becomes INVALID_TOKEN (after
        # the logprobs, which need an id in range) and the runner fails that request alone.
        invalid = ~torch.isfinite(logits.max(dim=-1).values)
        if not rand:
            tokens = logits.argmax(dim=-1)
        elif not rand_subset:
            tokens = self._sample(reqs, logits)
        else:
            tokens = logits.argmax(dim=-1)
            sampled = self._sample([reqs[i] for i in rand], logits.index_select(0, rand_idx))
            tokens = tokens.index_copy(0, rand_idx, sampled)
        invalid |= tokens < 0  # a draw from weights that did not sum to a positive number
        tokens = tokens.clamp(0, logits.shape[1] - 1)
        out = None
        if lp_rows:
            k = max(params[i].logprobs or 0 for i in lp_rows)
            if lp_subset:
                out = token_logprobs(raw.index_select(0, lp_idx), tokens.index_select(0, lp_idx), k)
            else:
                out = token_logprobs(raw, tokens, k)
        return SamplerOutput(tokens.masked_fill(invalid, INVALID_TOKEN), lp_rows, out)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if _has_penalty(r.sampling_params)]
        if not rows:
            return logits
        # Each row's tokens as a tensor of its own (a whole context through Python lists costs a Python object
        # per token, every step): the output tokens, and for a repetition penalty every token.
        outs = [_ids(reqs[i].all_token_ids[reqs[i].num_prompt_tokens :]) for i in rows]
        seens = [
            _ids(reqs[i].all_token_ids if reqs[i].sampling_params.repetition_penalty != 1.0 else [])
            for i in rows
        ]
        p = [reqs[i].sampling_params for i in rows]
        host = torch.tensor(
            [[q.repetition_penalty, q.frequency_penalty, q.presence_penalty] for q in p], dtype=torch.float32
        )
        coef = to_device(host, logits.device)
        # One copy: (row in the penalised subset, token) pairs, then the subset's rows of the batch.
        subset = torch.arange(len(rows))
        out_r = subset.repeat_interleave(_ids([len(t) for t in outs]))
        seen_r = subset.repeat_interleave(_ids([len(t) for t in seens]))
        dev = to_device(torch.cat([out_r, seen_r, *outs, *seens, _ids(rows)]), logits.device)
        n_out, n_pairs = len(out_r), len(out_r) + len(seen_r)
        idx = dev[: 2 * n_pairs].view(2, n_pairs)
        rows_idx = dev[2 * n_pairs :]
        if logits.device.type == "cpu":
            return _penalize_touched(logits, rows_idx, idx, n_out, coef)
        sub = logits.index_select(0, rows_idx)  # [P, vocab]
        # Flat (row * vocab + token) indices with index_add_ / index_fill_: CUDA's accumulating index_put_
        # range-checks its indices with two .item() calls, i.e. two syncs.
        flat = idx[0] * sub.shape[1] + idx[1]
        counts = torch.zeros_like(sub)
        counts.view(-1).index_add_(0, flat[:n_out], torch.ones(n_out, device=sub.device))
        seen = torch.zeros_like(sub, dtype=torch.bool)
        seen.view(-1).index_fill_(0, flat[n_out:], True)
        rep = coef[:, 0:1]
        # Repetition penalty (prompt and output tokens): shrink positive logits, push negative ones down.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - coef[:, 1:2] * counts - coef[:, 2:3] * (counts > 0).float()
        return logits.index_copy_(0, rows_idx, sub)

    def _apply_min_tokens(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], constrained: set[int]
    ) -> torch.Tensor:
        """Masks the stop tokens of rows still short of min_tokens: its stop_token_ids and, unless it ignores
        EOS, the EOS ids the scheduler stops it on (`ScheduledRequest.eos_token_ids`). A constrained row whose grammar allows
        nothing but a stop token keeps it: the grammar wins, so the output ends complete and short
        (finish "stop"), where masking would leave the row nothing to sample."""
        rows: list[int] = []
        toks: list[int] = []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                stop_set = p.stop_token_set if p.ignore_eos else p.stop_token_set.union(r.eos_token_ids)
                stop = [t for t in stop_set if 0 <= t < logits.shape[1]]
                rows += [i] * len(stop)
                toks += stop
        if not rows:
            return logits
        idx = index_tensor(rows + toks, logits.device).view(2, -1)
        # new_full fills on the device; torch.tensor(x, device=...) would be a blocking copy.
        masked = logits.index_put((idx[0], idx[1]), logits.new_full((), float("-inf")))
        both = sorted(constrained.intersection(rows))
        if not both:
            return masked
        sub = index_tensor(both, logits.device)
        left = torch.isfinite(masked.index_select(0, sub).max(dim=-1, keepdim=True).values)
        keep = torch.where(left, masked.index_select(0, sub), logits.index_select(0, sub))
        return masked.index_copy(0, sub, keep)

    def _sample(self, reqs: list[ScheduledRequest], logits: torch.Tensor) -> torch.Tensor:
        params = [r.sampling_params for r in reqs]
        vocab = logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # Rows without top-p get an unreachable threshold: a cumulative sum can round to slightly over 1.
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        host = torch.tensor(
            [[p.temperature, p.min_p, k, tp] for p, k, tp in zip(params, top_k, top_p, strict=True)],
            dtype=torch.float32,
        )
        cols = to_device(host, logits.device)  # one copy for all four per-row settings
        logits = logits / cols[:, 0:1]
        if any(p.min_p > 0 for p in params):
            probs = logits.softmax(dim=-1)
            too_small = probs < cols[:, 1:2] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(too_small, float("-inf"))
        if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
            logits = top_k_top_p(logits, top_k, top_p, cols[:, 2:3], cols[:, 3:4])
        probs = logits.softmax(dim=-1)
        # Inverse CDF: one uniform u per row; the token is the first whose cumulative probability exceeds
        # u x the row's total. A token of probability 0 adds nothing to the sum, so it is never the first to
        # exceed it. One number per row, where an exponential race (argmax p / E, E ~ Exp(1) per token) draws
        # one per vocabulary entry, which costs far more than the cumulative sum. Row by row (torch sums each row on its own, in order), so a row's token depends only on
        # its own logits and noise, whatever the batch.
        u = torch.empty(len(params), 1, dtype=probs.dtype, device=probs.device)
        seeded = [(i, p.seed) for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            u.uniform_()
        for i, seed in seeded:
            self._generator.manual_seed(mix_seed(seed, reqs[i].num_output_tokens))
            u[i].uniform_(generator=self._generator)
        return inverse_cdf(probs, u)


# Candidates a top-p row is first cut from: its most likely tokens. A row they do not cover is cut from 16x as
# many, then from its whole sorted row, with the same arithmetic, so the cut never depends on which way it was
# found. At usual temperatures most rows' top-p mass lies in these few candidates; at high temperatures the
# mass spreads and more rows fall back to the wider cuts, down to the whole sort every row once paid.
TOP_P_CANDIDATES = 256


def top_k_top_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], k_col: torch.Tensor, p_col: torch.Tensor
) -> torch.Tensor:
    """`logits` with what top-k and then top-p drop set to -inf. top_k, top_p: per row, on the host (k = vocab
    and p >= 1 where disabled); k_col, p_col: the same as [N, 1] float tensors on the logits' device.

    Top-k keeps the tokens whose logit is at least the k-th largest (a tie with it stays, as in vLLM). Top-p
    ranks the kept tokens' probabilities, largest first, and keeps each token whose higher-ranked mass is still
    below p (so the first always), then every token as likely as the last one kept: both cuts are thresholds
    on values, so tied tokens are kept or dropped together and the order a sort gives ties changes nothing.
    A full sort of a vocabulary-wide row costs more on a CPU than the rest of a decode step; the k or
    TOP_P_CANDIDATES largest cost a small fraction of it. On CUDA rows are sorted whole (no host sync to find uncovered rows)."""
    n, vocab = logits.shape
    k_rows = [k for k in top_k if k < vocab]
    p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not k_rows and not p_rows:
        return logits
    width = max(k_rows + ([TOP_P_CANDIDATES] if p_rows else []))
    if width >= vocab or logits.device.type != "cpu":
        width = vocab
    if k_rows:
        top = logits.topk(width, dim=-1).values
        kth = top.gather(1, (k_col.long() - 1).clamp(max=width - 1))
        kth = torch.where(k_col < vocab, kth, torch.full_like(kth, float("-inf")))  # no top-k: keep all
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not p_rows:
        return logits
    probs = logits.softmax(dim=-1)
    tau = _top_p_threshold(probs.topk(width, dim=-1).values, p_col)
    short = p_rows
    while width < vocab:
        covered = (tau > 0).view(-1).tolist()  # 0: the candidates hold less than p (CPU: no device sync)
        short = [i for i in short if not covered[i]]
        if not short:
            break
        # Rows the candidates do not cover: 16x as many (~0.5 ms a row), then the whole row, sorted.
        width = min(vocab, width * 16)
        rows = torch.tensor(short, device=logits.device)
        sub = probs.index_select(0, rows)
        ranked = sub.topk(width, dim=-1).values if width < vocab else sub.sort(dim=-1, descending=True).values
        tau = tau.index_copy(0, rows, _top_p_threshold(ranked, p_col.index_select(0, rows)))
    tau = torch.where(p_col < 1.0, tau, torch.zeros_like(tau))
    return logits.masked_fill(probs < tau, float("-inf"))


def _top_p_threshold(ranked: torch.Tensor, p_col: torch.Tensor) -> torch.Tensor:
    """ranked: [N, W] probabilities, largest first (a row's W largest). The probability of the last token
    top-p keeps, per row [N, 1]; 0 where none of the W is dropped (all kept, and maybe tokens past them)."""
    w = ranked.shape[1]
    cum = ranked.cumsum(dim=-1)  # torch sums a row on its own, in order: any W gives the same prefix sums
    drop = (cum - ranked) >= p_col  # the mass ranked above reaches p; never the first (nothing is above it)
    # Kept: the ranks before the first dropped one (argmax finds the first True).
    kept = torch.where(drop.any(dim=-1, keepdim=True), drop.int().argmax(dim=-1, keepdim=True), w)
    tau = ranked.gather(1, (kept - 1).clamp(min=0))
    return torch.where(kept < w, tau, torch.zeros_like(tau))
