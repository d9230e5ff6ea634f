"""A scenario or a protocol of the user's own, in the user's own file, named by dotted path.

Like a user trainer (``trainer.trainer_type=my_module.MyTrainer``), ``scenario=my_module.MyScenario``
and ``protocol=my_module.MyProtocol`` import the module before the config is composed, so that the
schema it registers types its options; a class that registers nothing takes its parent's options.
The modules are written to ``tmp_path`` and imported from there, each under a name of its own.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from nip_like import __main__ as entry
from nip_like.cli import compose_config, report_errors
from nip_like.validation import validate
from nip_like.experiment import run_experiment
from nip_like.validation import build_scenario
from nip_like.registry import PROTOCOLS, SCENARIOS
from nip_like.scenarios.hidden_bits.scenario import HiddenBitsConfig, HiddenBitsScenario
from tests.conftest import make_config, smoke_config

USER_MODULE = '''
from dataclasses import dataclass

from nip_like.allowed import checked
from nip_like.protocols.prover_verifier import ProverVerifierConfig, ProverVerifierProtocol
from nip_like.registry import register_protocol, register_scenario
from nip_like.scenarios.duplicates.scenario import DuplicatesConfig, DuplicatesScenario
from nip_like.scenarios.hidden_bits.scenario import HiddenBitsConfig, HiddenBitsScenario
from nip_like.trainers.dpo import DpoTrainer


class MyDpo(DpoTrainer):
    """A trainer that registers nothing: its objective options are DPO's."""


@dataclass
class LoudBitsConfig(HiddenBitsConfig):
    """Hidden bits with an option of its own."""

    name: str = "loud_bits"  # scenario name
    loudness: int = checked(1, ge=1)  # an option of the user's scenario


@register_scenario("loud_bits", LoudBitsConfig)
class LoudBits(HiddenBitsScenario):
    """Hidden bits, registered with a schema that extends the built-in one."""


class PlainBits(HiddenBitsScenario):
    """Hidden bits, registering nothing: its options are the parent's."""


@dataclass
class MyDuplicatesConfig(DuplicatesConfig):
    """The duplicates game with an option of its own."""

    name: str = "my_duplicates"  # scenario name
    bonus: float = 0.5  # an option of the user's scenario


@register_scenario("my_duplicates", MyDuplicatesConfig)
class MyDuplicates(DuplicatesScenario):
    """The duplicates game, registered with a subclass of its schema."""


@dataclass
class TalkativeConfig(ProverVerifierConfig):
    """The prover-verifier protocol with an option of its own."""

    name: str = "talkative"  # protocol name
    greeting: str = "hello"  # an option of the user's protocol


@register_protocol("talkative", TalkativeConfig)
class Talkative(ProverVerifierProtocol):
    """The prover-verifier protocol, registered with a schema that extends the built-in one."""

    def __init__(self, greeting: str = "hello", **options) -> None:
        super().__init__(**options)
        self.greeting = greeting

