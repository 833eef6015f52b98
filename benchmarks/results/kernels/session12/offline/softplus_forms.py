"""Relative error of the three softplus forms against float64, in numpy float32 (the arithmetic
the Triton CPU interpreter uses), around Mamba's initial dt values. python softplus_forms.py"""
import numpy as np

rng = np.random.default_rng(0)
one = np.float32(1)
for dt in (1e-3, 1e-2, 1e-1):
    v = (np.log(np.expm1(dt)) + rng.uniform(-0.05, 0.05, 100000)).astype(np.float32)
    true = np.log1p(np.exp(v.astype(np.float64)))
    mamba1_old = np.log(one + np.exp(v))  # log(1 + exp(v))
    u = np.exp(-np.abs(v))
    series = u * (1 - u * (0.5 - u * (np.float32(1 / 3) - 0.25 * u)))
    ssd_old = np.maximum(v, 0) + np.where(u < 1e-2, series, np.log(one + u))  # series below u = 1e-2
    w = one + u
    new = np.maximum(v, 0) + np.log(w) - ((w - one) - u) * (np.float32(2) - w)  # scan_common.softplus
    err = lambda x: np.max(np.abs(x.astype(np.float64) - true) / true)  # noqa: E731
    print(f"dt ~ {dt:g}: Mamba-1 old {err(mamba1_old):.2e}, SSD old {err(ssd_old):.2e}, new {err(new):.2e}")
