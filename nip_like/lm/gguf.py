"""GGUF files (llama.cpp, Ollama) as model sources: checked, dequantized once, cached as a model folder.

A ``pretrained_path`` (an LM agent's, a text model's ``path``, a frozen
co-player's ``frozen_from``) may name a ``.gguf`` file. :func:`check_gguf`
reads its header and tensor table (memory-mapped, no weights are read) and
refuses in one line what cannot work: a missing ``gguf`` package, a file that
is not GGUF, a truncated one, an architecture transformers cannot read from
GGUF or that is not a causal language model. :func:`converted_folder` then
dequantizes it once through transformers
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, float32)
and writes an ordinary ``save_pretrained`` folder (model, tokenizer, a
``checksums.json`` manifest and ``gguf_source.json``) under the cache, keyed
by the file's SHA-256: ``$NIP_LIKE_GGUF_CACHE`` or ``~/.cache/nip_like/gguf``,
one ``<sha256[:16]>`` folder per file (``<run folder>/cache/gguf`` for a run
with ``run.fresh_cache``, :mod:`nip_like.cache_record`, which also records
each folder a run converts or reads). Every later run (and every process of
this one) checks that folder against its manifest and reads it; a damaged
entry is written again. Processes that convert the same file at once wait for
each other (a lock file), so the work is done once.

transformers keeps a GGUF-loaded model marked as quantized and refuses to
``save_pretrained`` it; the conversion copies its (dequantized) weights into a
plain model of the same config, which saves as any other.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from nip_like import cache_record
from nip_like.checkpoint import check_manifest, file_sha256, write_manifest, write_text_atomic
from nip_like.errors import CheckpointError, ConfigError
from nip_like.lm.gguf_header import HeaderError, read_header

__all__ = ["GgufInfo", "cache_root", "check_gguf", "converted_folder", "is_gguf"]

log = logging.getLogger(__name__)

#: Environment variable that moves the cache of converted folders.
CACHE_ENV = "NIP_LIKE_GGUF_CACHE"
#: The cache of converted folders when the variable is unset.
DEFAULT_CACHE = "~/.cache/nip_like/gguf"
#: What a converted folder records about its source.
SOURCE_FILE = "gguf_source.json"
#: The cache's index of file digests (path, size and modification time -> SHA-256).
DIGESTS_FILE = "digests.json"
#: GGUF architectures transformers reads that are not decoder-only language models.
NOT_CAUSAL = ("t5", "t5encoder", "bert", "nomic-bert")


@dataclass(frozen=True)
class GgufInfo:
    """What :func:`check_gguf` found in a GGUF file.

    Attributes
    ----------
    path : Path
        The file, resolved.
    architecture : str
        Its ``general.architecture`` (``gemma3``, ``llama``, ``qwen2``, ...).
    name : str or None
        Its ``general.name``, if it has one.
    size : int
        Bytes.
    sha256 : str
        The file's SHA-256 (the cache key).
    """

    path: Path
    architecture: str
    name: Optional[str]
    size: int
    sha256: str


def is_gguf(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix; the file is checked by :func:`check_gguf`)."""
    return path is not None and str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted folders live: ``$NIP_LIKE_GGUF_CACHE``, else ``~/.cache/nip_like/gguf``; ``<run folder>/cache/gguf`` in a run with ``run.fresh_cache``."""
    return cache_record.fresh_folder("gguf", Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser())


_checked: dict[tuple[str, int, int], GgufInfo] = {}


def check_gguf(path: str | os.PathLike, field_name: str = "pretrained_path") -> GgufInfo:
    """Check a GGUF file without reading its weights; a one-line :class:`ConfigError` for what cannot load.

    A file already found whole is not read again in this process while its
    size and modification time stay the same.

    Parameters
    ----------
    path : str or PathLike
        The ``.gguf`` file.
    field_name : str
        The config field that named it, for the messages.

    Returns
    -------
    GgufInfo

    Raises
    ------
    ConfigError
        If the file is missing, the ``gguf`` package is not installed, the
        file is not GGUF, is truncated, or holds an architecture that
        transformers cannot read from GGUF or that is not a causal LM.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        what = "a folder, not a file" if file.is_dir() else "not an existing file"
        raise ConfigError(f"{field_name}: {str(path)!r} is {what}; a GGUF model source is one .gguf file")
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _checked:
        return _checked[key]
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"{field_name}: {file} is a GGUF file, and reading one needs the gguf package: pip install 'gguf>=0.10' "
            f"(or the nip_like[gguf] extra)"
        )
    try:
        header = read_header(file)
    except HeaderError as error:
        raise ConfigError(f"{field_name}: {file} is not a readable GGUF file: {error}") from None
    if not header.tensors:
        raise ConfigError(f"{field_name}: {file} holds no tensors, so it holds no model")
    if header.data_end > stat.st_size:
        raise ConfigError(
            f"{field_name}: {file} is truncated: its tensors need {header.data_end} bytes, the file holds {stat.st_size}; "
            f"copy or assemble it again"
        )
    architecture = header.metadata.get("general.architecture")
    if not architecture:
        raise ConfigError(f"{field_name}: {file} names no architecture (general.architecture), so it cannot be loaded")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    import transformers

    if architecture in NOT_CAUSAL:
        raise ConfigError(
            f"{field_name}: {file} holds a {architecture} model, not a causal language model: agents need a "
            f"decoder-only model (gemma3, llama, qwen2, ...)"
        )
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        known = ", ".join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in NOT_CAUSAL))
        raise ConfigError(
            f"{field_name}: {file} holds architecture {architecture!r}, which transformers {transformers.__version__} "
            f"cannot read from GGUF (it reads: {known}); convert it to a save_pretrained folder another way"
        )
    info = GgufInfo(file.resolve(), architecture, header.metadata.get("general.name"), stat.st_size, _digest(file, stat))
    _checked[key] = info
    return info


