"""A model folder whose tokenizer renders a chosen chat template: what a text model fine-tuned by jobs starts from.

A text model (``trainer=expert_iteration``, ``trainer=malt``) is fine-tuned
in jobs that each load a folder and save the next: the template it plays
with must be in the folder itself. :func:`templated_folder` writes one into
the run (links to the source's weights, the tokenizer saved anew with the
template of :mod:`nip_like.lm.chat_templates`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nip_like.errors import ConfigError
from nip_like.lm.chat_templates import apply_chat_template, resolve_chat_template
from nip_like.lm.models import load_tokenizer

__all__ = ["templated_folder"]


#: Files of a model folder that hold its tokenizer (rewritten in a templated folder, never linked).
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
)


def templated_folder(source: Path, chat_template: str, target: Path, field_name: str = "path") -> Path:
    """A model folder at ``target``: ``source``'s files, with a tokenizer that renders ``chat_template``.

    The weights and config are symbolic links to ``source``'s (nothing is
    copied); the tokenizer is saved anew with the template (and, where the
    template's turn end is one token, that token as its eos). What a text
    model that is fine-tuned by jobs starts from: every later model is saved
    from it, template included. A ``target`` already written is kept (a
    resumed run).

    Raises
    ------
    ConfigError
        For an unknown template, or one whose turn end is not one token of the
        tokenizer (a text model's reply ends at its eos, so the turn end must be one).
    """
    if (target / "config.json").is_file():
        return target
    tokenizer = load_tokenizer(source, field_name)
    template = resolve_chat_template(chat_template, field_name.rpartition(".")[0] + ".chat_template" if "." in field_name else "chat_template")
    stops = apply_chat_template(tokenizer, template)
    if stops:
        raise ConfigError(
            f"{field_name}: chat template {template.name!r} ends turns with {stops[0]!r}, which is not one token of the "
            f"tokenizer in {source}: text models end a reply at their eos; choose a template whose turn end it has, or plain"
        )
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in Path(source).iterdir():
        if path.is_file() and path.name not in _TOKENIZER_FILES and path.name != "checksums.json":
            (staging / path.name).symlink_to(path.resolve())
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return target
