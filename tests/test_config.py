"""Config schemas: documented fields, run identity, group options."""

import ast
import dataclasses
import inspect
import logging
from pathlib import Path

import pytest

import nip_like.config as config_module
from nip_like.config import CONFIG_DIR, run_id
from nip_like.warm_start import pretrain_key
from nip_like.registry import REGISTRIES
from nip_like.trainers import TensorDictRlTrainer
from nip_like.validation import validate_schemas
from tests.conftest import make_config, smoke_config


def _schema_modules() -> set[str]:
    """The global config module and every module that defines a registered component's schema."""
    modules = {config_module.__file__}
    for registry in REGISTRIES.values():
        modules.update(inspect.getsourcefile(entry.schema) for entry in registry.entries() if entry.schema)
    return modules


def test_every_schema_field_has_a_default_and_a_comment():
    checked = 0
    for path in _schema_modules():
        source = Path(path).read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name) and d.id == "dataclass" for d in node.decorator_list
            ):
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and "ClassVar" not in ast.unparse(statement.annotation):
                        name = statement.target.id
                        assert statement.value is not None, f"{node.name}.{name} has no default"
                        assert "  # " in lines[statement.lineno - 1], f"{node.name}.{name} has no comment ({path})"
                        checked += 1
    assert checked > 80


def test_options_added_later_change_no_key_at_their_neutral_value_and_do_when_set():
    from nip_like.config import hyper_parameters

    lm = make_config("preset=lm_quick")
    keyed = str(hyper_parameters(lm)) + str(pretrain_key(lm, "prover"))
    assert "sampler" not in keyed and "agent_restarts" not in keyed  # as before the options existed
    assert "decoding" not in keyed and "sampling_dtype" not in keyed and "test_rollouts" not in keyed
    for option in ("scenario.default_agent.decoding=static", "scenario.default_agent.sampling_dtype=bfloat16", "trainer.test_rollouts=2"):
        assert run_id(make_config("preset=lm_quick", option)) != run_id(lm), option
    served = make_config("preset=lm_quick", "scenario.default_agent.sampler.kind=server")
    assert run_id(served) != run_id(lm) and pretrain_key(served, "prover") == pretrain_key(lm, "prover")
    restarted = make_config("preset=lm_quick", "+trainer.pretrain.agent_restarts={verifier: 2}")
    assert run_id(restarted) != run_id(lm) and pretrain_key(restarted, "prover") == pretrain_key(lm, "prover")


def test_run_settings_do_not_change_the_run_id():
    base = run_id(smoke_config())
    assert run_id(smoke_config("run.device=cuda", "run.test_run=true", "logger=tensorboard",
                               "run.checkpoint_every=3", "run.progress_bar=true")) == base
    # Where caches live is not a hyper-parameter either (the text trainer's job seeds once hung on it).
    assert run_id(smoke_config("trainer.pretrain.cache_dir=/elsewhere")) == base
    gi = make_config("preset=quick")
    moved = make_config("preset=quick", "scenario.cache_dir=/elsewhere", "trainer.pretrain.cache_dir=/elsewhere")
    assert run_id(moved) == run_id(gi)
    # Nor of a pretrained agent's cache key: moving the dataset cache must not refit the agents.
    assert pretrain_key(moved, "prover") == pretrain_key(gi, "prover")
    assert pretrain_key(make_config("preset=quick", "seed=1"), "prover") != pretrain_key(gi, "prover")
    assert run_id(smoke_config("seed=1")) != base
    assert run_id(smoke_config("trainer.objective.clip_epsilon=0.1")) != base
    assert run_id(smoke_config("protocol.message_rounds=3")) != base


def test_group_options_compose():
    assert make_config("trainer=ppo_kl").trainer.objective.variant == "kl"
    assert make_config("trainer=ipo").trainer.objective.beta == 0.1
    assert make_config("protocol=solo_verifier").protocol.name == "solo_verifier"
    assert list(make_config("logger=none").logger.backends) == []
    assert make_config("preset=smoke").trainer.num_iterations == 3
    assert make_config().name == "hidden_bits_prover_verifier"


def test_main_job_default_is_the_graph_isomorphism_quick_preset():
    from nip_like.cli import compose_config

    config = compose_config([])  # what `python -m nip_like` runs with no overrides
    assert (config.scenario.name, config.protocol.name, config.trainer.trainer_type) == ("graph_isomorphism", "nip", "ppo")
    assert config.trainer.num_iterations == 100 and config.protocol.min_rounds == 3
    assert list(config.trainer.pretrain.agents) == ["*"] and config.trainer.eval.test_checkpoint == "best"
    paper = make_config("preset=paper")
    assert (paper.trainer.frames_per_batch, paper.trainer.num_epochs, paper.trainer.optimizer.lr) == (2048, 10, 0.0003)
    assert (paper.trainer.objective.gamma, paper.trainer.objective.lmbda, paper.protocol.max_rounds) == (0.95, 0.95, 8)
    # A preset's turn limits reach the protocols that take turns, and only those.
    assert make_config("preset=quick", "protocol=debate").protocol.max_rounds == 6
    assert "max_rounds" not in make_config("preset=quick", "protocol=adp").protocol


