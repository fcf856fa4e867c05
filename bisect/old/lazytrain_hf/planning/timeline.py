"""A PNG picture of a simulated step: one row per lane (compute, h2d, d2h, nvme, cpu) and the GPU memory curve.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend change), so it works headless and
inside applications that use another backend.
"""

from __future__ import annotations

from pathlib import Path

from .simulator import LANES, SimulationResult

__all__ = ["plot_timeline", "task_category"]

_GIB = 1024**3

# category -> colour (task labels start with these words; see simulator._build)
_COLOURS = {
    "fwd": "#4C72B0", "fwd+grad": "#64B5CD", "recompute": "#DD8452", "bwd": "#55A868", "head": "#8172B3",
    "opt": "#C44E52", "W": "#937860", "opt state": "#DA8BC3", "fetch": "#8C8C8C", "stash": "#CCB974",
    "grad": "#2F4B7C", "write": "#B47CC7", "read": "#C4AD66",
}


def task_category(label: str) -> str:
    """The colour category of a simulator task label ("fwd L3" -> "fwd", "opt state L2" -> "opt state")."""
    for cat in ("opt state", "fwd+grad", "recompute", "fwd", "bwd", "head", "opt", "fetch", "stash", "grad",
                "write", "read", "W"):
        if label.startswith(cat):
            return cat
    return label.split(" ")[0]


def plot_timeline(result: SimulationResult, path: str | Path, *, title: str = "", gpu_budget_bytes: int | None = None,
                  width_in: float = 14.0) -> Path:
    """Write a PNG of `result` to `path` (parent folders are created).

    Args:
        result: a simulated step (`simulate(cost_model, schedule)`).
        path: output file (.png).
        title: figure title (model, batch, policy, predicted step time, ...).
        gpu_budget_bytes: draw the GPU budget as a line on the memory plot (bytes).
        width_in: figure width (inches).

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(width_in, 6.0))
    FigureCanvasAgg(fig)
    ax, mem_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    lanes = list(reversed(LANES))  # compute on top
    seen: dict[str, str] = {}
    for row, lane in enumerate(lanes):
        spans = [(s, e - s, _COLOURS.get(task_category(lbl), "#999999"), task_category(lbl))
                 for ln, s, e, lbl in result.events if ln == lane]
        if spans:
            ax.broken_barh([(s, w) for s, w, _, _ in spans], (row - 0.4, 0.8),
                           facecolors=[c for _, _, c, _ in spans], edgecolor="white", linewidth=0.3)
            for _, _, c, cat in spans:
                seen.setdefault(cat, c)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.axvline(result.step_ms, color="black", linestyle="--", linewidth=0.8)
    ax.set_title(title or f"predicted step {result.step_ms:.1f} ms, peak GPU {result.peak_gpu_bytes / _GIB:.2f} GiB",
                 fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in seen.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if result.memory:
        ts = [0.0] + [t for t, _ in result.memory] + [max(result.step_ms, result.memory[-1][0])]
        gib = [0.0] + [b / _GIB for _, b in result.memory]
        gib.append(gib[-1])
        mem_ax.step(ts, gib, where="post", color="#4C72B0", linewidth=1.0)
    if gpu_budget_bytes:
        mem_ax.axhline(gpu_budget_bytes / _GIB, color="#C44E52", linestyle=":", linewidth=1.0, label="GPU budget")
        mem_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    mem_ax.set_ylabel("GPU GiB")
    mem_ax.set_xlabel("ms since the previous backward ended")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
