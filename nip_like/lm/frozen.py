"""Frozen co-players: an agent loaded from a finished run (or a model folder) and never trained.

``scenario.agents.<name>.frozen_from`` names either

* a run folder: the agent of the same name saved beside its last checkpoint,
  ``RUN_DIR/checkpoints/last/<name>/`` (``RUN_DIR/checkpoints/best/<name>``
  with ``frozen_checkpoint: best``), or
* an agent or model folder: one written by ``python -m nip_like.export``, any
  ``save_pretrained`` folder, or a checkpoint's agent folder itself.

An agent folder that holds LoRA adapters only is merged, once, into the base
folder that its ``adapter_config.json`` names, and the merged folder is cached
under ``<scenario.cache_dir>/frozen/``. The agent then plays from it as from a
``pretrained_path``: every weight frozen, no optimiser state, no value head
unless the agent's ``value_head`` asks for one, and it is its own reference
policy (no copy). Its weights are not written into the run's checkpoints; the
checkpoints record where they came from and a checksum of the files read
(:class:`FrozenSource`), and resuming refuses, in one line, a source whose
files have changed since.

A frozen co-player may also be played by an OpenAI-compatible chat server
(:class:`ServedConfig`, ``served: {base_url, model, ...}``): its chat goes out
as a chat-completions request through the client the text models and the
inference-server sampler share, and the answer's text is its reply
(:func:`served_player`; :func:`check_served` before the run). The stress
test's target is one (``scenario.target.served``), and so is any frozen agent
of a chat-view scenario with ``scenario.agents.<name>.served``
(:class:`ServedAgent`, checked by :func:`check_served_agent`): its prompt is
read back into the chat its template rendered, and the answer, in its
tokenizer's tokens, is its message.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from nip_like import cache_record
from nip_like.errors import CheckpointError, ConfigError
from nip_like.lm.agent_folders import ADAPTER_CONFIG, checked_agent_folder
from nip_like.lm.lora import lora_enabled

#: The checkpoints a run folder offers.
CHECKPOINTS = ("last", "best")


@dataclass(frozen=True)
class FrozenSource:
    """Where a frozen agent's weights come from, and the checksum of what was read."""

    source: str  # frozen_from as given
    folder: str  # the agent or model folder read
    checksum: str  # sha256 over the folder's files (and an adapter folder's base folder)


def agent_folder(path: str | Path, agent: str, checkpoint: str = "last", where: str = "frozen_from") -> Path:
    """The agent or model folder that ``path`` names for agent ``agent`` (see the module docstring); one line if none."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{where}: {path} does not exist: give a run folder or a model folder")
    if (folder / "config.json").is_file() or (folder / ADAPTER_CONFIG).is_file():
        return folder
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"{where}: frozen_checkpoint must be one of {', '.join(CHECKPOINTS)}, got {checkpoint!r}")
    saved = folder / "checkpoints" / checkpoint
    if (saved / agent).is_dir():
        return saved / agent
    if saved.is_dir():
        found = sorted(item.name for item in saved.iterdir() if item.is_dir() and not item.name.startswith("."))
        raise ConfigError(f"{where}: the run {path} saved no agent {agent} in checkpoints/{checkpoint}/ (it has: {', '.join(found) or 'none'})")
    raise ConfigError(
        f"{where}: {path} is neither a model folder (config.json, or adapter_config.json) nor a run folder with "
        f"checkpoints/{checkpoint}/{agent}/"
    )


def merged_folder(folder: Path, base: Path, cache_dir: str | Path, checksum: str) -> Path:
    """The adapter folder ``folder`` merged into ``base``, written once under ``cache_dir/frozen/`` (a standalone model folder).

    The run in progress records the folder (:func:`nip_like.cache_record.record`, kind ``frozen merge``).
    """
    from nip_like.lm.agent_folders import write_standalone

    target = Path(cache_dir).expanduser() / "frozen" / checksum[:16]
    built = not (target / "config.json").is_file()
    if built:
        staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        write_standalone(folder, staging, base)
        if not (target / "config.json").is_file():  # another process may have written it meanwhile
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    cache_record.record("frozen merge", checksum, target, built=built)
    return target


def resolve(path: str, agent: str, cache_dir: str | Path, checkpoint: str = "last", where: str = "frozen_from") -> tuple[Path, FrozenSource]:
    """The standalone model folder a frozen agent plays from, and its :class:`FrozenSource`.

    Parameters
    ----------
    path : str
        ``frozen_from``: a run folder or a model (or agent) folder.
    agent : str
        The agent's name (the run's agent of that name is read).
    cache_dir : str or Path
        Where an adapter folder is merged into its base (once).
    checkpoint : str
        The run's checkpoint: last or best.
    where : str
        The config path, for messages.
    """
    folder = agent_folder(path, agent, checkpoint, where)
    base = checked_agent_folder(folder, where)  # files that differ from their checksums.json are refused before anything is read
    outside = base is not None and folder.resolve() not in base.resolve().parents  # a base/ inside is hashed with the folder
    checksum = cache_record.folder_checksum(folder, *([base] if outside else []))
    standalone = folder if base is None else merged_folder(folder, base, cache_dir, checksum)
    return standalone, FrozenSource(source=str(path), folder=str(folder.resolve()), checksum=checksum)


def check_sources(saved: Mapping[str, Any], current: Mapping[str, FrozenSource]) -> None:
    """Refuse, in one line, a resume whose frozen agents do not come from the files the checkpoint recorded.

    Parameters
    ----------
    saved : mapping of str to dict
        The checkpoint's record: agent -> :class:`FrozenSource` fields.
    current : mapping of str to FrozenSource
        The frozen agents of the run being resumed.
    """
    if set(saved) != set(current):
        raise CheckpointError(
            f"the checkpoint's frozen agents {sorted(saved)} are not this run's {sorted(current)}: resume with the same frozen_from settings"
        )
    for name, source in current.items():
        recorded = saved[name]
        if recorded["checksum"] != source.checksum:
            raise CheckpointError(
                f"agent {name} was loaded frozen from {recorded['folder']} (sha256 {recorded['checksum'][:12]}...), whose files "
                f"have changed since (now {source.checksum[:12]}... in {source.folder}): restore them, or start a new run"
            )


def source_record(sources: Mapping[str, FrozenSource]) -> dict[str, dict[str, str]]:
    """The checkpoint's record of the frozen agents' sources (plain dicts)."""
    return {name: asdict(source) for name, source in sources.items()}


def check_frozen_config(where: str, config: Any) -> None:
    """Refuse, in one line, a ``frozen_from`` agent config that asks for something a frozen agent cannot do."""
    from nip_like.lm.models import agent_option  # models.py reads ServedConfig from here

    get = lambda name: agent_option(config, name)  # noqa: E731
    if not get("frozen_from"):
        return
    if get("pretrained_path"):
        raise ConfigError(f"{where}.frozen_from and {where}.pretrained_path: give one of them (frozen_from reads the model it names)")
    if lora_enabled(get("lora")):
        raise ConfigError(f"{where}.frozen_from: a frozen agent trains nothing, so it takes no LoRA adapters: set {where}.lora.r=0")
    if get("share_base_with"):
        raise ConfigError(f"{where}.frozen_from and {where}.share_base_with do not go together: a frozen agent plays from its own folder")
