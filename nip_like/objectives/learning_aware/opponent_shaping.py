"""Opponent shaping: LOLA (:class:`LOLALoss`, PPO-clipped: POLA) and SOS (:class:`SOSLoss`, PPO-clipped: PSOS).

Each agent differentiates through an anticipated gradient step of the others
(the shaping term ``chi``, and the look-ahead term ``H_o xi``); notation:
:mod:`nip_like.objectives.learning_aware`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nip_like.allowed import checked
from nip_like.objectives.learning_aware.base import LearningAwareConfig, LearningAwareLoss
from nip_like.objectives.learning_aware.second_order import Vector, _dot, _flat
from nip_like.objectives.options import check_options

#: Whom an agent anticipates in LOLA and SOS: every other agent, or only the agents that follow it.
ANTICIPATE = ("all", "followers")


# ------------------------------------------------------------------ schemas
@dataclass
class OpponentShapingConfig(LearningAwareConfig):
    """Options LOLA and SOS share: whom an agent anticipates, and the step size it assumes they take."""

    lookahead_lr: Optional[float] = checked(None, gt=0)  # the step size agents assume the others learn with (times each one's agent_lr / lr); null: each one's trainer.optimizer learning rate
    anticipate: str = checked("all", choices=ANTICIPATE)  # all (every other agent) | followers (the protocol's later groups)


@dataclass
class LOLAConfig(OpponentShapingConfig):
    """Options of LOLA (:class:`LOLALoss`)."""

    lookahead_term: bool = False  # also differentiate the own objective at the others' anticipated step (LookAhead, H_o xi)


@dataclass
class POLAConfig(LOLAConfig):
    """Options of PPO-clipped LOLA (:class:`LOLALoss` with ``clip_epsilon``)."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio of each agent's own term


@dataclass
class SOSConfig(OpponentShapingConfig):
    """Options of stable opponent shaping (:class:`SOSLoss`)."""

    sos_a: float = checked(0.5, gt=0, lt=1)  # a: the shaping may cancel at most this share of the look-ahead update
    sos_b: float = checked(0.1, gt=0)  # b: below this gradient norm the shaping scales with its square


