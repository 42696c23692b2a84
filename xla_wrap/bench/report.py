"""Comparing benchmark runs with the reference, and showing them: a table and a chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = (
    ("model", "model"),
    ("variant", "variant"),
    ("runs", "runs?"),
    ("grads_equal", "grads = none"),
    ("peak_mib", "peak MiB"),
    ("peak_ratio", "vs none"),
    ("floor_mib", "floor MiB"),
    ("floor_ratio", "vs floor"),
    ("flops_ratio", "FLOPs vs none"),
    ("time_ratio", "step time vs none"),
    ("compile_s", "compile s"),
    ("trace_ms", "trace ms"),
    ("recompiles", "recompiles"),
    ("error", "error"),
)


def compare(runs: list[dict[str, Any]]) -> None:
    """Add ratios to the reference ("none") of the same model, and whether gradients equal its."""
    import torch

    references = {r["model"]: r for r in runs if r["variant"] == "none" and "error" not in r}
    for run in runs:
        run["runs"] = "error" not in run
        if "error" in run:
            continue
        run["peak_mib"] = run["peak_bytes"] / 2**20
        reference = references.get(run["model"])
        if reference is None:  # the reference itself crashed: no ratios, no gradient check
            continue
        run["peak_ratio"] = run["peak_bytes"] / reference["peak_bytes"]
        if "floor_bytes" in reference:  # estimated for single-device models only
            run["floor_mib"] = reference["floor_bytes"] / 2**20
            run["floor_ratio"] = run["peak_bytes"] / reference["floor_bytes"]
        run["flops_ratio"] = run["flops"] / reference["flops"] if reference["flops"] else None
        if "step_ms" in run and "step_ms" in reference:
            run["time_ratio"] = run["step_ms"] / reference["step_ms"]
        if run.get("own_masks"):  # other Dropout masks, other gradients: nothing to compare
            run["grads_equal"] = None
            continue
        expected = torch.load(reference["grads"])
        got = torch.load(run["grads"])
        # Within 1e-4 relative, judged against each gradient's own scale: XLA fuses the
        # checkpointed program differently, which moves the last bits.
        run["grads_equal"] = len(expected) == len(got) and all(
            a.shape == b.shape and torch.allclose(b, a, rtol=1e-4, atol=1e-4 * float(a.abs().max()))
            for a, b in zip(expected, got, strict=True)
        )


def _cell(run: dict[str, Any], key: str) -> str:
    value = run.get(key)
    if key in ("model", "variant"):
        return str(value)
    if key == "error":
        text = value or (f"timing: {run['timing_error']}" if "timing_error" in run else "")
        return str(text)[:90]
    if key == "runs":
        return "no" if "error" in run else "yes"
    if key == "grads_equal" and "error" not in run:
        if run["variant"] == "none":
            return "reference"
        if run.get("own_masks"):
            return "- (own masks)"
        return "-" if value is None else ("yes" if value else "NO")
    if value is None:
        return "-"
    if key.endswith("_ratio"):
        return f"{value:.2f}x"
    if key.endswith("_mib"):
        return f"{value:.1f}"
    if key == "compile_s":
        return f"{value:.1f}"
    if key == "trace_ms":
        return f"{value:.0f}"
    return str(value)


def render_table(runs: list[dict[str, Any]], caption: str = "") -> str:
    """The runs as an aligned text table, under `caption` (say how XLA was configured)."""
    rows = [tuple(title for _, title in COLUMNS)]
    rows += [tuple(_cell(run, key) for key, _ in COLUMNS) for run in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < 2 or i in (3, len(COLUMNS) - 1) else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join([caption, *lines] if caption else lines)


def render_plan_table(sections: list[dict[str, Any]]) -> str:
    """The plan section: per model, the uniform plans, then each budget's plan next to the
    cheapest uniform plan that fits the same budget."""
    from ..internal import summarize

    rows = [
        ("model", "plan", "budget MiB", "peak MiB", "fits", "FLOPs vs none", "step vs none",
         "cheapest fitting uniform", "its FLOPs")
    ]  # fmt: skip
    for section in sections:
        if "error" in section:
            rows.append((section["model"], "error", "", "", "", "", "", section["error"][:80], ""))
            continue
        uniform = section["uniform"]
        none = uniform["none"]

        def ratio(value: float | None, reference: float | None) -> str:
            return f"{value / reference:.3f}x" if value and reference else "-"

        for name, u in uniform.items():
            rows.append((
                section["model"], name, "-", f"{u['peak_bytes'] / 2**20:.1f}", "-",
                ratio(u["flops"], none["flops"]), ratio(u.get("step_ms"), none.get("step_ms")),
                "", "",
            ))  # fmt: skip
        for p in section["planned"]:
            cheapest = p["cheapest_uniform"]
            rows.append((
                section["model"], f"planned: {summarize(p['choices'].values())}",
                f"{p['budget_bytes'] / 2**20:.1f}", f"{p['peak_bytes'] / 2**20:.1f}",
                "yes" if p["peak_bytes"] <= p["budget_bytes"] else "NO",
                ratio(p["flops"], none["flops"]), ratio(p.get("step_ms"), none.get("step_ms")),
                cheapest or "none fits",
                ratio(uniform[cheapest]["flops"], none["flops"]) if cheapest else "-",
            ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i in (0, 1, 7) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def render_chart(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Peak memory and step time per variant, one panel pair per model; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(dict.fromkeys(r["model"] for r in runs))
    figure, axes = plt.subplots(len(models), 2, figsize=(12, 3.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        ok = [r for r in runs if r["model"] == model and "peak_mib" in r]
        names = [r["variant"] for r in ok]
        crashed = [r["variant"] for r in runs if r["model"] == model and "error" in r]
        if crashed:
            row[0].set_xlabel("crashed: " + ", ".join(crashed), fontsize=8)
        row[0].barh(names, [r["peak_mib"] for r in ok], color="tab:blue")
        floors = [r["floor_mib"] for r in ok if "floor_mib" in r]
        if floors:
            row[0].axvline(floors[0], color="black", linestyle="--", label="estimated floor")
            row[0].legend(loc="lower right")
        row[0].set_title(f"{model}: compiled peak (MiB)")
        row[1].barh(names, [r.get("step_ms", 0.0) for r in ok], color="tab:orange")
        row[1].set_title(f"{model}: median step time (ms)")
        for ax in row:
            ax.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
