"""Language-model agents on disk: ``save_pretrained`` folders plus a value head.

An agent's folder is what ``save_pretrained`` writes for the model
(``config.json``, ``generation_config.json``, ``model.safetensors``) and for
the tokenizer (``tokenizer.json``, ``tokenizer_config.json``), so plain
``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)`` and
``AutoTokenizer.from_pretrained(folder)`` reload it, plus the value head, if
any, in ``value_head.pt`` beside them, and ``checksums.json``, the size and
SHA-256 of each of those files (:func:`~nip_like.checkpoint.write_manifest`),
which :func:`checked_agent_folder` compares them with before they are read.
A LoRA agent's folder holds its adapters (``adapter_config.json``,
``adapter_model.safetensors``); its ``adapter_config.json`` names the base
they go on: the local folder the run started from, or the folder's own
``base/`` where the base is nowhere else (built from config, or fitted in a
warm start).
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Union

import torch
from safetensors import SafetensorError

from nip_like.checkpoint import check_manifest, load_checked, save_atomic, write_failed, write_manifest
from nip_like.errors import CheckpointError, ConfigError
from nip_like.lm.value import LMValueHead

if TYPE_CHECKING:  # transformers loads on first use: a run without language models never imports it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: The value head's file in an agent's folder.
VALUE_HEAD_FILE = "value_head.pt"
#: The file that marks an agent folder holding LoRA adapters only.
ADAPTER_CONFIG = "adapter_config.json"


def save_agent(
    folder: Union[str, Path],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    value_head: Optional[LMValueHead] = None,
    model_state: Optional[dict] = None,
    head_state: Optional[dict] = None,
    with_base: bool = False,
) -> Path:
    """Write a language-model agent to ``folder``, whole or not at all.

    Everything is first written to a hidden sibling folder, which then takes
    ``folder``'s place, so a crash mid-save leaves the previous agent (or the
    new one) complete under ``folder``.

    Parameters
    ----------
    folder : str or Path
        Created if missing; the agent's files in it are overwritten, and a
        value head file left by an earlier save is removed when
        ``value_head`` is None.
    model : PreTrainedModel
        The causal LM (``save_pretrained``).
    tokenizer : PreTrainedTokenizerBase
        Its tokenizer (``save_pretrained``).
    value_head : LMValueHead, optional
        Saved with :func:`~nip_like.checkpoint.save_atomic` as
        ``value_head.pt``: whether its body is shared, its width and its
        state dict (a separate body's weights included).
    model_state, head_state : dict, optional
        The weights to write instead of the modules' own state dicts (whole
        tensors of agents sharded with FSDP2, :mod:`nip_like.lm.sharding`).
    with_base : bool
        For a LoRA model whose base is no longer its folder's (adapters added
        after a warm start that fitted every weight): also write the base,
        without adapters, as a model folder ``base/`` (with the tokenizer),
        and name it in ``adapter_config.json`` by the path ``"base"``,
        relative to the agent folder (so it holds when the run is moved), so that
        ``PeftModel.from_pretrained`` over it, ``nip_like.export`` and
        ``frozen_from`` rebuild the agent. A LoRA model whose base has no
        local folder (built from config) gets its ``base/`` without being
        asked; a base folder given as a relative path is named by its
        absolute path.

    Returns
    -------
    Path
        The folder.

    Raises
    ------
    WriteError
        If the files cannot be written (a full disk, say), in one line; the
        previous folder is kept and the partial one removed.
    """
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        with quiet_progress():
            model.save_pretrained(staging, **({"state_dict": model_state} if model_state is not None else {}))
            tokenizer.save_pretrained(staging)
            if (staging / ADAPTER_CONFIG).is_file() and (with_base or not _names_local_base(staging)):
                _save_base(model, tokenizer, staging, folder, model_state)
        if value_head is not None:
            state = {
                "shared_body": value_head.shared_body,
                "hidden_size": value_head.linear.in_features,
                "state_dict": head_state if head_state is not None else value_head.state_dict(),
            }
            save_atomic(state, staging / VALUE_HEAD_FILE)
        write_manifest(staging)  # last: it lists every file above
    except (OSError, SafetensorError) as error:  # a full disk: safetensors reports it as its own error
        shutil.rmtree(staging, ignore_errors=True)
        raise write_failed(folder, error) from error
    # Swap the finished folder in: a crash leaves the old folder or the new one whole (and a
    # hidden leftover that the next save removes), never a half-written agent under its name.
    previous = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(previous, ignore_errors=True)
    if folder.exists():
        folder.rename(previous)
    staging.rename(folder)
    shutil.rmtree(previous, ignore_errors=True)
    return folder


#: The folder, inside an agent's folder, of the base its adapters were added to when it is not the start folder's.
BASE_FOLDER = "base"


def _names_local_base(staging: Path) -> bool:
    """Whether the adapter config in ``staging`` names an existing local base folder (then named by its absolute path)."""
    config_path = staging / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    base = config.get("base_model_name_or_path")
    if not base or base == BASE_FOLDER or not Path(base).expanduser().is_dir():
        # Built from config (peft writes None), a hub name, or the base/ beside the adapters of the agent folder
        # the model was read from: the base is written beside the adapters.
        return False
    absolute = str(Path(base).expanduser().resolve())
    if absolute != base:  # a relative path holds only from the folder the run started in
        config["base_model_name_or_path"] = absolute
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return True


def _save_base(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, staging: Path, folder: Path, model_state: Optional[dict]) -> None:
    """Write a LoRA model's base (its adapters left out) to ``staging/base`` and name it in its adapter config.

    The adapter config names it by the path ``"base"``, relative to the
    adapter folder, so that it still holds after the run folder is moved:
    :func:`adapter_base_folder` (and a user) joins it to the folder.
    """
    # The base's own names in the LoRA model's state (whole tensors of a sharded agent when given): no copy is made.
    state = model_state if model_state is not None else model.state_dict()
    prefix = "base_model.model."
    base_state = {
        key[len(prefix):].replace(".base_layer.", "."): value
        for key, value in state.items()
        if key.startswith(prefix) and "lora_" not in key
    }
    model.get_base_model().save_pretrained(staging / BASE_FOLDER, state_dict=base_state)
    tokenizer.save_pretrained(staging / BASE_FOLDER)
    write_manifest(staging / BASE_FOLDER)  # a model folder of its own: checked when it is loaded alone too
    config_path = staging / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_FOLDER
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def load_saved_base(model: PreTrainedModel, folder: Path) -> None:
    """Copy the base saved in agent folder ``folder`` (``base/``, :func:`_save_base`) into LoRA model ``model``'s base, in place.

    For a base fitted in a warm start, which a run's checkpoint file leaves
    out (its model folder holds it): ``python -m nip_like.evaluate`` skips
    the warm start and takes the base from here.

    Raises
    ------
    CheckpointError
        If the folder has no saved base, or it does not fit the model.
    """
    from safetensors.torch import load_file

    path = Path(folder) / BASE_FOLDER / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {BASE_FOLDER}/model.safetensors: the base its adapters were added to (fitted in the warm start) was not saved")
    saved = load_file(path)
    prefix = "base_model.model."
    loaded, missing = set(), []
    with torch.no_grad():
        for key, tensor in model.state_dict(keep_vars=True).items():
            if not key.startswith(prefix) or "lora_" in key:
                continue
            name = key[len(prefix):].replace(".base_layer.", ".")
            if name not in saved:
                missing.append((name, tensor))
                continue
            if saved[name].shape != tensor.shape:
                raise CheckpointError(f"{path} does not fit the agent: {name} has shape {tuple(saved[name].shape)}, not {tuple(tensor.shape)}")
            tensor.copy_(saved[name])
            loaded.add(tensor.data_ptr())
    untied = [name for name, tensor in missing if tensor.data_ptr() not in loaded]  # tied weights are saved once
    if untied:
        raise CheckpointError(f"{path} does not fit the agent: it has no {untied[0]}")


def adapter_base_folder(folder: Path) -> Optional[str]:
    """The base an adapter folder's adapters go on: its own ``base/`` if it has one, else the one its adapter config names.

    A config naming ``"base"`` (what :func:`save_agent` writes) means the
    folder's own ``base/``, wherever the folder now lies.
    """
    if (folder / BASE_FOLDER / "config.json").is_file():
        return str(folder / BASE_FOLDER)
    named = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return str(folder / BASE_FOLDER) if named == BASE_FOLDER else named


@contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' progress bars of saving and loading weights (one per agent, at every checkpoint)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_agent(
    folder: Union[str, Path],
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Optional[LMValueHead]]:
    """Read an agent written by :func:`save_agent` (or any local model folder).

    Parameters
    ----------
    folder : str or Path
        A local folder; nothing is downloaded.

    Returns
    -------
    model : PreTrainedModel
        The causal LM, float32, on the CPU.
    tokenizer : PreTrainedTokenizerBase
        Its tokenizer.
    value_head : LMValueHead or None
        The value head, None if the folder has no ``value_head.pt``.

    Raises
    ------
    ConfigError
        If ``folder`` is not an existing folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = local_model_folder(folder)
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer, load_value_head(folder, model)


