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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    print(f"wrote {path}")


def line_plot(path: str | Path, series: list[dict], xlabel: str, ylabel: str, title: str,
              logx: bool = False, logy: bool = False) -> None:
    """One line per series: {"label", "x", "y"} plus optional matplotlib style keys (e.g. "ls", "marker")."""
    panel_plot(path, [{"series": series, "xlabel": xlabel, "ylabel": ylabel, "title": title, "logx": logx,
                       "logy": logy}])


def panel_plot(path: str | Path, panels: list[dict]) -> None:
    """Panels side by side; each {"series", "xlabel", "ylabel", "title", "logx", "logy"} as in line_plot."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for s in panel["series"]:
            style = {k: v for k, v in s.items() if k not in ("label", "x", "y")}
            ax.plot(s["x"], s["y"], label=s["label"], **style)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def bar_plot(path: str | Path, labels: list[str], values: list[float], ylabel: str, title: str) -> None:
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    bars = ax.bar(labels, values, color=["#999999", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(values)])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _save(fig, path)
