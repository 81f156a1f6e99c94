"""Turn benchmark results into numbers, a markdown report and PNG charts.

`summarize` is per workload run; `markdown` and `charts` take every run of a comparison (server x workload).
Only what was measured is shown: a server that does not report cached tokens or cache counters gets "n/a",
never a 0 that would read as "no hits".
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from benchmarks.results import WorkloadResult

# compare.py names a server's caching-off twin "<name>-no-cache": the "off" side of its on / off ratios.
NO_CACHE_SUFFIX = "-no-cache"


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(r: WorkloadResult) -> dict:
    ok = [x for x in r.requests if x.ok]
    ttfts = [x.ttft for x in ok if x.ttft is not None]
    by_tag: dict[str, list[float]] = defaultdict(list)
    cached_by_tag: dict[str, list[int | None]] = defaultdict(list)
    for x in ok:
        if x.ttft is not None:
            by_tag[x.tag].append(x.ttft)
        cached_by_tag[x.tag].append(x.cached_tokens)
    out_tokens = sum(x.completion_tokens or 0 for x in ok)
    prompt = [x.prompt_tokens for x in ok]
    cached = [x.cached_tokens for x in ok]
    reported = all(c is not None for c in cached) and bool(ok)
    return {
        "workload": r.workload,
        "server": r.server,
        "params": r.params,
        "requests": len(r.requests),
        "ok": len(ok),
        "errors": [x.error for x in r.requests if not x.ok][:5],
        "duration_s": r.duration,
        "request_throughput": len(ok) / r.duration if r.duration > 0 else None,
        "output_token_throughput": out_tokens / r.duration if r.duration > 0 else None,
        "prompt_tokens": sum(p for p in prompt if p is not None)
        if all(p is not None for p in prompt)
        else None,
        "cached_tokens": sum(c for c in cached if c is not None) if reported else None,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_mean_by_tag": {tag: mean(v) for tag, v in by_tag.items()},
        "ttft_p50_by_tag": {tag: percentile(v, 50) for tag, v in by_tag.items()},
        "ttft_p90_by_tag": {tag: percentile(v, 90) for tag, v in by_tag.items()},
        "noise_sent": r.noise_sent,
        "noise_ok": r.noise_ok,
        "cached_tokens_by_tag": {
            tag: (sum(c for c in v if c is not None) if all(c is not None for c in v) else None)
            for tag, v in cached_by_tag.items()
        },
        "itl_mean": mean([i for x in ok for i in x.itls]),
        "e2e_p50": percentile([x.e2e for x in ok if x.e2e is not None], 50),
        "cache_queries": r.cache_queries,
        "cache_hits": r.cache_hits,
        "hit_rate": r.hit_rate,
        "kv_usage_peak": r.kv_usage_peak,
        "cached_blocks_end": None if r.cached_blocks_end is None else int(r.cached_blocks_end),
    }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(summaries: list[dict]) -> list[dict]:
    """Per server, the headline numbers issue 8 asks for (None where the run did not measure them):
    doc-qa warm / cold mean TTFT, tenants later / first round mean TTFT, prefix-repetition and unique
    request throughput and its on / off ratio against the server's `-no-cache` twin, and in isolation
    tenant B's cached tokens and B's TTFT over A's cold TTFT (the same prompt, computed from scratch)."""
    by = {(s["server"], s["workload"]): s for s in summaries}

    def ttft(server: str, workload: str, tag: str) -> float | None:
        s = by.get((server, workload))
        return s["ttft_mean_by_tag"].get(tag) if s else None

    def req_s(server: str, workload: str) -> float | None:
        s = by.get((server, workload))
        return s["request_throughput"] if s else None

    rows = []
    for srv in dict.fromkeys(s["server"] for s in summaries):
        off = srv + NO_CACHE_SUFFIX
        iso = by.get((srv, "isolation"))
        rows.append({
            "server": srv,
            "doc_qa_warm_over_cold_ttft": _div(ttft(srv, "doc-qa", "warm"), ttft(srv, "doc-qa", "cold")),
            "tenants_later_over_first_ttft": _div(ttft(srv, "tenants", "warm"), ttft(srv, "tenants", "cold")),
            "prefix_repetition_req_s": req_s(srv, "prefix-repetition"),
            "prefix_repetition_on_over_off": _div(req_s(srv, "prefix-repetition"),
                                                  req_s(off, "prefix-repetition")),
            "unique_req_s": req_s(srv, "unique"),
            "unique_on_over_off": _div(req_s(srv, "unique"), req_s(off, "unique")),
            "isolation_b_cached_tokens": iso["cached_tokens_by_tag"].get("other-tenant") if iso else None,
            "isolation_b_over_a_cold_ttft": _div(ttft(srv, "isolation", "other-tenant"),
                                                 ttft(srv, "isolation", "cold")),
        })  # fmt: skip
    return rows


