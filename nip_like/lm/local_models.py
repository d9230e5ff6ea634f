"""Model folders that look like a downloaded chat model, built offline.

Nothing can be downloaded where nip_like is tested, yet the chat view and LoRA
must be shown on what users bring: a local folder with ``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and a chat template, read back through
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
:func:`build_chat_model_folder` writes such a folder for three families:

* ``qwen2``: ``<|im_start|>role ... <|im_end|>`` turns; eos ``<|im_end|>``, pad ``<|endoftext|>``;
* ``llama``: Llama 3 headers and ``<|eot_id|>``; eos ``<|eot_id|>``, pad = eos;
* ``gpt2``: ``role: ...`` lines; eos ``<|endoftext|>``, pad = eos.

Each has a byte-level BPE tokenizer trained here with ``tokenizers`` on
generated English-like text, numbers and the duplicates game's words
(vocabulary in the thousands), and randomly initialised weights: a stand-in
for a pretrained model in shape, not in knowledge. ``scripts/build_lm_folder.py``
is the command-line front end; the tests use it through a fixture.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nip_like.errors import ConfigError
from nip_like.lm.agent_folders import quiet_progress

if TYPE_CHECKING:  # transformers loads on first use: runs without language models never import it
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class ChatFamily:
    """The special tokens and chat template of one model family."""

    bos: str | None
    eos: str
    pad: str
    extra_special: tuple[str, ...]
    template: str


_QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_GPT2_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

#: The families :func:`build_chat_model_folder` can build, by transformers model type.
FAMILIES: dict[str, ChatFamily] = {
    "qwen2": ChatFamily(None, "<|im_end|>", "<|endoftext|>", ("<|im_start|>",), _QWEN2_TEMPLATE),
    "llama": ChatFamily(
        "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>"), _LLAMA_TEMPLATE
    ),
    "gpt2": ChatFamily(None, "<|endoftext|>", "<|endoftext|>", (), _GPT2_TEMPLATE),
}

_WORDS = (
    "the a list of values cell cells holds two equal same different pair name names answer accept reject "
    "prover verifier says shows no yes is are not and or in at which does do two three four five because "
    "first second third look here there value number numbers see seen hidden open opened claim argue proof "
    "true false maybe think so then if every each one zero check checked game turn reply message question"
).split()


def training_lines(count: int, seed: int = 0) -> list[str]:
    """``count`` generated lines: word salad, number lists like the game's, and replies naming cells.

    Parameters
    ----------
    count : int
        Lines to make.
    seed : int
        The same seed gives the same lines.
    """
    rng = random.Random(seed)
    # Made-up words from syllables give BPE thousands of merges to learn, as natural text would.
    syllables = [onset + vowel for onset in ("", *"bcdfghklmnprstvwz", "ch", "sh", "th", "st", "tr") for vowel in
                 ("a", "e", "i", "o", "u", "ai", "ou", "ee", "an", "er", "in", "on")]
    words = list(_WORDS) + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    lines = []
    for index in range(count):
        kind = index % 3
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            cells = [str(rng.randrange(64)) if rng.random() < 0.6 else "?" for _ in range(rng.randint(4, 16))]
            lines.append("list: " + " ".join(cells))
        else:
            first, second = rng.randrange(32), rng.randrange(32)
            lines.append(rng.choice((f"{first} {second}", f"cells {first} and {second}", "accept", "reject")))
    return lines


def train_bpe_tokenizer(family: str, vocab_size: int = 2000, seed: int = 0, lines: int = 20000) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``family``'s special tokens and chat template, trained here.

    Parameters
    ----------
    family : str
        A key of :data:`FAMILIES`.
    vocab_size : int
        Target vocabulary (special tokens and the 256 byte symbols included).
    seed : int
        Seed of the training text.
    lines : int
        Lines of generated text to train on.

    Returns
    -------
    PreTrainedTokenizerFast
        With ``eos_token``, ``pad_token`` (and ``bos_token`` where the family
        has one) set, ``chat_template`` set, padding on the left.
    """
    spec = _family(family)
    specials = list(dict.fromkeys(token for token in (spec.bos, spec.eos, spec.pad, *spec.extra_special) if token))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_lines(lines, seed), trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=list(spec.extra_special) or None,
        padding_side="left",
    )
    tokenizer.chat_template = spec.template
    return tokenizer


def build_chat_model_folder(
    folder: str | Path,
    family: str = "qwen2",
    vocab_size: int = 2000,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    lines: int = 20000,
) -> Path:
    """Write a chat-model folder of ``family`` as a download of one would look.

    Parameters
    ----------
    folder : str or Path
        Where to write (created; existing files of the same names are
        overwritten).
    family : str
        ``qwen2``, ``llama`` or ``gpt2`` (see :data:`FAMILIES`).
    vocab_size : int
        Target vocabulary of the BPE tokenizer.
    hidden_size, num_layers, num_heads, intermediate_size : int
        Sizes of the transformer (GPT-2 takes ``n_embd``, ``n_layer``,
        ``n_head``, ``n_inner``).
    max_position_embeddings : int
        The model's context length.
    seed : int
        Seeds the tokenizer's training text and the weights.
    lines : int
        Lines of generated text the tokenizer trains on.

    Returns
    -------
    Path
        The folder.
    """
    spec = _family(family)
    tokenizer = train_bpe_tokenizer(family, vocab_size, seed, lines)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (("eos", spec.eos), ("pad", spec.pad))}
    bos_id = tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos else ids["eos"]
    if family == "gpt2":
        sizes = dict(n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_inner=intermediate_size,
                     n_positions=max_position_embeddings)
    else:
        sizes = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                     num_key_value_heads=num_heads, intermediate_size=intermediate_size,
                     max_position_embeddings=max_position_embeddings)
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), bos_token_id=bos_id, eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        tie_word_embeddings=True, **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _family(family: str) -> ChatFamily:
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[family]
