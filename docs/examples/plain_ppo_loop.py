"""Multi-agent PPO as a plain TorchRL loop: what nip_like's ``PpoTrainer`` does, by hand.

A CleanRL-style reference, to be read top to bottom: the hyper-parameters,
the set-up (seeding, agents, loss and GAE, optimiser, environment, collector,
replay buffer), then the loop (collect, GAE, fill the buffer, epochs x
minibatches, per-agent gradient clipping, optimiser step). From nip_like it
takes only the hidden-bits scenario's environment and agents, the
:class:`~nip_like.objectives.ppo.MultiAgentPPOLoss` with its GAE, and two
helpers (``compose_config`` to read the config, ``derive_seed`` for the
environments' seed); the rest is TorchRL's ``Collector`` and
``TensorDictReplayBuffer``.

Every hyper-parameter comes from the same composed Hydra config as
``python -m nip_like`` uses, and the set-up seeds the same generators in the
same order as the framework, so this loop and the framework's PPO trainer end
with bit-identical parameters (``tests/test_reference_loop.py`` checks it, and
``scripts/benchmark_ppo.py`` times one against the other).

Run it from the repository root, with optional Hydra overrides::

    python docs/examples/plain_ppo_loop.py                            # 2 iterations of the hidden-bits game
    python docs/examples/plain_ppo_loop.py trainer.num_iterations=40  # the default config's full run
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer
from torchrl.envs.utils import ExplorationType
from torchrl.objectives.value import GAE

from nip_like.checkpoint import derive_seed
from nip_like.cli import compose_config
from nip_like.objectives.ppo import MultiAgentPPOLoss
from nip_like.protocols.prover_verifier import ProverVerifierProtocol
from nip_like.scenarios.hidden_bits import HiddenBitsScenario


# --------------------------------------------------------- hyper-parameters
@dataclass(frozen=True)
class LoopSettings:
    """The settings of the loop itself, read from the composed config.

    The objective's hyper-parameters (GAE and PPO) are read by
    :func:`ppo_options` instead.
    """

    seed: int  # seeds Python's, NumPy's and torch's generators; the train environments get a seed derived from it
    device: str  # where the agents, the environments and the batches live (run.device)
    iterations: int  # collect-then-optimise iterations (trainer.num_iterations)
    num_envs: int  # environments stepped side by side by the collector (trainer.num_envs)
    frames_per_batch: int  # environment steps per iteration, a multiple of num_envs (trainer.frames_per_batch)
    num_epochs: int  # passes over each collected batch (trainer.num_epochs)
    minibatch_size: int  # transitions per gradient step (trainer.minibatch_size)
    lr: float  # Adam learning rate, the same for every agent (trainer.optimizer.lr)
    betas: tuple[float, float]  # Adam's decay rates of the first and second moments (trainer.optimizer.betas)
    eps: float  # Adam's epsilon (trainer.optimizer.eps)
    max_grad_norm: float  # each agent's gradient is clipped to this norm on its own (trainer.optimizer.max_grad_norm)

    @classmethod
    def from_config(cls, config: DictConfig) -> LoopSettings:
        """Read the loop's settings from an experiment config.

        Parameters
        ----------
        config : DictConfig
            The composed experiment config.

        Returns
        -------
        LoopSettings
            The settings, as plain Python values.

        Raises
        ------
        ValueError
            If the config asks for something this loop does not do (another
            scenario or protocol, another optimiser, weight decay, gradient
            accumulation, a learning-rate schedule, per-agent learning rates or
            update schedules, unclipped gradients, grouped rollouts,
            pretraining or autocast): the framework does these, this loop
            does not.
        """
        tc = config.trainer
        optimizer = tc.optimizer
        required = {
            "scenario.name": (config.scenario.name, "hidden_bits"),
            "protocol.name": (config.protocol.name, "prover_verifier"),
            "trainer.optimizer.name": (optimizer.name, "adam"),
            "trainer.optimizer.weight_decay": (optimizer.weight_decay, 0.0),
            # null (the default) is one minibatch per rank: 1 in this one process.
            "trainer.optimizer.grad_accumulation_steps": (optimizer.grad_accumulation_steps or 1, 1),
            "trainer.optimizer.lr_schedule": (optimizer.lr_schedule, "constant"),
            "trainer.optimizer.warmup_iterations": (optimizer.warmup_iterations, 0),
            "trainer.group_size": (tc.group_size, 1),
            "run.autocast_dtype": (config.run.autocast_dtype, None),
        }
        for name, (value, wanted) in required.items():
            if value != wanted:
                raise ValueError(f"the plain loop supports only {name}={wanted!r}, got {value!r}")
        if optimizer.agent_lr or tc.agent_updates or tc.pretrain.agents or optimizer.max_grad_norm is None:
            raise ValueError(
                "the plain loop supports neither per-agent learning rates, update schedules or pretraining, "
                "nor unclipped gradients"
            )
        return cls(
            seed=int(config.seed),
            device=str(config.run.device),
            iterations=int(tc.num_iterations),
            num_envs=int(tc.num_envs),
            frames_per_batch=int(tc.frames_per_batch),
            num_epochs=int(tc.num_epochs),
            minibatch_size=int(tc.minibatch_size),
            lr=float(optimizer.lr),
            betas=(float(optimizer.betas[0]), float(optimizer.betas[1])),
            eps=float(optimizer.eps),
            max_grad_norm=float(optimizer.max_grad_norm),
        )


def ppo_options(config: DictConfig) -> dict[str, Any]:
    """Read the objective's hyper-parameters (GAE and PPO) from an experiment config.

    The only place in this file that reads them.

    Parameters
    ----------
    config : DictConfig
        The composed experiment config.

    Returns
    -------
    dict
        ``gamma`` and ``lmbda`` for the GAE, and the keyword arguments of
        :class:`~nip_like.objectives.ppo.MultiAgentPPOLoss`.
    """
    objective = config.trainer.objective  # PPOConfig: the loss's keyword arguments
    return {
        "variant": str(objective.variant),  # "clip": clipped surrogate; "kl": adaptive KL penalty
        "clip_epsilon": float(objective.clip_epsilon),  # the ratio is clipped to [1 - eps, 1 + eps] (clip)
        "kl_beta": float(objective.kl_beta),  # initial weight of the KL penalty (kl)
        "kl_target": float(objective.kl_target),  # KL per update that the weight adapts towards (kl)
        "kl_adaptive": bool(objective.kl_adaptive),  # whether the weight adapts after each minibatch (kl)
        "entropy_coeff": float(objective.entropy_coeff),  # weight of the entropy bonus
        "critic_coeff": float(objective.critic_coeff),  # weight of the value loss
        "normalize_advantage": bool(objective.normalize_advantage),  # standardise advantages per agent
        "loss_critic_type": str(objective.loss_critic_type),  # value loss: "l1", "l2" or "smooth_l1"
        "gamma": float(objective.gamma),  # discount factor of the returns (GAE)
        "lmbda": float(objective.lmbda),  # GAE lambda: 0 bootstraps after one step, 1 sums the whole episode
    }


# ------------------------------------------------------------------- set-up
@dataclass
class PlainLoop:
    """Everything the loop works with, as :func:`build_plain_loop` makes it."""

    settings: LoopSettings  # the loop's settings
    loss_module: MultiAgentPPOLoss  # the agents' policy and value networks, and the PPO loss on them
    gae: GAE  # writes advantages and value targets into a collected batch
    optimizer: torch.optim.Optimizer  # Adam, one parameter group per agent
    collector: Collector  # steps the environments with the policy, frames_per_batch steps at a time
    batches: Iterator[TensorDictBase]  # the collector's stream of batches, shape (num_envs, steps per env)
    buffer: TensorDictReplayBuffer  # one batch of transitions, sampled in minibatches without replacement

    def close(self) -> None:
        """Shut the collector down."""
        self.collector.shutdown()


def build_plain_loop(config: DictConfig) -> PlainLoop:
    """Seed, and build the agents, the loss, the optimiser, the environment, the collector and the buffer.

    The order is the framework's (``nip_like.experiment.build_trainer``, then
    the ``TensorDictRlTrainer`` constructor), so that the global generators
    hand out the same numbers on both sides.

    Parameters
    ----------
    config : DictConfig
        The composed experiment config.

    Returns
    -------
    PlainLoop
        Ready for :func:`run_plain_loop`; call its ``close()`` when done.
    """
    settings = LoopSettings.from_config(config)
    options = ppo_options(config)
    device = torch.device(settings.device)
    if config.run.num_threads:  # torch threads (run.num_threads); 0 keeps torch's default
        torch.set_num_threads(int(config.run.num_threads))

    # Seed the global generators, as the framework does (nip_like.checkpoint.seed_everything).
    random.seed(settings.seed)
    np.random.seed(settings.seed % 2**32)
    torch.manual_seed(settings.seed)

    # The game and its players: a prover who sees the hidden bits and a verifier who must name them.
    protocol = ProverVerifierProtocol(**OmegaConf.to_container(config.protocol))
    scenario = HiddenBitsScenario(config.scenario, protocol)
    agents = scenario.make_agents()  # stacked policy and value networks, one slice per agent
    agents.modules().to(device)

    # The PPO loss, and its GAE (loss_module.value_estimator), which reads the same ("agents", ...) keys.
    loss_module = MultiAgentPPOLoss(agents.policy, agents.value, agents.agent_names, **options)
    loss_module.to(device)

    # One parameter group per agent, so that each agent's gradient is clipped on its own.
    optimizer = torch.optim.Adam(
        [{"params": list(agents.agent_parameters(name))} for name in agents.agent_names],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        fused=True,  # one kernel for all parameters; the framework picks it too (nip_like.optimizers.fast_implementation)
    )

    env = scenario.make_env(settings.num_envs, "train", derive_seed(settings.seed, "train_env"), device)
    collector = Collector(
        env,
        agents.policy,
        frames_per_batch=settings.frames_per_batch,
        total_frames=-1,  # endless: the loop decides when to stop
        device=device,
        exploration_type=ExplorationType.RANDOM,  # sample actions from the policy
        auto_register_policy_transforms=False,
    )
    buffer = TensorDictReplayBuffer(
        storage=LazyTensorStorage(settings.frames_per_batch, device=device),
        sampler=SamplerWithoutReplacement(drop_last=True),  # each transition once per epoch
        batch_size=settings.minibatch_size,
    )
    return PlainLoop(settings, loss_module, loss_module.value_estimator, optimizer, collector, iter(collector), buffer)


# --------------------------------------------------------------------- loop
def run_plain_loop(loop: PlainLoop, on_iteration: Callable[[int, TensorDictBase], None] | None = None) -> int:
    """Train for ``loop.settings.iterations`` iterations.

    Parameters
    ----------
    loop : PlainLoop
        What :func:`build_plain_loop` built; trained in place.
    on_iteration : callable, optional
        Called after each iteration with its number (from 1) and the
        collected batch, e.g. to print rewards.

    Returns
    -------
    int
        The number of environment frames collected.
    """
    settings, loss_module, optimizer = loop.settings, loop.loss_module, loop.optimizer
    num_minibatches = settings.frames_per_batch // settings.minibatch_size
    loss_module.train()
    frames = 0
    for iteration in range(1, settings.iterations + 1):
        # Collect frames_per_batch steps with the current policy; GAE adds
        # ("agents", "advantage") and ("agents", "value_target").
        with torch.no_grad():
            batch = next(loop.batches)
            loop.gae(batch)
        frames += batch.numel()

        # The batch's transitions replace the previous ones in the buffer.
        loop.buffer.empty()
        loop.buffer.extend(batch.reshape(-1))

        for _ in range(settings.num_epochs):
            for _ in range(num_minibatches):
                losses = loss_module(loop.buffer.sample())
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                loss.backward()
                for group in optimizer.param_groups:  # one group per agent
                    torch.nn.utils.clip_grad_norm_(group["params"], settings.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        if on_iteration is not None:
            on_iteration(iteration, batch)
    return frames


# --------------------------------------------------------------- reporting
def mean_episode_returns(batch: TensorDictBase) -> torch.Tensor:
    """Return each agent's mean return over the episodes that ended in ``batch``.

    Parameters
    ----------
    batch : TensorDictBase
        A collected batch, shape ``(num_envs, steps)``.

    Returns
    -------
    torch.Tensor
        Shape ``(num_agents,)``; NaN if no episode ended.
    """
    done = batch.get(("next", "done")).squeeze(-1)
    returns = batch.get(("next", "agents", "episode_return"))[done]
    return returns.squeeze(-1).float().mean(0)


def parameter_checksum(module: torch.nn.Module) -> float:
    """Return the sum of all parameters of ``module``, in float64: a quick fingerprint of a run."""
    return float(sum(parameter.detach().double().sum() for parameter in module.parameters()))


def main(overrides: list[str]) -> None:
    """Compose the default hidden-bits config, train for 2 iterations and print rewards and a checksum.

    Parameters
    ----------
    overrides : list of str
        Hydra overrides, applied after ``preset=none trainer.num_iterations=2``.
    """
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    config = compose_config(["preset=none", "trainer.num_iterations=2", *overrides])
    loop = build_plain_loop(config)
    names = loop.loss_module.agent_names

    def report(iteration: int, batch: TensorDictBase) -> None:
        returns = ", ".join(f"{name} {value:.3f}" for name, value in zip(names, mean_episode_returns(batch).tolist()))
        print(f"iteration {iteration}/{loop.settings.iterations}: mean episode return {returns}")

    try:
        frames = run_plain_loop(loop, on_iteration=report)
    finally:
        loop.close()
    print(f"{frames} frames; checksum of the final parameters {parameter_checksum(loop.loss_module):.10f}")


if __name__ == "__main__":
    main(sys.argv[1:])