def load_value_head(folder: Union[str, Path], model: PreTrainedModel) -> Optional[LMValueHead]:
    """Read ``value_head.pt`` from an agent's folder, None if there is none.

    Parameters
    ----------
    folder : str or Path
        The agent's folder.
    model : PreTrainedModel
        The agent's causal LM (a separate value body is built like its
        ``base_model`` before its weights are loaded).

    Returns
    -------
    LMValueHead or None

    Raises
    ------
    CheckpointError
        If the file cannot be read or does not fit the model.
    """
    path = Path(folder) / VALUE_HEAD_FILE
    if not path.is_file():
        return None
    state = load_checked(path, what="value head")  # a damaged file is refused in one line, never loaded
    try:
        head = LMValueHead.for_model(model, shared_body=state["shared_body"])
        head.load_state_dict(state["state_dict"])
    except Exception as error:  # noqa: BLE001 - any failure is one line for the user
        raise CheckpointError(f"cannot load the value head {path}: {type(error).__name__}: {error}") from error
    return head.to(next(model.parameters()).device)


def local_model_folder(path: Union[str, Path]) -> Path:
    """``path`` as a Path if it is an existing folder, else a one-line :class:`ConfigError`.

    Parameters
    ----------
    path : str or Path
        A model folder (``save_pretrained``); hub names are refused.

    Returns
    -------
    Path
    """
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"model folder {str(path)!r} is a file, not a folder: give the folder save_pretrained wrote")
    if not folder.is_dir():
        raise ConfigError(f"model folder {str(path)!r} does not exist: only local folders are read, nothing is downloaded")
    return folder


