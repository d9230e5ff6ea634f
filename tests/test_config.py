"""Config schemas: documented fields, run identity, group options."""

import ast
import dataclasses
from pathlib import Path

import nip_like.config as config_module
from nip_like.config import run_id
from tests.conftest import make_config, smoke_config


def test_every_schema_field_has_a_default_and_a_comment():
    source = Path(config_module.__file__).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    checked = 0
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(d, ast.Name) and d.id == "dataclass" for d in node.decorator_list
        ):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign):
                    name = statement.target.id
                    assert statement.value is not None, f"{node.name}.{name} has no default"
                    assert "  # " in lines[statement.lineno - 1], f"{node.name}.{name} has no comment"
                    checked += 1
    assert checked > 50


def test_run_settings_do_not_change_the_run_id():
    base = run_id(smoke_config())
    assert run_id(smoke_config("run.device=cuda", "run.test_run=true", "logger=tensorboard",
                               "run.checkpoint_every=3", "run.progress_bar=true")) == base
    assert run_id(smoke_config("seed=1")) != base
    assert run_id(smoke_config("trainer.ppo.clip_epsilon=0.1")) != base
    assert run_id(smoke_config("protocol.message_rounds=3")) != base


def test_group_options_compose():
    assert make_config("trainer=ppo_kl").trainer.ppo.variant == "kl"
    assert make_config("protocol=solo_verifier").protocol.name == "solo_verifier"
    assert list(make_config("logger=none").logger.backends) == []
    assert make_config("preset=smoke").trainer.num_iterations == 3
    assert make_config().name == "hidden_bits_prover_verifier"


def test_main_job_default_is_the_graph_isomorphism_quick_preset():
    from nip_like.cli import compose_config

    config = compose_config([])  # what `python -m nip_like` runs with no overrides
    assert (config.scenario.name, config.protocol.name, config.trainer.trainer_type) == ("graph_isomorphism", "nip", "ppo")
    assert config.trainer.num_iterations == 150 and config.protocol.min_rounds == 3
    paper = make_config("preset=paper")
    assert (paper.trainer.frames_per_batch, paper.trainer.num_epochs, paper.trainer.optimizer.lr) == (2048, 10, 0.0003)
    assert (paper.trainer.gamma, paper.trainer.lmbda, paper.protocol.max_rounds) == (0.95, 0.95, 8)


def test_schema_defaults_match_the_dataclasses():
    config = make_config("trainer=ppo")
    defaults = config_module.PPOConfig()
    for field in dataclasses.fields(defaults):
        assert config.trainer.ppo[field.name] == getattr(defaults, field.name)
