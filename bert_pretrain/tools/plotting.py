"""Every picture the project draws (matplotlib, no display needed): a run's curves
(`bert-report`), attention maps (`bert-attention`), a sweep's summary (`bert-sweep-summary`) and
GLUE scores of several models side by side (`bert-glue`).

The callers gather numbers; this module only draws them, with the same conventions everywhere:
a log axis where positive values span a decade or more, labels kept inside the figure
(`constrained` layout), PNGs written atomically (a reader never sees half a file).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

DPI = 100


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> str:
    """Write `fig` to `path` (PNG) atomically and close it."""
    plt = pyplot()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.png")
    try:
        fig.savefig(tmp, dpi=DPI)
        os.replace(tmp, path)
    except BaseException:  # (the picture that was there stays; no half-written one is left)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def spans_decades(values: Sequence[float]) -> bool:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) >= 10


# --------------------------------------------------------------------------- run curves


@dataclass
class Series:
    """One line: x and y values (None where missing), and how to draw it."""

    x: list
    y: list
    label: str
    style: str = "-"
    marker: Optional[str] = None


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list = field(default_factory=list)  # (run index, Series)
    hlines: list = field(default_factory=list)  # (run index or None, y, label, style)
    ylim: Optional[tuple] = None
    log_ok: bool = True


def plot_panels(panels: Sequence[Panel], run_names: Sequence[str], xlabel: str, title: str,
                path: str, notes: Sequence[str] = (), counts_x: bool = False) -> str:
    """A grid of panels sharing the x axis meaning; colour = run, line style = what (train,
    held-out, baseline). The last cell holds the legend (runs and line styles) and `notes`.
    `counts_x`: x is a count (tokens), labelled 500k, 1M, ... rather than with a 1e6 offset."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    ncols = 4
    nrows = math.ceil((len(panels) + 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows),
                             layout="constrained", squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = [colors[i % len(colors)] for i in range(len(run_names))]
    styles = {}
    for ax, panel in zip(axes.flat, panels):
        ys = []
        for run, s in panel.series:
            pts = [(x, y) for x, y in zip(s.x, s.y) if x is not None and y is not None
                   and math.isfinite(y)]
            if not pts:
                continue
            xs, yv = zip(*pts)
            ys += yv
            ax.plot(xs, yv, s.style, marker=s.marker, markersize=3.5, color=color[run],
                    linewidth=1.4)
            styles.setdefault(s.label, (s.style, s.marker))
        for run, y, label, style in panel.hlines:
            ax.axhline(y, color="0.35" if run is None else color[run], linestyle=style,
                       linewidth=1.3)
            styles.setdefault(label, (style, None))
            ys.append(y)
        if panel.log_ok and spans_decades(ys):
            ax.set_yscale("log")
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        if not ys:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                    color="0.5")
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.tick_params(labelsize=8)
        if counts_x:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend_ax = list(axes.flat)[-1]
    handles = [Line2D([], [], color=color[i], linewidth=2.5) for i in range(len(run_names))]
    labels = list(run_names)
    for label, (style, marker) in styles.items():
        handles.append(Line2D([], [], color="0.3", linestyle=style, marker=marker,
                              markersize=4))
        labels.append(label)
    legend_ax.legend(handles, labels, loc="upper left", fontsize=9, frameon=False,
                     title="runs and lines" if len(run_names) > 1 else "lines",
                     title_fontsize=9)
    if notes:
        import textwrap

        text = "\n".join(textwrap.fill(n, 48, subsequent_indent="  ") for n in notes)
        legend_ax.text(0.0, 0.02, text, transform=legend_ax.transAxes, fontsize=8,
                       va="bottom", wrap=True, color="0.25")
    fig.suptitle(title, fontsize=11)
    return save(fig, path)


# --------------------------------------------------------------------------- attention maps


