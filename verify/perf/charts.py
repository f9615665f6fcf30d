"""PNG charts written next to the tables. Optional: without matplotlib (the `charts` extra)
each function writes nothing and returns a one-line note saying so."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MISSING = "charts skipped: matplotlib is not installed (pip install -e '.[charts]')"


@dataclass(frozen=True)
class Chart:
    path: Path | None  # None: not written
    note: str | None = None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def step_breakdown(
    path: Path, rows: Sequence[tuple[str, Mapping[str, float]]], *, title: str = ""
) -> Chart:
    """Horizontal stacked bars: one bar per variant, one segment per phase (ms)."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    labels = [label for label, _ in rows]
    segments = list(dict.fromkeys(k for _, seg in rows for k in seg))
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for name in segments:
        widths = [max(0.0, seg.get(name, 0.0)) for _, seg in rows]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title or "step breakdown")
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, plt, path)


def sweep(
    path: Path,
    sizes_mb: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    *,
    ylabel: str = "ms per step",
    title: str = "",
    marks: Mapping[str, float] | None = None,
) -> Chart:
    """Lines over bucket sizes (log x); `marks` draws labelled vertical lines."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        pts = [(x, y) for x, y in zip(sizes_mb, ys) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for label, x in (marks or {}).items():
        ax.axvline(x, linestyle="--", color="gray")
        ax.annotate(label, (x, ax.get_ylim()[1]), fontsize="small", rotation=90, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def bandwidth(
    path: Path,
    sizes: Sequence[int],
    series: Mapping[str, Sequence[float]],
    *,
    reference: tuple[str, float] | None = None,
    title: str = "",
) -> Chart:
    """Bus bandwidth (GB/s) over message size (bytes), log-log, with a horizontal reference."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # Labels are "<op> n=<world>": one colour per op, one line style per world size.
    ops = list(dict.fromkeys(label.split()[0] for label in series))
    worlds = list(dict.fromkeys(label.split()[-1] for label in series))
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    palette = plt.get_cmap("tab10").colors
    for label, ys in series.items():
        op, world = ops.index(label.split()[0]), worlds.index(label.split()[-1])
        ax.plot(
            sizes[: len(ys)],
            ys,
            color=palette[op % len(palette)],
            linestyle=styles[world % len(styles)],
            marker=markers[world % len(markers)],
            markersize=4,
            label=label,
        )
    if reference:
        ax.axhline(reference[1], linestyle="--", color="gray", label=reference[0])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.legend(fontsize="x-small", ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def curves(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
) -> Chart:
    """Plain lines: {label: (xs, ys)} (loss curves, throughput)."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, (xs, ys)) in enumerate(series.items()):
        # The reference goes underneath as a thick pale line, so curves on top stay visible.
        style = {"linewidth": 4, "alpha": 0.4} if i == 0 else {"linewidth": 1.2}
        ax.plot(xs, ys, label=label, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def loss_curves(
    path: Path, steps: Sequence[int], losses: Mapping[str, Sequence[float]], reference: str
) -> Chart:
    """Left: every loss curve over the reference's; right: |loss - reference| per curve."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, losses[reference], linewidth=4, alpha=0.4, label=reference)
    for name, ys in losses.items():
        if name == reference:
            continue
        left.plot(steps, ys, linewidth=1.2, label=name)
        gaps = [max(abs(a - b), 1e-12) for a, b in zip(ys, losses[reference])]
        right.plot(steps, gaps, linewidth=1.0, label=name)
    left.set(xlabel="step", ylabel="training loss (global batch)", title="loss")
    right.set(xlabel="step", ylabel=f"|loss - {reference}|", title="gap to the reference")
    right.set_yscale("log")
    for ax in (left, right):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def timeline(
    path: Path, rows: Sequence[tuple[str, Sequence[tuple[float, float, str]]]], *, title: str
) -> Chart:
    """One step as horizontal lanes of (start ms, duration ms, name) ranges: what the
    training thread does while each communication thread has a collective on the wire."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    palette = plt.get_cmap("tab10").colors
    colors: dict[str, tuple] = {}

    def color(name: str) -> tuple:
        key = name.split("[")[0]  # all launches alike, all waits alike
        return colors.setdefault(key, palette[len(colors) % len(palette)])

    fig, ax = plt.subplots(figsize=(11, 0.7 * len(rows) + 1.4))
    for y, (_, items) in enumerate(rows):
        ax.broken_barh(
            [(s, d) for s, d, _ in items],
            (y - 0.35, 0.7),
            facecolors=[color(n) for _, _, n in items],
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(
        handles, list(colors), fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0)
    )
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Chart:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Chart(Path(path))
