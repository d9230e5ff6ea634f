"""One table per kind of component: a new objective registers from outside the package, and every list derives from the tables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra.core.config_store import ConfigStore
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives import LossModule

from nip_like.allowed import checked
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.logging import read_csv_metric
from nip_like.objectives import ObjectiveConfig, RolloutLoss
from nip_like.objectives.contract import contract_of, default_metric_name
from nip_like.objectives.masking import per_agent_mean
from nip_like.registry import PROTOCOLS, REGISTRIES, SCENARIOS, TRAINERS, register_trainer
from nip_like.trainers import TensorDictRlTrainer
from tests.conftest import REPO_ROOT, smoke_config


# ----------------------------------------------------------- a new objective
@dataclass
class AnchoredReinforceConfig(ObjectiveConfig):
    """Options of the test objective: exactly its loss's keyword arguments."""

    anchor_weight: float = checked(0.1, ge=0)  # weight of a pull of the logits towards zero
    scale: float = checked(1.0, gt=0)  # multiplies the episode return


class AnchoredReinforceLoss(RolloutLoss):
    """REINFORCE on each step's episode return, plus a new loss term; lays out only the acting steps."""

    metric_names = {"anchor": "policy/anchor"}

    def __init__(self, actor_network, agent_names, *, anchor_weight: float, scale: float) -> None:
        super().__init__()
        self.actor_network = actor_network
        self.agent_names = agent_names
        self.anchor_weight = anchor_weight
        self.scale = scale
        self.iterations_started: list[int] = []
        self._layout: dict[str, float] = {}

    def start_iteration(self, iteration: int) -> None:
        self.iterations_started.append(iteration)

    def layout_rollouts(self, batch: TensorDictBase) -> TensorDictBase:
        steps = batch.reshape(-1)
        steps = steps[steps.get(("agents", "active")).any(-1)]
        self._layout = {"anchor/steps": float(steps.numel())}
        return steps

    def layout_metrics(self) -> dict[str, float]:
        return self._layout

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        active = tensordict.get(("agents", "active"))
        dist = self.actor_network.get_dist(tensordict.clone(False))
        log_prob = torch.where(active, dist.log_prob(tensordict.get(("agents", "action"))), 0.0)
        returns = tensordict.get(("next", "agents", "episode_return")).squeeze(-1) * self.scale
        logits = torch.where(dist.logits.isfinite(), dist.logits, 0.0)
        anchor = (logits**2).mean()
        return TensorDict(
            {
                "loss_objective": -per_agent_mean(log_prob * returns, active).sum(),
                "loss_anchor": self.anchor_weight * anchor,
                "anchor": anchor.detach(),
            }
        )


@register_trainer("anchored_reinforce_test", objective=AnchoredReinforceConfig)
class AnchoredReinforceTrainer(TensorDictRlTrainer):
    """The one method: the loss, built from the options."""

    def _get_loss_module_and_gae(self):
        return AnchoredReinforceLoss(self.policy, self.agent_names, **self.objective_options), None


DOTTED = f"{__name__}.AnchoredReinforceTrainer"


def test_a_new_objective_registers_and_trains_without_touching_the_package(tmp_path):
    # Naming the trainer by dotted path imports it, which registers it and selects its options.
    config = smoke_config("logger=csv", f"trainer.trainer_type={DOTTED}", "trainer.objective.scale=2.0")
    assert ConfigStore.instance().load("trainer/objective/anchored_reinforce_test.yaml") is not None
    assert "anchored_reinforce_test" in TRAINERS.names()
    assert dict(config.trainer.objective) == {"anchor_weight": 0.1, "scale": 2.0}
    trainer = build_trainer(config, tmp_path / "a")
    assert (trainer.loss_module.scale, trainer.loss_module.anchor_weight) == (2.0, 0.1)
    before = [p.clone() for p in trainer.policy.parameters()]
    trainer.train()
    # The loop called the contract: a hook per iteration, the layout's statistics, the loss's own metric names.
    assert trainer.loss_module.iterations_started == list(range(3))
    assert read_csv_metric(tmp_path / "a", "loss/anchor") and read_csv_metric(tmp_path / "a", "policy/anchor")
    steps = [value for _, value in read_csv_metric(tmp_path / "a", "train/anchor/steps")]
    assert steps and all(0 < value <= 96 for value in steps)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


