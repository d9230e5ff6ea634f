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

    def __init__(
        self,
        *args,
        ihvp_method: str = "cg",
        ihvp_iterations: int = 10,
        ihvp_rank: int = 8,
        ihvp_damping: float = 0.01,
        **kwargs,
    ) -> None:
        if ihvp_method not in IHVP_METHODS:
            raise ValueError(f"ihvp_method must be one of {list(IHVP_METHODS)}, got {ihvp_method!r}")
        if ihvp_iterations < 1 or ihvp_rank < 1 or ihvp_damping < 0:
            raise ValueError(
                f"ihvp_iterations and ihvp_rank must be >= 1 and ihvp_damping >= 0, "
                f"got {ihvp_iterations}, {ihvp_rank}, {ihvp_damping}"
            )
        super().__init__(*args, **kwargs)
        self.ihvp_method = ihvp_method
        self.ihvp_iterations = int(ihvp_iterations)
        self.ihvp_rank = int(ihvp_rank)
        self.ihvp_damping = float(ihvp_damping)

    def inverse_hvp(self, gradient: Vector, follower: str, hessian_of: Vector) -> tuple[Vector, float]:
        """``(d_j d_j L_j + damping)^-1 gradient`` for follower ``j``, ``hessian_of`` its ``grad_j L_j`` with graph."""
        params = self.parameters_of[follower]

        def hvp(flat: torch.Tensor) -> torch.Tensor:
            product = self._grad(_dot(hessian_of, _unflat(flat, params)), follower)
            return _flat(product).detach()

        b = _flat(gradient).detach()
        # The solver's own products in float32: under autocast the Lanczos projections (matmuls) would run in bfloat16.
        with float32_region(b.device):
            if self.ihvp_method == "cg":
                x, residual = conjugate_gradient(hvp, b, self.ihvp_iterations, self.ihvp_damping)
            else:
                x, residual = low_rank_inverse(hvp, b, self.ihvp_rank, self.ihvp_damping)
        return _unflat(x, params), residual

    def _corrections(self, joint_losses, own_losses):
        index = {name: k for k, name in enumerate(self.agent_names)}
        own_grads: dict[str, Vector] = {}
        corrections: dict[str, Vector] = {}
        residuals: dict[str, float] = {}
        for leader in self._trained():
            followers = [name for name in self.followers(leader) if self.parameters_of[name]]
            if not followers:
                continue
            total = joint_losses.new_zeros(())
            worst = 0.0
            for follower in followers:
                if follower not in own_grads:
                    own_grads[follower] = self._grad(joint_losses[index[follower]], follower, create_graph=True)
                cross = self._grad(joint_losses[index[leader]], follower)  # grad_j L_i
                solved, residual = self.inverse_hvp(cross, follower, own_grads[follower])
                worst = max(worst, residual)
                total = total + _dot(own_grads[follower], [s.detach() for s in solved])
            corrections[leader] = [-c for c in self._grad(total, leader)]
            residuals[leader] = worst
        return corrections, {"ihvp_residual": residuals}