def plot_attention(maps: Any, tokens: Sequence[str], layers: Sequence[int],
                   heads: Sequence[int], path: str, title: str) -> str:
    """`maps[i][j]`: the [L, L] attention probabilities of layers[i], heads[j] (row = the query
    token attending, column = the key token attended to). One panel per head, tokens as labels."""
    plt = pyplot()
    n = len(tokens)
    side = min(max(2.6, 0.17 * n + 1.0), 9.0)  # room for the token labels
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(side * len(heads) + 0.8,
                                                               side * len(layers) + 0.6),
                             layout="constrained", squeeze=False)
    fontsize = 8 if n <= 24 else (6 if n <= 48 else 4)
    # One colour scale for every panel (so heads compare), up to the largest weight shown: a
    # fixed 0..1 scale leaves most maps nearly black.
    vmax = max(float(m.max()) for row in maps for m in row)
    image = None
    for i, layer in enumerate(layers):
        for j, head in enumerate(heads):
            ax = axes[i][j]
            image = ax.imshow(maps[i][j], cmap="viridis", vmin=0.0, vmax=vmax,
                              interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head}", fontsize=9)
            ax.set_xticks(range(n), tokens, rotation=90, fontsize=fontsize)
            ax.set_yticks(range(n), tokens, fontsize=fontsize)
            ax.tick_params(length=0)
            if i == len(layers) - 1:
                ax.set_xlabel("attended to (key)", fontsize=8)
            if j == 0:
                ax.set_ylabel("attending (query)", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


# --------------------------------------------------------------------------- sweep summary


def plot_sweep(path: str, points: Sequence[tuple], metric: str, params: Sequence[str],
               title: str, empty: Optional[Sequence[str]] = None) -> str:
    """One panel per swept hyperparameter: `points` = [(overrides dict, value)], best first
    (circled). Numeric values get a numeric axis (log when they span a decade, as learning rates
    do; integer ticks when every value is an integer); anything else is categorical. `params` =
    ["job"] plots against the job number. With no points, the lines of `empty` say why."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    if not points:
        import textwrap

        fig, ax = plt.subplots(figsize=(7.0, 3.6), layout="constrained")
        ax.axis("off")
        lines = list(empty or ["no trial to plot"])
        ax.text(0.5, 0.5, "\n".join(textwrap.fill(ln, 80) for ln in lines), ha="center",
                va="center", transform=ax.transAxes, fontsize=10, color="0.25")
        fig.suptitle(title, fontsize=10)
        return save(fig, path)
    fig, axes = plt.subplots(1, len(params), figsize=(4.2 * len(params), 3.6),
                             layout="constrained", squeeze=False)
    for ax, param in zip(axes[0], params):
        raw = [o.get(param, "-") for o, _ in points]
        ys = [v for _, v in points]
        try:
            xs: list = [float(r) for r in raw]
            if spans_decades(xs):
                ax.set_xscale("log")
            elif all(x.is_integer() for x in xs):  # job numbers, warmup steps: no 1.5
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        except ValueError:
            categories = sorted(set(raw))
            xs = [categories.index(r) for r in raw]
            ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        ax.scatter(xs, ys, s=28, color="tab:blue", zorder=2)
        ax.scatter(xs[:1], ys[:1], s=110, facecolors="none", edgecolors="tab:red",
                   linewidths=1.5, zorder=3, label="best")
        ax.legend(loc="best", fontsize=8)
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


# --------------------------------------------------------------------------- GLUE scores


@dataclass
class Scores:
    """One model's scores: a value (None: not run) and its [low, high] spread per group."""

    label: str
    values: list
    spreads: list
    colour: int = 0
    """Index into the colour cycle: a model and its control share one."""
    hollow: bool = False
    """An open marker (e.g. the same model from random initialisation)."""


def plot_scores(path: str, groups: Sequence[str], series: Sequence[Scores], ylabel: str,
                title: str, notes: Sequence[str] = (), separate_last: bool = False) -> str:
    """Groups (tasks) along x, one point per model inside each (side by side), its spread
    (e.g. the seeds' range) as an error bar and its value written beside it. Points rather than
    bars: the axis can then zoom to the scores, where one or two points of difference show.
    `separate_last` draws a line before the last group (an average)."""
    plt = pyplot()
    width = 0.7 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(groups) + 3), 4.6),
                           layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, line in enumerate(series):
        colour = colours[line.colour % len(colours)]
        for i, (value, spread) in enumerate(zip(line.values, line.spreads)):
            if value is None:
                continue
            x = i - 0.35 + width * (k + 0.5)
            low, high = spread if spread else (value, value)
            ax.errorbar([x], [value], yerr=[[value - low], [high - value]], fmt="o",
                        markersize=8, color=colour, mfc="white" if line.hollow else colour,
                        mew=1.8, capsize=3, label=line.label if i == 0 or not any(
                            v is not None for v in line.values[:i]) else None)
            ax.annotate(f"{value:.1f}", (x, high), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    if separate_last and len(groups) > 1:
        ax.axvline(len(groups) - 1.5, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    if notes:
        import textwrap

        wrapped = [w for note in notes for w in textwrap.wrap(note, 120)]
        fig.text(0.01, 0.005, "\n".join(wrapped), fontsize=7, va="bottom", ha="left")
        fig.get_layout_engine().set(rect=(0, 0.035 * len(wrapped) + 0.01, 1,
                                          1 - 0.035 * len(wrapped) - 0.01))
    return save(fig, path)
