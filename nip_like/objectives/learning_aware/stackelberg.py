"""Stackelberg policy gradient (:class:`SPGLoss`, PPO-clipped: PSPG).

A leader differentiates through its followers' best responses, with
inverse-Hessian-vector products by conjugate gradient or a low-rank Lanczos
approximation; notation: :mod:`nip_like.objectives.learning_aware`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nip_like.allowed import checked
from nip_like.objectives.learning_aware.base import LearningAwareConfig, LearningAwareLoss
from nip_like.objectives.learning_aware.second_order import (
    Vector,
    _dot,
    _flat,
    _unflat,
    conjugate_gradient,
    low_rank_inverse,
)
from nip_like.objectives.options import check_options
from nip_like.precision import float32_region

#: Ways to compute inverse-Hessian-vector products.
IHVP_METHODS = ("cg", "low_rank")


# ------------------------------------------------------------------ schemas
@dataclass
class SPGConfig(LearningAwareConfig):
    """Options of Stackelberg policy gradient (:class:`SPGLoss`)."""

    ihvp_method: str = checked("cg", choices=IHVP_METHODS)  # cg (conjugate gradient) | low_rank (Lanczos, |eigenvalues|)
    ihvp_iterations: int = checked(10, ge=1, le=1000)  # conjugate-gradient iterations (cg)
    ihvp_rank: int = checked(8, ge=1, le=1000)  # rank of the Hessian approximation (low_rank)
    ihvp_damping: float = checked(0.01, ge=0)  # added to the follower's Hessian's diagonal before inverting


@dataclass
class PSPGConfig(SPGConfig):
    """Options of PPO-clipped Stackelberg policy gradient (:class:`SPGLoss` with ``clip_epsilon``)."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio of each agent's own term


# -------------------------------------------------------------------- loss
class SPGLoss(LearningAwareLoss):
    """Stackelberg policy gradient (Fiez et al., 2020) and, with ``clip_epsilon``, its PPO-clipped form.

    A leader ``i`` takes ``xi_i - sum_j (d_i d_j L_j) (d_j d_j L_j + damping)^-1
    grad_j L_i`` over its followers ``j`` (all agents of later groups in
    ``leader_order``), the gradient of its loss along its followers' best
    responses by the implicit function theorem; followers take their own
    gradients. Each follower's best response is taken on its own (a
    block-diagonal Hessian of the followers). The inverse-Hessian-vector
    product is computed by conjugate gradient or by a low-rank Lanczos
    approximation, with Hessian-vector products by double backpropagation.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`LearningAwareLoss`; ``leader_order`` is required.
    ihvp_method : str
        ``"cg"`` or ``"low_rank"``.
    ihvp_iterations : int
        Conjugate-gradient iterations.
    ihvp_rank : int
        Rank (Lanczos steps) of the low-rank approximation.
    ihvp_damping : float
        Added to the Hessian's diagonal.
    """

    needs_leader_order = True
    options_schema = SPGConfig

    def __init__(
        self,
        *args,
        ihvp_method: str = SPGConfig.ihvp_method,
        ihvp_iterations: int = SPGConfig.ihvp_iterations,
        ihvp_rank: int = SPGConfig.ihvp_rank,
        ihvp_damping: float = SPGConfig.ihvp_damping,
        **kwargs,
    ) -> None:
        check_options(
            self,
            SPGConfig,
            ihvp_method=ihvp_method,
            ihvp_iterations=ihvp_iterations,
            ihvp_rank=ihvp_rank,
            ihvp_damping=ihvp_damping,
        )
        super().__init__(*args, **kwargs)
        self.ihvp_method = ihvp_method
        self.ihvp_iterations = int(ihvp_iterations)
        self.ihvp_rank = int(ihvp_rank)
        self.ihvp_damping = float(ihvp_damping)

    def inverse_hvp(
        self, gradient: Vector, follower: str, hessian_of: Vector, log_ratio: torch.Tensor | None = None
    ) -> tuple[Vector, float, torch.Tensor | None]:
        """``x = (d_j d_j L_j + damping)^-1 gradient`` for follower ``j``, ``hessian_of`` its ``grad_j L_j`` with graph.

        Returns ``x``, the solve's relative residual and, given ``log_ratio``,
        ``d <hessian_of, x> / d log_ratio``: the leaders' parameters reach
        ``hessian_of`` through the log-ratios only, so the leader's
        correction is a Jacobian-transpose product of it. Each
        Hessian-vector product yields it for its own vector in the same
        backward pass, and the solvers combine them as they combine the
        vectors (None without ``log_ratio``, or for a zero right-hand side).
        """
        params = self.parameters_of[follower]
        inputs = [*params, log_ratio] if log_ratio is not None else params

        def hvp(flat: torch.Tensor):
            value = _dot(hessian_of, _unflat(flat, params))
            if value.requires_grad:
                grads = torch.autograd.grad(
                    value, inputs, retain_graph=True, allow_unused=True, materialize_grads=True
                )
            else:
                grads = [torch.zeros_like(t) for t in inputs]
            product = _flat(grads[: len(params)]).detach()
            return (product, grads[-1].detach()) if log_ratio is not None else product

        b = _flat(gradient).detach()
        side = log_ratio is not None
        # The solver's own products in float32: under autocast the Lanczos projections (matmuls) would run in bfloat16.
        with float32_region(b.device):
            if self.ihvp_method == "cg":
                solved = conjugate_gradient(hvp, b, self.ihvp_iterations, self.ihvp_damping, side=side)
            else:
                solved = low_rank_inverse(hvp, b, self.ihvp_rank, self.ihvp_damping, side=side)
        x, residual = solved[0], solved[1]
        return _unflat(x, params), residual, (solved[2] if side else None)

    def _corrections(self, joint_losses, own_losses, log_ratio):
        index = {name: k for k, name in enumerate(self.agent_names)}
        own_grads: dict[str, Vector] = {}
        residuals: dict[str, float] = {}
        # The leaders' corrections, -J_i^T d/dlr_i sum_j <grad_j L_j, x_ij>, as cotangents of the log-ratios (column i).
        reaching = torch.zeros_like(log_ratio)
        leaders = []
        for leader in self._trained():
            followers = [name for name in self.followers(leader) if self.parameters_of[name]]
            if not followers:
                continue
            i = index[leader]
            worst = 0.0
            for follower in followers:
                if follower not in own_grads:
                    own_grads[follower] = self._grad(joint_losses[index[follower]], follower, create_graph=True)
                cross = self._grad(joint_losses[i], follower)  # grad_j L_i
                _, residual, side = self.inverse_hvp(cross, follower, own_grads[follower], log_ratio)
                worst = max(worst, residual)
                if side is not None:
                    reaching[..., i] -= side[..., i]
            leaders.append(leader)
            residuals[leader] = worst
        corrections = self._vjp(reaching, log_ratio, leaders)
        return corrections, {"ihvp_residual": residuals}


class PSPGLoss(SPGLoss):
    """PSPG: :class:`SPGLoss` with each agent's own term PPO-clipped, ``trainer=pspg``'s objective (:class:`PSPGConfig`).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`SPGLoss`.
    clip_epsilon : float
        Clip range of the probability ratio of each agent's own term.
    """

    options_schema = PSPGConfig

    def __init__(self, *args, clip_epsilon: float = PSPGConfig.clip_epsilon, **kwargs) -> None:
        super().__init__(*args, clip_epsilon=clip_epsilon, **kwargs)
