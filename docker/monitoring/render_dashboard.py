"""Render the Grafana dashboard's panels (grafana/dashboards/brine.json) from a Prometheus into one PNG.

For a picture of the dashboard where Grafana itself is not at hand: the same panels, queries, units and legends,
drawn with matplotlib from Prometheus's range-query API. This is how dashboard.png was made.

    python docker/monitoring/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 10 \\
        --out docker/monitoring/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "brine.json"


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = {"query": expr, "start": start, "end": end, "step": step}
    r = httpx.get(f"{base}/api/v1/query_range", params=params, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def render(base: str, start: float, end: float, out: Path, rate_interval: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    cols = 3
    rows = -(-len(panels) // cols)
    plt.style.use("dark_background")
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    step = max(1.0, (end - start) / 400)
    for ax, panel in zip(axes.flat, panels, strict=False):
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate_interval)
            for series in query_range(base, expr, start, end, step):
                xs = [datetime.fromtimestamp(float(t), tz=timezone.utc) for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.6, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], loc="left", fontsize=11)
        ax.grid(alpha=0.2)
        ax.xaxis.set_major_locator(mdates.MinuteLocator())
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.yaxis.set_major_formatter(
                FuncFormatter(lambda v, _: f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s")
            )
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", framealpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"{dashboard['title']} (the Grafana dashboard's panels, rendered from Prometheus with matplotlib)",
        fontsize=13,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="how far back from --end to draw")
    parser.add_argument("--end", type=float, default=None, help="unix time of the right edge (default: now)")
    parser.add_argument("--rate-interval", default="1m", help="what Grafana's $__rate_interval stands for")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args()
    end = args.end or time.time()
    render(args.prometheus, end - args.minutes * 60, end, args.out, args.rate_interval)


if __name__ == "__main__":
    main()