def adapter_base(folder: Path, where: str = "") -> Optional[Path]:
    """The local base folder of adapter folder ``folder`` (None for a whole model folder); one line if there is none.

    Parameters
    ----------
    folder : Path
        An agent or model folder.
    where : str
        The config field or command that named it, for the message.

    Raises
    ------
    ConfigError
        If ``folder`` holds adapters whose base is not a local folder (the
        folders of runs before nip_like saved a from-config base beside
        them: ``python -m nip_like.export`` rebuilds it from the run).
    """
    if not (folder / ADAPTER_CONFIG).is_file():
        return None
    base = adapter_base_folder(folder)
    if not base or not Path(base).expanduser().is_dir():
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{folder}/{ADAPTER_CONFIG} names base model {base!r}, which is not a local folder")
    return Path(base).expanduser()


def checked_agent_folder(folder: Path, where: str = "") -> Optional[Path]:
    """Compare an agent folder's files, then those of the base its adapters go on, with their ``checksums.json``; return that base.

    The folder's manifest is checked before any of its files is read (its
    ``base/``, if any, through it), then the base folder of its adapters.
    Folders without a manifest are accepted unchecked (see
    :func:`~nip_like.checkpoint.check_manifest`).

    Parameters
    ----------
    folder : Path
        The agent (or model) folder.
    where : str
        The config field or command that named it, for the messages.

    Returns
    -------
    Path or None
        The local base folder of an adapter folder (:func:`adapter_base`),
        None for a whole model folder.

    Raises
    ------
    CheckpointError
        If a file differs from its manifest, in one line naming it.
    ConfigError
        If the folder holds adapters whose base is not a local folder.
    """
    check_manifest(Path(folder), "agent folder")
    base = adapter_base(Path(folder), where)
    if base is not None:
        check_manifest(base, "base model folder")
    return base


def write_standalone(folder: Path, out: Path, base: Optional[Path] = None) -> Path:
    """Write agent folder ``folder`` to ``out`` as a folder that needs nothing else.

    An adapter folder (``adapter_config.json``) is merged into a copy of the
    base model's weights (``base``, else the local base folder of
    :func:`adapter_base`), with the agent's tokenizer and value head; any
    other folder is copied. The folder and the base are first checked
    against their manifests (:func:`checked_agent_folder`); nothing is
    written if either differs.

    Raises
    ------
    ConfigError
        If the base folder an adapter folder names is not a local folder.
    CheckpointError
        If a file differs from its folder's ``checksums.json``.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nip_like.dependency_warnings import dependency_warnings_once

    if base is None:
        base = checked_agent_folder(folder)
    else:
        check_manifest(folder, "agent folder")
        check_manifest(base, "base model folder")
    if base is None:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(folder, out)
        return out
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        with dependency_warnings_once():
            merged = PeftModel.from_pretrained(model, folder).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    value_head = load_value_head(folder, merged) if (folder / VALUE_HEAD_FILE).is_file() else None
    return save_agent(out, merged, tokenizer, value_head)
