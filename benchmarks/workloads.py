"""Benchmark workloads: lists of requests built from a seed, never from real data.

Each workload is a `Workload`: the requests in the order they are sent, and how many may be in flight at
once. The text is random words from a fixed vocabulary, so a "document" of N tokens costs N tokens of
prefill on any tokenizer (about 1.3 tokens per word on SmolLM2's) and two documents never share a prefix
by accident. Every document starts with a random id and a header naming the workload and seed, so a rerun
with another seed starts cold on a server that is still warm from the last run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("doc-qa", "tenants", "prefix-repetition", "unique", "isolation")
# Workloads whose requests carry tenants' API keys: only a server started with their --tenants file runs them.
TENANT_WORKLOADS = ("shared-system-prompt",)
WORDS_PER_TOKEN = 0.75  # measured on SmolLM2's tokenizer with this vocabulary: ~1.33 tokens per word
VOCAB = (
    "river stone garden lamp orbit copper violet engine harbor meadow signal canvas lantern prism thunder "
    "willow beacon falcon glacier marble ember quartz saddle timber velvet anchor cobalt dune feather granite "
    "jasmine kettle ledger mosaic nectar oyster pepper quiver raven spindle tulip umber vessel walnut zephyr "
    "amber basalt cedar delta forest silver morning window paper bridge castle mountain ocean valley winter "
    "summer yellow purple orange market school doctor teacher letter number people water little house world"
).split()
QUESTIONS = (
    "Which word appears first?", "Which word appears most often?", "How many sentences are there?",
    "Summarize the text in one line.", "Which colour is mentioned last?", "Name three nouns from the text.",
    "Is the word river in the text?", "What is the tenth word?", "Which word is the longest?",
    "Write a title for this text.", "Does the text mention the ocean?", "Which word ends the text?",
)  # fmt: skip


@dataclass(slots=True)
class BenchRequest:
    prompt: str
    tag: str  # what this request is for the report: "cold", "warm", "other-tenant", "unique", ...
    group: str = ""  # the shared prefix or tenant it belongs to
    salt: str | None = None  # sent as cache_salt when set
    max_tokens: int = 16
    api_key: str | None = None  # sent as this request's bearer token (a tenant's key) when set
    system: str | None = None  # a system message before the prompt (chat API only)
    wave: int = 0  # waves run one after the other, each with its own concurrency (Workload.wave_concurrency)
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers (a router's X-Session-ID)


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    concurrency: int = 1
    params: dict[str, int] = field(default_factory=dict)  # the sizes it was built with, for the report
    wave_concurrency: dict[int, int] = field(default_factory=dict)  # per wave; default `concurrency`
    api: str | None = None  # "chat" / "completions" when the workload needs one
    # Sample brine_kv_cache_usage_perc while it runs (peak) and brine_num_cached_blocks at the end.
    sample_kv: bool = False
    tenant_keys: dict[str, str] = field(default_factory=dict)  # tenant id -> API key the requests use
    public_prefix: list[dict[str, str]] | None = None  # chat messages a server may declare public
    # noisy-neighbour only: the same requests' twin on other documents, run alone first (the baseline), and
    # the /v1/completions body a noisy tenant sends back to back while `requests` run.
    baseline: list[BenchRequest] = field(default_factory=list)
    noise: dict | None = None


def document(rng: random.Random, tokens: int, header: str) -> str:
    """About `tokens` tokens of synthetic sentences, starting with `header` so it is unique to its use."""
    words = [rng.choice(VOCAB) for _ in range(max(1, int(tokens * WORDS_PER_TOKEN)))]
    sentences = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    # A random id comes first: documents then differ from their second token on, so no two share a block.
    return f"Document {rng.getrandbits(32):08x} ({header}).\n" + " ".join(sentences)


def question(i: int) -> str:
    """The i-th question: distinct for every i (past the fixed list, numbered), so that "different questions"
    never become an identical prompt, which would be a full-prompt hit rather than a shared-prefix one."""
    q = QUESTIONS[i % len(QUESTIONS)]
    return q if i < len(QUESTIONS) else f"{q} (variant {i // len(QUESTIONS)})"


def ask(doc: str, question: str) -> str:
    return f"{doc}\n\nAnswer briefly.\nQuestion: {question}\nAnswer:"


def doc_qa(seed: int, doc_tokens: int = 2000, questions: int = 6, max_tokens: int = 16) -> Workload:
    """One long document, then different questions about it: the first is cold, the rest reuse the document."""
    rng = random.Random(seed)
    doc = document(rng, doc_tokens, f"doc-qa {seed}")
    reqs = [
        BenchRequest(ask(doc, question(i)), "cold" if i == 0 else "warm", "doc", None, max_tokens)
        for i in range(questions)
    ]
    return Workload("doc-qa", reqs, 1, {"doc_tokens": doc_tokens, "questions": questions})


def replicas(
    seed: int,
    docs: int = 3,
    doc_tokens: int = 800,
    questions: int = 4,
    max_tokens: int = 8,
    salted: bool = False,
) -> Workload:
    """D documents, Q questions each, in Q waves of one question per document, all D in flight at once:
    what a router spreading documents over replicas sees. Each request carries `X-Session-ID: doc-<d>`, the
    key vllm-router's consistent_hash policy routes by (other policies ignore it). `salted`: each document's
    requests carry their own cache_salt, as a tenant's would. An odd D by default: with an even one, round
    robin over two replicas would send each document to the same replica every wave, by accident."""
    rng = random.Random(seed)
    texts = [document(rng, doc_tokens, f"replicas {seed} doc {d}") for d in range(docs)]
    reqs = [
        BenchRequest(
            ask(texts[d], question(q)),
            "cold" if q == 0 else "warm",
            f"doc-{d}",
            None,
            max_tokens,
            wave=q,
            headers={"X-Session-ID": f"doc-{seed}-{d}"},
        )  # fmt: skip
        for q in range(questions)
        for d in range(docs)
    ]
    return Workload("replicas", reqs, docs, {"docs": docs, "doc_tokens": doc_tokens, "questions": questions})


def tenants(
    seed: int, num_tenants: int = 3, doc_tokens: int = 1000, rounds: int = 3, max_tokens: int = 16
) -> Workload:
    """T tenants, each with its own document and cache_salt, asking in round-robin order."""
    rng = random.Random(seed)
    docs = [document(rng, doc_tokens, f"tenants {seed} tenant {t}") for t in range(num_tenants)]
    reqs = [
        BenchRequest(
            ask(docs[t], question(r + t)),
            "cold" if r == 0 else "warm",
            f"tenant-{t}",
            f"tenant-{seed}-{t}",
            max_tokens,
        )  # fmt: skip
        for r in range(rounds)
        for t in range(num_tenants)
    ]
    return Workload("tenants", reqs, 1, {"tenants": num_tenants, "doc_tokens": doc_tokens, "rounds": rounds})


def prefix_repetition(
    seed: int,
    prefixes: int = 4,
    repeats: int = 4,
    prefix_tokens: int = 500,
    concurrency: int = 4,
    max_tokens: int = 16,
) -> Workload:
    """P shared prefixes x R requests each (distinct suffixes), shuffled, sent C at a time."""
    rng = random.Random(seed)
    docs = [document(rng, prefix_tokens, f"prefix-repetition {seed} prefix {p}") for p in range(prefixes)]
    reqs = [
        BenchRequest(
            ask(docs[p], f"{QUESTIONS[r % len(QUESTIONS)]} (variant {r})"),
            "shared",
            f"prefix-{p}",
            None,
            max_tokens,
        )  # fmt: skip
        for p in range(prefixes)
        for r in range(repeats)
    ]
    rng.shuffle(reqs)
    params = {
        "prefixes": prefixes,
        "repeats": repeats,
        "prefix_tokens": prefix_tokens,
        "concurrency": concurrency,
    }
    return Workload("prefix-repetition", reqs, concurrency, params)


def unique(
    seed: int, num_requests: int = 12, prompt_tokens: int = 500, concurrency: int = 4, max_tokens: int = 16
) -> Workload:
    """No shared prefixes at all: the cache can only cost here, never pay."""
    rng = random.Random(seed)
    reqs = [
        BenchRequest(
            ask(document(rng, prompt_tokens, f"unique {seed} request {i}"), QUESTIONS[i % len(QUESTIONS)]),
            "unique",
            f"request-{i}",
            None,
            max_tokens,
        )  # fmt: skip
        for i in range(num_requests)
    ]
    params = {"requests": num_requests, "prompt_tokens": prompt_tokens, "concurrency": concurrency}
    return Workload("unique", reqs, concurrency, params)


def isolation(seed: int, doc_tokens: int = 1000, max_tokens: int = 16) -> Workload:
    """Tenant A asks twice; tenant B sends A's exact first prompt under its own salt.

    A's first request is the cold baseline for the same prompt; B must be as slow as that and report 0 cached
    tokens: a fast B would tell B that A had sent this text.
    """
    rng = random.Random(seed)
    doc = document(rng, doc_tokens, f"isolation {seed}")
    a, b = f"tenant-a-{seed}", f"tenant-b-{seed}"
    prompt = ask(doc, QUESTIONS[0])
    reqs = [
        BenchRequest(prompt, "cold", "tenant-a", a, max_tokens),
        BenchRequest(ask(doc, QUESTIONS[1]), "warm", "tenant-a", a, max_tokens),
        BenchRequest(prompt, "other-tenant", "tenant-b", b, max_tokens),
    ]
    return Workload("isolation", reqs, 1, {"doc_tokens": doc_tokens})


def prefix_sweep(
    seed: int, lengths: tuple[int, ...] = (256, 512, 1024, 2048), max_tokens: int = 8
) -> Workload:
    """For each length L: a cold request on a fresh L-token document, then a warm one on the same document."""
    rng = random.Random(seed)
    reqs: list[BenchRequest] = []
    for length in lengths:
        doc = document(rng, length, f"prefix-sweep {seed} length {length}")
        reqs.append(BenchRequest(ask(doc, QUESTIONS[0]), "cold", f"len-{length}", None, max_tokens))
        reqs.append(BenchRequest(ask(doc, QUESTIONS[1]), "warm", f"len-{length}", None, max_tokens))
    return Workload("prefix-sweep", reqs, 1, {"lengths": len(lengths)})


def shared_system_prompt(
    seed: int,
    num_tenants: int = 8,
    system_tokens: int = 1500,
    context_tokens: int = 200,
    questions: int = 3,
    max_tokens: int = 16,
) -> Workload:
    """T tenants (each with its own API key) behind one public system prompt, each with its own private
    context, asking Q questions (chat API).

    Wave 0: every tenant's first question, one at a time (tenant 1's is cold; tenants 2..T show whether the
    system prompt is shared). Wave 1: the remaining questions, all at once, so that the KV blocks in use show
    how many copies of the system prompt the cache holds. Serve it with `--tenants` (and, to share the
    prompt, `--public-prefix`) from `write_server_files`.
    """
    rng = random.Random(seed)
    system = f"You are the assistant of shop {seed}. Answer from the context.\n" + document(
        rng, system_tokens, f"shared-system-prompt {seed} system prompt"
    )
    keys = {f"bench-tenant-{t + 1}": f"sk-bench-{seed}-{t + 1}" for t in range(num_tenants)}
    contexts = [
        document(rng, context_tokens, f"shared-system-prompt {seed} tenant {t + 1}")
        for t in range(num_tenants)
    ]
    reqs = []
    for q in range(questions):
        for t, key in enumerate(keys.values()):
            tag = ("first-tenant-1" if t == 0 else "first-other") if q == 0 else "later"
            reqs.append(BenchRequest(ask(contexts[t], question(q + t)), tag, f"tenant-{t + 1}", None, max_tokens,
                                     api_key=key, system=system, wave=0 if q == 0 else 1))  # fmt: skip
    params = {"tenants": num_tenants, "system_tokens": system_tokens, "context_tokens": context_tokens,
              "questions": questions}  # fmt: skip
    return Workload("shared-system-prompt", reqs, 1, params, wave_concurrency={1: num_tenants * (questions - 1)},
                    api="chat", sample_kv=True, tenant_keys=keys,
                    public_prefix=[{"role": "system", "content": system}])  # fmt: skip


def write_server_files(workload: Workload, directory: Path) -> tuple[Path, Path | None]:
    """The --tenants file for the workload's keys and the --public-prefix file of its shared prompt (None
    when it has none), written into `directory`."""
    import hashlib
    import json

    directory.mkdir(parents=True, exist_ok=True)
    tenants = directory / f"{workload.name}-tenants.txt"
    tenants.write_text(
        "".join(f"{t} {hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in workload.tenant_keys.items())
    )
    if workload.public_prefix is None:
        return tenants, None
    prefix = directory / f"{workload.name}-public-prefix.json"
    prefix.write_text(json.dumps(workload.public_prefix))
    return tenants, prefix


def noisy_neighbour(
    seed: int,
    quiet_tenants: int = 3,
    doc_tokens: int = 1000,
    questions: int = 4,
    fan_prompts: int = 128,
    fan_n: int = 2,
    fan_max_tokens: int = 16,
    max_tokens: int = 16,
) -> Workload:
    """Quiet tenants ask doc-qa questions (each its own document and salt, one request in flight per tenant)
    while a noisy tenant sends fan-out requests at Brine's default limit (128 prompts x n=2 = 256 sequences)
    back to back. The same quiet requests on other documents first run alone: the baseline."""

    def quiet(s: int, tag: str) -> list[BenchRequest]:
        rng = random.Random(s)
        docs = [document(rng, doc_tokens, f"noisy-neighbour {s} tenant {t}") for t in range(quiet_tenants)]
        return [
            BenchRequest(ask(docs[t], question(q)), tag, f"tenant-{t}", f"quiet-{s}-{t}", max_tokens)
            for q in range(questions)
            for t in range(quiet_tenants)
        ]

    noise = {
        "prompt": [f"Tell me a story about the number {i}." for i in range(fan_prompts)],
        "n": fan_n,
        "max_tokens": fan_max_tokens,
        "temperature": 1.0,
    }
    params = {"quiet_tenants": quiet_tenants, "doc_tokens": doc_tokens, "questions": questions,
              "fan_prompts": fan_prompts, "fan_n": fan_n, "fan_max_tokens": fan_max_tokens}  # fmt: skip
    return Workload(
        "noisy-neighbour",
        quiet(seed + 1, "noisy"),
        quiet_tenants,
        params,
        baseline=quiet(seed, "alone"),
        noise=noise,
    )


def build(name: str, seed: int, **sizes: int) -> Workload:
    """A workload by name; `sizes` override the builder's keyword defaults (unknown ones raise TypeError)."""
    builders = {"doc-qa": doc_qa, "tenants": tenants, "prefix-repetition": prefix_repetition, "unique": unique,
                "isolation": isolation, "prefix-sweep": prefix_sweep,
                "shared-system-prompt": shared_system_prompt,
                "noisy-neighbour": noisy_neighbour}  # fmt: skip
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(builders)}")
    return builders[name](seed, **sizes)
