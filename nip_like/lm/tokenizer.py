"""Word-level tokenizers for a scenario's alphabet of symbols.

A message of a language-model agent is a sequence of symbols from the
scenario's alphabet, written as text with the symbols separated by
whitespace (``"a b 1"``). :func:`build_tokenizer` makes a Hugging Face fast
tokenizer with one token per symbol and the special tokens a causal LM
needs, with ids that depend only on the alphabet and its order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from nip_like.errors import ConfigError

if TYPE_CHECKING:  # transformers loads on first use: runs without language models never import it
    from transformers import PreTrainedTokenizerFast

#: Padding: fills prompts on the left and responses after their end; never sampled.
PAD_TOKEN = "<pad>"
#: Beginning of sequence: put in front of every encoded text; never sampled.
BOS_TOKEN = "<bos>"
#: End of sequence: a sampled ``<eos>`` ends the message.
EOS_TOKEN = "<eos>"
#: Unknown symbol: what a word outside the alphabet encodes to.
UNK_TOKEN = "<unk>"
#: The special tokens, in the order of their ids (0, 1, 2, 3); the alphabet follows.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def build_tokenizer(alphabet: Sequence[str]) -> PreTrainedTokenizerFast:
    """Make a word-level tokenizer with one token per symbol of ``alphabet``.

    Parameters
    ----------
    alphabet : sequence of str
        The symbols, each a non-empty string without whitespace, all
        different, none of them a special token.

    Returns
    -------
    PreTrainedTokenizerFast
        A tokenizer (``tokenizers`` ``WordLevel`` model, ``WhitespaceSplit``
        pre-tokenizer) whose ids are ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2,
        ``<unk>`` 3, then the symbols in the order given (the ``i``-th symbol
        has id ``4 + i``). ``pad_token``, ``bos_token``, ``eos_token`` and
        ``unk_token`` are set; encoding puts ``<bos>`` in front of the text
        (``add_special_tokens=False`` leaves it out) and pads on the left, as
        prompts of a causal LM are padded. It round-trips through
        ``save_pretrained`` / ``from_pretrained`` (or ``AutoTokenizer``) on a
        local folder.

    Raises
    ------
    ConfigError
        (a ``ValueError``) if the alphabet is empty, has a symbol twice, a
        symbol that is empty or contains whitespace, or a special token.
    """
    symbols = list(alphabet)
    if not symbols:
        raise ConfigError("the tokenizer's alphabet is empty: give at least one symbol")
    for symbol in symbols:
        if not isinstance(symbol, str) or not symbol or any(char.isspace() for char in symbol):
            raise ConfigError(f"alphabet symbol {symbol!r} is not a non-empty string without whitespace")
        if symbol in SPECIAL_TOKENS:
            raise ConfigError(f"alphabet symbol {symbol!r} is a special token; these are {', '.join(SPECIAL_TOKENS)}")
    duplicates = sorted({symbol for symbol in symbols if symbols.count(symbol) > 1})
    if duplicates:
        raise ConfigError(f"the alphabet has symbols more than once: {', '.join(map(repr, duplicates))}")

    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *symbols))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos = (BOS_TOKEN, vocab[BOS_TOKEN])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[bos]
    )
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )
