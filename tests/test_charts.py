"""The PNG charts' layout (verify/perf/charts.py), in-process: what a reader must be able to
read is never covered by a legend."""

from __future__ import annotations

import pytest

from verify.perf import charts


@pytest.mark.parametrize("rows", [2, 6])
def test_the_legend_below_a_chart_leaves_its_x_axis_label_readable(rows):
    """The step breakdown's legend sat over its x-axis label ("ms per step") on a short
    chart: anchored at a fraction of the axes' height, not below the label. Measured as
    drawn, after the layout `_save` applies."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(8, 0.5 * rows + 1.6))  # as step_breakdown sizes it
    for name in ("forward", "backward", "all_reduce", "step"):
        ax.barh([f"v{i}" for i in range(rows)], [1.0] * rows, label=name)
    ax.set_xlabel("ms per step")
    charts._legend_below(ax, 4)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    label = ax.xaxis.label.get_window_extent(renderer)
    ticks = ax.xaxis.get_tightbbox(renderer)
    plt.close(fig)
    assert legend.y1 <= label.y0 and legend.y1 <= ticks.y0, (legend, label)
