"""Learning-aware objectives: agents that account for how the other agents learn.

Three updates and their PPO-clipped forms, all in one loss family:

* **SPG**, Stackelberg policy gradient (Fiez et al., 2020): a leader
  differentiates through its followers' best responses, with
  inverse-Hessian-vector products (conjugate gradient or a low-rank
  approximation);
* **LOLA**, learning with opponent-learning awareness (Foerster et al., 2018):
  each agent differentiates through one anticipated gradient step of the others;
* **SOS**, stable opponent shaping (Letcher et al., 2019): LOLA's shaping
  term, scaled down where it would stop the update from converging.

Notation (every quantity is estimated on the minibatch; agents minimise their
losses ``L_k = -(V_k + entropy_coeff * H_k)``, ``V_k`` the expected return of
agent ``k`` and ``H_k`` its policy's entropy): ``xi_i = grad_i L_i`` is the
simultaneous (naive) gradient, ``alpha_j`` the learning rate agent ``j`` is
assumed to learn with, and for agent ``i`` with anticipated agents ``j``

* shaping ``chi_i = sum_j (d_i d_j L_j) v_ij`` with ``v_ij = alpha_j grad_j L_i``
  (LOLA, SOS), or ``v_ij = (d_j d_j L_j + damping)^-1 grad_j L_i`` (SPG);
* look-ahead ``(H_o xi)_i = sum_j alpha_j (d_i d_j L_i) grad_j L_j`` (SOS, and
  LOLA with ``lookahead_term``).

The update of agent ``i`` is ``xi_i - chi_i`` (SPG, LOLA), ``xi_i - (H_o xi)_i
- chi_i`` (LOLA with the look-ahead term), or ``xi_i - (H_o xi)_i - p chi_i``
(SOS, with Letcher et al.'s ``p``). The losses return it through the standard
loop: ``loss_objective`` has gradient ``xi`` and ``loss_shaping`` (of value 0)
the rest, so the trainer's optimiser, per-agent learning rates, gradient
clipping and update schedules apply unchanged.

Estimators. Rollouts are laid out as whole episodes (:func:`padded_episodes`).
``V_k`` is estimated with importance weights over every agent's actions, in
the form of Loaded DiCE (Farquhar et al., 2019):
``V_k ~ mean_episodes sum_t (W_<=t - W_<t) A_k(t)``, where ``W_<=t`` is the
product of all agents' probability ratios ``pi / pi_behaviour`` of the actions
up to step ``t`` and ``A_k(t)`` agent ``k``'s advantage (GAE). Its first and
second derivatives at the behaviour policy are the policy-gradient estimates
of ``grad V_k`` and of the Hessian blocks; for a one-step game without a
baseline they are exact on a batch that holds each joint action in proportion
to its probability. The first-order term ``xi`` is each agent's own surrogate
``mean_episodes sum_t r_i(t) A_i(t)`` over its active steps; the PPO-clipped
forms (``clip_epsilon`` set) clip it as PPO does, and keep the unclipped
estimator for the second-order terms. The entropy ``H_k`` is exact for
categorical actions (the sum of the token entropies of the stored actions for
messages) and enters every derivative.

Modules: :mod:`~nip_like.objectives.learning_aware.base` (the base loss, its
options and the episode layout), :mod:`~nip_like.objectives.learning_aware.opponent_shaping`
(LOLA, SOS and their clipped forms POLA, PSOS), :mod:`~nip_like.objectives.learning_aware.stackelberg` (SPG, PSPG) and
:mod:`~nip_like.objectives.learning_aware.second_order` (inverse-Hessian-vector
products and the other second-order helpers). Every public name is importable
from this package too.
"""

from __future__ import annotations

from nip_like.objectives.learning_aware.base import (
    VALID_KEY,
    LearningAwareConfig,
    LearningAwareLoss,
    joined_episodes,
    padded_episodes,
)
from nip_like.objectives.learning_aware.opponent_shaping import (
    ANTICIPATE,
    LOLAConfig,
    LOLALoss,
    OpponentShapingConfig,
    POLAConfig,
    POLALoss,
    PSOSConfig,
    PSOSLoss,
    SOSConfig,
    SOSLoss,
)
from nip_like.objectives.learning_aware.second_order import (
    Vector,
    actor_parameters,
    conjugate_gradient,
    low_rank_inverse,
    twice_differentiable,
)
from nip_like.objectives.learning_aware.stackelberg import (
    IHVP_METHODS,
    PSPGConfig,
    PSPGLoss,
    SPGConfig,
    SPGLoss,
)

__all__ = [
    "ANTICIPATE",
    "IHVP_METHODS",
    "LOLAConfig",
    "LOLALoss",
    "LearningAwareConfig",
    "LearningAwareLoss",
    "OpponentShapingConfig",
    "POLAConfig",
    "POLALoss",
    "PSOSConfig",
    "PSOSLoss",
    "PSPGConfig",
    "PSPGLoss",
    "SOSConfig",
    "SOSLoss",
    "SPGConfig",
    "SPGLoss",
    "VALID_KEY",
    "Vector",
    "actor_parameters",
    "conjugate_gradient",
    "joined_episodes",
    "low_rank_inverse",
    "padded_episodes",
    "twice_differentiable",
]
