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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchrl.objectives import ValueEstimators
from torchrl.objectives.utils import distance_loss
from torchrl.objectives.value import GAE

from nip_like import keys
from nip_like.agents import PerAgent
from nip_like.allowed import checked
from nip_like.distributed import concatenated
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.episodes import complete_episodes, lengthened
from nip_like.objectives.masking import per_agent_mean, set_per_agent, standardize_per_agent
from nip_like.objectives.ppo import CRITIC_LOSS_TYPES, clipped_surrogate
from nip_like.objectives.scoring import behaviour_token_log_probs, critic_value, score_actions
from nip_like.precision import float32_region

#: ``(episodes, time)`` booleans of the episode layout: the step is part of its episode (not padding).
VALID_KEY = "valid_step"
#: Ways to compute inverse-Hessian-vector products.
IHVP_METHODS = ("cg", "low_rank")
#: Whom an agent anticipates in LOLA and SOS: every other agent, or only the agents that follow it.
ANTICIPATE = ("all", "followers")

Vector = list[torch.Tensor]


# ------------------------------------------------------------------ schemas
@dataclass
class LearningAwareConfig(ObjectiveConfig):
    """Options every learning-aware objective shares (the keyword arguments of :class:`LearningAwareLoss`)."""

    entropy_coeff: float = checked(0.01, ge=0)  # weight of each agent's entropy in its own objective (enters the second-order terms too)
    critic_coeff: float = checked(0.5, ge=0)  # weight of the value loss
    loss_critic_type: str = checked("l2", choices=CRITIC_LOSS_TYPES)  # l1 | l2 | smooth_l1
    normalize_advantage: bool = False  # standardise advantages per agent (rescales every gradient, so off by default)
    gamma: float = checked(0.99, ge=0, le=1)  # discount factor of GAE
    lmbda: float = checked(0.95, ge=0, le=1)  # GAE lambda


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


@dataclass
class LOLAConfig(LearningAwareConfig):
    """Options of LOLA (:class:`LOLALoss`)."""

    lookahead_lr: Optional[float] = checked(None, gt=0)  # the step size agents assume the others learn with (times each one's agent_lr / lr); null: each one's trainer.optimizer learning rate
    anticipate: str = checked("all", choices=ANTICIPATE)  # all (every other agent) | followers (the protocol's later groups)
    lookahead_term: bool = False  # also differentiate the own objective at the others' anticipated step (LookAhead, H_o xi)


@dataclass
class POLAConfig(LOLAConfig):
    """Options of PPO-clipped LOLA (:class:`LOLALoss` with ``clip_epsilon``)."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio of each agent's own term


@dataclass
class SOSConfig(LearningAwareConfig):
    """Options of stable opponent shaping (:class:`SOSLoss`)."""

    lookahead_lr: Optional[float] = checked(None, gt=0)  # the step size agents assume the others learn with (times each one's agent_lr / lr); null: each one's trainer.optimizer learning rate
    anticipate: str = checked("all", choices=ANTICIPATE)  # all (every other agent) | followers (the protocol's later groups)
    sos_a: float = checked(0.5, gt=0, lt=1)  # a: the shaping may cancel at most this share of the look-ahead update
    sos_b: float = checked(0.1, gt=0)  # b: below this gradient norm the shaping scales with its square


@dataclass
class PSOSConfig(SOSConfig):
    """Options of PPO-clipped SOS (:class:`SOSLoss` with ``clip_epsilon``)."""

    clip_epsilon: float = checked(0.2, gt=0)  # clip range of the probability ratio of each agent's own term


# ------------------------------------------------------------------ layout
def joined_episodes(parts: list[TensorDictBase]) -> TensorDictBase:
    """Padded episodes of several batches (the ranks'), each padded to the longest of all, concatenated."""
    length = max(part.batch_size[1] for part in parts)
    return concatenated([lengthened(part, length, 0, (VALID_KEY, keys.ACTIVE_KEY)) for part in parts])


def padded_episodes(batch: TensorDictBase) -> TensorDictBase:
    """The complete episodes of a collected ``(env, time)`` batch, padded to one length.

    Parameters
    ----------
    batch : TensorDictBase
        As collected, with the round (``("state", "round")``) and done flags.

    Returns
    -------
    TensorDictBase
        Batch shape ``(episodes, T)``, ``T`` the longest episode; step ``t``
        of an episode is its round ``t``. Padding repeats an episode's first
        step with :data:`VALID_KEY` false and every agent inactive.
    """
    found = complete_episodes(batch)
    steps = batch[found.complete]
    _, episode = found.ids[found.complete].unique(return_inverse=True)
    position = batch.get(keys.ROUND_KEY)[found.complete]
    num_episodes = int(episode.max()) + 1 if episode.numel() else 0
    length = int(position.max()) + 1 if position.numel() else 1
    slot = episode * length + position
    first = torch.full((num_episodes,), steps.batch_size[0], dtype=torch.long, device=slot.device)
    first = first.scatter_reduce(0, episode, torch.arange(steps.batch_size[0], device=slot.device), "amin")
    padded = steps[first.repeat_interleave(length)].clone()
    valid = torch.zeros(num_episodes * length, dtype=torch.bool, device=slot.device)
    valid[slot] = True
    padded[slot] = steps
    padded.set(VALID_KEY, valid)
    padded.set(keys.ACTIVE_KEY, padded.get(keys.ACTIVE_KEY) & valid.unsqueeze(-1))
    return padded.reshape(num_episodes, length)


def twice_differentiable():
    """A context in which attention runs on PyTorch's math kernel, the one with second derivatives.

    The fused attention kernels (flash, memory-efficient; the CPU's flash
    kernel too) have first derivatives only. The math kernel gives the same
    values up to rounding, so probability ratios stay 1 at the behaviour policy.
    """
    return sdpa_kernel([SDPBackend.MATH])


# ------------------------------------------------------- vector helpers
def _dot(a: Vector, b: Vector) -> torch.Tensor:
    products = [(x * y).sum() for x, y in zip(a, b)]
    return torch.stack(products).sum() if products else torch.zeros(())


def _flat(vector: Vector) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in vector]) if vector else torch.zeros(0)


def _unflat(flat: torch.Tensor, like: Vector) -> Vector:
    parts, start = [], 0
    for tensor in like:
        parts.append(flat[start : start + tensor.numel()].view_as(tensor))
        start += tensor.numel()
    return parts


def conjugate_gradient(
    hvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iterations: int, damping: float
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

    Returns
    -------
    tuple
        ``x`` and the relative residual ``|b - (H + damping) x| / |b|``.
    """
    x = torch.zeros_like(b)
    norm_b = b.norm()
    if norm_b == 0:
        return x, 0.0
    residual, direction = b.clone(), b.clone()
    squared = residual.dot(residual)
    for step in range(iterations):
        product = hvp(direction) + damping * direction
        curvature = direction.dot(product)
        if curvature <= 0:
            if step > 0 or curvature == 0:
                break
            curvature = -curvature
            product = -product
        size = squared / curvature
        x = x + size * direction
        residual = residual - size * product
        new_squared = residual.dot(residual)
        if new_squared.sqrt() <= 1e-10 * norm_b:
            squared = new_squared
            break
        direction = residual + (new_squared / squared) * direction
        squared = new_squared
    return x, float(squared.sqrt() / norm_b)


def low_rank_inverse(
    hvp: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, rank: int, damping: float
) -> tuple[torch.Tensor, float]:
    """Apply ``(|H_r| + damping I)^-1`` to ``b``, ``H_r`` a rank-``rank`` Lanczos approximation of ``H``.

    Lanczos from ``b`` (with full reorthogonalisation) gives an orthonormal
    basis ``Q`` of the Krylov space and ``H ~ Q T Q^T``; the eigenvalues of
    ``T`` are replaced by their magnitudes (so an indefinite Hessian still
    gives a descent direction) and damped. Since ``b`` lies in the span of
    ``Q``, nothing of it is left out.

    Returns
    -------
    tuple
        ``x`` and the relative residual of ``(H + damping) x = b`` measured
        with one more Hessian-vector product.
    """
    norm_b = b.norm()
    if norm_b == 0:
        return torch.zeros_like(b), 0.0
    basis = [b / norm_b]
    diagonal, off_diagonal = [], []
    for step in range(min(rank, b.numel())):
        w = hvp(basis[-1])
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
    residual = (b - hvp(x) - damping * x).norm() / norm_b
    return x, float(residual)


def actor_parameters(actor: nn.Module, agent_names: Iterable[str]) -> dict[str, list[nn.Parameter]]:
    """Each agent's trainable policy parameters: those of its network in the actor's :class:`~nip_like.agents.PerAgent` modules.

    Raises
    ------
    ValueError
        If the actor has no per-agent networks (its parameters cannot be told apart by agent).
    """
    per_agent = [module for module in actor.modules() if isinstance(module, PerAgent)]
    if not per_agent:
        raise ValueError(f"the actor {type(actor).__name__} has no per-agent networks (nip_like.agents.PerAgent)")
    parameters: dict[str, list[nn.Parameter]] = {}
    for name in agent_names:
        seen: dict[int, nn.Parameter] = {}
        for module in per_agent:
            for param in module.networks[name].parameters():
                if param.requires_grad:
                    seen.setdefault(id(param), param)
        parameters[name] = list(seen.values())
    return parameters


# -------------------------------------------------------------------- loss
class LearningAwareLoss(RolloutLoss):
    """Base of the learning-aware losses: estimators, layout, critic and the way the update is returned.

    A subclass implements :meth:`_corrections`, the part of each agent's
    update beyond its own gradient (see the module docstring).

    Parameters
    ----------
    actor_network : ProbabilisticActor or an actor with ``score_actions``
        The agents' policy; each agent's parameters are those of its network
        in the actor's :class:`~nip_like.agents.PerAgent` modules, and must be
        twice differentiable.
    critic_network : TensorDictModule
        The value network (``("agents", "state_value")``), GAE's baseline.
    agent_names : tuple of str
        Agents, in the order of the agent dimension.
    leader_order : tuple of tuple of str, optional
        Groups of agents, leaders first (a protocol's ``leader_order``); an
        agent's followers are the agents of all later groups.
    lr_factors : dict, optional
        Each agent's learning-rate factor (its learning rate over the base
        one); LOLA and SOS assume agent ``j`` learns with step size
        ``alpha_j = lookahead_lr * lr_factors[j]``. 1 for an agent left out.
    entropy_coeff, critic_coeff : float
        Weights of the entropy (in every agent's objective) and of the value loss.
    loss_critic_type : str
        ``"l1"``, ``"l2"`` or ``"smooth_l1"``.
    normalize_advantage : bool
        Standardise advantages per agent over the valid steps.
    gamma, lmbda : float
        GAE's discount and lambda (:attr:`value_estimator`).
    clip_epsilon : float, optional
        Clip each agent's own term as PPO does (the P-forms); ``None`` does not clip.

    Notes
    -----
    The output holds ``loss_objective`` (the agents' own surrogates, gradient
    ``xi``), ``loss_shaping`` (value 0, gradient the learning-aware part of
    the update), ``loss_entropy`` and ``loss_critic``, the statistics
    ``entropy``, ``clip_fraction``, ``shaping_norm`` (the norm of the
    learning-aware part over all agents) and each subclass's own, and per
    agent ``("agents", <name>, ...)``. Their logged names are declared in
    :attr:`metric_names`. Outside gradient mode (``torch.no_grad``) the
    second-order terms are not computed and ``loss_shaping`` is 0.
    """

    @dataclass
    class _AcceptedKeys:
        advantage: NestedKey = keys.ADVANTAGE_KEY
        value_target: NestedKey = keys.VALUE_TARGET_KEY
        value: NestedKey = keys.VALUE_KEY
        action: NestedKey = keys.ACTION_KEY
        sample_log_prob: NestedKey = keys.LOG_PROB_KEY
        active: NestedKey = keys.ACTIVE_KEY
        valid: NestedKey = VALID_KEY
        reward: NestedKey = keys.REWARD_KEY
        done: NestedKey = keys.DONE_KEY
        terminated: NestedKey = keys.TERMINATED_KEY

    default_keys = _AcceptedKeys
    default_value_estimator = ValueEstimators.GAE
    metric_names: ClassVar = {
        "shaping_norm": "learning_aware/shaping_norm",
        "lookahead_norm": "learning_aware/lookahead_norm",
        "sos_p": "learning_aware/sos_p",
        "ihvp_residual": "learning_aware/ihvp_residual",
        "own_grad_norm": "learning_aware/own_grad_norm",
        "episodes": "learning_aware/episodes",
    }
    #: Whether the loss needs a leader order whatever its options (SPG).
    needs_leader_order: ClassVar[bool] = False

    def __init__(
        self,
        actor_network: nn.Module,
        critic_network: TensorDictModule,
        agent_names: tuple[str, ...],
        *,
        leader_order: tuple[tuple[str, ...], ...] | None = None,
        lr_factors: dict[str, float] | None = None,
        entropy_coeff: float = 0.01,
        critic_coeff: float = 0.5,
        loss_critic_type: str = "l2",
        normalize_advantage: bool = False,
        gamma: float = 0.99,
        lmbda: float = 0.95,
        clip_epsilon: float | None = None,
    ) -> None:
        if loss_critic_type not in CRITIC_LOSS_TYPES:
            raise ValueError(f"loss_critic_type must be one of {list(CRITIC_LOSS_TYPES)}, got {loss_critic_type!r}")
        if clip_epsilon is not None and clip_epsilon <= 0:
            raise ValueError(f"clip_epsilon must be > 0 or None, got {clip_epsilon}")
        super().__init__()
        self.actor_network = actor_network
        self.critic_network = critic_network
        self.agent_names = tuple(agent_names)
        self.leader_order = tuple(tuple(group) for group in leader_order) if leader_order is not None else None
        if self.needs_leader_order and self.leader_order is None:
            raise ValueError(f"{type(self).__name__} needs a leader_order (groups of agents, leaders first)")
        if self.leader_order is not None:
            listed = sorted(name for group in self.leader_order for name in group)
            if listed != sorted(self.agent_names) or len(self.leader_order) < 2:
                raise ValueError(
                    f"leader_order must split the agents {list(self.agent_names)} into at least two groups, "
                    f"got {self.leader_order}"
                )
        factors = dict(lr_factors or {})
        unknown = sorted(set(factors) - set(self.agent_names))
        if unknown:
            raise ValueError(f"lr_factors names {unknown}; the agents are {list(self.agent_names)}")
        self.lr_factors = {name: float(factors.get(name, 1.0)) for name in self.agent_names}
        self.entropy_coeff = float(entropy_coeff)
        self.critic_coeff = float(critic_coeff)
        self.loss_critic_type = loss_critic_type
        self.normalize_advantage = bool(normalize_advantage)
        self.clip_epsilon = clip_epsilon
        self.parameters_of = actor_parameters(actor_network, self.agent_names)
        #: ``iteration -> agents trained on it``; set by the trainer to follow its update schedule.
        self.update_schedule: Callable[[int], tuple[str, ...]] | None = None
        self.learning_agents: tuple[str, ...] = self.agent_names
        self._last_layout: dict[str, float] = {}
        self.make_value_estimator(gamma=gamma, lmbda=lmbda)

    # ------------------------------------------------------------ contract
    def make_value_estimator(self, value_type: ValueEstimators | None = None, **hyperparams) -> None:
        """Build the GAE advantage estimator that reads this loss's keys."""
        value_type = value_type or self.default_value_estimator
        if value_type != ValueEstimators.GAE:
            raise NotImplementedError(f"{type(self).__name__} supports GAE only, not {value_type}")
        hyperparams.setdefault("deactivate_vmap", True)
        self._value_estimator = GAE(value_network=self.critic_network, **hyperparams)
        self._forward_value_estimator_keys()

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        """Whole episodes, padded (:func:`padded_episodes`): one buffer item per complete episode."""
        episodes = padded_episodes(batch)
        valid = episodes.get(VALID_KEY)
        self._last_layout = {
            "episodes": float(episodes.batch_size[0]),
            "episode_length": float(valid.sum(-1).float().mean()) if valid.numel() else 0.0,
        }
        return episodes

    def layout_metrics(self) -> dict[str, float]:
        """Number and mean length of the complete episodes laid out."""
        return dict(self._last_layout)

    def join_layouts(self, parts: list[TensorDictBase]) -> TensorDictBase:
        """The ranks' padded episodes as one layout (:func:`joined_episodes`)."""
        return joined_episodes(parts)

    def start_iteration(self, iteration: int) -> None:
        """Note which agents learn on this iteration (the others are not anticipated to move)."""
        if self.update_schedule is not None:
            self.learning_agents = tuple(self.update_schedule(iteration))

    # ------------------------------------------------------------- forward
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        """Compute the loss terms and statistics on a minibatch of padded episodes (attention on the math kernel)."""
        with twice_differentiable():
            return self._forward(tensordict)

    def _forward(self, tensordict: TensorDictBase) -> TensorDict:
        valid = tensordict.get(self.tensor_keys.valid)
        active = tensordict.get(self.tensor_keys.active) & valid.unsqueeze(-1)
        advantage = tensordict.get(self.tensor_keys.advantage).squeeze(-1)
        stepwise = valid.unsqueeze(-1).expand_as(advantage)
        if self.normalize_advantage:
            advantage = standardize_per_agent(advantage, stepwise)
        advantage = torch.where(stepwise, advantage, torch.zeros_like(advantage))

        scores = score_actions(self.actor_network, tensordict, with_value=True)
        difference = scores.token_log_probs - behaviour_token_log_probs(tensordict)
        log_ratio = torch.where(scores.token_mask, difference, torch.zeros_like(difference)).sum(-1)
        log_ratio = torch.where(active, log_ratio, torch.zeros_like(log_ratio))  # (E, T, N)
        step_entropy = torch.where(scores.token_mask, scores.token_entropy, torch.zeros_like(scores.token_entropy)).sum(-1)
        entropy = torch.where(active, step_entropy, torch.zeros_like(step_entropy)).sum(1).mean(0)  # (N,)

        # Each agent's own first-order surrogate: its ratio times its advantage on its active steps.
        ratio = log_ratio.exp()
        if self.clip_epsilon is None:
            own_gain = ratio * advantage
        else:
            own_gain = clipped_surrogate(ratio, advantage, self.clip_epsilon)
        own = torch.where(active, own_gain, torch.zeros_like(own_gain)).sum(1).mean(0)  # (N,)
        own_losses = -(own + self.entropy_coeff * entropy)
        with torch.no_grad():
            clipped = (ratio - 1).abs() > (self.clip_epsilon if self.clip_epsilon is not None else math.inf)
            clip_fraction = per_agent_mean(clipped.float().flatten(0, 1), active.flatten(0, 1))

        # The joint estimator (Loaded DiCE with importance weights), for the second-order terms.
        step_log_weight = log_ratio.sum(-1)  # (E, T)
        cumulative = step_log_weight.cumsum(1)
        weight_difference = cumulative.exp() - (cumulative - step_log_weight).exp()
        joint = (weight_difference.unsqueeze(-1) * advantage).sum(1).mean(0)  # (N,)
        joint_losses = -(joint + self.entropy_coeff * entropy)

        output = TensorDict(
            {
                "loss_objective": -own.sum(),
                "loss_entropy": -self.entropy_coeff * entropy.sum(),
                "entropy": entropy.detach().mean(),
                "clip_fraction": clip_fraction.mean(),
                "episodes": advantage.new_tensor(float(valid.shape[0])),
            }
        )
        statistics = {"loss_objective": -own.detach(), "entropy": entropy.detach(), "clip_fraction": clip_fraction}

        corrections: dict[str, Vector] = {}
        if torch.is_grad_enabled() and joint_losses.requires_grad:
            corrections, extra = self._corrections(joint_losses, own_losses)
            for key, value in extra.items():
                if isinstance(value, dict):
                    statistics[key] = advantage.new_tensor([value.get(name, 0.0) for name in self.agent_names])
                else:
                    output[key] = advantage.new_tensor(value)
        shaping = advantage.new_zeros(())
        norms = []
        for name in self.agent_names:
            correction = corrections.get(name)
            if correction is None:
                norms.append(advantage.new_zeros(()))
                continue
            shaping = shaping + _dot(self.parameters_of[name], [c.detach() for c in correction])
            norms.append(_flat(correction).detach().norm())
        norms = torch.stack(norms)
        output["loss_shaping"] = shaping - shaping.detach()
        output["shaping_norm"] = norms.norm()
        statistics["shaping_norm"] = norms

        value = critic_value(self.critic_network, tensordict, scores, self.tensor_keys.value)
        target = tensordict.get(self.tensor_keys.value_target)
        value_loss = per_agent_mean(distance_loss(value, target, self.loss_critic_type).squeeze(-1), stepwise)
        output["loss_critic"] = self.critic_coeff * value_loss.sum()
        statistics["loss_critic"] = value_loss
        set_per_agent(output, self.agent_names, statistics)
        return output

    # ------------------------------------------------------ second order
    def _corrections(
        self, joint_losses: torch.Tensor, own_losses: torch.Tensor
    ) -> tuple[dict[str, Vector], dict[str, float | dict[str, float]]]:
        """Each learning agent's update beyond its own gradient, and statistics (a subclass's hook).

        Parameters
        ----------
        joint_losses : torch.Tensor
            ``(N,)`` the losses ``L_k`` from the joint estimator, with graphs
            through every agent's parameters.
        own_losses : torch.Tensor
            ``(N,)`` each agent's own surrogate loss (clipped in the P-forms),
            whose gradient in its own parameters is ``xi``.

        Returns
        -------
        tuple
            Per agent the correction (a list of tensors shaped like its
            parameters), and statistics: a float for the whole minibatch or a
            dict of floats by agent.
        """
        raise NotImplementedError

    def _grad(self, value: torch.Tensor, agent: str, create_graph: bool = False) -> Vector:
        """``d value / d theta_agent``, zeros where it does not depend on them."""
        params = self.parameters_of[agent]
        if not value.requires_grad:
            return [torch.zeros_like(p) for p in params]
        return list(
            torch.autograd.grad(
                value, params, retain_graph=True, create_graph=create_graph, allow_unused=True, materialize_grads=True
            )
        )

    def followers(self, agent: str) -> tuple[str, ...]:
        """The agents of the groups after ``agent``'s in :attr:`leader_order` (none without one)."""
        if self.leader_order is None:
            return ()
        for index, group in enumerate(self.leader_order):
            if agent in group:
                return tuple(name for later in self.leader_order[index + 1 :] for name in later)
        return ()

    def _trained(self) -> tuple[str, ...]:
        return tuple(name for name in self.agent_names if name in self.learning_agents and self.parameters_of[name])


class _OpponentShapingLoss(LearningAwareLoss):
    """What LOLA and SOS share: anticipated agents, their learning rates, the shaping and look-ahead terms."""

    def __init__(self, *args, lookahead_lr: float | None = None, anticipate: str = "all", **kwargs) -> None:
        if anticipate not in ANTICIPATE:
            raise ValueError(f"anticipate must be one of {list(ANTICIPATE)}, got {anticipate!r}")
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
        self, joint_losses: torch.Tensor, lookahead: bool
    ) -> tuple[dict[str, Vector], dict[str, Vector]]:
        """Per learning agent ``i``: ``chi_i`` and, if ``lookahead``, ``(H_o xi)_i`` (both with the alphas inside)."""
        index = {name: k for k, name in enumerate(self.agent_names)}
        own_grads: dict[str, Vector] = {}  # grad_j L_j, with its graph
        shaping: dict[str, Vector] = {}
        looking: dict[str, Vector] = {}
        for agent in self._trained():
            targets = self.anticipated(agent)
            shaping_value = joint_losses.new_zeros(())
            lookahead_value = joint_losses.new_zeros(())
            for other in targets:
                if other not in own_grads:
                    own_grads[other] = self._grad(joint_losses[index[other]], other, create_graph=True)
                cross = self._grad(joint_losses[index[agent]], other, create_graph=lookahead)  # grad_j L_i
                alpha = self.learning_rates[other]
                shaping_value = shaping_value + alpha * _dot(own_grads[other], [c.detach() for c in cross])
                if lookahead:
                    lookahead_value = lookahead_value + alpha * _dot(cross, [g.detach() for g in own_grads[other]])
            shaping[agent] = self._grad(shaping_value, agent)
            if lookahead:
                looking[agent] = self._grad(lookahead_value, agent)
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
        their ``lr_factors``); ``None`` is 1.
    anticipate : str
        ``"all"``: every other agent; ``"followers"``: the agents of later groups of ``leader_order``.
    lookahead_term : bool
        Add the look-ahead term ``(H_o xi)_i`` that Foerster et al. leave out.
    """

    def __init__(self, *args, lookahead_term: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead_term = bool(lookahead_term)

    def _corrections(self, joint_losses, own_losses):
        shaping, looking = self._shaping_terms(joint_losses, self.lookahead_term)
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

    def __init__(self, *args, sos_a: float = 0.5, sos_b: float = 0.1, **kwargs) -> None:
        if not 0 < sos_a < 1 or sos_b <= 0:
            raise ValueError(f"sos_a must be in (0, 1) and sos_b > 0, got {sos_a} and {sos_b}")
        super().__init__(*args, **kwargs)
        self.sos_a = float(sos_a)
        self.sos_b = float(sos_b)

    def _corrections(self, joint_losses, own_losses):
        shaping, looking = self._shaping_terms(joint_losses, lookahead=True)
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
