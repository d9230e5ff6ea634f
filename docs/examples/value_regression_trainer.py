from contextlib import ExitStack
from dataclasses import dataclass

import torch

from nip_like.trainers import TensorDictTrainer, attach_progress_bar


@dataclass
class Counters:
    iteration: int = 0  # completed train iterations; resume reads it


class ValueRegressionTrainer(TensorDictTrainer):
    """Fit every agent's value network to the episode return of random play."""

    def __init__(self, config, scenario, run_dir, logger):
        super().__init__(config, scenario, run_dir, logger)
        self.agents = scenario.make_agents()
        self.env = scenario.make_env(config.trainer.num_envs, "train", config.seed, "cpu")
        self.optimizer = torch.optim.Adam(self.agents.value.parameters(), lr=config.trainer.optimizer.lr)
        self.state = Counters()

    def trainable_modules(self):
        return [self.agents.modules()]

    def train(self):
        with ExitStack() as stack:
            self._build_train_context(stack)
            self._run_train_loop()
        return self.test()  # the test loop below, in the test context (TensorDictTrainer.test)

    def _loss(self):
        rollout = self.env.rollout(self.scenario.protocol.num_rounds, break_when_any_done=False)
        target = rollout["next", "agents", "episode_return"][:, -1:].expand_as(rollout["agents", "episode_return"])
        value = self.agents.value(rollout)["agents", "state_value"]
        return torch.nn.functional.mse_loss(value, target)

    @attach_progress_bar(lambda self: self.config.trainer.num_iterations)
    def _run_train_loop(self, iteration_context):
        iteration_context.set_description("Training")
        while self.state.iteration < self.config.trainer.num_iterations:
            loss = self._loss()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.state.iteration += 1
            self.logger.log({"loss/value": loss.item()}, step=self.state.iteration)
            iteration_context.set_postfix(loss=f"{loss.item():.3g}")
            iteration_context.step()
        self.save_checkpoint("last")

    @attach_progress_bar(lambda self: 1)
    def _run_test_loop(self, iteration_context):
        iteration_context.set_description("Testing")
        metrics = {"test/loss/value": self._loss().item()}
        iteration_context.step()
        return metrics

    def state_dict(self):
        return {
            "agents": self.agents.modules().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "iteration": self.state.iteration,
        }

    def load_state_dict(self, state):
        self.agents.modules().load_state_dict(state["agents"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.iteration = state["iteration"]
        self.progress_initial = {"_run_train_loop": self.state.iteration}