@dataclass
class PSOSConfig(SOSConfig):
    """Options of PPO-clipped SOS (:class:`SOSLoss` with ``clip_epsilon``)."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio of each agent's own term


# -------------------------------------------------------------------- loss
class _OpponentShapingLoss(LearningAwareLoss):
    """What LOLA and SOS share: anticipated agents, their learning rates, the shaping and look-ahead terms."""

    options_schema = OpponentShapingConfig

    def __init__(
        self,
        *args,
        lookahead_lr: float | None = OpponentShapingConfig.lookahead_lr,
        anticipate: str = OpponentShapingConfig.anticipate,
        **kwargs,
    ) -> None:
        check_options(self, OpponentShapingConfig, lookahead_lr=lookahead_lr, anticipate=anticipate)
        if anticipate == "followers" and kwargs.get("leader_order") is None:
            raise ValueError("anticipate='followers' needs a leader_order")
        super().__init__(*args, **kwargs)
        self.anticipate = anticipate
        scale = 1.0 if lookahead_lr is None else float(lookahead_lr)
        #: The step size ``alpha_j`` each agent is assumed to take.
        self.learning_rates = {name: scale * factor for name, factor in self.lr_factors.items()}

    def anticipated(self, agent: str) -> tuple[str, ...]:
        """The agents whose next step ``agent`` anticipates: those that learn this iteration, and follow it if asked."""
        others = self.followers(agent) if self.anticipate == "followers" else self.agent_names
        return tuple(
            name
            for name in others
            if name != agent and name in self.learning_agents and self.parameters_of[name] and self.learning_rates[name] > 0
        )

    def _shaping_terms(
        self, joint_losses: torch.Tensor, log_ratio: torch.Tensor, lookahead: bool
    ) -> tuple[dict[str, Vector], dict[str, Vector]]:
        """Per learning agent ``i``: ``chi_i`` and, if ``lookahead``, ``(H_o xi)_i`` (both with the alphas inside).

        Both terms differentiate, in ``theta_i``, a product with a gradient in
        ``theta_j``; ``theta_i`` reaches it through the log-ratios only. So,
        with ``a_k = dL_k / d log_ratio`` (the estimator's derivative, a few
        numbers per step) and ``J_j`` the Jacobian of agent ``j``'s
        log-ratios in its parameters,

        * ``chi_i = alpha_j J_i^T d/dlr_i <a_j[j], J_j v>`` with ``v = grad_j L_i = J_j^T a_i[j]``,
        * ``(H_o xi)_i = alpha_j J_i^T d/dlr_i <a_i[j], J_j grad_j L_j>``.

        ``J_j^T y`` is taken once per pair with its graph in ``y`` (a leaf set
        to ``a_i[j]``, so its value is ``v``), and the products ``J_j v`` and
        ``J_j grad_j L_j`` are its derivatives in ``y``; the last step, ``J_i^T``,
        is one backward pass for every agent together. This equals the
        double backward pass through ``grad_j L_j`` term by term, with one
        backward pass less per pair (``v`` comes with the graph).
        """
        index = {name: k for k, name in enumerate(self.agent_names)}
        trained = self._trained()
        targets = {agent: self.anticipated(agent) for agent in trained}
        shaping_at = torch.zeros_like(log_ratio)  # the cotangents of the log-ratios, column i for agent i
        looking_at = torch.zeros_like(log_ratio)
        slopes: dict[str, torch.Tensor] = {}  # a_k, with its graph in the log-ratios

        def slope(name: str) -> torch.Tensor:
            if name not in slopes:
                slopes[name] = self._through(joint_losses[index[name]], log_ratio, create_graph=True)
            return slopes[name]

        own_grads: dict[str, Vector] = {}  # grad_j L_j (values), for the look-ahead term
        for agent in trained:
            i = index[agent]
            for other in targets[agent]:
                j = index[other]
                column = torch.zeros_like(log_ratio)
                column[..., j] = 1
                y = (slope(agent) * column).detach().requires_grad_()
                cross = self._vjp(y, log_ratio, [other], create_graph=True)[other]  # grad_j L_i, linear in y
                alpha = self.learning_rates[other]
                moved = self._through(_dot(cross, [c.detach() for c in cross]), y) * column  # J_j grad_j L_i
                shaping_at[..., i] += alpha * self._through((slope(other) * moved).sum(), log_ratio)[..., i]
                if lookahead:
                    if other not in own_grads:
                        own_grads[other] = self._grad(joint_losses[j], other)
                    moved = self._through(_dot(cross, own_grads[other]), y) * column  # J_j grad_j L_j
                    looking_at[..., i] += alpha * self._through((slope(agent) * moved).sum(), log_ratio)[..., i]
        shaping_agents = [agent for agent in trained if targets[agent]]
        shaping = self._vjp(shaping_at, log_ratio, shaping_agents)
        looking = self._vjp(looking_at, log_ratio, shaping_agents) if lookahead else {}
        for agent in trained:  # an agent that anticipates nobody: no shaping, no look-ahead
            if not targets[agent]:
                shaping[agent] = [torch.zeros_like(p) for p in self.parameters_of[agent]]
                if lookahead:
                    looking[agent] = [torch.zeros_like(p) for p in self.parameters_of[agent]]
        return shaping, looking


class LOLALoss(_OpponentShapingLoss):
    """LOLA (Foerster et al., 2018) and, with ``clip_epsilon``, its PPO-clipped form POLA.

    Agent ``i``'s update is ``xi_i - chi_i``, and ``xi_i - (H_o xi)_i -
    chi_i`` with ``lookahead_term`` (see :mod:`nip_like.objectives.learning_aware`).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`LearningAwareLoss`.
    lookahead_lr : float, optional
        The base step size ``alpha`` agents assume the others take (times
        their ``lr_factors``); ``None`` is 1 here (the trainer passes its
        optimiser's learning rate for the config's ``null``).
    anticipate : str
        ``"all"``: every other agent; ``"followers"``: the agents of later groups of ``leader_order``.
    lookahead_term : bool
        Add the look-ahead term ``(H_o xi)_i`` that Foerster et al. leave out.
    """

    options_schema = LOLAConfig

    def __init__(self, *args, lookahead_term: bool = LOLAConfig.lookahead_term, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead_term = bool(lookahead_term)

    def _corrections(self, joint_losses, own_losses, log_ratio):
        shaping, looking = self._shaping_terms(joint_losses, log_ratio, self.lookahead_term)
        corrections = {}
        for agent, chi in shaping.items():
            correction = [-c for c in chi]
            if self.lookahead_term:
                correction = [c - h for c, h in zip(correction, looking[agent])]
            corrections[agent] = correction
        extra = {}
        if self.lookahead_term:
            extra["lookahead_norm"] = float(_flat([h for v in looking.values() for h in v]).norm())
        return corrections, extra


class SOSLoss(_OpponentShapingLoss):
    """Stable opponent shaping (Letcher et al., 2019) and, with ``clip_epsilon``, its PPO-clipped form.

    With ``xi_0 = xi - H_o xi`` (the look-ahead update) and the shaping
    ``chi``, the update is ``xi_0 - p chi``: ``p1 = 1`` if ``<-chi, xi_0> >=
    0``, else ``min(1, -a |xi_0|^2 / <-chi, xi_0>)``; ``p2 = |xi|^2`` if
    ``|xi| < b``, else 1; ``p = min(p1, p2)``. Norms and inner products run over
    every learning agent's parameters at once.

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`LearningAwareLoss`.
    lookahead_lr, anticipate
        As for :class:`LOLALoss`.
    sos_a : float
        ``a`` in ``(0, 1)``.
    sos_b : float
        ``b > 0``.
    """

    options_schema = SOSConfig

    def __init__(self, *args, sos_a: float = SOSConfig.sos_a, sos_b: float = SOSConfig.sos_b, **kwargs) -> None:
        check_options(self, SOSConfig, sos_a=sos_a, sos_b=sos_b)
        super().__init__(*args, **kwargs)
        self.sos_a = float(sos_a)
        self.sos_b = float(sos_b)

    def _corrections(self, joint_losses, own_losses, log_ratio):
        shaping, looking = self._shaping_terms(joint_losses, log_ratio, lookahead=True)
        agents = list(shaping)
        if not agents:
            return {}, {}
        index = {name: k for k, name in enumerate(self.agent_names)}
        xi = _flat([g for agent in agents for g in self._grad(own_losses[index[agent]], agent)])
        chi = _flat([c for agent in agents for c in shaping[agent]])
        xi_0 = xi - _flat([h for agent in agents for h in looking[agent]])
        inner = float((-chi).dot(xi_0))
        p1 = 1.0 if inner >= 0 else min(1.0, -self.sos_a * float(xi_0.dot(xi_0)) / inner)
        xi_norm = float(xi.norm())
        p2 = xi_norm**2 if xi_norm < self.sos_b else 1.0
        p = min(p1, p2)
        corrections = {
            agent: [-h - p * c for h, c in zip(looking[agent], shaping[agent])] for agent in agents
        }
        extra = {
            "sos_p": p,
            "own_grad_norm": xi_norm,
            "lookahead_norm": float(_flat([h for agent in agents for h in looking[agent]]).norm()),
        }
        return corrections, extra


class POLALoss(LOLALoss):
    """POLA: :class:`LOLALoss` with each agent's own term PPO-clipped, ``trainer=pola``'s objective (:class:`POLAConfig`).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`LOLALoss`.
    clip_epsilon : float
        Clip range of the probability ratio of each agent's own term.
    """

    options_schema = POLAConfig

    def __init__(self, *args, clip_epsilon: float = POLAConfig.clip_epsilon, **kwargs) -> None:
        super().__init__(*args, clip_epsilon=clip_epsilon, **kwargs)


class PSOSLoss(SOSLoss):
    """PSOS: :class:`SOSLoss` with each agent's own term PPO-clipped, ``trainer=psos``'s objective (:class:`PSOSConfig`).

    Parameters
    ----------
    *args, **kwargs
        Those of :class:`SOSLoss`.
    clip_epsilon : float
        Clip range of the probability ratio of each agent's own term.
    """

    options_schema = PSOSConfig

    def __init__(self, *args, clip_epsilon: float = PSOSConfig.clip_epsilon, **kwargs) -> None:
        super().__init__(*args, clip_epsilon=clip_epsilon, **kwargs)
