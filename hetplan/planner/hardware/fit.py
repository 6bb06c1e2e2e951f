"""Fits of the profile's tables (pure functions): latency + bandwidth lines, the optimizer step,
and the contention factors stored in a topology's calibration (hetplan.planner.hardware.calibration).

Tested on synthetic tables (tests/test_calibration.py, tests/test_profile.py).
"""
from __future__ import annotations

import statistics

import numpy as np

from hetplan.planner.hardware.calibration import OptimizerFit


def fit_latency_bandwidth(rows: list[dict]) -> tuple[float, float]:
    """Fit s = latency_s + bytes / bytes_per_s to rows {"bytes", "s"} by least squares weighted
    by 1/s (relative residuals, so small and large sizes count alike). No rows: ValueError. One
    row: latency 0. A non-positive slope: the best measured bytes/s. A negative intercept: the
    smallest measured time (an upper bound of the latency). Returns (latency_s, bytes_per_s)."""
    if not rows:
        raise ValueError("no rows to fit")
    x = np.array([r["bytes"] for r in rows], dtype=float)
    y = np.array([r["s"] for r in rows], dtype=float)
    if len(rows) == 1:
        return 0.0, float(x[0] / y[0])
    w = 1.0 / y
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    bandwidth = 1.0 / slope if slope > 0 else float(np.max(x / y))
    latency = float(intercept) if intercept >= 0 else float(np.min(y))
    return latency, float(bandwidth)


def lower_envelope(rows: list[dict]) -> tuple[tuple[float, float], ...]:
    """((bytes, s), ...) by size, each time the least measured at that size or any larger one:
    a message cannot cost more than a larger one, so a slower small size is noise (a scheduler
    tick, a late wake-up) and the larger size's time bounds it."""
    pts = sorted((float(r["bytes"]), float(r["s"])) for r in rows)
    out, best = [], float("inf")
    for n, t in reversed(pts):
        best = min(best, t)
        out.append((n, best))
    return tuple(reversed(out))


def host_copy_fit(rows: list[dict]) -> dict:
    """Latency + bytes/bandwidth fits of a host_copy_table (hetplan.runtime.profile_bench), per kind and
    direction: {"pinned": {"h2d": {"latency_s", "bytes_per_s"}, "d2h": ...}, "pageable": {...}}."""
    out: dict = {}
    for kind, prefix in (("pageable", ""), ("pinned", "pinned_")):
        out[kind] = {}
        for direction in ("h2d", "d2h"):
            lat, bw = fit_latency_bandwidth([{"bytes": r["bytes"], "s": r[f"{prefix}{direction}_s"]}
                                             for r in rows])
            out[kind][direction] = {"latency_s": lat, "bytes_per_s": bw}
    return out


def fit_optimizer(rows: list[dict], fixed: bool = False) -> OptimizerFit:
    """Fit s = n_tensors * s_per_tensor + bytes * s_per_byte (+ s_fixed with `fixed`) to rows
    {"tensors", "bytes", "s"} (non-negative least squares with relative residuals, weights 1/s)."""
    from scipy.optimize import nnls
    if len(rows) < 2 + fixed:
        raise ValueError(f"need at least {2 + fixed} rows to fit the optimizer step")
    n = np.array([r["tensors"] for r in rows], dtype=float)
    b = np.array([r["bytes"] for r in rows], dtype=float)
    y = np.array([r["s"] for r in rows], dtype=float)
    w = 1.0 / y
    columns = [n, b] + [np.ones_like(n)] * fixed
    coef, _ = nnls(np.stack(columns, axis=1) * w[:, None], y * w)
    return OptimizerFit(s_per_tensor=float(coef[0]), s_per_byte=float(coef[1]),
                        s_fixed=float(coef[2]) if fixed else 0.0)


def memory_contention_factor(alone_rows: list[dict], together_rows: list[dict]) -> float | None:
    """Median over rows (matched by tensors and bytes) of together s / alone s, at least 1;
    None without matching rows."""
    alone = {(r["tensors"], r["bytes"]): r["s"] for r in alone_rows}
    ratios = [r["s"] / alone[(r["tensors"], r["bytes"])] for r in together_rows
              if (r["tensors"], r["bytes"]) in alone and alone[(r["tensors"], r["bytes"])] > 0]
    return max(1.0, statistics.median(ratios)) if ratios else None


def contention_factor(alone_s: list[float], together_s: list[float]) -> float:
    """Median over workers of (time with all workers busy) / (time alone), at least 1."""
    if not alone_s or len(alone_s) != len(together_s):
        raise ValueError("need one alone and one together time per worker")
    return max(1.0, statistics.median(t / a for a, t in zip(alone_s, together_s)))


__all__ = ["fit_latency_bandwidth", "host_copy_fit", "fit_optimizer", "contention_factor",
           "memory_contention_factor"]