def test_a_new_objectives_options_are_checked(tmp_path):
    with pytest.raises(Exception, match="anchor_wait"):
        smoke_config(f"trainer.trainer_type={DOTTED}", "trainer.objective.anchor_wait=0.2")
    with pytest.raises(Exception, match="scale"):
        smoke_config(f"trainer.trainer_type={DOTTED}", "trainer.objective.scale=big")
    with pytest.raises(ConfigError, match="trainer.objective.scale must be > 0, got -2.0"):
        build_trainer(smoke_config(f"trainer.trainer_type={DOTTED}", "trainer.objective.scale=-2"), tmp_path / "b")
    # A trainer named with another objective's options is refused, naming the way to select them.
    config = smoke_config(f"trainer.trainer_type={DOTTED}", "trainer/objective=ppo")
    with pytest.raises(ConfigError, match="trainer/objective=anchored_reinforce_test"):
        build_trainer(config, tmp_path)


def test_a_plain_torchrl_loss_gets_the_contracts_defaults():
    plain = contract_of(LossModule())
    batch = TensorDict({"x": torch.zeros(4, 3)}, batch_size=[4, 3])
    assert plain.layout_rollouts(batch).batch_size == (12,)
    assert plain.layout_metrics() == {} and plain.needs_groups is False
    assert plain.metric_name("loss_objective") == "loss/policy" and plain.metric_name("loss_new") == "loss/new"
    assert plain.metric_name("ESS") == "train/ESS" and plain.metric_name("rewards/chosen") == "rewards/chosen"
    assert default_metric_name("kl_approx") == "policy/approxkl"


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_errors_list_the_registered_names(kind):
    registry = REGISTRIES[kind]
    with pytest.raises(ConfigError) as error:
        registry.get("no_such_component")
    assert str(registry.names()) in str(error.value)
    assert len(registry.names()) >= 2


def test_each_registered_component_has_its_yaml_and_schema():
    for kind, group in (("protocol", "protocol"), ("scenario", "scenario")):
        for entry in REGISTRIES[kind].entries():
            assert entry.schema is not None, entry.name
            assert (REPO_ROOT / "nip_like" / "configs" / group / f"{entry.name}.yaml").is_file(), entry.name
    assert set(PROTOCOLS.names()) >= {"nip", "adp", "solo_verifier"} and "hidden_bits" in SCENARIOS.names()


#: Where a list of names written out by hand would be a second source of truth.
SEARCHED = ["nip_like/**/*.py", "scripts/*.py", "tests/*.py", "docs/**/*.rst", "docs/**/*.py", "README.md"]


def test_no_list_of_component_names_outside_the_registry():
    """No line names three or more components of one kind (a list that would need an edit per new component)."""
    TRAINERS.load_builtins()
    builtin = {
        kind: [entry.name for entry in registry.entries() if entry.cls.__module__.startswith("nip_like.")]
        for kind, registry in REGISTRIES.items()
    }
    # One pattern per kind, its longest names first: a name stands alone (not inside a longer word or path).
    patterns = {
        kind: re.compile(rf"(?<![\w./-])({'|'.join(re.escape(name) for name in sorted(names, key=len, reverse=True))})(?![\w/-])")
        for kind, names in builtin.items()
    }
    offending = []
    for pattern in SEARCHED:
        for path in sorted(REPO_ROOT.glob(pattern)):
            if path.name == Path(__file__).name:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for kind, named in patterns.items():
                    found = set(named.findall(line))
                    if len(found) >= 3:
                        offending.append(f"{path.relative_to(REPO_ROOT)}:{number} names {kind}s {sorted(found)}")
    assert not offending, "\n".join(offending)


# ------------------------------------------------- what trainers require of scenarios
def test_every_built_in_trainer_has_a_built_in_scenario_that_meets_its_requirements():
    from nip_like.validation import meets
    from nip_like.scenarios.chat import ChatGame
    from nip_like.scenarios.duplicates.chat import DuplicatesChatScenario

    scenarios = [entry.cls for entry in SCENARIOS.entries()]
    for entry in TRAINERS.entries():
        assert entry.cls.requires, f"trainer {entry.name} declares nothing it requires"
        assert [cls for cls in scenarios if meets(cls, entry.cls.requires)], entry.name
    # A scenario never inherits a method it must refuse: the chat game has no tensor agents to make.
    assert issubclass(DuplicatesChatScenario, ChatGame) and not hasattr(DuplicatesChatScenario, "make_agents")
    assert meets(DuplicatesChatScenario, TRAINERS.get("expert_iteration").requires)
    assert not meets(DuplicatesChatScenario, TRAINERS.get("ppo").requires)