def _digest(file: Path, stat: os.stat_result) -> str:
    """The SHA-256 of ``file``, read from the cache's index while the file keeps its path, size and modification time."""
    index = cache_root() / DIGESTS_FILE
    key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    digest = file_sha256(file)
    known[key] = digest
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json.dumps(known, indent=1, sort_keys=True) + "\n", index)
    except Exception:  # noqa: BLE001 - an index that cannot be written only costs a hash next time
        log.debug("could not write %s", index)
    return digest


def converted_folder(path: str | os.PathLike, field_name: str = "pretrained_path") -> Path:
    """The model folder a GGUF file converts to: read from the cache, or converted once and cached.

    Parameters
    ----------
    path : str or PathLike
        The ``.gguf`` file (checked by :func:`check_gguf` first).
    field_name : str
        The config field that named it, for the messages.

    Returns
    -------
    Path
        A ``save_pretrained`` folder: ``config.json``, ``model.safetensors``,
        the tokenizer's files, ``generation_config.json``,
        ``gguf_source.json`` and ``checksums.json``.
    """
    info = check_gguf(path, field_name)
    root = cache_root()
    target = root / info.sha256[:16]
    if _whole(target, info):
        cache_record.record("gguf conversion", info.sha256, target, built=False)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if _whole(target, info):  # converted by another process while this one waited
            cache_record.record("gguf conversion", info.sha256, target, built=False)
            return target
        log.info("converting %s (%s, %.0f MB) into a model folder at %s: once, then cached", info.path, info.architecture, info.size / 2**20, target)
        started = time.monotonic()
        staging = root / f".{target.name}.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _convert(info, staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("converted %s in %.0f s", info.path.name, time.monotonic() - started)
    cache_record.record("gguf conversion", info.sha256, target, built=True)
    return target


def _whole(target: Path, info: GgufInfo) -> bool:
    """Whether ``target`` is a finished conversion of ``info``'s file whose files match their manifest."""
    source = target / SOURCE_FILE
    if not source.is_file():
        return False
    try:
        if json.loads(source.read_text(encoding="utf-8")).get("sha256") != info.sha256:
            return False
        return check_manifest(target, "converted GGUF model folder")
    except (CheckpointError, ValueError, OSError) as error:
        log.warning("the cached conversion %s is damaged (%s): converting %s again", target, error, info.path.name)
        return False


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """While it lasts, transformers' readers of a GGUF file are one reader, parsed once, over a plain array.

    transformers parses the file's metadata three times (config, tokenizer,
    weights), and ``gguf.GGUFReader`` parses it through a ``numpy.memmap``,
    whose every small slice pays the subclass's bookkeeping: for Gemma 3's
    262,144-token vocabulary that was 28 CPU-s a parse here, 84 s in all. A
    plain ``ndarray`` view of the same mapping parses in 11 s, once.
    """
    import gguf
    import numpy as np

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert(info: GgufInfo, folder: Path) -> None:
    """Dequantize ``info``'s file through transformers and save it, float32, as a plain model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nip_like.lm.agent_folders import quiet_progress

    where, name = str(info.path.parent), info.path.name
    try:
        with quiet_progress(), _one_reader_per_file():
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - transformers' own failure to read the file: one line
        raise ConfigError(
            f"transformers could not load {info.path} ({info.architecture}): {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from error
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    del loaded
    folder.mkdir(parents=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    record = {"gguf": info.path.name, "sha256": info.sha256, "architecture": info.architecture, "name": info.name}
    write_text_atomic(json.dumps(record, indent=2) + "\n", folder / SOURCE_FILE)
    write_manifest(folder)