def ratio_table(summaries: list[dict]) -> list[str]:
    """The headline ratios as markdown lines ([] when none of their workloads ran)."""
    rows = ratios(summaries)
    if not any(v is not None for r in rows for k, v in r.items() if k != "server"):
        return []

    def throughput(v: float | None, on_off: float | None) -> str:
        return fmt(v, " req/s") + ("" if on_off is None else f", {fmt(on_off, 'x')}")

    lines = [
        "TTFT ratios are the mean TTFT of the later requests over the first ones (lower: the cache pays).",
        f"On / off is a server's request throughput over its `{NO_CACHE_SUFFIX}` twin's in this run (a server",
        "without one shows its throughput only). Isolation: B sends A's first prompt under another",
        "`cache_salt`; B's cached tokens must be 0 and B's TTFT close to A's cold one.",
        "",
        "| server | doc-qa warm / cold TTFT | tenants later / first round TTFT | prefix-repetition, on / off "
        "| unique, on / off | isolation: B cached tokens | isolation: B / A cold TTFT |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["server"],
            fmt(r["doc_qa_warm_over_cold_ttft"]),
            fmt(r["tenants_later_over_first_ttft"]),
            throughput(r["prefix_repetition_req_s"], r["prefix_repetition_on_over_off"]),
            throughput(r["unique_req_s"], r["unique_on_over_off"]),
            fmt(r["isolation_b_cached_tokens"]),
            fmt(r["isolation_b_over_a_cold_ttft"], "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def fmt(v: float | int | None, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, int):
        return f"{v}{unit}"
    return f"{v:.{digits}g}{unit}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def cached_cell(s: dict) -> str:
    if s["cached_tokens"] is None and s["prompt_tokens"] is None:
        return "n/a"
    return f"{fmt(s['cached_tokens'])}/{fmt(s['prompt_tokens'])}"


def markdown(summaries: list[dict], header: str) -> str:
    lines = [header, "", *ratio_table(summaries)]
    lines += ["| workload | server | ok/sent | req/s | out tok/s | TTFT p50 | TTFT p90 | TTFT p99 | "
              "cold TTFT | warm TTFT | cached tokens | hit rate (/metrics) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summaries:
        tags = s["ttft_mean_by_tag"]
        lines.append(
            f"| {s['workload']} | {s['server']} | {s['ok']}/{s['requests']} | {fmt(s['request_throughput'])} | "
            f"{fmt(s['output_token_throughput'])} | {fmt(s['ttft_p50'], ' s')} | {fmt(s['ttft_p90'], ' s')} | "
            f"{fmt(s['ttft_p99'], ' s')} | {fmt(tags.get('cold'), ' s')} | {fmt(tags.get('warm'), ' s')} | "
            f"{cached_cell(s)} | {pct(s['hit_rate'])} |"
        )
    iso = [s for s in summaries if s["workload"] == "isolation"]
    if iso:
        lines += ["", "Isolation: tenant B sends tenant A's exact prompt under another `cache_salt`.", "",
                  "| server | A cold TTFT | A warm TTFT | B TTFT | B / A cold | B cached tokens |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for s in iso:
            t, c = s["ttft_mean_by_tag"], s["cached_tokens_by_tag"]
            cold, b = t.get("cold"), t.get("other-tenant")
            ratio = b / cold if b is not None and cold else None
            lines.append(f"| {s['server']} | {fmt(cold, ' s')} | {fmt(t.get('warm'), ' s')} | {fmt(b, ' s')} | "
                         f"{fmt(ratio, 'x', 2)} | {fmt(c.get('other-tenant'))} |")  # fmt: skip
    lines += shared_prompt_table(summaries)
    lines += noisy_neighbour_table(summaries)
    errors = [(s["server"], s["workload"], e) for s in summaries for e in s["errors"]]
    if errors:
        lines += ["", "Errors (first few):", ""] + [f"- {srv} / {wl}: `{e}`" for srv, wl, e in errors]
    return "\n".join(lines) + "\n"


def shared_prompt_table(summaries: list[dict]) -> list[str]:
    """The shared-system-prompt workload: first-request TTFT of tenants 2..N and the KV it takes, with and
    without the system prompt declared public ([] when it did not run)."""
    rows = [s for s in summaries if s["workload"] == "shared-system-prompt"]
    if not rows:
        return []
    p = rows[0]["params"]
    lines = ["", f"Shared system prompt: {p.get('tenants')} tenants, each with its own API key, behind one "
             f"~{p.get('system_tokens')}-token system prompt, each with its own ~{p.get('context_tokens')}-token "
             f"context, {p.get('questions')} questions each. First questions one at a time, the rest all at once. "
             "Cached tokens are the mean over tenants 2.. first requests; peak KV usage is the highest "
             "`brine_kv_cache_usage_perc` sampled during the run; cached blocks is `brine_num_cached_blocks` "
             "at its end.", "",
             "| server | tenant 1 first TTFT | tenants 2.. first TTFT | their cached tokens | later TTFT "
             "| peak KV usage | cached blocks at end |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {}
    for s in rows:
        t, c = s["ttft_mean_by_tag"], s["cached_tokens_by_tag"]
        n_other = max(1, (p.get("tenants") or 2) - 1)
        other_cached = c.get("first-other")
        by[s["server"]] = s
        lines.append(
            f"| {s['server']} | {fmt(t.get('first-tenant-1'), ' s')} | {fmt(t.get('first-other'), ' s')} | "
            f"{fmt(None if other_cached is None else round(other_cached / n_other))} | {fmt(t.get('later'), ' s')} | "
            f"{pct(s['kv_usage_peak'])} | {fmt(s['cached_blocks_end'])} |"
        )
    shared, private = by.get("brine-tenants-public-prefix"), by.get("brine-tenants")
    if shared and private:
        ttft = _div(
            shared["ttft_mean_by_tag"].get("first-other"), private["ttft_mean_by_tag"].get("first-other")
        )
        kv = _div(shared["kv_usage_peak"], private["kv_usage_peak"])
        blocks = _div(shared["cached_blocks_end"], private["cached_blocks_end"])
        lines += ["", f"With `--public-prefix` / without: tenants 2.. first TTFT {fmt(ttft, 'x')}, peak KV usage "
                  f"{fmt(kv, 'x')}, cached blocks at the end {fmt(blocks, 'x')}."]  # fmt: skip
    return lines


def noisy_neighbour_table(summaries: list[dict]) -> list[str]:
    """Quiet tenants' TTFT beside a noisy one (fan-out at the limit) against the same workload alone."""
    rows = [s for s in summaries if s["workload"] == "noisy-neighbour"]
    if not rows:
        return []
    lines = ["", "Noisy neighbour: quiet tenants' TTFT while another sends fan-out requests at the limit, against",
             "the same workload alone (ratios: beside the noisy tenant / alone; 1 is perfect isolation).", "",
             "| server | alone p50 | alone p90 | beside p50 | beside p90 | p50 ratio | p90 ratio | noisy requests ok/sent |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in rows:
        p50, p90 = s["ttft_p50_by_tag"], s["ttft_p90_by_tag"]
        a50, a90, n50, n90 = p50.get("alone"), p90.get("alone"), p50.get("noisy"), p90.get("noisy")
        lines.append(f"| {s['server']} | {fmt(a50, ' s')} | {fmt(a90, ' s')} | {fmt(n50, ' s')} | {fmt(n90, ' s')} | "
                     f"{fmt(_div(n50, a50), 'x', 2)} | {fmt(_div(n90, a90), 'x', 2)} | "
                     f"{s['noise_ok']}/{s['noise_sent']} |")  # fmt: skip
    return lines


def charts(summaries: list[dict], results: list[WorkloadResult], out_prefix: Path) -> list[Path]:
    """Three PNGs: cold vs warm TTFT (doc-qa), TTFT vs cached prefix length (prefix-sweep), throughput."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    servers = list(dict.fromkeys(s["server"] for s in summaries))

    docqa = {s["server"]: s for s in summaries if s["workload"] == "doc-qa"}
    if docqa:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [n for n in servers if n in docqa]
        for i, kind in enumerate(("cold", "warm")):
            vals = [docqa[n]["ttft_mean_by_tag"].get(kind) or 0.0 for n in names]
            bars = ax.bar([j + 0.4 * i for j in range(len(names))], vals, 0.4, label=kind)
            ax.bar_label(bars, fmt="%.2f s", fontsize=8)  # warm bars are too short to read otherwise
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title("doc-qa: first question (cold) vs later questions (warm)")
        ax.legend()
        paths.append(_save(fig, out_prefix, "ttft_cold_warm"))

    sweep = [r for r in results if r.workload == "prefix-sweep"]
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        for n, r in enumerate(sweep):
            for kind, style in (("cold", "--"), ("warm", "-")):
                pts = sorted((int(x.group.split("-")[1]), x.ttft) for x in r.requests
                             if x.ok and x.tag == kind and x.ttft is not None)  # fmt: skip
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        marker="o",
                        color=f"C{n}",  # one colour per server: cold dashed, warm solid
                        label=f"{r.server} {kind}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shared prefix length (tokens, approx.)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title("TTFT vs cached prefix length")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_prefix, "ttft_vs_prefix"))

    workloads = list(dict.fromkeys(s["workload"] for s in summaries if s["workload"] != "prefix-sweep"))
    if workloads:
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / max(1, len(servers))
        by = {(s["server"], s["workload"]): s for s in summaries}
        for i, name in enumerate(servers):
            vals = [(by.get((name, w)) or {}).get("request_throughput") or 0.0 for w in workloads]
            ax.bar([j + width * i for j in range(len(workloads))], vals, width, label=name)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel("requests / s")
        ax.set_title("Request throughput per workload")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_prefix, "throughput"))
    return paths


def _save(fig, out_prefix: Path, name: str) -> Path:  # noqa: ANN001 (matplotlib Figure, imported lazily)
    path = out_prefix.with_name(f"{out_prefix.name}_{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
