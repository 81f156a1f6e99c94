"""The engine's synchronous core: requests in, one step at a time, `RequestOutput` deltas out.

A step is schedule -> runner.execute -> scheduler.update -> output processing (`OutputProcessor`:
detokenize, stop strings, merge a request's n sequences into one `RequestOutput`) -> the stops it found
applied to the scheduler (`Scheduler.finish`: blocks freed) -> stats to every stat logger. Flows go one way:
the output processor never calls the scheduler, the engine hands its stops on. The core knows nothing of threads or asyncio (`AsyncEngine` drives it from one thread), so tests
drive it directly with a fake runner.

Express passes (engine.express): a main step may pause between two layers of its forward, and the core
runs a short step of other requests there (`step(between=...)`), whose outputs go to their callers at once.

Failure rules: an exception while handling one request (adding it, its tokens, its text) fails that request
only, with an error output, and so does a runner failure that one request is to blame for
(`engine.attribution`); any other exception from the runner propagates: the caller treats it as fatal.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from time import perf_counter  # a step's own duration (engine.spec_cost): never the requests' clock
from typing import TYPE_CHECKING, Protocol

from engine.attribution import execute_attributing
from engine.config import EngineConfig
from engine.errors import PromptTokenError
from engine.express import ExpressPacer, Interjection
from engine.output_processor import OutputProcessor, Processed, error_output
from engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from engine.request import Origin, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import EXPRESS_MIN_STEP_TOKENS, Scheduler
from engine.structured_output import CompiledGrammar, grammar_states
from kv_cache.manager import KVCacheManager
from kv_cache.namespace import CacheNamespace, Owner
from kv_cache.stats import KVCacheEvent
from metrics.stats import IterationStats, SchedulerStats

if TYPE_CHECKING:
    from engine.kept_logits import KeptLogits
    from engine.kv_tiers import KVTiers
    from engine.lora.manager import LoRAAdapter

logger = logging.getLogger(__name__)


class Runner(Protocol):
    num_blocks: int
    block_size: int
    max_model_len: int
    is_causal: bool

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


class Detokenizes(Protocol):
    eos_token_ids: frozenset[int]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Detokenizes,
        config: EngineConfig | None = None,
        *,
        kv_event_sink: Callable[[list[KVCacheEvent]], None] | None = None,
    ) -> None:
        """Reads max_model_len (default: the runner's), enable_prefix_caching, prefix_caching_hash_algo and
        stat_loggers from `config`, and hands it on to the scheduler. kv_event_sink: receives the KV cache
        events of each step (and of a reset) as one batch, on the step's thread
        (`engine.kv_event_publisher.KVEventPublisher.publish`); None records no events."""
        config = config or EngineConfig()
        config = dataclasses.replace(config, max_model_len=config.max_model_len or runner.max_model_len)
        enable_prefix_caching = config.enable_prefix_caching
        if enable_prefix_caching and not runner.is_causal:
            logger.info(
                "prefix caching disabled: the model is not causal, so a prefix's K/V depends on what follows"
            )
            enable_prefix_caching = False
        self.runner = runner
        self.tokenizer = tokenizer
        # The ids a prompt may hold: the smaller of the model's and the tokenizer's vocabularies (either may
        # be the larger: added tokens past the embedding, or an embedding padded past the tokenizer). None:
        # neither says (test doubles).
        sizes = [
            v for v in (getattr(runner, "vocab_size", None), getattr(tokenizer, "vocab_size", None)) if v
        ]
        self.vocab_size: int | None = min(sizes) if sizes else None
        # KV tiers behind the pool (--kv-host-memory, --kv-disk-dir): engine.kv_tiers, which imports torch.
        self.tiers: KVTiers | None = None
        if enable_prefix_caching and (config.kv_host_memory or config.kv_disk_dir):
            from engine.kv_tiers import build_tiers

            self.tiers = build_tiers(config, runner)
        self.kv_manager = KVCacheManager(
            runner.num_blocks,
            runner.block_size,
            enable_caching=enable_prefix_caching,
            hash_algo=config.prefix_caching_hash_algo,
            enable_events=kv_event_sink is not None,
            none_hash=self.tiers.none_hash if self.tiers is not None else None,
            max_retained_fraction=config.max_retained_fraction,
        )
        if self.tiers is not None:
            self.kv_manager.attach_tiers(self.tiers)
        self.kv_event_sink = kv_event_sink
        self.scheduler = Scheduler(self.kv_manager, config, eos_token_ids=tokenizer.eos_token_ids)
        # The logits the runner keeps after prompts' last tokens (engine.kept_logits), where it keeps them: the
        # scheduler admits a prompt sent again with nothing to compute.
        self.kept_logits: KeptLogits | None = (
            getattr(runner, "kept_logits", None) if enable_prefix_caching else None
        )
        self.scheduler.kept_logits = self.kept_logits
        # The express lane (engine.express), where the runner pauses between layers.
        self.scheduler.express_enabled = config.express_lane and bool(
            getattr(runner, "yields_between_layers", False)
        )
        self._pacer = ExpressPacer()
        self._paused = 0.0  # seconds the main step in flight spent paused (express passes): not its own time
        # Requests that failed in an express pass made inside the step in flight: their cached blocks were not
        # computed, and that step's end hands the tiers every block cached meanwhile (see _run).
        self._failed_inside: set[str] = set()
        self.max_model_len = self.scheduler.max_model_len
        self.num_blocks = runner.num_blocks  # the KV pool's size, in blocks of block_size tokens
        self.block_size = runner.block_size
        # The LoRA adapters (engine.lora.manager.LoRAManager; thread-safe), None without --enable-lora.
        self.loras = getattr(runner, "lora", None)
        self.stat_loggers = list(config.stat_loggers)
        self._lora_requests: dict[str, int] = {}  # API requests added per LoRA adapter, since the last record
        self.outputs = OutputProcessor(tokenizer.decode)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_manager.enable_caching

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """ValueError for a request that can never run. Reads only constants: safe from any thread."""
        params.validate()
        vocab = self.vocab_size
        if (
            vocab is not None
            and prompt_token_ids
            and not 0 <= min(prompt_token_ids) <= max(prompt_token_ids) < vocab
        ):
            raise PromptTokenError(vocab)
        self.scheduler.check_request(len(prompt_token_ids), params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        origin: Origin | None = None,
        arrival_time: float | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> list[RequestOutput]:
        """Queues a request (n sequences). Returns an error output if it cannot be added, else [].
        `origin`: its cache namespace and the API request it is part of (`Origin`; None: unsalted, alone).
        Its sequences share one fair share: the namespace's if it has one, else its group's, else this
        request's (`fair_share_key`). `grammar` (compiled off this thread) constrains every sequence's
        output; each gets its own matcher."""
        namespace = origin.namespace if origin is not None else None
        group = origin.group if origin is not None else None
        try:
            self.check_request(prompt_token_ids, params)
            lora = self._lora_of(namespace)
            arrival = time.monotonic() if arrival_time is None else arrival_time
            children = []
            states = grammar_states(grammar, params.n)  # one mask budget for all n sequences
            for i in range(params.n):
                # Child i of a seeded request uses seed + i, so the n samples differ yet are reproducible.
                child_params = dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i
                )
                child_id = request_id if params.n == 1 else f"{i}_{request_id}"
                hasher = self.kv_manager.make_hasher(namespace, prompt_token_ids)
                children.append(
                    Request(
                        child_id,
                        prompt_token_ids,
                        child_params,
                        namespace,
                        hasher,
                        arrival,
                        index=i,
                        owner=group or request_id,
                        grammar=states[i],
                        lora=lora,
                    )
                )
            self.outputs.add(request_id, prompt_token_ids, children)
            if lora is not None:
                self._lora_requests[lora.name] = self._lora_requests.get(lora.name, 0) + 1
        except Exception as exc:
            return [error_output(request_id, prompt_token_ids, params.n, str(exc))]
        for child in children:
            self.scheduler.add_request(child)
        return []

    def _lora_stats(self, sched: SchedulerStats) -> None:
        """The LoRA fields of a step's record (vLLM's lora_requests_info): adapters running and waiting."""
        manager = self.loras
        if manager is None:
            return
        sched.max_lora = manager.max_loras
        running = {r.lora.name for r in self.scheduler.running if r.lora is not None}
        waiting = {r.lora.name for r in self.scheduler.waiting if r.lora is not None}
        sched.running_lora_adapters, sched.waiting_lora_adapters = (
            tuple(sorted(running)),
            tuple(sorted(waiting)),
        )
        sched.lora_requests, self._lora_requests = self._lora_requests, {}

    def _lora_of(self, namespace: CacheNamespace | None) -> LoRAAdapter | None:
        """The LoRA adapter the namespace names (engine.lora), None for the base model; raises if unservable."""
        if self.loras is not None:
            return self.loras.resolve(namespace)
        if namespace is not None and namespace.lora is not None:
            raise ValueError("this engine serves no LoRA adapters (--enable-lora is off)")
        return None

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Aborts every sequence of a request now (its blocks are freed). Unknown ids: nothing."""
        return self._apply_stops(self.outputs.finish(request_id, RequestStatus.FINISHED_ABORTED))

    def _apply_stops(self, processed: Processed) -> list[RequestOutput]:
        """Finishes in the scheduler the sequences the output processor ended (their blocks are freed)."""
        for stop in processed.stops:
            self.scheduler.finish(stop.request, stop.status, stop.error)
        return processed.outputs

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forgets every cached prefix; False (nothing changes) while a request holds blocks, unless `force`
        (blocks in use then lose their hashes and keep serving). A reset is recorded to the stat loggers at
        once: the engine may stay idle for long (no step, no record), and `/metrics` would show the old cache
        until the next request."""
        if self.tiers is not None:
            self._drain_tier_writes()
        if not self.kv_manager.reset_prefix_cache(force):
            return False
        if self.kept_logits is not None:
            self.kept_logits.clear()
        if self.tiers is not None:
            self.tiers.clear()  # the tiers forget every block too: a reset reaches the disk
        self._publish_events()
        self._record_stats(IterationStats(), prefix_cache_reset=True)
        return True

    def forget_prefix_cache(self, owner: Owner) -> int:
        """Forgets `owner`'s cached private blocks (a tenant's reset, allowed while requests run); returns
        how many. Recorded to the stat loggers at once, like a reset (the cached-blocks gauge moves)."""
        n = self.kv_manager.forget(owner)
        if self.kept_logits is not None:  # unreachable without its blocks' KV, but its prompts' all the same
            self.kept_logits.forget(owner)
        if self.tiers is not None:
            self.tiers.forget(owner)  # and its blocks in the tiers (files on disk deleted)
        self._publish_events()
        self._record_stats(IterationStats())
        return n

    def set_public_prefixes(self, prefixes: list[list[int]]) -> None:
        """Declares the public prefixes (token ids, `--public-prefix`) for every request added from now on."""
        self.kv_manager.set_public_prefixes(prefixes)

    def num_used_blocks(self) -> int:
        """KV blocks with a reference now (requests', retention's, tier pins'): 0 once nothing holds any,
        which the leak checks of tests and benchmarks wait for."""
        return self.kv_manager.num_blocks - self.kv_manager.num_free_blocks

    def has_work(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self.scheduler.has_unreported_finishes()
            or self.kv_manager.tier_busy
        )

    # ---- KV tiers --------------------------------------------------------------------------------------

    def _pump_tiers(self) -> None:
        """Take what the tier threads finished: unpin copied-out blocks, requeue requests whose loads ended."""
        assert self.tiers is not None
        loaded, unpin = self.tiers.poll()
        if unpin:
            self.kv_manager.unpin(unpin)
        if loaded:
            self.scheduler.loads_done(self.kv_manager.finish_loads(loaded))

    def _drain_tier_writes(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until no block is pinned for a write, so that a reset finds them free."""
        assert self.tiers is not None
        deadline = time.monotonic() + timeout
        self.tiers.submit_writes(self.kv_manager.take_writes())
        while (
            self.kv_manager.tiers is not None and self.kv_manager.tiers.pins and time.monotonic() < deadline
        ):
            self.tiers.wait(0.01)
            self._pump_tiers()

    def close(self) -> None:
        """Finish the tiers' queued writes and save the disk index (a restart finds every block)."""
        if self.tiers is not None:
            self.tiers.submit_writes(self.kv_manager.take_writes())
            self.tiers.close()

    def step(self, between: Interjection | None = None) -> list[RequestOutput]:
        """One main step (and express passes, engine.express). `between`: the driver's side of a pause in the
        step (new requests in, express outputs out at once); None: no pause, and the express outputs of the
        pass after the step come with the step's."""
        if self.tiers is not None:
            self._pump_tiers()
        sched_out = self.scheduler.schedule()
        if self.tiers is not None:
            self.tiers.submit_loads(self.kv_manager.take_loads())
        hook = None
        served = [False]
        if between is not None and self.scheduler.express_enabled:
            if sched_out.num_batched_tokens >= EXPRESS_MIN_STEP_TOKENS:
                in_flight = self.kv_manager.last_pass_cached  # the main step writes them: never hit

                def hook() -> None:
                    if self._pacer.due():
                        paused = perf_counter()
                        between.poll()
                        outputs = self._express_pass(in_flight, inside=True)
                        served[0] = served[0] or bool(outputs)
                        between.emit(outputs)
                        self._paused += perf_counter() - paused

        outputs = self._run(sched_out, hook)
        if self.scheduler.has_express() and (not served[0] or self._pacer.due()):
            outputs += self._express_pass(frozenset())  # held out of the step: their token now
        return outputs

    def _express_pass(self, in_flight: frozenset[int], inside: bool = False) -> list[RequestOutput]:
        """`inside`: made during a pause of the main step (which writes the `in_flight` blocks)."""
        sched_out = self.scheduler.schedule_express(in_flight)
        if sched_out is None:
            return []
        with self._pacer.timing():
            return self._run(sched_out, inside=inside)

    def _run(
        self,
        sched_out: SchedulerOutput,
        between_layers: Callable[[], None] | None = None,
        inside: bool = False,
    ) -> list[RequestOutput]:
        """Runs a scheduled step and applies its results: the outputs of its requests. `inside`: an express
        pass inside a paused step, which leaves the tiers' writes to that step's end."""
        now = time.monotonic()
        for sr in sched_out.scheduled:
            req = self.scheduler.requests[sr.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        if not inside:
            self._paused = 0.0
        started = perf_counter()
        result = (
            execute_attributing(self.runner, sched_out, between_layers)
            if sched_out.scheduled
            else RunnerOutput({})
        )
        spec = self.scheduler.spec
        if spec is not None and not inside and sched_out.decode_only():
            # What a draft row costs here, for "auto" min_draft_acceptance (engine.spec_cost): timed only where
            # the step is nothing but decode rows, less the express passes made while it was paused.
            drafts = sum(len(sr.draft_token_ids) for sr in sched_out.scheduled)
            spec.observe_step(len(sched_out.scheduled), drafts, perf_counter() - started - self._paused)
        if self.tiers is not None and inside:
            # The blocks cached so far include the paused step's, not computed yet: they all go out at its end
            # (a pinned block is never reused meanwhile), but for those this pass failed to compute.
            self._failed_inside.update(result.errors)
        elif self.tiers is not None:
            # The step computed the blocks its pass cached: copy them out (off this thread).
            failed, self._failed_inside = self._failed_inside | set(result.errors), set()
            self.tiers.submit_writes(self.kv_manager.take_writes(failed))
            if not sched_out.scheduled:
                self.tiers.wait(0.002)  # only loads or writes pending: don't spin
        updates = self.scheduler.update(sched_out, result)
        iteration = IterationStats()
        for sr in sched_out.scheduled:  # prompt tokens computed (hits and recomputed outputs excluded)
            iteration.num_prompt_tokens += max(
                0, min(sr.num_prompt_tokens - sr.num_computed_tokens, len(sr.new_token_ids))
            )
        iteration.num_kept_logits_hits = sum(
            1
            for sr in sched_out.scheduled
            if sr.kept_logits is not None and sr.request_id not in result.errors
        )
        iteration.spec_decoding = self.scheduler.take_spec_stats()
        outputs = self._apply_stops(self.outputs.process(updates, iteration))
        self._publish_events()
        self._record_stats(iteration)
        return outputs

    def _publish_events(self) -> None:
        if self.kv_event_sink is None:
            return
        events = self.kv_manager.take_events()
        if events:
            try:
                self.kv_event_sink(events)
            except Exception:  # a broken event stream must not take the engine down
                logger.exception("KV event sink failed")

    # ---- stats -----------------------------------------------------------------------------------------

    def _record_stats(self, iteration: IterationStats, prefix_cache_reset: bool = False) -> None:
        if not self.stat_loggers:
            self.kv_manager.make_prefix_cache_stats()  # keep the counters from growing unread
            self.scheduler.take_num_preemptions()
            return
        sched = SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_manager.usage,
            num_cached_blocks=self.kv_manager.num_cached_blocks,
            prefix_cache=self.kv_manager.make_prefix_cache_stats(),  # kv_cache's record, handed on whole
            num_preemptions=self.scheduler.take_num_preemptions(),
            prefix_cache_reset=prefix_cache_reset,
        )
        self._lora_stats(sched)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(sched, iteration)
            except Exception:  # a broken logger must not take the engine down
                logger.exception("stat logger %r failed", stat_logger)
