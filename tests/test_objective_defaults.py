"""One default per objective option: a loss built directly is the objective its schema names.

Every registered objective's schema is the ``options_schema`` of a loss in
:mod:`nip_like.objectives`, whose constructor has each of the schema's fields
as a keyword argument with the schema's default; a loss built directly
refuses a value outside the field's declared range in one line naming the
argument.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from typing import Any

import pytest
import torch

import nip_like.objectives
from nip_like.allowed import allowed_of
from nip_like.errors import ConfigError
from nip_like.objectives.contract import ObjectiveConfig, RolloutLoss
from nip_like.objectives.dpo import DPOConfig, DPOLoss, IPOLoss
from nip_like.objectives.grpo import GRPOLoss
from nip_like.objectives.learning_aware import LearningAwareConfig, LOLALoss, SOSLoss, SPGLoss
from nip_like.objectives.options import check_options
from nip_like.objectives.ppo import MultiAgentPPOLoss, PPOConfig
from nip_like.objectives.reference import ReferencePolicy
from nip_like.objectives.reinforce import MultiAgentReinforceLoss
from nip_like.registry import TRAINERS
from tests.test_environment import make_scenario


def objective_losses() -> list[type[RolloutLoss]]:
    """The losses of :mod:`nip_like.objectives` (every module imported) that declare their options schema."""
    for module in pkgutil.walk_packages(nip_like.objectives.__path__, "nip_like.objectives."):
        importlib.import_module(module.name)
    found, pending = [], [RolloutLoss]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith("nip_like.objectives.") and vars(cls).get("options_schema") is not None:
            found.append(cls)
    return sorted(set(found), key=lambda cls: cls.__qualname__)


def registered_objectives() -> dict[str, type[ObjectiveConfig]]:
    """The built-in trainers whose options are a loss's (an :class:`ObjectiveConfig`), by name."""
    TRAINERS.load_builtins()
    return {
        entry.name: entry.schema
        for entry in TRAINERS.entries()
        if entry.cls.__module__.startswith("nip_like.")
        and entry.schema is not None
        and issubclass(entry.schema, ObjectiveConfig)
    }


def constructor_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls(...)``, following ``**kwargs`` up to the base classes that receive them."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        for parameter in parameters:
            named = parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            if named and parameter.default is not parameter.empty:
                defaults.setdefault(parameter.name, parameter.default)
        if not any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
            break
    return defaults


def drifted(schema: type, loss: type) -> list[str]:
    """Each field of ``schema`` whose default ``loss``'s constructor lacks or differs from, one line each."""
    defaults = constructor_defaults(loss)
    lines = []
    for field in dataclasses.fields(schema):
        if field.name not in defaults:
            lines.append(f"{loss.__name__} has no keyword argument {field.name} with a default ({schema.__name__} has one)")
        elif defaults[field.name] != field.default or type(defaults[field.name]) is not type(field.default):
            lines.append(
                f"{field.name}: {schema.__name__} says {field.default!r}, {loss.__name__}(...) says {defaults[field.name]!r}"
            )
    return lines


def test_every_registered_objective_is_a_loss_that_declares_its_schema():
    schemas = {loss.options_schema for loss in objective_losses()}
    missing = {name: schema.__name__ for name, schema in registered_objectives().items() if schema not in schemas}
    assert not missing, f"no loss in nip_like.objectives declares these schemas as its options_schema: {missing}"
    assert len(registered_objectives()) > 10 and registered_objectives()["ppo"].__name__ == "PPOConfig"  # not vacuous


@pytest.mark.parametrize("loss", objective_losses(), ids=lambda loss: loss.__name__)
def test_constructor_defaults_are_the_schema_defaults(loss):
    assert drifted(loss.options_schema, loss) == []


def test_a_redeclared_field_keeps_its_range():
    """A schema that redeclares an inherited field to change its default (IPO's beta) keeps the field's range.

    The PPO-clipped learning-aware forms' ``clip_epsilon`` allows what PPO's does: the loss checks it against
    :class:`PPOConfig`.
    """
    differing = []
    for schema in {loss.options_schema for loss in objective_losses()}:
        for field in dataclasses.fields(schema):
            bases = [base for base in schema.__mro__[1:] if field.name in getattr(base, "__dataclass_fields__", {})]
            if field.name == "clip_epsilon" and issubclass(schema, LearningAwareConfig):
                bases.append(PPOConfig)
            for base in bases:
                inherited = allowed_of(base.__dataclass_fields__[field.name])
                if allowed_of(field) != inherited:
                    said = [allowed.describe() if allowed else "anything" for allowed in (allowed_of(field), inherited)]
                    differing.append(f"{schema.__name__}.{field.name} allows {said[0]}, {base.__name__}'s {said[1]}")
    assert differing == []


