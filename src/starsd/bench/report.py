"""Writing benchmark results: JSON for machines, PNG plots for people."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def write_json(path: str | Path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "machine": platform.machine()}
    path.write_text(json.dumps({"meta": meta, **result}, indent=1))
    print(f"wrote {path}")


def bar_plot(path: str | Path, labels: list[str], values: list[float], ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, values, color=["#999999", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(values)])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
