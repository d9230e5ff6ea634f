"""Second-order helpers of the learning-aware losses: vectors of parameter-shaped tensors,
inverse-Hessian-vector products, each agent's parameters, and attention with second derivatives.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nip_like.agent_modules import PerAgent

#: A vector in parameter space: one tensor per parameter, each shaped like it.
Vector = list[torch.Tensor]


def twice_differentiable():
    """A context in which attention runs on PyTorch's math kernel, the one with second derivatives.

    The fused attention kernels (flash, memory-efficient; the CPU's flash
    kernel too) have first derivatives only. The math kernel gives the same
    values up to rounding, so probability ratios stay 1 at the behaviour policy.
    """
    return sdpa_kernel([SDPBackend.MATH])


# ------------------------------------------------------- vector helpers
def _empty_like(like: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of ``shape`` on the device and of the dtype of ``like``: the value of an empty vector's dot or flattening.

    An empty vector (an agent without parameters) holds no tensor to take a
    device from, so the caller names one; the package's callers filter such
    agents out before they get here.

    Raises
    ------
    ValueError
        If ``like`` is None.
    """
    if like is None:
        raise ValueError("an empty parameter vector has no device or dtype: pass like= (a tensor of the data it meets)")
    return like.new_zeros(shape)


def _dot(a: Vector, b: Vector, like: torch.Tensor | None = None) -> torch.Tensor:
    """The dot product of two vectors (a scalar); zero on ``like``'s device and dtype if they are empty."""
    products = [(x * y).sum() for x, y in zip(a, b)]
    return torch.stack(products).sum() if products else _empty_like(like, ())


def _flat(vector: Vector, like: torch.Tensor | None = None) -> torch.Tensor:
    """The vector's tensors flattened into one; an empty one on ``like``'s device and dtype if there are none."""
    return torch.cat([v.reshape(-1) for v in vector]) if vector else _empty_like(like, (0,))


def _unflat(flat: torch.Tensor, like: Vector) -> Vector:
    parts, start = [], 0
    for tensor in like:
        parts.append(flat[start : start + tensor.numel()].view_as(tensor))
        start += tensor.numel()
    return parts


def conjugate_gradient(
    hvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iterations: int, damping: float, side: bool = False
) -> tuple[torch.Tensor, float]:
    """Solve ``(H + damping I) x = b`` by conjugate gradient, from ``x = 0``.

    Stops after ``iterations`` steps, at a relative residual of ``1e-10``, or
    where the damped Hessian shows non-positive curvature along the search
    direction (the follower is not at a local optimum there); a first step
    along such a direction uses the curvature's magnitude.

    Parameters
    ----------
    hvp : callable
        ``v -> H v`` on flat vectors.
    b : torch.Tensor
        Flat right-hand side.
    iterations : int
        At most this many steps.
    damping : float
        Added to the diagonal.
    side : bool
        ``hvp(v)`` returns ``(H v, s(v))`` with ``s`` linear in ``v`` (a
        by-product of the same pass), and the result adds ``s(x)``,
        combined from the ``s`` of the search directions as ``x`` is (None
        for ``b = 0``).

    Returns
    -------
    tuple
        ``x`` and the relative residual ``|b - (H + damping) x| / |b|``
        (and ``s(x)`` with ``side``).
    """
    x = torch.zeros_like(b)
    norm_b = b.norm()
    if norm_b == 0:
        return (x, 0.0, None) if side else (x, 0.0)
    residual, direction = b.clone(), b.clone()
    squared = residual.dot(residual)
    along = None  # s(x)
    for step in range(iterations):
        product = hvp(direction)
        if side:
            product, by_product = product
        product = product + damping * direction
        curvature = direction.dot(product)
        if curvature <= 0:
            if step > 0 or curvature == 0:
                break
            curvature = -curvature
            product = -product
        size = squared / curvature
        x = x + size * direction
        if side:
            along = size * by_product if along is None else along + size * by_product
        residual = residual - size * product
        new_squared = residual.dot(residual)
        if new_squared.sqrt() <= 1e-10 * norm_b:
            squared = new_squared
            break
        direction = residual + (new_squared / squared) * direction
        squared = new_squared
    if side:
        return x, float(squared.sqrt() / norm_b), along
    return x, float(squared.sqrt() / norm_b)


