"""Writing benchmark results: JSON for machines, PNG plots for people; and what a person sees of a
long run on the terminal: its progress (`Steps`, on stderr) and a summary at its end (`summary`,
on stdout)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.filesize import decimal
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn,
                           TimeElapsedColumn)
from rich.table import Table
from rich.text import Text

ERR = Console(stderr=True)  # progress; one console, so that a bar started inside another nests in it
OUT = Console()  # results


def write_json(path: str | Path, result: dict) -> None:
    """`result` with what traces it: when, the command, the commit and the CPU it ran on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "machine": platform.machine(),
            "command": " ".join(["starsd", *sys.argv[1:]]), "commit": commit(), "cpu": cpu_model(),
            "cpu_kind": cpu_kind()}
    path.write_text(json.dumps({"meta": meta, **result}, indent=1))
    print(f"wrote {path}")


def commit() -> str | None:
    """The source's git commit, `+dirty` where files differ from it (None outside a checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def cpu_kind() -> str:
    """The widest vector unit of this CPU that StarSD's engines use: AMX, AVX512-BF16, AVX-512 or AVX2."""
    flags = set((cpuinfo("flags") or "").split())
    for flag, kind in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return kind
    return "x86"


def cpu_model() -> str | None:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    return cpuinfo("model name")


def cpuinfo(field: str) -> str | None:
    """A field of the first processor in /proc/cpuinfo (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == field), None)
    except OSError:
        return None


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


def bar_panels(path: str | Path, panels: list[dict]) -> None:
    """Bar charts side by side, each bar labelled with its value; a panel is {"labels", "values",
    "ylabel", "title"}. Many bars: the labels turn sideways."""
    fig, axes = _pyplot().subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        bars = ax.bar(panel["labels"], panel["values"], color="#1f77b4")
        ax.bar_label(bars, fontsize=7)
        ax.tick_params(axis="x", labelrotation=60 if len(panel["labels"]) > 4 else 0, labelsize=8)
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"], fontsize=10)
    _save(fig, path)


# ------------------------------------------------------------------------------------- terminal
class TimeLeft(ProgressColumn):
    """The steps left times one step's seconds (`step_s`: as given until a step is done, then the mean
    of those done), less what the running step has taken; blank while no step time is known."""

    def render(self, task: Task) -> Text:
        step_s = task.fields.get("step_s")
        if step_s is None or task.total is None or task.finished:
            return Text("")
        began = task.fields.get("began")
        left = step_s * (task.total - task.completed) - (time.monotonic() - began if began else 0.0)
        return Text(f"~{_clock(max(0.0, left))} left", style="progress.remaining")


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Steps:
    """A progress bar on stderr over the `total` steps of a long run (a benchmark's measured points, a
    download's parts): what runs now, step k of K, the time spent and, once a step's length is known
    (`step_s`, or the mean of the steps done), the time left. `line` prints above the bar. Where
    stderr is not a terminal (a CI log) rich draws no bar: the lines appear, and the bar's last state
    when the run ends.

        with Steps("scale", total=len(points), step_s=warmup_s + measure_s) as steps:
            for p in points:
                steps.begin(f"batched N={p.n}")
                ...
                steps.end(f"batched N={p.n}: 12.3 tok/s")
    """

    def __init__(self, title: str, total: int, step_s: float | None = None):
        self.title = title
        self.given_s = step_s
        self.first: float | None = None  # when the first step began
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeLeft(), console=ERR,
            redirect_stdout=sys.stdout.isatty())  # prints go above the bar, unless stdout is piped: then it stays whole
        self.task = self.progress.add_task(title, total=total, step_s=step_s, began=None)

    @property
    def live(self) -> bool:
        """Whether a bar is drawn (stderr is a terminal)."""
        return ERR.is_terminal

    def __enter__(self) -> Steps:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def begin(self, what: str) -> None:
        """Step k + 1 starts: `what` it is."""
        now = time.monotonic()
        self.first = self.first or now
        self.progress.update(self.task, began=now)
        self.say(what)

    def say(self, what: str) -> None:
        """What the bar shows beside the title: the running step, or the whole once it is done."""
        self.progress.update(self.task, description=f"{self.title}: {what}")

    def end(self, line: str | None = None) -> None:
        """The running step is done; `line` (its result) is printed above the bar."""
        done = self.progress.tasks[0].completed + 1
        mean_s = (time.monotonic() - self.first) / done if self.first else self.given_s
        self.progress.update(self.task, advance=1, began=None, step_s=mean_s)
        if line:
            self.line(line)

    def line(self, text: str) -> None:
        ERR.print(text, markup=False, highlight=False, soft_wrap=True)


def status(text: str):
    """A spinner on stderr with `text`, for a long step of unknown length: `with status("converting"):`."""
    return ERR.status(Text(text))


def size(nbytes: int) -> str:
    """1234567 -> '1.2 MB'."""
    return decimal(nbytes)


def summary(title: str, columns: list[str], rows: list[list | None], facts: dict[str, str] | None = None,
            files: dict[str, str | Path | None] | None = None) -> None:
    """The end of a run, on one screen of stdout: a table of its main figures (a row per mode, point or
    target; None between rows starts a new section, e.g. before a total), then a line `key: value` per
    fact, then the files it wrote (`label: path`; None: not written)."""
    table = Table()
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        if row is None:
            table.add_section()
        else:
            table.add_row(*(Text("-" if x is None else str(x)) for x in row))
    OUT.print(Text(title, style="bold"), soft_wrap=True)  # above, not as the table's title: that wraps to its width
    OUT.print(table)
    for key, value in (facts or {}).items():
        OUT.print(Text.assemble((f"{key}:", "bold"), " ", value), soft_wrap=True)
    for label, path in (files or {}).items():
        if path is not None:
            OUT.print(Text.assemble((f"{label}:", "bold"), " ", (str(path), "cyan")), soft_wrap=True)
