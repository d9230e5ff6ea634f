"""The prompts a conversation starts from: a file of strings, or a small generated default set, split in two.

``scenario.prompts_file`` is a JSON file holding a list of strings, or a
JSONL file with one JSON string per line. Without one, :func:`default_prompts`
generates everyday openings of a conversation. Either set is shuffled by
``scenario.data_seed`` and cut into a ``train`` split (training rollouts)
and a held-out ``test`` split (evaluation and the test), ``test_fraction``
of them at least one.
"""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path

import torch

from nip_like.errors import ConfigError

#: How a default prompt opens.
OPENINGS = (
    "I have been thinking about {topic}, and",
    "My neighbour keeps talking about {topic}, so",
    "Honestly, when it comes to {topic},",
    "Yesterday at work someone brought up {topic} and",
    "Can we talk about {topic}? I think",
)
#: What a default prompt is about.
TOPICS = ("football", "the weather", "my sister's cooking", "traffic in the city", "video games", "the new office", "politics", "online reviews")


def default_prompts() -> list[str]:
    """The generated default set: every opening with every topic (40 prompts)."""
    return [opening.format(topic=topic) for opening, topic in product(OPENINGS, TOPICS)]


def load_prompts(path: str | Path, where: str = "scenario.prompts_file") -> list[str]:
    """The prompts of a JSON list of strings or a JSONL file of strings; one line if the file is not that.

    Parameters
    ----------
    path : str or Path
        The file (``.jsonl``: one JSON string per line; otherwise one JSON list).
    where : str
        The config path, for messages.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where}: {path} does not exist: give a JSON list of strings or a JSONL file of strings")
    text = file.read_text(encoding="utf-8")
    try:
        if file.suffix == ".jsonl":
            prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            prompts = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: {path} is not valid JSON{' lines' if file.suffix == '.jsonl' else ''}: {error}") from None
    if not isinstance(prompts, list) or not all(isinstance(prompt, str) for prompt in prompts):
        raise ConfigError(f"{where}: {path} must hold a list of strings (JSON) or one string per line (JSONL)")
    if len(prompts) < 2:
        raise ConfigError(f"{where}: {path} holds {len(prompts)} prompt(s); a train and a test split need at least 2")
    return prompts


def split_prompts(prompts: list[str], test_fraction: float, seed: int) -> dict[str, list[str]]:
    """``{"train": [...], "test": [...]}``: the prompts shuffled by ``seed``, the test split ``test_fraction`` of them (at least one each)."""
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(int(seed))).tolist()
    test = min(max(1, round(len(prompts) * float(test_fraction))), len(prompts) - 1)
    shuffled = [prompts[index] for index in order]
    return {"train": shuffled[test:], "test": shuffled[:test]}