def low_rank_inverse(
    hvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, rank: int, damping: float, side: bool = False
) -> tuple[torch.Tensor, float]:
    """Apply ``(|H_r| + damping I)^-1`` to ``b``, ``H_r`` a rank-``rank`` Lanczos approximation of ``H``.

    Lanczos from ``b`` (with full reorthogonalisation) gives an orthonormal
    basis ``Q`` of the Krylov space and ``H ~ Q T Q^T``; the eigenvalues of
    ``T`` are replaced by their magnitudes (so an indefinite Hessian still
    gives a descent direction) and damped. Since ``b`` lies in the span of
    ``Q``, nothing of it is left out.

    With ``side``, ``hvp(v)`` returns ``(H v, s(v))`` as for
    :func:`conjugate_gradient`, and the result adds ``s(x)`` (from the
    product that measures the residual).

    Returns
    -------
    tuple
        ``x`` and the relative residual of ``(H + damping) x = b`` measured
        with one more Hessian-vector product (and ``s(x)`` with ``side``).
    """
    norm_b = b.norm()
    if norm_b == 0:
        return (torch.zeros_like(b), 0.0, None) if side else (torch.zeros_like(b), 0.0)
    product_of = (lambda v: hvp(v)[0]) if side else hvp  # noqa: E731
    basis = [b / norm_b]
    diagonal, off_diagonal = [], []
    for step in range(min(rank, b.numel())):
        w = product_of(basis[-1])
        diagonal.append(basis[-1].dot(w))
        stacked = torch.stack(basis)
        w = w - stacked.T @ (stacked @ w)
        w = w - stacked.T @ (stacked @ w)  # twice is enough (Kahan)
        beta = w.norm()
        if step == rank - 1 or beta <= 1e-8 * norm_b:
            break
        off_diagonal.append(beta)
        basis.append(w / beta)
    size = len(diagonal)
    tridiagonal = torch.diag(torch.stack(diagonal))
    if off_diagonal:
        betas = torch.stack(off_diagonal[: size - 1])
        tridiagonal = tridiagonal + torch.diag(betas, 1) + torch.diag(betas, -1)
    eigenvalues, vectors = torch.linalg.eigh(tridiagonal)
    first = vectors[0] * norm_b  # U^T (Q^T b) with Q^T b = |b| e_1
    coefficients = vectors @ (first / (eigenvalues.abs() + damping).clamp_min(1e-12))
    x = torch.stack(basis[:size]).T @ coefficients
    if side:
        product, along = hvp(x)
        return x, float((b - product - damping * x).norm() / norm_b), along
    residual = (b - hvp(x) - damping * x).norm() / norm_b
    return x, float(residual)


def actor_parameters(actor: nn.Module, agent_names: Iterable[str]) -> dict[str, list[nn.Parameter]]:
    """Each agent's trainable policy parameters: those of its network in the actor's :class:`~nip_like.agent_modules.PerAgent` modules.

    Raises
    ------
    ValueError
        If the actor has no per-agent networks (its parameters cannot be told apart by agent).
    """
    per_agent = [module for module in actor.modules() if isinstance(module, PerAgent)]
    if not per_agent:
        raise ValueError(f"the actor {type(actor).__name__} has no per-agent networks (nip_like.agent_modules.PerAgent)")
    parameters: dict[str, list[nn.Parameter]] = {}
    for name in agent_names:
        seen: dict[int, nn.Parameter] = {}
        for module in per_agent:
            for param in module.networks[name].parameters():
                if param.requires_grad:
                    seen.setdefault(id(param), param)
        parameters[name] = list(seen.values())
    # The second-order terms factor through each agent's log-ratios, which must depend on its own parameters only.
    owner: dict[int, str] = {}
    for name, params in parameters.items():
        for param in params:
            other = owner.setdefault(id(param), name)
            if other != name:
                raise ValueError(f"agents {other} and {name} share parameters; each agent needs parameters of its own")
    return parameters

