"""Output: the console table, Markdown, and the time-vs-n plot."""

from __future__ import annotations

import os
import platform
import subprocess
import time

from .core import BenchResult, Row

COLUMNS = [
    "problem",
    "solver",
    "iters x runs",
    "s / iter",
    "vs flashot",
    "% HW limit",
    "cores used",
    "peak RSS MiB",
    "+RSS MiB",
    "value <a,f>+<b,g>",
    "rel. diff",
    "notes",
]


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def row_cells(row: Row) -> list[str]:
    p = row.problem
    prob = f"n={p.n:,} d={p.d} {p.dtype}"
    name = row.solver + (
        f" ({row.engine})"
        if row.engine and row.solver.startswith("flashot:") and row.engine != row.solver.split(":", 1)[1]
        else ""
    )
    if row.status != "ok":
        note = f"{row.status}: {row.reason}"
        return [
            prob,
            name,
            "—",
            "—",
            "—",
            "—",
            "—",
            _fmt(row.rss_peak_mib, ".0f") if row.status == "error" else "—",
            "—",
            "—",
            "—",
            note,
        ]
    ratio = "1 (ref)" if row.is_ref else _fmt(row.ratio, ".3g")
    return [
        prob,
        name,
        f"{row.iters} x {row.repeats}",
        f"{row.s_per_iter:.4g}",
        ratio,
        _fmt(None if row.hw_fraction is None else 100 * row.hw_fraction, ".3g"),
        _fmt(row.cores_used, ".2f"),
        _fmt(row.rss_peak_mib, ".0f"),
        _fmt(row.delta_mib, ".0f"),
        f"{row.value:.8g}",
        _fmt(row.rel_diff, ".1e"),
        row.reduced,
    ]


def text_table(res: BenchResult) -> str:
    data = [COLUMNS] + [row_cells(r) for r in res.rows]
    widths = [max(len(r[i]) for r in data) for i in range(len(COLUMNS))]
    lines = []
    for k, r in enumerate(data):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(res: BenchResult) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in res.rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in row_cells(r)) + " |")
    return "\n".join(out)


def limits_lines(res: BenchResult) -> list[str]:
    out = []
    for dt, lim in res.limits.items():
        fl = (
            f"{lim.exp_rate_flashot / 1e9:.3g} G/s"
            if lim.exp_rate_flashot is not None
            else f"not measured ({lim.build_error or 'cpu engine not built'})"
        )
        out.append(
            f"measured limits ({dt}, {lim.threads} threads): exp: torch.exp {lim.exp_rate_torch / 1e9:.3g} G/s, "
            f"flashot compiled vector exp {fl}; exp rate = the faster ({lim.exp_source}, "
            f"{lim.exp_rate / 1e9:.3g} G/s); GEMM {lim.gemm_rate / 1e9:.3g} GFLOP/s; limit per iteration = "
            f"max(2nm / exp rate, 4nmd / GEMM rate)"
        )
    return out


def missing_lines(res: BenchResult) -> list[str]:
    return [f"{name}: {why}" for name, why in res.missing.items()]


def cpu_identity() -> str:
    """Vendor, family, model and stepping from /proc/cpuinfo (the model name alone, e.g. "AMD EPYC",
    does not tell a Zen 4 from a Zen 5; figures from other CPUs may differ)."""
    want = {
        "vendor_id": "vendor",
        "cpu family": "family",
        "model": "model",
        "stepping": "stepping",
        "CPU implementer": "implementer",
        "CPU part": "part",
    }
    got: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # first processor only
                k, _, v = line.partition(":")
                if k.strip() in want:
                    got[want[k.strip()]] = v.strip()
    except OSError:
        return ""
    return ", ".join(f"{k} {v}" for k, v in got.items())


def kernel_isa() -> str:
    """The instruction set the cpu engine's kernels were compiled for here ("" if unavailable)."""
    try:
        from flashot.ops.cpu import build

        lib = build.load(quiet=True)
    except Exception:  # noqa: BLE001 - no compiler, no engine: nothing to report
        return ""
    info = build.BUILD_INFO
    pre = " prebuilt" if info.get("prebuilt") else ""
    return (
        f"-march={info.get('march')}{pre} ({lib.flashot_vector_bytes() * 8}-bit vectors; "
        f"{' '.join(info.get('isa', []))})"
    )


def machine_info() -> dict[str, str]:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info["cpu"] = model or platform.processor() or "?"
    ident = cpu_identity()
    if ident:
        info["cpu"] += f" ({ident})"
    kern = kernel_isa()
    if kern:
        info["cpu kernels"] = kern
    info["cores"] = str(os.cpu_count())
    try:
        with open("/proc/meminfo") as fh:
            info["memory"] = f"{int(fh.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    try:
        info["load average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    return info


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in (
        "flashot",
        "torch",
        "numpy",
        "pot",
        "geomloss",
        "pykeops",
        "jax",
        "jaxlib",
        "ott-jax",
        "flash-sinkhorn",
    ):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def markdown_report(res: BenchResult, command: str, title: str = "flashot bench") -> str:
    lines = [
        f"## {title}",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; run time {res.elapsed_s:.0f} s",
        "",
    ]
    mi = machine_info()
    lines.append("Machine: " + "; ".join(f"{k}: {v}" for k, v in mi.items()))
    lines.append("")
    lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in library_versions().items()))
    lines.append("")
    for l in limits_lines(res):
        lines.append(f"- {l}")
    for l in missing_lines(res):
        lines.append(f"- missing: {l}")
    lines += ["", markdown_table(res), ""]
    return "\n".join(lines)


def check_matplotlib() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib, or flashot[bench])"
    return None


def plot(res: BenchResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in res.rows:
        spi = r.s_per_iter
        if r.status == "ok" and spi is not None:
            key = f"{r.solver} (d={r.problem.d}, {r.problem.dtype})"
            series.setdefault(key, []).append((r.problem.n, spi))
    for key, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("n = m (points per cloud)")
    ax.set_ylabel("seconds per iteration (two softmins)")
    ax.set_title(f"Sinkhorn, eps={res.config.eps:g}, |x-y|^2, uniform points in the unit cube")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
