"""ModelRunner: a SchedulerOutput in, one token per sampling request out.

Owns the model, the KV tensors (`engine.kv_store.KVStore`), the attention backend, the native decoder stack
where the architecture declares it, and the sampler: it assembles engine/model's parts (the model from
`loading`, the backend from `attention.chooser`, the stack from `models.native_stack`) and hands the model one
`ForwardContext` per step. Per step it builds host lists
once, sends them with one host->device copy (input ids, positions, slots and logits rows share one int64
tensor), runs the model, samples, and brings every result back with one device->host sync (tokens and
logprobs packed into one float64 tensor: token ids are exact in float64).

Rows of the logits, in order: one per request that samples (its last new token; a request with speculative
drafts, one per draft and one before them: engine.spec_verify), then for requests asking prompt logprobs, one
per new token whose next token is still a prompt token.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.grammar_masks import MaskFiller, StepMasks
from engine.kept_logits import KeptLogits
from engine.kv_store import KVStore
from engine.lora.manager import LoRAManager
from engine.model.attention.base import AttentionBackend, AttentionMetadata, slot_ids
from engine.model.attention.chooser import select_backend
from engine.model.attention.flex import FlexBackend
from engine.model.attention.native import NativeBackend
from engine.model.cuda_graphs import GraphRunner, StaticFlexAttention
from engine.model.device import resolve_device, resolve_dtype, resolve_kv_dtype
from engine.model.graph_plan import Q_BLOCK, PaddedStep, buckets_up_to, pad_step
from engine.model.kernels.build import describe as describe_kernels
from engine.model.layers.linear import PackedLinear
from engine.model.layers.quant_linear import QuantLinear
from engine.model.loading.loader import load_model
from engine.model.models.context import ForwardContext
from engine.model.models.native_stack import NativeStack
from engine.model.transfer import index_tensor, to_device
from engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprob
from engine.sampler import INVALID_TOKEN, LogprobsOut, Sampler, SamplerOutput, token_logprobs
from engine.spec_verify import accept, sampling_rows

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 * 2**30
CUDA_KV_FRACTION = 0.9
CUDA_HEADROOM_BYTES = 512 * 2**20  # activations and logits of the largest step stay outside the KV budget


class ModelRunner:
    def __init__(self, engine_config: EngineConfig) -> None:
        """Reads model (a resolved directory), device, dtype, block_size, kv_cache_memory, num_blocks,
        max_num_batched_tokens, max_num_seqs, batch_invariant, quantization, quantize_activations, enforce_eager and the LoRA
        settings from `engine_config`; the model's own config is `self.model_config`."""
        config = engine_config
        if config.model is None:
            raise ValueError("the runner needs a model directory (engine.model.loading.files.resolve_model)")
        block_size, num_blocks = config.block_size, config.num_blocks
        kv_cache_memory, batch_invariant = config.kv_cache_memory, config.batch_invariant
        max_num_batched_tokens, max_num_seqs = config.max_num_batched_tokens, config.max_num_seqs
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, self.dtype, self.device
        )  # before the slow load
        self.batch_invariant = batch_invariant
        self.model = load_model(
            Path(config.model),
            self.device,
            self.dtype,
            batch_invariant=batch_invariant,
            quantized=config.quantization == "auto",
            quantize_activations=config.quantize_activations,
        )
        cfg = self.model_config = self.model.cfg
        self.capabilities = self.model.capabilities  # the native paths the architecture declares
        self.architecture = cfg.architecture
        self.is_causal = cfg.is_causal
        self.max_model_len = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.block_size = block_size
        shape = (cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        if num_blocks is None:
            budget = kv_cache_memory if kv_cache_memory is not None else self._default_kv_budget()
            self.kv_store = KVStore.from_budget(budget, *shape)
        else:
            self.kv_store = KVStore(cfg.num_layers, num_blocks, *shape[1:])
        self.num_blocks = num_blocks = self.kv_store.num_blocks
        # Flex pads each request's queries to 16 rows: bound the padded rows of the largest step.
        max_rows = max_num_batched_tokens + 16 * max_num_seqs
        # The one choice of attention for this engine: every step's ForwardContext carries it.
        self.attn_backend: AttentionBackend = select_backend(
            self.device,
            num_blocks,
            block_size,
            max_rows,
            head_dim=cfg.head_dim,
            batch_invariant=batch_invariant,
        )
        if self.kv_dtype != self.dtype and not isinstance(self.attn_backend, NativeBackend):
            raise ValueError(
                f"--kv-cache-dtype float16 under float32 needs Brine's CPU attention (native), and this engine "
                f"has {self.attention_backend}: the kernels did not build, or BRINE_ATTENTION_BACKEND chose another"
            )
        self.sampler = Sampler(
            self.device, cfg.vocab_size
        )  # EOS ids come with each request (the scheduler's)
        self.grammar_masks = MaskFiller(cfg.vocab_size)
        # The logits after prompts' last tokens (engine.kept_logits): a prompt sent again samples from them with
        # no forward. Only where the kernels are batch invariant, which makes them the bits a forward would give.
        self.kept_logits = KeptLogits(cfg.vocab_size) if batch_invariant else None
        # Adapters add their deltas from Python (engine.model.layers.lora), which the native stack would skip: with
        # --enable-lora every step runs the Python layers, so a base row's bits never depend on its neighbours.
        self.lora = LoRAManager.from_config(config, self.model, self.device) if config.enable_lora else None
        self.layer_stack, why_not = self._layer_stack(config.enforce_eager)
        # CUDA graphs for short steps (engine.model.cuda_graphs); None on CPU, whose path never pads.
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda":
            self.graphs = self._capture_graphs(config)
        logger.info(
            "model %s on %s (%s), kernels %s, linears %s, attention backend %s, layers %s, native paths "
            "declared: %s, batch invariance %s",
            self.architecture,
            self.device,
            str(self.dtype).removeprefix("torch.")
            + (
                ""
                if self.kv_dtype == self.dtype
                else f", KV cache {str(self.kv_dtype).removeprefix('torch.')}"
            ),
            describe_kernels() if self.device.type == "cpu" else "cuda",
            self.linear_weights,
            self.attention_backend,
            "in one native call per step" if self.layer_stack else f"from Python ({why_not})",
            self.capabilities.describe(),
            "on" if batch_invariant else "off",
        )

    def _layer_stack(self, enforce_eager: bool) -> tuple[NativeStack | None, str]:
        """The native decoder stack where it may run, else (None, why not)."""
        if enforce_eager:
            return None, "--enforce-eager"
        if self.lora is not None:
            return None, "--enable-lora"
        if not self.capabilities.native_stack:
            return None, f"{self.architecture} declares no native decoder stack"
        return NativeStack.build(self.model, self.attn_backend)

    def _capture_graphs(self, config: EngineConfig) -> GraphRunner | None:
        """CUDA graphs of the short steps, captured now (each capture's time is logged), or None with the
        reason logged. Untested on a GPU as of issue 33's CPU preparation (see engine.model.cuda_graphs)."""
        cfg = self.model_config
        why = None
        if config.enforce_eager:
            why = "--enforce-eager"
        elif self.lora is not None:
            why = "--enable-lora"
        elif not isinstance(self.attn_backend, FlexBackend) or self.attn_backend.failed:
            why = f"the attention backend is {self.attention_backend}, not flex"
        elif any(w is not None for w in cfg.sliding_windows):
            why = "sliding-window layers"
        if why is not None:
            logger.info("CUDA graphs off: %s", why)
            return None
        buckets = buckets_up_to(config.max_num_batched_tokens)
        max_len = min(config.max_model_len or self.max_model_len, self.max_model_len)
        try:
            attention = StaticFlexAttention(
                self.device, self.num_blocks, self.block_size, max(buckets) * Q_BLOCK, compile=True
            )
            graphs = GraphRunner(
                self.model,
                self.kv_store.k_caches,
                self.kv_store.v_caches,
                attention,
                self.block_size,
                max_len,
                buckets,
                self.is_causal,
            )
            graphs.capture()
        except Exception as exc:  # a capture that fails leaves the eager path, which serves every step
            logger.warning("CUDA graphs off: capture failed (%s: %s)", type(exc).__name__, exc, exc_info=exc)
            return None
        return graphs

    @property
    def linear_weights(self) -> str:
        """How the linears hold their weights: 'N Q4_1, M Q8_0, K dense', counted over the model's modules."""
        kinds: dict[str, int] = {}
        for module in self.model.modules():
            if isinstance(module, QuantLinear):
                kind = module.kind
            elif isinstance(module, (nn.Linear, PackedLinear)):
                kind = "dense"
            else:
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))

    @property
    def attention_backend(self) -> str:
        backend = self.attn_backend
        return f"{backend.name} (failed over to sdpa)" if backend.failed else backend.name

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, int(free * CUDA_KV_FRACTION) - CUDA_HEADROOM_BYTES)

    @property
    def yields_between_layers(self) -> bool:
        """Whether `execute` calls a `between_layers` hook between decoder layers (on CPU; on CUDA the
        forward is queued ahead of the host, so a pause between layers would only stall the device)."""
        return self.device.type == "cpu"

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, between_layers: Callable[[], None] | None = None) -> RunnerOutput:
        """Runs one step. `between_layers`: called between two decoder layers of the forward (CPU only; see
        `ForwardContext.between_layers`), for the engine's express steps (engine.express)."""
        if out.block_copies:
            self.kv_store.copy_blocks(out.block_copies)
        errors = {r.request_id: why for r in out.scheduled if (why := self._invalid(r)) is not None}
        reqs = [r for r in out.scheduled if r.request_id not in errors] if errors else out.scheduled
        # Requests that compute nothing and sample from kept logits: their rows are read now, before the
        # forward (an express pass inside it may keep others and push these out).
        kept = [r for r in reqs if r.kept_logits is not None]
        kept_rows = self._kept_rows(kept)
        if kept:
            reqs = [r for r in reqs if r.kept_logits is None]
        if not reqs and not kept:
            return RunnerOutput({}, errors=errors)
        if self.graphs is not None and not kept:  # CUDA only: short steps replay a captured graph
            lists = self._host_lists(reqs)
            graphed = self._graphed(reqs, lists)
            if graphed is not None:
                rows, padded = graphed
                with self.grammar_masks.filling(rows.sampling) as masks:
                    logits = self.graphs.run(padded)[: padded.num_rows]
                    self._keep(rows.sampling, logits)
                    result = self._sample(rows, logits, masks)
                result.errors.update(errors)
                return result
            step = self._prepare(reqs, lists)
        elif reqs:
            step = self._prepare(reqs)
        else:
            step = None
        rows = _Rows([], [], []) if step is None else step
        if kept:  # after the forward's sampling rows (the prompt-logprob rows come after them all)
            rows = _Rows(rows.sampling + kept, rows.prompt_spans, rows.drafted)
        adapters = self.lora.step(reqs) if self.lora is not None and reqs else contextlib.nullcontext()
        # Grammar masks are filled on their own thread while the forward runs (engine.grammar_masks).
        hook = between_layers if self.yields_between_layers else None
        with self.grammar_masks.filling(rows.sampling) as masks, adapters:
            if step is None:
                assert kept_rows is not None  # nothing to compute: every request sampled from a kept row
                logits = kept_rows
            else:
                logits = self._run(step, hook)
                self._keep(step.sampling, logits)
                if kept_rows is not None:
                    ns = len(step.sampling)
                    logits = torch.cat((logits[:ns], kept_rows, logits[ns:]))
            result = self._sample(rows, logits, masks)
        result.errors.update(errors)
        return result

    def _kept_rows(self, kept: list[ScheduledRequest]) -> torch.Tensor | None:
        """The kept logits rows of the requests scheduled with them, in order (`_invalid` checked that they are
        there); None for none."""
        store = self.kept_logits
        if not kept or store is None:
            return None
        rows = []
        for r in kept:
            row = store.get(r.kept_logits) if r.kept_logits is not None else None
            assert row is not None, "_invalid checked that its kept row is there"
            rows.append(row)
        return torch.stack(rows)

    def _keep(self, sampling: list[ScheduledRequest], logits: torch.Tensor) -> None:
        """Keep the rows of requests that asked for it (a prompt's end; never a drafted request's rows)."""
        if self.kept_logits is None:
            return
        for i, r in enumerate(sampling):
            if r.keep_logits is not None and not r.draft_token_ids:
                key, owner = r.keep_logits
                self.kept_logits.put(key, logits[i], owner)

    def _invalid(self, r: ScheduledRequest) -> str | None:
        """Why one request cannot run in this step (it fails alone; the batch goes on), or None."""
        start, n = r.num_computed_tokens, len(r.new_token_ids)
        if r.kept_logits is not None:
            if n or not r.sample or self.kept_logits is None or r.kept_logits not in self.kept_logits:
                return "its kept logits are gone (engine.kept_logits)"
            return None
        if n < 1 or len(r.block_ids) * self.block_size < start + n:
            return f"{n} new tokens, {len(r.block_ids)} blocks for {start + n}"
        if min(r.new_token_ids) < 0 or max(r.new_token_ids) >= self.vocab_size:
            return f"token id out of range for a vocabulary of {self.vocab_size}"
        return None

    def _host_lists(self, reqs: list[ScheduledRequest]) -> _HostLists:
        """The step's token lists, built once on the host."""
        bs = self.block_size
        lists = _HostLists([], [], [], [], [], [])
        input_ids, positions, slots = lists.input_ids, lists.positions, lists.slots
        sample_rows, prompt_rows, prompt_spans = lists.sample_rows, lists.prompt_rows, lists.prompt_spans
        for r in reqs:  # each checked by _invalid
            start, n = r.num_computed_tokens, len(r.new_token_ids)
            ctx = start + n
            row0 = len(input_ids)
            input_ids += r.new_token_ids
            positions += range(start, ctx)
            slots += slot_ids(r.block_ids, start, ctx, bs)
            if r.sample:  # the last token's row, after those of the drafts' positions
                sample_rows += range(row0 + n - 1 - len(r.draft_token_ids), row0 + n)
            if r.sampling_params.prompt_logprobs is not None:
                # rows whose next token is still a prompt token
                count = min(ctx, r.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_spans.append((r, len(prompt_rows), count))
                    prompt_rows += range(row0, row0 + count)
        return lists

    def _prepare(self, reqs: list[ScheduledRequest], lists: _HostLists | None = None) -> _Step:
        """Host lists for the step, sent to the device in one copy."""
        h = lists if lists is not None else self._host_lists(reqs)
        input_ids, positions, slots = h.input_ids, h.positions, h.slots
        t = len(input_ids)
        host = torch.tensor(input_ids + positions + slots + h.sample_rows + h.prompt_rows, dtype=torch.int64)
        dev = to_device(host, self.device)
        meta = AttentionMetadata(
            query_lens=[len(r.new_token_ids) for r in reqs],
            context_lens=[r.num_computed_tokens + len(r.new_token_ids) for r in reqs],
            block_tables=[r.block_ids for r in reqs],
            block_size=self.block_size,
            slot_mapping=dev[2 * t : 3 * t],
            is_causal=self.is_causal,
        )
        sampling, drafted = sampling_rows(reqs)
        return _Step(
            sampling=sampling,
            prompt_spans=h.prompt_spans,
            drafted=drafted,
            input_ids=dev[:t],
            positions=dev[t : 2 * t],
            meta=meta,
            logits_indices=dev[3 * t :],
            logits_rows=h.sample_rows + h.prompt_rows,
        )

    def _graphed(self, reqs: list[ScheduledRequest], h: _HostLists) -> tuple[_Rows, PaddedStep] | None:
        """The step padded to a captured bucket (CUDA graphs), or None where it runs eagerly: no graphs,
        prompt logprobs, no row to sample, more tokens than the largest bucket, a context past the plan's."""
        graphs = self.graphs
        if graphs is None or h.prompt_rows or not h.sample_rows:
            return None
        context_lens = [r.num_computed_tokens + len(r.new_token_ids) for r in reqs]
        bucket = graphs.bucket(len(h.input_ids), max(context_lens))
        if bucket is None:
            return None
        padded = pad_step(
            bucket,
            h.input_ids,
            h.positions,
            h.slots,
            h.sample_rows,
            [len(r.new_token_ids) for r in reqs],
            context_lens,
            [r.block_ids for r in reqs],
        )
        sampling, drafted = sampling_rows(reqs)
        return _Rows(sampling, [], drafted), padded

    def _run(self, step: _Step, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """The model over the step: [sampling rows + prompt-logprob rows, vocab] float32 logits."""
        ctx = ForwardContext.for_step(
            self.attn_backend,
            step.meta,
            step.positions,
            self.kv_store.k_caches,
            self.kv_store.v_caches,
            step.logits_indices,
            self.layer_stack,
            between_layers,
            step.logits_rows,
        )
        return self.model(step.input_ids, ctx)

    def _sample(self, step: _Rows, logits: torch.Tensor, masks: StepMasks | None = None) -> RunnerOutput:
        """Sampled tokens and logprobs, brought back with the step's one device->host sync."""
        sampling, prompt_spans = step.sampling, step.prompt_spans
        ns = len(sampling)
        parts: list[torch.Tensor] = []
        sampled = self.sampler(logits[:ns], sampling, masks) if sampling else None
        if sampled is not None:
            parts.append(sampled.token_ids)
            if sampled.logprobs is not None:
                parts += _flat(sampled.logprobs)
        prompt_lp = None
        targets = [
            r.all_token_ids[r.num_computed_tokens + i + 1] for r, _, c in prompt_spans for i in range(c)
        ]
        if prompt_spans:
            k = max(r.sampling_params.prompt_logprobs or 0 for r, _, _ in prompt_spans)
            tgt = index_tensor(targets, self.device)
            prompt_lp = token_logprobs(logits[ns:], tgt, k)
            parts += _flat(prompt_lp)
        # The step's only device->host sync: every result in one float64 tensor (token ids are exact).
        values = torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).tolist() if parts else []
        return _unpack(values, sampling, sampled, prompt_spans, targets, prompt_lp, step.drafted)


@dataclass(slots=True)
class _HostLists:
    """One step's host lists (`_host_lists`), before they are sent."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    sample_rows: list[int]  # flat token index of each sampling row
    prompt_rows: list[int]  # flat token index of each prompt-logprob row
    prompt_spans: list[tuple[ScheduledRequest, int, int]]  # (request, first row, count)


@dataclass(slots=True)
class _Rows:
    """What `_sample` needs to read a step's logits back."""

    sampling: list[ScheduledRequest]  # the requests that sample, in row order (one per verified position)
    prompt_spans: list[tuple[ScheduledRequest, int, int]]  # (request, first prompt row, count)
    drafted: list[tuple[ScheduledRequest, int]]  # requests with drafts: (request, first of its sampling rows)


@dataclass(slots=True)
class _Step(_Rows):
    """One step's device inputs (from `_prepare`) beside its rows."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N]: one row per sampling request, then the prompt-logprob rows
    logits_rows: list[int]  # the same rows on the host


def _unpack(
    values: list[float],
    sampling: list[ScheduledRequest],
    sampled: SamplerOutput | None,
    prompt_spans: list[tuple[ScheduledRequest, int, int]],
    prompt_targets: list[int],
    prompt_lp: LogprobsOut | None,
    drafted: list[tuple[ScheduledRequest, int]],
) -> RunnerOutput:
    """Split the one synced list back into records, in the order execute() packed them."""
    pos = 0

    def take(n: int) -> list[float]:
        nonlocal pos
        pos += n
        return values[pos - n : pos]

    result = RunnerOutput({})
    if sampled is not None:
        tokens = [int(x) for x in take(len(sampling))]
        verified = {first + i for r, first in drafted for i in range(len(r.draft_token_ids) + 1)}
        by_row: dict[int, TokenLogprob] = {}
        for row, (r, tok) in enumerate(zip(sampling, tokens, strict=True)):
            if row in verified:
                continue  # below, once its logprobs are read too
            if tok == INVALID_TOKEN:
                result.errors[r.request_id] = (
                    "no token could be sampled: no logit was finite after penalties, temperature and masks"
                )
            else:
                result.sampled_token_ids[r.request_id] = tok
        if sampled.logprobs is not None:
            records = _records(
                take,
                sampled.logprobs,
                [tokens[i] for i in sampled.logprob_rows],
                [sampling[i].sampling_params.logprobs or 0 for i in sampled.logprob_rows],
            )
            for i, rec in zip(sampled.logprob_rows, records, strict=True):
                if i not in verified:
                    result.logprobs[sampling[i].request_id] = rec
            by_row = dict(zip(sampled.logprob_rows, records, strict=True))
        for r, first in drafted:
            span = range(first, first + len(r.draft_token_ids) + 1)
            lps = [by_row[i] for i in span] if r.sampling_params.logprobs is not None else None
            outcome = accept(r.draft_token_ids, tokens[span.start : span.stop], lps)
            if isinstance(outcome, str):
                result.errors[r.request_id] = outcome
            else:
                result.verified[r.request_id] = outcome
    if prompt_lp is not None:
        ks = [r.sampling_params.prompt_logprobs or 0 for r, _, c in prompt_spans for _ in range(c)]
        records = _records(take, prompt_lp, prompt_targets, ks)
        for r, first, count in prompt_spans:
            result.prompt_logprobs[r.request_id] = records[first : first + count]
    return result


def _flat(lp: LogprobsOut) -> list[torch.Tensor]:
    return [lp.chosen, lp.top_ids, lp.top_vals]


def _records(take, lp: LogprobsOut, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    m, k = lp.top_ids.shape
    chosen = take(m)
    ids = take(m * k)
    vals = take(m * k)
    return [
        TokenLogprob(
            tokens[i], chosen[i], [(int(ids[i * k + j]), vals[i * k + j]) for j in range(min(ks[i], k))]
        )
        for i in range(m)
    ]
