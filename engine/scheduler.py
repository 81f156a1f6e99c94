"""Token-budget continuous batching (vLLM v1 style): which requests run this step, and with how many tokens.

Every request carries `num_computed_tokens`; a step moves it towards `num_tokens`. One rule covers a fresh
prefill, a prefill that starts after a prefix hit, a chunk of a long prefill and a decode step: schedule
`min(num_tokens - num_computed_tokens, budget left)` tokens. Running requests go first (oldest first), then
waiting ones while the budget, `max_num_seqs` and the KV cache allow.

Fairness between owners (`Request.owner`: the request's cache namespace, its tenant, gateway value or salt;
without one, its API request, all its prompts and n sequences), so that one request's fan-out, one long prompt
or one salt's flood cannot hold everyone else's first token behind it:
- admission is round-robin across owners (`FairQueue`), FIFO within an owner;
- while more than one owner has work, each owner's fair share is `max_num_seqs / owners` running sequences
  and `max_num_batched_tokens / owners` tokens per step. An owner at its share is admitted only when no owner
  below its share waits; a prefill chunk is cut at its owner's token share, and whatever budget the others
  leave over is handed back to the cut chunks at the end of the step (work-conserving: alone, a request gets
  the whole budget, so throughput is as before);
- an owner waiting below its share, when slots or KV blocks are short, preempts the newest sequences of the
  owner running the most sequences above its share (recomputed later, usually from their own cached blocks).
  KV preemption during a step takes its victim from the same owner.
A single-sequence request is never above its share, so this never preempts plain traffic for plain traffic.
- an owner that runs nothing gets its first chunk in a step of its own, ahead of the running batch, when that
  batch holds at least `PREFILL_STEP_MIN_RUNNING` sequences (SGLang runs prefill batches ahead of decode): on
  a CPU a step costs about its tokens, so a 5-token prompt's first token costs ~5 ms instead of the ~50 ms of
  64 decodes beside it, and the decodes lose one step's fixed cost. Never twice in a row, so under a stream of
  new owners (salts rotated on purpose) the running sequences still advance at least every other step.

The express lane: a step of many rows takes tens of milliseconds on a CPU (seconds for a long prefill), and
a request that arrives meanwhile would wait for all of it. Where the engine's runner pauses between two
decoder layers (`express_enabled`), a request of an owner that runs nothing gets its first chunk in an express
pass made during such a pause (`schedule_express`), and the decodes of owners running only a few sequences
(at most `EXPRESS_MAX_SEQS_PER_OWNER`, `EXPRESS_MAX_ROWS` in all, where the others have at least
`EXPRESS_MIN_STEP_TOKENS` tokens to compute: 16 decodes, a long prompt's chunk) are held out of the main step
for those passes: another salt's short request beside a flood gets
its tokens at the pace of its own small steps, not the flood's. An express pass never preempts, never touches
a request of the step in flight, never hits a block that step is still writing, and may run up to
`EXPRESS_MAX_ROWS` sequences past `max_num_seqs` until the next main pass preempts the excess.

When the KV cache runs out, a running request is preempted: its blocks are freed and it goes back to the
front of its owner's queue (and its owner to the front of the turn order) to be recomputed later (its own
blocks, still hashed in the free queue, will usually hit). Nothing is failed for lack of blocks; requests that
could never fit are refused by `check_request` before they get here.

Rules for callers: `schedule()` and `update()` alternate, one `update` per `schedule`; an express pass
(`schedule_express` and its own `update`) may come between the two. Requests are finished from outside only
between a step and the next `schedule()` (`finish_requests`), which frees their blocks at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Container, Iterable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import ContextLengthError
from engine.fair_queue import FairQueue
from engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprob, VerifiedDrafts
from engine.request import Request, RequestStatus
from engine.spec_decode import SpecDecoder
from kv_cache.lookup import ComputedBlocks
from kv_cache.manager import KVCacheManager
from metrics.stats import SpecDecodingStats

# Running sequences from which a new owner's prefill gets a step of its own. Below it the batch's own cost is
# small beside a step's fixed cost (weights read once), so splitting would slow everyone for little.
PREFILL_STEP_MIN_RUNNING = 16
# The express lane (module docstring). An owner with at most this many running sequences is "small"; at most
# EXPRESS_MAX_ROWS sequences are held out of a main step (more small owners than that: all run in the main
# step, so that rotating salts on purpose buys no express service), and an express pass computes at most
# EXPRESS_MAX_TOKENS tokens (a long new prompt gets its first chunk there, the rest in main steps).
EXPRESS_MAX_SEQS_PER_OWNER = 4
# A main step of fewer tokens runs straight through (no pause): it is short, and each pause costs a native call
# per layer. 16 decodes of the default model take ~15-20 ms on two cores.
EXPRESS_MIN_STEP_TOKENS = 16
EXPRESS_MAX_ROWS = 8
EXPRESS_MAX_TOKENS = 256


@dataclass(slots=True)
class RequestUpdate:
    """What one request got from a step: its new token (if it sampled) and whether it is now finished."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Reads max_num_seqs, max_num_batched_tokens, max_model_len (resolved: not None) and
        speculative_config from `config`."""
        # Either at 0 would schedule nothing while requests wait: the step loop would spin and clients hang.
        if config.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {config.max_num_seqs}")
        if config.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {config.max_num_batched_tokens}"
            )
        if config.max_model_len is None:
            raise ValueError("the scheduler needs max_model_len (EngineCore fills in the model's)")
        self.kv_manager = kv_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # A sequence of N tokens needs N - 1 KV slots to sample its next token; past the whole pool it can
        # never run again, so it stops there ("length") instead of preempting itself forever.
        self.kv_capacity = kv_manager.num_blocks * kv_manager.block_size
        self.waiting = FairQueue()
        self.running: list[Request] = []  # admission order: the last one is the newest
        # Requests whose prefix hit is being loaded from a KV tier (kv_cache.tier_bridge): out of both queues
        # until loads_done puts them back at the front of theirs.
        self.loading: dict[str, Request] = {}
        self._num_running: Counter[str] = Counter()  # owner -> its running sequences
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since the last take_num_preemptions()
        self._last_split = False  # the last step was a prefill step of its own (below): the next one is not
        # The express lane (module docstring): on only where the engine runs express passes.
        self.express_enabled = False
        self._express: dict[str, None] = {}  # ids held out of the main step in flight (an ordered set)
        self._express_refused: set[str] = set()  # no KV room in an express pass: in the next main step
        # A request finished since the last schedule() (an abort between steps, a stop string): the engine
        # steps once more, so that the stat loggers see the freed blocks and the finished request.
        self._finished_since_schedule = False
        # Speculative decoding (engine.spec_decode): drafts for decoding requests; None when off.
        spec = config.speculative_config
        self.spec = SpecDecoder(spec, self.max_model_len) if spec is not None else None
        # The keys of the logits the runner keeps after prompts' last tokens (engine.kept_logits), set by the
        # engine where the runner keeps them: a request whose every token's KV is cached and whose logits are
        # kept is admitted with nothing to compute. None: every request computes at least its last token.
        self.kept_logits: Container[bytes] | None = None

    # ---- admission -------------------------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raises ValueError for a request that can never run. Reads only constants: safe from any thread."""
        if num_prompt_tokens < 1:
            raise ValueError("The prompt must contain at least one token.")
        wanted = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
        if wanted > self.max_model_len:
            completion = (
                f"{max_tokens} in the completion" if max_tokens is not None else "at least 1 to generate"
            )
            raise ContextLengthError(
                self.max_model_len,
                f"you requested {wanted} tokens ({num_prompt_tokens} in the prompt, {completion}). Please "
                "reduce the length of the prompt or the completion.",
            )
        if num_prompt_tokens > self.kv_capacity:
            raise ValueError(
                f"The prompt ({num_prompt_tokens} tokens) can never fit the KV cache, which holds "
                f"{self.kv_capacity} tokens ({self.kv_manager.num_blocks} blocks of {self.kv_manager.block_size})."
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ---- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        owners = set(self._num_running) | set(self.waiting.owners())
        seq_share = max(1, self.max_num_seqs // max(1, len(owners)))
        token_share = max(1, self.max_num_batched_tokens // max(1, len(owners)))
        self._make_room(seq_share, token_share)
        budget = self.max_num_batched_tokens
        given: Counter[str] = Counter()  # tokens scheduled per owner in this step
        scheduled: list[ScheduledRequest] = []
        cut: list[int] = []  # indexes into `scheduled` of prefill chunks cut at their owner's share
        preempted = False
        self._express = {}
        split, self._last_split = self._last_split, False
        if not split and len(self.running) >= PREFILL_STEP_MIN_RUNNING:
            fresh = {owner for owner in self.waiting.owners() if not self._num_running[owner]}
            if fresh:
                budget = self._admit(scheduled, cut, given, budget, seq_share, token_share, fresh)
                if scheduled:  # a step of their own; the running batch goes next (at most every other step)
                    self._last_split = True
                    budget = self._top_up(scheduled, cut, budget)
                    self._finished_since_schedule = False
                    return SchedulerOutput(
                        scheduled, self.max_num_batched_tokens - budget, self.kv_manager.end_pass()
                    )
        if self.spec is not None:
            self.spec.begin_step(self.running, len(self.waiting), self.requests)
        self._express = express = self._pick_express()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in express:  # decoded by the express passes made during this step
                i += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            # A decode (one token) is never cut: it is cheap, and cutting it would stall the sequence.
            num_new = min(remaining, budget, max(1, token_share - given[req.owner]))
            drafts = self.spec.propose(req, budget - 1) if self.spec is not None and remaining == 1 else []
            while self.kv_manager.allocate_slots(req, num_new + len(drafts)) is None:
                if drafts:  # drafts never preempt anyone: without them first
                    drafts = []
                    continue
                preempted = True
                victim = self._kv_victim(i)  # never one scheduled earlier in this loop
                self.running.remove(victim)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if num_new < min(remaining, budget):
                cut.append(len(scheduled))
            scheduled.append(self._scheduled(req, num_new, drafts))
            given[req.owner] += num_new + len(drafts)
            budget -= num_new + len(drafts)
            i += 1
        # Requests just preempted for room must not be overtaken by newer ones in the same step.
        if not preempted:
            budget = self._admit(scheduled, cut, given, budget, seq_share, token_share)
        budget = self._top_up(scheduled, cut, budget)
        self._finished_since_schedule = False
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, self.kv_manager.end_pass())

    def _admit(
        self,
        scheduled: list[ScheduledRequest],
        cut: list[int],
        given: Counter[str],
        budget: int,
        seq_share: int,
        token_share: int,
        only: set[str] | None = None,
    ) -> int:
        """Admits waiting requests into this step while the budget, the slots and the KV cache allow (owners
        in `only`, if given); returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.kv_manager.num_free_blocks == 0:
                break  # every admission needs a new block: skip a lookup that cannot succeed
            req = self._next_to_admit(seq_share, only)
            if req is None:
                break
            hit, kept = self._lookup(req)
            if hit.load:  # a tier holds more of its prefix: load it (only this request waits for it)
                if not self.kv_manager.start_load(req, hit):
                    break
                self.waiting.pop(req)
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = req
                continue
            remaining = req.num_tokens - hit.num_tokens
            num_new = min(remaining, budget, max(1, token_share - given[req.owner]))
            if self.kv_manager.allocate_slots(req, num_new, hit) is None:
                break  # the head waits for blocks rather than letting smaller requests jump ahead
            self._start(req, hit.num_tokens)
            if num_new < min(remaining, budget):
                cut.append(len(scheduled))
            scheduled.append(self._scheduled(req, num_new, kept=kept))
            given[req.owner] += num_new
            budget -= num_new
        return budget

    def _lookup(self, req: Request, in_flight: Collection[int] = ()) -> tuple[ComputedBlocks, bytes | None]:
        """A waiting request's prefix hit, and the key of its kept logits where that hit covers every one of its
        tokens (it then computes nothing: engine.kept_logits); else None, and the hit leaves its last token to
        compute, as always."""
        kept = self.kept_logits
        seq = self.kv_manager.sequence_key(req) if kept is not None else None
        key = seq[0] if seq is not None and kept is not None and seq[0] in kept else None
        hit = self.kv_manager.get_computed_blocks(req, in_flight, whole=key is not None)
        return hit, (key if hit.num_tokens == req.num_tokens else None)

    def _start(self, req: Request, num_hit_tokens: int) -> None:
        """A waiting request, its blocks allocated, joins the running ones."""
        self.waiting.pop(req)
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._num_running[req.owner] += 1

    # ---- the express lane ------------------------------------------------------------------------------

    def _pick_express(self) -> dict[str, None]:
        """The decodes to hold out of the main step being planned (module docstring), as an ordered set."""
        refused, self._express_refused = self._express_refused, set()
        if not self.express_enabled:
            return {}
        small = [
            r.request_id
            for r in self.running
            if self._num_running[r.owner] <= EXPRESS_MAX_SEQS_PER_OWNER
            and r.num_tokens - r.num_computed_tokens == 1
            and r.request_id not in refused
        ]
        if not small or len(small) > EXPRESS_MAX_ROWS:
            return {}
        held = dict.fromkeys(small)
        # The main step's work without them: 16 decodes, or one long prefill chunk, make a step long enough
        # to pause (EXPRESS_MIN_STEP_TOKENS); a shorter one runs straight through, with them in it.
        rest = sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.request_id not in held)
        return held if rest >= EXPRESS_MIN_STEP_TOKENS else {}

    def schedule_express(self, in_flight: Collection[int]) -> SchedulerOutput | None:
        """An express pass, made while the main step runs (between two of its layers) or right after it: one
        decode for each request held out of the main step, then the first chunk of owners that run nothing
        (arrived since). None when there is nothing to run. `in_flight`: the blocks the main step writes
        (`KVCacheManager.last_pass_cached` of its pass), never hit here. Never preempts and never touches a
        request of the main step; one `update` follows it, as for `schedule`."""
        scheduled: list[ScheduledRequest] = []
        budget = EXPRESS_MAX_TOKENS
        for rid in list(self._express):
            req = self.requests.get(rid)
            if (
                req is None
                or req.status is not RequestStatus.RUNNING
                or req.num_tokens - req.num_computed_tokens != 1
            ):
                del self._express[rid]  # finished, preempted, or not decoding
                continue
            if self.kv_manager.allocate_slots(req, 1) is None:
                del self._express[rid]  # no room: the next main step, which may preempt, takes it
                self._express_refused.add(rid)
                continue
            scheduled.append(self._scheduled(req, 1))
            budget -= 1
        fresh = {owner for owner in self.waiting.owners() if not self._num_running[owner]}
        while (
            fresh
            and budget > 0
            and len(scheduled) < EXPRESS_MAX_ROWS
            and len(self.running) < self.max_num_seqs + EXPRESS_MAX_ROWS
        ):
            req = self._next_to_admit(self.max_num_seqs, fresh)
            if req is None:
                break
            hit, kept = self._lookup(req, in_flight)
            if hit.load:
                break  # tier loads start in a main pass
            num_new = min(req.num_tokens - hit.num_tokens, budget)
            if self.kv_manager.allocate_slots(req, num_new, hit) is None:
                break
            self._start(req, hit.num_tokens)
            scheduled.append(sr := self._scheduled(req, num_new, kept=kept))
            if sr.sample:  # its decodes go on in the later express passes of the same main step
                self._express[req.request_id] = None
            budget -= num_new
        if not scheduled:
            return None
        self._finished_since_schedule = False
        return SchedulerOutput(scheduled, EXPRESS_MAX_TOKENS - budget, self.kv_manager.end_pass())

    def has_express(self) -> bool:
        """Whether requests are held out of the main step for express passes."""
        return bool(self._express)

    # ---- fairness --------------------------------------------------------------------------------------

    def _next_to_admit(self, seq_share: int, only: set[str] | None = None) -> Request | None:
        """The next owner in turn that runs fewer than its share of sequences; if every waiting owner is at its
        share, the next in turn anyway (a free slot is never left idle). Only owners in `only`, if given (None
        when none of them waits any more)."""
        first: Request | None = None
        for owner, head in self.waiting.heads():
            if only is not None and owner not in only:
                continue
            if self._num_running[owner] < seq_share:
                return head
            first = first or head
        return first

    def _make_room(self, seq_share: int, token_share: int) -> None:
        """Preempts sequences of owners above their share while an owner below its share waits and the free
        slots or KV blocks could not take its next sequence."""
        while len(self.running) > self.max_num_seqs:  # express passes ran some past it: back within it
            owner = max(self._num_running.items(), key=lambda kv: kv[1])[0]
            victim = next(r for r in reversed(self.running) if r.owner == owner)
            self.running.remove(victim)
            self._preempt(victim)
        starved = [head for owner, head in self.waiting.heads() if self._num_running[owner] < seq_share]
        if not starved:
            return
        bs = self.kv_manager.block_size
        # Blocks the starved heads' first chunks need at most (a prefix hit only lowers it), plus one per
        # running sequence for its next token.
        blocks = sum(-(-min(r.num_tokens, token_share) // bs) for r in starved) + len(self.running)
        while (
            len(self.running) + len(starved) > self.max_num_seqs or blocks > self.kv_manager.num_free_blocks
        ) and self.running:
            owner, count = max(self._num_running.items(), key=lambda kv: kv[1])
            if count <= seq_share:
                return  # nobody is above its share: the starved wait their turn
            victim = next(r for r in reversed(self.running) if r.owner == owner)
            self.running.remove(victim)
            self._preempt(victim)
            blocks -= 1

    def _kv_victim(self, i: int) -> Request:
        """The request to preempt for KV room while running[i] is being scheduled: the newest not yet scheduled
        in this step (running[i:]) of the owner with the most running sequences among them."""
        newest_first = self.running[i:][::-1]
        # max() keeps the first of equals: among owners tied for the most sequences, the newest request's.
        return max(newest_first, key=lambda r: self._num_running[r.owner])

    def _top_up(self, scheduled: list[ScheduledRequest], cut: list[int], budget: int) -> int:
        """Gives the budget nobody else used back to prefill chunks cut at their owner's share."""
        for k in cut:
            if budget <= 0:
                break
            sr = scheduled[k]
            req = self.requests[sr.request_id]
            extra = min(req.num_tokens - req.num_computed_tokens - len(sr.new_token_ids), budget)
            if extra <= 0 or self.kv_manager.allocate_slots(req, len(sr.new_token_ids) + extra) is None:
                continue
            scheduled[k] = self._scheduled(req, len(sr.new_token_ids) + extra)
            budget -= extra
        return budget

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """Applies a step's results: advances num_computed_tokens, appends sampled tokens, checks the
        token-level stop conditions (stop strings are the output processor's) and frees finished requests."""
        updates: list[RequestUpdate] = []
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            error = result.errors.get(sr.request_id)
            if error is None:
                try:
                    update = self._apply(req, sr, result)
                except Exception as exc:  # bad per-request state fails that request only
                    error = repr(exc)
            if error is not None:
                self.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR, error=error)
                update = RequestUpdate(req, [], None)
            if update is not None:
                updates.append(update)
        return updates

    def _apply(self, req: Request, sr: ScheduledRequest, result: RunnerOutput) -> RequestUpdate | None:
        start = req.num_computed_tokens
        req.num_computed_tokens += len(sr.new_token_ids)
        if sr.request_id in result.prompt_logprobs:
            req.add_prompt_logprobs(start, result.prompt_logprobs[sr.request_id])
        if not sr.sample:
            return None
        verified = result.verified.get(sr.request_id)
        if verified is not None:
            return self._apply_verified(req, sr, verified)
        token = result.sampled_token_ids.get(sr.request_id)
        if token is None:
            raise RuntimeError("the model runner returned no token for a request that had to sample")
        req.append_output_token(token)
        logprob = result.logprobs.get(sr.request_id)
        status = self._check_stop(req, token)
        if status is not None:
            self.finish_requests([req.request_id], status)
        return RequestUpdate(req, [token], [logprob] if logprob is not None else None)

    def _apply_verified(self, req: Request, sr: ScheduledRequest, verified: VerifiedDrafts) -> RequestUpdate:
        """A drafted request's tokens, appended and checked one by one as if each came from its own step."""
        assert self.spec is not None  # only a scheduler that drafts gets drafts back
        self.spec.apply(req, len(sr.draft_token_ids), verified)
        tokens: list[int] = []
        status = None
        for token in verified.token_ids:
            req.append_output_token(token)
            tokens.append(token)
            status = self._check_stop(req, token)
            if status is not None:
                break  # what followed would never have been generated
        # The last emitted token is computed by the next step, as after a plain decode step.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if status is not None:
            self.finish_requests([req.request_id], status)
        logprobs = verified.logprobs[: len(tokens)] if verified.logprobs is not None else None
        return RequestUpdate(req, tokens, logprobs)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        # A grammar that has ended (it accepted a stop token) ends the output even short of min_tokens, and
        # under ignore_eos: the sampler let it choose the stop token because nothing else was allowed, and past
        # it the grammar constrains nothing (ignore_eos once let a guided_choice ["a"] go on "a\nassistant...").
        grammar_ended = req.grammar is not None and not req.grammar.active and not req.grammar.rejected
        if req.num_output_tokens >= params.min_tokens or grammar_ended:
            if token in params.stop_token_set:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if (grammar_ended or not params.ignore_eos) and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len or req.num_tokens > self.kv_capacity:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- finishing and preemption ----------------------------------------------------------------------

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None
    ) -> list[Request]:
        """Finishes (aborts, stops, fails) requests now and frees their blocks. Unknown or already finished
        ids are ignored: an abort may race with a normal finish."""
        assert status.is_finished
        done: list[Request] = []
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self._drop_running(req)
                if self.spec is not None:
                    # A plain decode step caches every block its computed tokens fill when it schedules them;
                    # accepted drafts fill blocks in between: cache those too, so the same blocks stay cached
                    # (a no-op without drafts).
                    self.kv_manager.allocate_slots(req, 0)
                self.kv_manager.free(req)
            elif req.status is RequestStatus.LOADING:  # its blocks go when the load is over
                del self.loading[request_id]
                self.kv_manager.free(req)
            else:  # waiting or preempted: holds no blocks
                self.waiting.remove(req)
            req.status = status
            req.error = error
            self._finished_since_schedule = True
            done.append(req)
        return done

    def finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """Finishes one request now (`finish_requests`) or, when the scheduler has already let it go, says how
        it ended after all: a stop string completed by the last allowed token turns "length" into "stop", as
        in vLLM; an abort or failure may reach a sequence that had just finished. Either way `status` has one
        writer, the scheduler."""
        if not self.finish_requests([req.request_id], status, error):
            req.status, req.error = status, error

    def loads_done(self, request_ids: Iterable[str]) -> None:
        """Their tier loads are over (the blocks that arrived are cached): back to the front of the queue."""
        for rid in request_ids:
            req = self.loading.pop(rid, None)
            if req is not None:
                req.status = RequestStatus.WAITING
                self.waiting.push_front(req)

    def _preempt(self, req: Request) -> None:
        """Frees a running request's blocks (the caller took it out of `running`) and requeues it."""
        self._drop_running(req)
        self.kv_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so prepending keeps the older one ahead.
        self.waiting.push_front(req)

    def _drop_running(self, req: Request) -> None:
        self._num_running[req.owner] -= 1
        if not self._num_running[req.owner]:
            del self._num_running[req.owner]

    def _scheduled(
        self, req: Request, num_new: int, drafts: list[int] | None = None, kept: bytes | None = None
    ) -> ScheduledRequest:
        """`kept`: the key of the request's kept logits, its num_new 0 (`_lookup`)."""
        start = req.num_computed_tokens
        sample = start + num_new == req.num_tokens
        keep = None
        # A prompt's end (the first token to sample, not a draft's row): the place a repeated prompt comes back
        # to. A request's later rows are not kept: a sequence rarely comes back ending at one of its outputs.
        if sample and num_new and not drafts and not req.num_output_tokens and self.kept_logits is not None:
            keep = self.kv_manager.sequence_key(req)
        return ScheduledRequest(
            request_id=req.request_id,
            new_token_ids=req.all_token_ids[start : start + num_new] + (drafts or []),
            num_computed_tokens=start,
            block_ids=self.kv_manager.get_block_ids(req.request_id),
            sample=sample,
            sampling_params=req.sampling_params,
            all_token_ids=req.all_token_ids,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            grammar=req.grammar,
            draft_token_ids=drafts or [],
            lora=req.lora,
            eos_token_ids=self.eos_token_ids,
            kept_logits=kept,
            keep_logits=keep,
        )

    # ---- state -----------------------------------------------------------------------------------------

    def take_spec_stats(self) -> SpecDecodingStats | None:
        """The drafts verified since the last call (None: none, or speculation is off)."""
        return self.spec.take_stats() if self.spec is not None else None

    def take_num_preemptions(self) -> int:
        n, self.num_preemptions = self.num_preemptions, 0
        return n

    def check_invariants(self) -> None:
        """For tests, after any step: the per-owner counts match `running`, and every request is in exactly
        one of running / waiting."""
        assert self._num_running == Counter(r.owner for r in self.running), "per-owner running counts drifted"
        assert len(self.running) <= self.max_num_seqs + (EXPRESS_MAX_ROWS if self.express_enabled else 0)
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting] + list(self.loading)
        assert sorted(ids) == sorted(self.requests), "a request is lost or in two queues"
        assert len(self.waiting) == sum(1 for _ in self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_unreported_finishes(self) -> bool:
        return self._finished_since_schedule
