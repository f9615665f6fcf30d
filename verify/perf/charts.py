"""PNG charts written next to the tables. Optional: without matplotlib (the `charts` extra)
each function writes nothing and returns a one-line note saying so.

What a reader must be able to trust, in every chart: no legend over data (legends go beside
or below the axes), one colour per name in every chart of a run (a collective or a phase is
the same colour in each timeline: `COLOURS`, then a colour fixed by the name), integer ticks
where the axis counts (world sizes), and zero drawn as zero (a gap of exactly 0 is on the
axis at 0, not at an unlabelled 1e-12; a value below the measurement's noise is not drawn).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MISSING = "charts skipped: matplotlib is not installed (pip install -e '.[charts]')"


@dataclass(frozen=True)
class Chart:
    path: Path | None  # None: not written
    note: str | None = None


def _figure(**subplots):
    """(pyplot, figure, axes), or three Nones without matplotlib."""
    plt = _pyplot()
    return (None, None, None) if plt is None else (plt, *plt.subplots(**subplots))


def _finish(plt, fig, ax, path: Path, title: str, entries: int) -> Chart:
    """Title, a legend of `entries` below, a light grid; saved to `path`."""
    ax.set_title(title)
    _legend_below(ax, entries)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


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
        ax.barh(labels, widths, left=left, label=name, color=colour(name, plt))
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title or "step breakdown")
    _legend_below(ax, len(segments))
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
    plt, fig, ax = _figure(figsize=(7, 4))
    if plt is None:
        return Chart(None, MISSING)
    for label, ys in series.items():
        pts = [(x, y) for x, y in zip(sizes_mb, ys) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for label, x in (marks or {}).items():
        ax.axvline(x, linestyle="--", color="gray")
        ax.annotate(label, (x, ax.get_ylim()[1]), fontsize="small", rotation=90, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes_mb), [f"{x:g}" for x in sizes_mb])
    ax.minorticks_off()
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel(ylabel)
    if all(y is None or y >= 0 for ys in series.values() for y in ys):
        ax.set_ylim(bottom=0)  # zero where zero is: a difference starts at the axis
    return _finish(plt, fig, ax, path, title, len(series))


def bandwidth(
    path: Path,
    sizes: Sequence[int],
    series: Mapping[str, Sequence[float]],
    *,
    reference: tuple[str, float] | None = None,
    title: str = "",
) -> Chart:
    """Bus bandwidth (GB/s) over message size (bytes), log-log, with a horizontal reference."""
    plt, fig, ax = _figure(figsize=(8, 4.5))
    if plt is None:
        return Chart(None, MISSING)
    # Labels are "<op> n=<world>": one colour per op (as in the timelines), one line style
    # per world size.
    worlds = list(dict.fromkeys(label.split()[-1] for label in series))
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    for label, ys in series.items():
        world = worlds.index(label.split()[-1])
        ax.plot(
            sizes[: len(ys)],
            ys,
            color=colour(label.split()[0], plt),
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
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
    plt, fig, ax = _figure(figsize=(7, 4))
    if plt is None:
        return Chart(None, MISSING)
    for i, (label, (xs, ys)) in enumerate(series.items()):
        # The reference goes underneath as a thick pale line, so curves on top stay visible.
        style = {"linewidth": 4, "alpha": 0.4} if i == 0 else {"linewidth": 1.2}
        ax.plot(xs, ys, label=label, marker="o" if i else None, **style)
    if all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no world size 1.25
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(plt, fig, ax, path, title, len(series))


def loss_curves(
    path: Path, steps: Sequence[int], losses: Mapping[str, Sequence[float]], reference: str
) -> Chart:
    """Left: every loss curve over the reference's; right: |loss - reference| per curve."""
    plt = _pyplot()
    if plt is None:
        return Chart(None, MISSING)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    left.plot(steps, losses[reference], linewidth=4, alpha=0.4, label=reference)
    gaps = {
        name: [abs(a - b) for a, b in zip(ys, losses[reference])]
        for name, ys in losses.items()
        if name != reference
    }
    # Curves that coincide must all show: each its own marker and dash.
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for i, name in enumerate(gaps):
        marker, dash = styles[i % len(styles)]
        (line,) = left.plot(steps, losses[name], linewidth=1.2, linestyle=dash, label=name)
        right.plot(
            steps,
            gaps[name],
            linewidth=1.0,
            linestyle=dash,
            marker=marker,
            markersize=4,
            markerfacecolor="none",
            label=name,
            color=line.get_color(),
        )  # fmt: skip  (one colour per curve in both panels)
    left.set(xlabel="step", ylabel="training loss (global batch)", title="loss")
    right.set(xlabel="step", ylabel=f"|loss - {reference}|", title="gap to the reference")
    nonzero = [g for gs in gaps.values() for g in gs if g > 0]
    # symlog: a gap of exactly 0 sits on the axis at a labelled 0; the rest is logarithmic,
    # from a decade under the smallest gap to a decade over the largest
    low, high = (min(nonzero), max(nonzero)) if nonzero else (1e-12, 1e-11)
    right.set_yscale("symlog", linthresh=low / 10)
    right.set_ylim(0, high * 10)
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
        _legend_below(ax, 1 + len(gaps))
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
    colors: dict[str, tuple] = {}

    def color(name: str) -> tuple:
        key = name.split("[")[0]  # all launches alike, all waits alike
        return colors.setdefault(key, colour(key, plt))

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


# One colour per name in every chart: the phases, then the collectives by op (gloo's or
# NCCL's), then the implementations' own ranges by what they do.
COLOURS = {
    "forward": "#1f77b4", "backward": "#ff7f0e", "grad_sync": "#2ca02c",
    "optimizer_step": "#d62728", "all_reduce": "#9467bd", "broadcast": "#17becf",
    "all_gather": "#8c564b", "reduce_scatter": "#e377c2", "launch": "#c5b0d5",
    "wait": "#7f7f7f", "step": "#ff9896", "sync_params": "#9edae5",
    "compute (local step)": "#1f77b4",
    "exposed communication (step - local)": "#ff7f0e",
}  # fmt: skip


def colour(name: str, plt) -> tuple | str:
    """The colour of `name` in every chart: `COLOURS` by the name, by its op after a backend
    prefix (`gloo:all_reduce`), or by its last part (`OverlapDDP.launch`); else one fixed by
    the name's hash from a palette the fixed colours do not use."""
    for key in (name, name.split(":")[-1], name.split(".")[-1]):
        if key in COLOURS:
            return COLOURS[key]
    spare = plt.get_cmap("Set2").colors
    return spare[zlib.crc32(name.encode()) % len(spare)]


def _legend_below(ax, entries: int) -> None:
    """Under the axes and under their x-axis (ticks and label), never over the data or the
    label. Anchored a distance in points below the axes, the x-axis's measured height: the
    ticks and the label sit at fixed points below the axes, so the anchor stays right when
    `tight_layout` resizes the axes (a fraction of the axes' height would not: on a short
    chart the label fell under the legend)."""
    from matplotlib.transforms import offset_copy

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    axis = ax.xaxis.get_tightbbox(renderer)
    below = 0.0 if axis is None else max(0.0, ax.get_window_extent(renderer).y0 - axis.y0)
    anchor = offset_copy(ax.transAxes, fig=fig, y=-(below * 72.0 / fig.dpi + 4), units="points")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, 0.0),
              bbox_transform=anchor, ncol=min(entries, 4), frameon=False)  # fmt: skip


def _save(fig, plt, path: Path) -> Chart:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends below the axes included
    plt.close(fig)
    return Chart(Path(path))