'''

_numbers = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write :data:`USER_MODULE` under a fresh name, importable from ``tmp_path``; return its name.

    The components it registers are forgotten after the test, so that every
    test imports and registers them again.
    """
    name = f"user_components_{next(_numbers)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    for registry in (SCENARIOS, PROTOCOLS):
        registry.load_builtins()
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def in_process_cli(tmp_path, monkeypatch):
    """Run ``python -m nip_like`` in this process, in ``tmp_path``: ``run(*arguments)``.

    Hydra's job logging adds handlers to the root logger, on this test's
    captured streams; they are taken away afterwards, so that no later test
    logs to a closed stream.
    """
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # restores sys.path, to which main() adds the current folder
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def run(*arguments: str) -> None:
        monkeypatch.setattr(sys, "argv", ["nip_like", *arguments])
        entry.main()

    yield run
    for handler in set(root.handlers) - set(handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def test_a_scenario_by_dotted_path_gets_its_registered_options_and_runs(tmp_path, user_module):
    config = smoke_config(f"scenario={user_module}.LoudBits", "scenario.loudness=3", "run.test_run=true")
    # Its schema types the section; the name keeps the dotted path, as trainer.trainer_type does.
    assert OmegaConf.get_type(config.scenario).__name__ == "LoudBitsConfig"
    assert config.scenario.name == f"{user_module}.LoudBits"
    assert (config.scenario.loudness, config.scenario.num_bits) == (3, 2)
    scenario = build_scenario(config)
    assert type(scenario).__name__ == "LoudBits" and scenario.config.loudness == 3
    with pytest.raises(Exception, match="loudness"):
        smoke_config(f"scenario={user_module}.LoudBits", "scenario.loudness=loud")
    run_experiment(config, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 1 and "test/accuracy" in summary["test_metrics"]


def test_scenario_name_by_dotted_path_selects_the_options_too(user_module):
    config = make_config(f"scenario.name={user_module}.LoudBits", "scenario.loudness=2")
    assert (config.scenario.name, config.scenario.loudness) == (f"{user_module}.LoudBits", 2)


def test_a_subclass_that_registers_nothing_takes_its_parents_options(user_module):
    config = make_config(f"scenario={user_module}.PlainBits", "scenario.num_bits=3")
    assert OmegaConf.get_type(config.scenario) is HiddenBitsConfig
    assert (config.scenario.name, config.scenario.num_bits) == (f"{user_module}.PlainBits", 3)
    scenario = build_scenario(config)
    assert type(scenario).__name__ == "PlainBits" and isinstance(scenario, HiddenBitsScenario)


def test_a_trainer_subclass_that_registers_nothing_takes_its_parents_objective(user_module):
    # The default trainer is PPO; the DPO trainer's subclass brings DPO's options, as its user-scenario twin does.
    config = make_config(f"trainer.trainer_type={user_module}.MyDpo", "trainer.objective.beta=0.2")
    assert OmegaConf.get_type(config.trainer.objective).__name__ == "DPOConfig"
    assert (config.trainer.trainer_type, config.trainer.objective.beta) == (f"{user_module}.MyDpo", 0.2)


def test_a_subclass_of_a_builtin_schema_merges(user_module):
    # Options composed from the built-in DuplicatesConfig, checked against the user's subclass of it:
    # OmegaConf alone refuses that merge ("DuplicatesConfig is not a subclass of MyDuplicatesConfig").
    config = make_config("scenario=duplicates", "protocol=nip", f"scenario.name={user_module}.MyDuplicates")
    options = SCENARIOS.typed_options(str(config.scenario.name), config.scenario, "scenario")
    assert options.bonus == 0.5 and options.length == config.scenario.length
    validate(config)  # every key known, every value allowed, the user's schema included
    # Chosen by its dotted path, its own options are selected and set like the built-in ones.
    config = make_config(
        f"scenario={user_module}.MyDuplicates", "protocol=nip", "scenario.bonus=2", "scenario.length=6"
    )
    assert (config.scenario.bonus, config.scenario.length) == (2.0, 6)
    validate(config)


def test_a_protocol_by_dotted_path(user_module):
    config = make_config(f"protocol={user_module}.Talkative", "protocol.greeting=hi", "protocol.message_rounds=3")
    assert (config.protocol.name, config.protocol.greeting) == (f"{user_module}.Talkative", "hi")
    protocol = build_scenario(config).protocol
    assert type(protocol).__name__ == "Talkative" and (protocol.greeting, protocol.num_rounds) == ("hi", 4)


def test_its_own_yaml_file_under_a_config_folder(tmp_path, user_module):
    folder = tmp_path / "conf"
    (folder / "scenario").mkdir(parents=True)
    (folder / "scenario" / "loud_bits.yaml").write_text("defaults:\n  - loud_bits_schema\n  - _self_\nloudness: 5\n")
    dotted = f"scenario={user_module}.LoudBits"
    for overrides, config_dir in (
        (["preset=none", dotted], folder),  # compose_config's own argument
        (["--config-dir", str(folder), "preset=none", dotted], None),  # a command line's flag
        ([f"hydra.searchpath=[file://{folder}]", "preset=none", dotted], None),
    ):
        config = compose_config(overrides, config_dir=config_dir)
        assert (config.scenario.name, config.scenario.loudness) == (f"{user_module}.LoudBits", 5)
    assert compose_config(["preset=none", dotted, "scenario.loudness=7"], config_dir=folder).scenario.loudness == 7


def test_the_command_line_runs_a_scenario_and_protocol_of_your_own(tmp_path, in_process_cli, user_module):
    in_process_cli(
        "preset=smoke",
        f"scenario={user_module}.LoudBits",
        "scenario.loudness=4",
        f"protocol={user_module}.Talkative",
        "run.test_run=true",
        "run.progress_bar=false",
        "logger=none",
        "hydra.run.dir=run",
    )
    resolved = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert (resolved.scenario.name, resolved.scenario.loudness) == (f"{user_module}.LoudBits", 4)
    assert resolved.protocol.name == f"{user_module}.Talkative"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 1


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("scenario=no_such.MyScenario", ["cannot import scenario 'no_such.MyScenario'", "Scenario subclass"]),
        ("scenario={module}.Missing", ["has no class 'Missing'", "'hidden_bits'", "such as my_module.MyScenario"]),
        ("scenario={module}.LoudBitsConfig", ["is not a subclass of Scenario", "'hidden_bits'"]),
        ("protocol={module}.LoudBits", ["is not a subclass of Protocol", "'prover_verifier'"]),
        ("scenario=nip_like.scenarios.base.Scenario", ["has no options schema", "@register_scenario"]),
        ("scenario=mazes", ["unknown scenario 'mazes'", "dotted path of a Scenario subclass"]),
        ("trainer.trainer_type={module}.LoudBits", ["is not a subclass of Trainer"]),
    ],
)
def test_bad_dotted_paths_give_one_line(capsys, user_module, override, fragments):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, report_errors():
        compose_config(["preset=none", override.format(module=user_module)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_bad_dotted_path_on_the_command_line_exits_with_status_2(tmp_path, in_process_cli, capsys):
    with pytest.raises(SystemExit) as exit_:
        in_process_cli("scenario=no_such_module.MyScenario", "hydra.run.dir=run")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot import scenario 'no_such_module.MyScenario'" in err, err
    assert not (tmp_path / "run").exists()


def test_compose_config_refuses_a_missing_config_folder(tmp_path):
    from nip_like.errors import ConfigError

    with pytest.raises(ConfigError, match="config folder .* not found"):
        compose_config(["preset=none"], config_dir=tmp_path / "nowhere")
