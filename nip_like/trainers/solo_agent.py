"""Supervised training of one agent on the labels: a baseline without interaction."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import torch

from nip_like.checkpoint import derive_seed, get_rng_states, set_rng_states
from nip_like.errors import ConfigError
from nip_like.optimizers import build_optimizer
from nip_like.lm.demonstration_fit import held_out_scores
from nip_like.warm_start import (
    TARGET_KEY,
    agent_data,
    fit_loss,
    is_token_data,
    policy_network,
    predicted_decisions,
    split_data,
)
from nip_like.registry import register_trainer
from nip_like.supervised import supervised_epoch
from nip_like.scenarios.base import Demonstrating, Labelled, TensorGame
from nip_like.trainers.base import IterationContext, TensorDictTrainer, attach_progress_bar


@dataclass
class SoloState:
    """Counters of the supervised loop, saved in checkpoints."""

    iteration: int = 0  # completed epochs
    gradient_steps: int = 0  # optimiser steps taken
    best_metric: float | None = None  # best validation accuracy
    best_iteration: int | None = None  # epoch of the best validation accuracy
    train_seconds: float = 0.0  # wall time in the train loop


@dataclass
class SoloAgentConfig:
    """Options of the supervised solo-agent objective (``trainer.objective``)."""

    agent: str = "verifier"  # the agent trained on the labels


@register_trainer("solo_agent", objective=SoloAgentConfig)
class SoloAgentTrainer(TensorDictTrainer):
    """Train one agent's policy to output the right decision straight from the datapoint.

    For a scenario whose agents speak (language models, :doc:`duplicates`),
    the agent is fine-tuned on its demonstrated messages instead
    (``scenario.demonstrations``), and ``accuracy`` is the share of held-out
    demonstrations that greedy decoding reproduces exactly: for the verifier,
    which speaks once, its decision accuracy.

    Otherwise the scenario supplies labelled data: the agent's decision
    demonstrations (``scenario.demonstrations``, as :doc:`graph_isomorphism`
    gives them: with ``solo_verifier``, the first observation of every pair)
    or ``scenario.supervised_data(split)`` (each agent's first observation of
    every datapoint), each with the correct action (``"target_action"``) and
    the actions to choose among (``"target_mask"``, e.g. accept and reject). The agent named ``trainer.objective.agent`` is
    fitted by cross-entropy for ``trainer.num_iterations`` epochs of
    minibatches of ``trainer.minibatch_size`` datapoints, evaluated on the
    validation split every ``trainer.eval.every`` epochs, and tested on the
    test split: a baseline of what the agent can learn without interaction.
    """

    requires = (TensorGame, (Demonstrating, Labelled))

    def __init__(self, config, scenario, run_dir, logger) -> None:
        super().__init__(config, scenario, run_dir, logger)
        tc = config.trainer
        self.agent = str(tc.objective.agent)
        if self.agent not in scenario.agent_names:
            raise ConfigError(
                f"trainer.objective.agent {self.agent!r} is not an agent of the protocol; "
                f"choose one of {list(scenario.agent_names)}"
            )
        self.agent_index = scenario.agent_names.index(self.agent)
        self.device = torch.device(config.run.device)
        self.agents = scenario.make_agents()
        self.agents.modules().to(self.device)
        parameters = {self.agent: list(self.agents.agent_parameters(self.agent))}
        self.optimizer = build_optimizer(tc.optimizer, parameters)
        self._data: dict[str, Any] = {}  # each split's supervised data, read on first use
        self.generator = torch.Generator().manual_seed(derive_seed(int(config.seed), "solo_agent"))
        self.state = SoloState()
        self.num_iterations = 1 if config.run.test_run else int(tc.num_iterations)

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.agents.modules()]

    # ------------------------------------------------------------ evaluation
    def data(self, split: str):
        """The agent's supervised data (or demonstrations) of ``split`` on the trainer's device, read once."""
        if split not in self._data:
            loaded = split_data(self.scenario, split, int(self.config.seed), self.device)
            self._data[split] = agent_data(self.scenario, loaded, self.agent, "trainer.objective.agent")
        return self._data[split]

    def _evaluate(self, split: str, prefix: str) -> dict[str, float]:
        data = self.data(split)
        if is_token_data(data):
            # The share of held-out demonstrations that greedy decoding says exactly: for a verifier
            # that speaks once, its decision accuracy.
            loss, reproduced = held_out_scores(policy_network(self.agents, self.agent), data)
            return {f"{prefix}/accuracy": reproduced, f"{prefix}/token_loss": loss}
        predicted = predicted_decisions(self.agents, self.agent_index, data)
        target = data.get(TARGET_KEY)
        metrics = {"accuracy": (predicted == target).float().mean().item()}
        if isinstance(self.scenario, Labelled):
            metrics.update(self.scenario.supervised_metrics(predicted, data))
        return {f"{prefix}/{k}": v for k, v in metrics.items()}

    # ----------------------------------------------------------------- loops
    def train(self) -> dict[str, float]:
        if self.state.iteration < self.num_iterations:
            with ExitStack() as stack:
                self._build_train_context(stack)
                self._run_train_loop()
        metrics = self.test()
        self.logger.log(metrics, step=self.state.iteration)
        return metrics

    @attach_progress_bar(lambda self: self.num_iterations)
    def _run_train_loop(self, iteration_context: IterationContext) -> None:
        iteration_context.set_description("Training")
        tc = self.config.trainer
        data = self.data("train")
        while self.state.iteration < self.num_iterations:
            started = time.perf_counter()
            loss, accuracy, steps = supervised_epoch(
                data, fit_loss(self.scenario, self.agents, self.agent, data), self.optimizer, tc.minibatch_size,
                self.generator, tc.optimizer.max_grad_norm,
            )
            self.state.gradient_steps += steps
            self.state.iteration += 1
            metrics = {
                "loss/policy": loss,
                "train/accuracy": accuracy,
                "train/gradient_steps": self.state.gradient_steps,
            }
            every = int(tc.eval.every)
            last = self.state.iteration == self.num_iterations
            if every and (self.state.iteration % every == 0 or last):
                with ExitStack() as stack:
                    self._build_test_context(stack)
                    metrics.update(self._evaluate("val", "eval"))
                if self.state.best_metric is None or metrics["eval/accuracy"] > self.state.best_metric:
                    self.state.best_metric = metrics["eval/accuracy"]
                    self.state.best_iteration = self.state.iteration
            self.state.train_seconds += time.perf_counter() - started
            self.logger.log(metrics, step=self.state.iteration)
            iteration_context.set_postfix(**{k: f"{v:.3g}" for k, v in metrics.items() if "accuracy" in k})
            iteration_context.step()
            checkpoint_every = self.config.run.checkpoint_every
            checkpoint = last or bool(checkpoint_every and self.state.iteration % checkpoint_every == 0)
            if checkpoint:
                self.save_checkpoint("last")
            self.stop_if_requested(self.state.iteration, checkpointed=checkpoint)

    @attach_progress_bar(lambda self: 1)
    def _run_test_loop(self, iteration_context: IterationContext) -> dict[str, float]:
        iteration_context.set_description("Testing")
        metrics = self._evaluate(self.test_split, "test")
        iteration_context.step()
        return metrics

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "agents": self.agents.modules().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "train_state": asdict(self.state),
            "generator": self.generator.get_state(),
            "rng": get_rng_states(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agents.modules().load_state_dict(state["agents"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.state = SoloState(**state["train_state"])
        self.generator.set_state(state["generator"])
        set_rng_states(state["rng"])
        self.progress_initial = {"_run_train_loop": self.state.iteration}
