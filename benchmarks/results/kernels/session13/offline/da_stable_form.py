"""The SSD backward's log-decay gradient in a stable (pairwise) form, checked in float64 and
compared with the kernels' identity in float32, over several chunks with carried states.

    python da_stable_form.py

One head of a chunked SSD (K chunks of Lc tokens; p head dim, n state size; i, j, k tokens of
a chunk, L its last). Per chunk, with S_in the state entering it, dS_out the loss gradient
reaching the state leaving it, cs the cumulative log-decay (a_t = dt_t A) since the chunk
start:
    y_i   = sum_{j <= i} exp(cs_i - cs_j) (C_i . B_j) dt_j x_j + exp(cs_i) S_in C_i
    S_out = exp(cs_L) S_in + sum_j exp(cs_L - cs_j) dt_j x_j B_j^T
Stable form: every term is credited to the a_k that its exponent holds, and nothing cancels:
    da_k = sum_{i >= k} u_i + sum_{j < k <= i} M_ij + exp(cs_L) <dS_out, S_in> + sum_{j < k} w_j
    u_i  = exp(cs_i) dy_i . (S_in C_i),   M_ij = exp(cs_i - cs_j) (C_i . B_j) dt_j (dy_i . x_j),
    w_j  = exp(cs_L - cs_j) dt_j x_j . (dS_out B_j)
The kernels' identity (ssd_scan_bwd): dcs_t = C_t . dC_t - dt_t ddt_t(direct)
+ [t = L] <dS_out, S_out>, da = suffix sums of dcs. Both give dA = sum_k dt_k da_k; the
truth is torch autograd in float64.
"""
import torch
import torch.nn.functional as F

K, LC, P, N = 4, 128, 64, 64


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    t = K * LC
    dt = F.softplus(r(t) + torch.log(torch.expm1(torch.tensor(0.01, dtype=torch.float64))))
    A = -torch.empty((), dtype=torch.float64).uniform_(1, 16, generator=g)
    return dict(x=r(t, P), B=r(t, N), C=r(t, N), dt=dt, A=A, dy=r(t, P))


def forward(v, A):
    """y (t, p) and the states entering / leaving every chunk (lists of (p, n))."""
    ys, s_in, s_out = [], [], []
    S = torch.zeros(P, N, dtype=A.dtype)
    for c in range(K):
        sl = slice(c * LC, (c + 1) * LC)
        x, B, C, dt = v["x"][sl], v["B"][sl], v["C"][sl], v["dt"][sl]
        cs = torch.cumsum(dt * A, 0)
        decay = torch.tril(torch.exp(cs[:, None] - cs[None, :]))
        ys.append((decay * (C @ B.T) * dt[None, :]) @ x + torch.exp(cs)[:, None] * (C @ S.T))
        s_in.append(S)
        S = torch.exp(cs[-1]) * S + (x * (torch.exp(cs[-1] - cs) * dt)[:, None]).T @ B
        S.retain_grad() if S.requires_grad else None
        s_out.append(S)
    return torch.cat(ys), s_in, s_out


def chunk_terms(v, c, A, S_in, dS_out):
    sl = slice(c * LC, (c + 1) * LC)
    x, B, C, dt, dy = (v[k][sl] for k in ("x", "B", "C", "dt", "dy"))
    cs = torch.cumsum(dt * A, 0)
    return x, B, C, dt, dy, cs, S_in, dS_out


def da_stable(v, c, A, S_in, dS_out):
    x, B, C, dt, dy, cs, S_in, dS_out = chunk_terms(v, c, A, S_in, dS_out)
    u = torch.exp(cs) * ((dy @ S_in) * C).sum(1)
    strict = torch.tril(torch.ones(LC, LC, dtype=torch.bool), -1)
    M = torch.where(strict, torch.exp(cs[:, None] - cs[None, :]) * (C @ B.T) * dt[None, :] * (dy @ x.T),
                    torch.zeros((), dtype=cs.dtype))
    rows = torch.cumsum(M, 1) - M  # sum over j < k of M[i, j], at column k
    pairs = torch.flip(torch.cumsum(torch.flip(rows, [0]), 0), [0]).diagonal()  # and over i >= k
    w = torch.exp(cs[-1] - cs) * dt * ((x @ dS_out) * B).sum(1)
    suffix = lambda t: torch.flip(torch.cumsum(torch.flip(t, [0]), 0), [0])  # noqa: E731
    return suffix(u) + pairs + torch.exp(cs[-1]) * (dS_out * S_in).sum() + (torch.cumsum(w, 0) - w)


def da_identity(v, c, A, S_in, dS_out):
    x, B, C, dt, dy, cs, S_in, dS_out = chunk_terms(v, c, A, S_in, dS_out)
    decay = torch.tril(torch.exp(cs[:, None] - cs[None, :]))
    dC = torch.exp(cs)[:, None] * (dy @ S_in) + (decay * (dy @ x.T) * dt[None, :]) @ B
    G = (decay * (C @ B.T)).T @ dy + torch.exp(cs[-1] - cs)[:, None] * (B @ dS_out.T)
    S_out = torch.exp(cs[-1]) * S_in + (x * (torch.exp(cs[-1] - cs) * dt)[:, None]).T @ B
    dcs = (C * dC).sum(1) - dt * (x * G).sum(1)
    dcs[-1] += (dS_out * S_out).sum()
    return torch.flip(torch.cumsum(torch.flip(dcs, [0]), 0), [0])


def main():
    worst = {"identity": 0.0, "stable": 0.0}
    for seed in range(10):
        v = inputs(seed)
        A = v["A"].clone().requires_grad_(True)
        y, s_in, s_out = forward(v, A)
        loss = (y * v["dy"]).sum()
        grads = torch.autograd.grad(loss, [A] + s_out[:-1])
        truth, d_out = grads[0], list(grads[1:]) + [torch.zeros(P, N, dtype=torch.float64)]
        s_in = [s.detach() for s in s_in]
        errs = {}
        for name, fn in (("identity", da_identity), ("stable", da_stable)):
            exact = sum((v["dt"][c * LC:(c + 1) * LC] * fn(v, c, v["A"], s_in[c], d_out[c])).sum() for c in range(K))
            assert abs(exact - truth) <= 1e-9 * abs(truth), (name, exact.item(), truth.item())  # the formula is right
            v32 = {k: t.float() for k, t in v.items()}
            got = sum((v32["dt"][c * LC:(c + 1) * LC] * fn(v32, c, v32["A"], s_in[c].float(), d_out[c].float())).sum()
                      for c in range(K))
            errs[name] = abs(got.double() - truth).item() / abs(truth).item()
            worst[name] = max(worst[name], errs[name])
        print(f"seed {seed}: dA {truth.item():+.4e}  float32 rel err " + "  ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    print(f"worst over 10 seeds ({K} chunks of {LC}, p={P}, n={N}):", {k: f"{e:.2e}" for k, e in worst.items()})


if __name__ == "__main__":
    main()
