"""The held-out R² of ridge maps along a λ path by Cholesky factorisations: the `"cholesky"` λ search of
`hf_kvbridge.fitting.solve`, from the standardized moments it hands over (all matrix-matrix work, batched over maps
and λ).

For each λ, `W(λ) = (Z + λI)⁻¹ a` (one Cholesky factorisation, two triangular solves) and, per output column, the mean
squared held-out residual `var_y − 2 wᵀc + wᵀ Z' w + (mean residual)²` from the held-out moments, as the
eigendecomposition's path computes it.
"""

from __future__ import annotations

import torch


def heldout_r2_by_cholesky(
    z: torch.Tensor,
    a: torch.Tensor,
    m: torch.Tensor,
    c: torch.Tensor,
    shift: torch.Tensor,
    offset: torch.Tensor,
    hvy: torch.Tensor,
    grid: torch.Tensor,
    head_dim: int,
    lam_batch: int,
) -> torch.Tensor:
    """Held-out R² `(n, Λ, q // d)` of `n` maps of one shape, `lam_batch` λ of `grid` factorised at once.

    Args:
        z (`torch.Tensor` of shape `(n, p, p)`), a (`(n, p, q)`): the standardized training Gram and cross blocks.
        m (`(n, p, p)`), c (`(n, p, q)`): the held-out ones in the training's standardization.
        shift (`(n, p)`), offset (`(n, q)`), hvy (`(n, q)`): held-out minus training input means, output means, and
            the held-out output variances.
        grid (`torch.Tensor` of shape `(Λ,)`): the λ, float64, on the moments' device.

    Example:

    ```python
    >>> n, p, q = 1, 4, 2
    >>> x = torch.randn(50, p, dtype=torch.float64)
    >>> z = (x.T @ x / 50)[None]
    >>> r2 = heldout_r2_by_cholesky(z, z[..., :q], z, z[..., :q], torch.zeros(n, p, dtype=torch.float64),
    ...                             torch.zeros(n, q, dtype=torch.float64), torch.ones(n, q, dtype=torch.float64),
    ...                             torch.tensor([1e-3, 1.0], dtype=torch.float64), head_dim=1, lam_batch=2)
    >>> r2.shape
    torch.Size([1, 2, 2])
    ```
    """
    n, p, q = a.shape
    chunks = q // head_dim
    sst = hvy.view(n, chunks, head_dim).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)  # (n, chunks)
    out = []
    for lam in grid.to(z.device).split(lam_batch):
        system = z.unsqueeze(1).repeat(1, lam.numel(), 1, 1)  # (n, λ, p, p)
        system.diagonal(dim1=-2, dim2=-1).add_(lam[None, :, None])
        factor, info = torch.linalg.cholesky_ex(system)
        if bool(info.any()):  # not positive definite (rounding on a singular block): a ridge of p·eps more
            system.diagonal(dim1=-2, dim2=-1).add_(torch.finfo(torch.float64).eps * p)
            factor = torch.linalg.cholesky(system)
        del system
        w = torch.cholesky_solve(a.unsqueeze(1).expand(n, lam.numel(), p, q), factor)  # (n, λ, p, q) W(λ)
        del factor
        # per column, mean squared held-out residual: var_y − 2 wᵀc + wᵀ Z' w + (mean residual)²
        quadratic = (m.unsqueeze(1) @ w).mul_(w).sum(-2)  # (n, λ, q)
        linear = (c.unsqueeze(1) * w).sum(-2)  # (n, λ, q)
        mean = offset.unsqueeze(1) - (shift[:, None, None, :] @ w).squeeze(-2)  # (n, λ, q)
        mse = hvy.unsqueeze(1) - 2 * linear + quadratic + mean**2
        sse = mse.clamp_min(0).view(n, lam.numel(), chunks, head_dim).sum(-1)  # (n, λ, chunks)
        out.append(1 - sse / sst.unsqueeze(1))
    return torch.cat(out, dim=1)
