"""The experiment config composed many times in one process, each time from a kept composition of its config groups.

Hydra composes a config in two steps (``ConfigLoaderImpl._load_configuration_impl``):
it builds the defaults list, that is which option of each config group the
overrides choose, and merges those configs; then it applies the overrides of
values (``key=value``, ``+key=value``, ``++key=value``, ``~key``) to the result
with ``ConfigLoaderImpl._apply_overrides_to_config``. A value override cannot
change the first step (a defaults list may interpolate only the choices of
other groups), and the first step is nearly all the time: about 0.15 s of the
0.17 s a compose took here, most of it copying the registered schemas. So
:func:`compose_from_kept_groups` keeps the first step's result per config
name, group overrides and state of the config sources (each folder's files,
sizes and modification times; the schemas registered in Hydra's ConfigStore),
and for each call copies it (under 10 ms) and applies that call's value
overrides with Hydra's own function. A test suite, a notebook or a script that
composes hundreds of configs (the test suite composes about a thousand) gains
the difference on each.

Overrides that change where configs are searched (``hydra.searchpath``) or that
sweep (``a=1,2``) go through Hydra's ``compose`` unchanged.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hydra import compose
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

#: How many compositions of group overrides are kept (the least recently used go first).
MAX_KEPT = 32

#: Kept compositions by (config name, group overrides, state of the sources): the config, with its hydra node, before
#: any value override; and the ConfigStore nodes the state names by identity, kept alive so that no other node can
#: take an identity the state holds.
_kept: OrderedDict[tuple, tuple[DictConfig, list[Any]]] = OrderedDict()


def compose_from_kept_groups(config_name: str, overrides: list[str]) -> DictConfig:
    """What ``hydra.compose(config_name, overrides)`` returns (no hydra node), from a kept composition of its groups.

    Called, like ``compose``, inside one of Hydra's ``initialize_*`` contexts.

    Parameters
    ----------
    config_name : str
        The primary config.
    overrides : list of str
        Hydra overrides.

    Raises
    ------
    hydra.errors.HydraException
        What ``compose`` raises for the same overrides.
    """
    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    if any(item.is_sweep_override() or item.key_or_group.startswith("hydra.searchpath") for item in parsed):
        return compose(config_name, overrides=list(overrides))
    repository = GlobalHydra.instance().config_loader().repository
    groups, values = [], []
    for item in parsed:
        # As Hydra's defaults list sorts them (hydra._internal.defaults_list.Overrides).
        is_value = isinstance(item.value(), dict) or not repository.group_exists(item.key_or_group)
        (values if is_value else groups).append(item)
    state, nodes = _sources_state(repository.get_sources())
    key = (config_name, tuple(item.input_line for item in groups), state)
    if key in _kept:
        _kept.move_to_end(key)
    else:
        composed = compose(config_name, overrides=[item.input_line for item in groups], return_hydra_config=True)
        _kept[key] = (composed, nodes)
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    config = copy.deepcopy(_kept[key][0])
    try:
        # Hydra's own application of value overrides, on the struct-mode config it leaves them.
        ConfigLoaderImpl._apply_overrides_to_config(values, config)
    except OmegaConfBaseException as error:  # as ConfigLoaderImpl.load_configuration wraps them
        raise ConfigCompositionException().with_traceback(error.__traceback__) from error
    with open_dict(config):
        del config["hydra"]
    return config


def _sources_state(sources: list) -> tuple[tuple, list[Any]]:
    """A hashable state of the config sources, and the ConfigStore nodes it names by identity.

    A folder: each file's relative path, size and modification time. The
    registered schemas: each node's path and identity (storing a node again
    makes a new one). Any other source (Hydra's own configs, in its package):
    its scheme and path.
    """
    parts: list[tuple] = []
    nodes: list[Any] = []
    for source in sources:
        scheme = source.scheme()
        if scheme == "file":
            parts.append(("file", source.path, _folder_state(Path(source.path))))
        elif scheme == "structured":
            parts.append(("structured", _store_state(ConfigStore.instance().repo, "", nodes)))
        else:
            parts.append((scheme, source.path))
    return tuple(parts), nodes


def _folder_state(folder: Path) -> tuple:
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue
            found.append((os.path.relpath(path, folder), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(found))


def _store_state(tree: dict, prefix: str, nodes: list[Any]) -> tuple:
    found = []
    for name, value in tree.items():
        if isinstance(value, dict):
            found.append((f"{prefix}{name}/", _store_state(value, f"{prefix}{name}/", nodes)))
        else:
            nodes.append(value)
            found.append((f"{prefix}{name}", id(value)))
    return tuple(found)