def test_a_drifted_default_is_caught():
    @dataclasses.dataclass
    class Options(ObjectiveConfig):
        beta: float = 0.3
        margin: float = 0.0

    class Base:
        def __init__(self, *, margin: float = 0.0, beta: float = 0.3) -> None: ...

    class Forwarding(Base):
        def __init__(self, *args, beta: float = 0.1, **kwargs) -> None: ...

    class Missing:
        def __init__(self, *, beta: float = 0.3) -> None: ...

    assert drifted(Options, Base) == []
    assert drifted(Options, Forwarding) == ["beta: Options says 0.3, Forwarding(...) says 0.1"]
    assert drifted(Options, Missing) == ["Missing has no keyword argument margin with a default (Options has one)"]


@pytest.fixture(scope="module")
def agents():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the networks' orthogonal initialisation is 30 times slower on two busy threads
    try:
        return make_scenario().make_agents()
    finally:
        torch.set_num_threads(threads)


def test_a_variant_loss_is_its_registered_objective(agents):
    """IPO: the loss class of the registered name has its defaults; DPOLoss keeps DPO's with any loss type."""
    ipo = IPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy))
    assert (ipo.loss_type, ipo.beta, ipo.length_normalize) == ("ipo", 0.1, True)
    dpo = DPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy))
    assert (dpo.loss_type, dpo.beta, dpo.length_normalize) == ("sigmoid", 0.3, False)
    with pytest.raises(TypeError, match="loss_type"):
        IPOLoss(agents.policy, agents.agent_names, ReferencePolicy(agents.policy), loss_type="hinge")


def _builders(agents) -> dict[str, Any]:
    reference = ReferencePolicy(agents.policy)
    names = agents.agent_names
    leaders = (("verifier",), ("prover",))
    return {
        "DPOLoss": lambda **kw: DPOLoss(agents.policy, names, reference, **kw),
        "IPOLoss": lambda **kw: IPOLoss(agents.policy, names, reference, **kw),
        "GRPOLoss": lambda **kw: GRPOLoss(agents.policy, names, reference, **kw),
        "MultiAgentReinforceLoss": lambda **kw: MultiAgentReinforceLoss(agents.policy, agents.value, names, **kw),
        "MultiAgentPPOLoss": lambda **kw: MultiAgentPPOLoss(agents.policy, agents.value, names, **kw),
        "SPGLoss": lambda **kw: SPGLoss(agents.policy, agents.value, names, leader_order=leaders, **kw),
        "LOLALoss": lambda **kw: LOLALoss(agents.policy, agents.value, names, **kw),
        "SOSLoss": lambda **kw: SOSLoss(agents.policy, agents.value, names, **kw),
    }


@pytest.mark.parametrize(
    ("loss", "options", "message"),
    [
        ("DPOLoss", {"beta": 0.0}, "DPOLoss: beta must be > 0, got 0.0"),
        ("IPOLoss", {"beta": -1.0}, "IPOLoss: beta must be > 0, got -1.0"),
        ("DPOLoss", {"loss_type": "kto"}, "DPOLoss: loss_type must be one of ['sigmoid', 'ipo', 'hinge'], got 'kto'"),
        ("GRPOLoss", {"entropy_coeff": -0.1}, "GRPOLoss: entropy_coeff must be >= 0, got -0.1"),
        ("MultiAgentReinforceLoss", {"gamma": 1.5}, "MultiAgentReinforceLoss: gamma must be in [0, 1], got 1.5"),
        ("MultiAgentPPOLoss", {"clip_epsilon": 0.0}, "MultiAgentPPOLoss: clip_epsilon must be > 0, got 0.0"),
        ("SPGLoss", {"ihvp_iterations": 0}, "SPGLoss: ihvp_iterations must be in [1, 1000], got 0"),
        ("SPGLoss", {"clip_epsilon": -0.2}, "SPGLoss: clip_epsilon must be > 0, got -0.2"),
        ("LOLALoss", {"lookahead_lr": 0.0}, "LOLALoss: lookahead_lr must be > 0, got 0.0"),
        ("SOSLoss", {"sos_a": 1.0}, "SOSLoss: sos_a must be in (0, 1), got 1.0"),
        ("SOSLoss", {"critic_coeff": -1.0}, "SOSLoss: critic_coeff must be >= 0, got -1.0"),
    ],
)
def test_a_loss_built_directly_refuses_a_value_outside_its_schema_range(agents, loss, options, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _builders(agents)[loss](**options)


def test_every_value_not_allowed_is_one_line(agents):
    with pytest.raises(ConfigError) as error:
        _builders(agents)["DPOLoss"](beta=0.0, label_smoothing=0.5, ref_mixup_alpha=1.5)
    assert str(error.value).splitlines() == [
        "DPOLoss: beta must be > 0, got 0.0",
        "DPOLoss: label_smoothing must be in [0, 0.5), got 0.5",
        "DPOLoss: ref_mixup_alpha must be in (0, 1], got 1.5",
    ]


def test_check_options_names_an_argument_its_schema_lacks():
    with pytest.raises(TypeError, match=r"^DPOLoss checks gamma, which DPOConfig does not declare$"):
        check_options(DPOLoss, DPOConfig, gamma=0.5)