@pytest.mark.slow  # a composition per registered component (about 4 s in all): the fast tier keeps tests under ~0.8 s
@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_schema_defaults_are_the_defaults_in_effect(kind):
    """No YAML repeats or changes a schema's default: each component's composed section equals its schema."""
    registry = REGISTRIES[kind]
    group = "trainer" if kind == "trainer" else kind
    checked = 0
    for entry in registry.entries():
        if entry.schema is None or not (CONFIG_DIR / group / f"{entry.name}.yaml").is_file():
            continue
        config = make_config(f"{group}={entry.name}")
        section = config.trainer.objective if kind == "trainer" else config[kind]
        for field in dataclasses.fields(entry.schema):
            expected = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            if field.name != "name":
                assert section[field.name] == expected, f"{group}/{entry.name}.yaml changes {field.name}"
        checked += 1
    assert checked >= 2


def _all_schemas() -> list[tuple[str, type]]:
    """The global schema and every built-in component's, with the config section each fills."""
    where = {"trainer": "trainer.objective", "protocol": "protocol", "scenario": "scenario"}
    schemas = [("", config_module.ExperimentConfig), *(("trainer", schema) for schema in config_module.LOOP_SCHEMAS)]
    for kind, registry in REGISTRIES.items():
        schemas += [
            (where[kind], entry.schema)
            for entry in registry.entries()
            if entry.schema is not None and entry.cls.__module__.startswith("nip_like.")
        ]
    return schemas


def test_every_numeric_field_declares_what_it_allows():
    """A new int or float field cannot be added without its range (nip_like.allowed.checked)."""
    from nip_like.allowed import numeric_fields_without_range

    missing = [f"{schema.__name__}.{name}" for _, schema in _all_schemas() for name in numeric_fields_without_range(schema)]
    assert not missing, missing


def test_every_default_is_allowed():
    from omegaconf import OmegaConf

    from nip_like.allowed import check_values

    for where, schema in _all_schemas():
        check_values(OmegaConf.structured(schema), schema, where)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.optimizer.lr=-0.1", "trainer.optimizer.lr must be > 0, got -0.1"),
        ("trainer.optimizer.max_grad_norm=-1", "trainer.optimizer.max_grad_norm must be > 0"),
        ("trainer.objective.gamma=1.5", "trainer.objective.gamma must be in [0, 1], got 1.5"),
        ("trainer.objective.lmbda=-0.5", "trainer.objective.lmbda must be in [0, 1]"),
        ("trainer.objective.clip_epsilon=-0.2", "trainer.objective.clip_epsilon must be > 0"),
        ("trainer.eval.every=-1", "trainer.eval.every must be >= 0"),
        ("run.checkpoint_every=-1", "run.checkpoint_every must be >= 0"),
        ("trainer.optimizer.warmup_iterations=-3", "trainer.optimizer.warmup_iterations must be >= 0"),
        ("run.num_threads=0", "run.num_threads must be >= 1"),
        ("run.autocast_dtype=int8", "run.autocast_dtype must be one of [None, 'bfloat16', 'float16']"),
        ("run.autocast_dtype=bf16", "run.autocast_dtype must be one of"),
        ("trainer.test_batch_episodes=0", "trainer.test_batch_episodes must be >= 1"),
        ("trainer.num_test_episodes=0", "trainer.num_test_episodes must be >= 1"),
        ("trainer.optimizer.betas=[0.9]", "trainer.optimizer.betas must be a list of 2, each in [0, 1), got [0.9]"),
        ("scenario.default_agent.hidden_size=-4", "scenario.default_agent.hidden_size must be >= 1"),
        ("protocol.message_rounds=0", "protocol.message_rounds must be >= 1"),
        ("+trainer.optimizer.agent_lr.prover=-1", "trainer.optimizer.agent_lr must be all > 0"),
        ("trainer.objective.entropy_coeff=nan", "trainer.objective.entropy_coeff must be >= 0, got nan"),
    ],
)
def test_values_outside_their_range_stop_the_build_in_one_line(tmp_path, override, message):
    from nip_like.errors import ConfigError
    from nip_like.experiment import build_trainer

    with pytest.raises(ConfigError) as error:
        build_trainer(smoke_config(override), tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not any(tmp_path.iterdir())  # nothing was written: the check comes before any work



class DirectRlTrainer(TensorDictRlTrainer):
    """A direct subclass of the RL trainer that registers nothing, as a user's own file may hold."""


def test_an_unregistered_direct_rl_trainer_is_told_which_options_it_takes(caplog):
    config = smoke_config(f"trainer.trainer_type={__name__}.DirectRlTrainer")
    with caplog.at_level(logging.INFO, logger="nip_like.validation"):
        assert validate_schemas(config).schema is None
    lines = [record.getMessage() for record in caplog.records if "registers no options schema" in record.getMessage()]
    assert len(lines) == 1 and "(PPOConfig; trainer=ppo by default)" in lines[0], lines
    assert lines[0].startswith(f"trainer {__name__}.DirectRlTrainer registers no options schema")
