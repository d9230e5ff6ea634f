"""Configs composed from a kept composition of their groups (nip_like.composition) are Hydra's own, errors included."""

from __future__ import annotations

import os
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf

from nip_like import composition
from nip_like.cli import compose_config
from nip_like.config import CONFIG_DIR, register_configs

#: Group choices (a preset, nested groups), value overrides of every kind (set, add, force-add, a dict value, a list, a
#: quoted string, a hydra key), in several orders.
CASES = [
    [],
    ["preset=smoke"],
    ["preset=smoke", "trainer.num_iterations=7", "seed=3"],
    ["seed=3", "preset=smoke", "trainer.num_iterations=7"],
    ["preset=none", "scenario=duplicates", "protocol=nip", "trainer=dpo", "scenario.num_lists=60"],
    ["preset=none", "scenario=duplicates", "+scenario.agents.verifier={pretrained_path: /x, lora: {r: 4}}"],
    ["preset=quick", "protocol=adp", "logger=csv", "++run.num_threads=1", "hydra.run.dir=/tmp/somewhere"],
    ["preset=smoke", "trainer=lola", "trainer.objective.lookahead_lr=0.5"],
    ["preset=smoke", "logger.backends=[csv,tensorboard]", "name='with spaces'"],
]

#: Overrides Hydra refuses, each with the error it raises: an unknown option, an unknown key, adding a key that exists,
#: a sweep, a group force-added, deleting a key of a schema, a malformed override.
REFUSED = [
    ["preset=smoke", "~trainer.eval"],
    ["name=a = b"],
    ["scenario=no_such_scenario"],
    ["trainer.no_such_key=1"],
    ["+seed=4"],
    ["seed=1,2"],
    ["++scenario=duplicates"],
]


def hydra_compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def kept_compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return composition.compose_from_kept_groups("config", overrides)


@pytest.mark.parametrize("overrides", CASES, ids=[" ".join(case) or "none" for case in CASES])
def test_a_kept_composition_gives_hydras_config(overrides):
    for _ in range(2):  # the first call keeps the groups' composition, the second starts from it
        ours, theirs = kept_compose(overrides), hydra_compose(overrides)
        assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(theirs)
        assert OmegaConf.is_struct(ours) == OmegaConf.is_struct(theirs)


def test_each_call_gets_its_own_copy():
    first = kept_compose(["preset=smoke"])
    first.trainer.num_iterations = 999
    assert kept_compose(["preset=smoke"]).trainer.num_iterations == 3


@pytest.mark.parametrize("overrides", REFUSED, ids=[" ".join(case) for case in REFUSED])
def test_refused_overrides_raise_what_hydra_raises(overrides):
    with pytest.raises(HydraException) as theirs:
        hydra_compose(overrides)
    for _ in range(2):
        with pytest.raises(HydraException) as ours:
            kept_compose(overrides)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_a_changed_config_file_is_read_again(tmp_path):
    config_dir = tmp_path / "configs"
    (config_dir / "scenario").mkdir(parents=True)
    option = config_dir / "scenario" / "mine.yaml"
    option.write_text("defaults:\n  - hidden_bits\n  - _self_\nnum_bits: 5\n")
    assert compose_config(["preset=none", "scenario=mine"], config_dir=config_dir).scenario.num_bits == 5
    # Not through the kept compositions (a searchpath override), but their state covers every folder they read:
    option.write_text("defaults:\n  - hidden_bits\n  - _self_\nnum_bits: 6\n")
    assert compose_config(["preset=none", "scenario=mine"], config_dir=config_dir).scenario.num_bits == 6
    assert composition._folder_state(config_dir) != ()


def test_a_changed_package_file_or_schema_changes_the_state(tmp_path, monkeypatch):
    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        from hydra.core.global_hydra import GlobalHydra

        sources = GlobalHydra.instance().config_loader().repository.get_sources()
        before, _ = composition._sources_state(sources)
        # A file of the config folder touched: another modification time.
        preset = CONFIG_DIR / "preset" / "smoke.yaml"
        stat = preset.stat()
        os.utime(preset, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        try:
            assert composition._sources_state(sources)[0] != before
        finally:
            os.utime(preset, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert composition._sources_state(sources)[0] == before
        # A schema stored again (a user's component registered anew): another node.
        store = ConfigStore.instance()
        store.store(name="composition_probe", node={"a": 1})
        with_probe, _ = composition._sources_state(sources)
        store.store(name="composition_probe", node={"a": 2})
        assert composition._sources_state(sources)[0] != with_probe


@pytest.mark.slow  # a timing over many composes, a second or two
def test_composing_from_kept_groups_is_several_times_faster():
    overrides = ["preset=smoke", "trainer.num_iterations=5"]
    kept_compose(overrides)
    started = time.perf_counter()
    for _ in range(5):
        hydra_compose(overrides)
    hydra_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(5):
        kept_compose(overrides)
    assert time.perf_counter() - started < hydra_seconds / 3
