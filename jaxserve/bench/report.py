"""Printing, saving and plotting benchmark results (a result is `metrics.summarize`'s dict)."""

from __future__ import annotations

import json
from pathlib import Path

MS = 1e3


def table(results: list[dict]) -> str:
    """One row per run: the load, throughputs, and the latency percentiles in ms."""
    head = (f"{'load':>8} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'tot tok/s':>9} "
            f"{'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>7} {'ITL p50':>7} {'p99':>7} {'E2EL p50':>8} "
            f"{'p99':>8}")
    rows = [head]
    for r in results:
        load = r.get("label") or f"c={r.get('max_concurrency') or 'inf'}"
        rows.append(f"{load:>8} {r['completed']:>5} {r['request_throughput']:6.2f} {r['output_throughput']:9.1f} "
                    f"{r['total_token_throughput']:9.1f} {r['ttft']['p50'] * MS:8.0f} {r['ttft']['p99'] * MS:7.0f} "
                    f"{r['tpot']['p50'] * MS:8.1f} {r['tpot']['p99'] * MS:7.1f} {r['itl']['p50'] * MS:7.1f} "
                    f"{r['itl']['p99'] * MS:7.1f} {r['e2el']['p50'] * MS:8.0f} {r['e2el']['p99'] * MS:8.0f}")
        if r["failed"]:
            rows.append(f"{'':>8} {r['failed']} failed: {'; '.join(r['errors'])}")
        if "goodput" in r:
            rows.append(f"{'':>8} goodput {r['goodput']:.2f} req/s ({r['good_requests']} within {r['slos_ms']} ms)")
    return "\n".join(rows)


def save_json(path: str | Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def plot(series: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """Output throughput against median TPOT and p99 TTFT, one line per server, a point per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, results in series.items():
        x = [r["output_throughput"] for r in results]
        for ax, key, pct in ((axes[0], "tpot", "p50"), (axes[1], "ttft", "p99")):
            y = [r[key][pct] * MS for r in results]
            ax.plot(x, y, marker="o", label=label)
            for xi, yi, r in zip(x, y, results):
                ax.annotate(f"c={r.get('max_concurrency') or 'inf'}", (xi, yi), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
    axes[0].set_ylabel("TPOT p50 (ms)")
    axes[1].set_ylabel("TTFT p99 (ms)")
    for ax in axes:
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
