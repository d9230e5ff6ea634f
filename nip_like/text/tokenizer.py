"""A character-level tokenizer with a chat template, for tiny local text models.

Text agents read and write chat messages: free text, not a scenario's symbols.
:func:`build_chat_tokenizer` makes a Hugging Face fast tokenizer with one
token per printable ASCII character (and newline), the special tokens a causal
LM needs, and role markers, plus a chat template, so that
``tokenizer.apply_chat_template(messages)`` works on a model built from config
exactly as on any chat model on disk. Nothing is downloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
#: Ends every chat message; generation stops at it (the tokenizer's ``eos_token``).
END_TOKEN = "<|end|>"
UNK_TOKEN = "<unk>"
#: The role markers, in the order of their ids after the four special tokens.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
#: Every character a message can hold: newline and printable ASCII.
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))

#: Jinja chat template: ``<bos>``, then ``<|role|>content<|end|>`` per message, then ``<|assistant|>``
#: when a reply is asked for. A model's reply is its text up to ``<|end|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Make the character-level chat tokenizer.

    Returns
    -------
    PreTrainedTokenizerFast
        Ids: ``<pad>`` 0, ``<bos>`` 1, ``<|end|>`` 2 (the eos token),
        ``<unk>`` 3, ``<|system|>`` 4, ``<|user|>`` 5, ``<|assistant|>`` 6,
        then newline and the printable ASCII characters. Characters outside
        that set encode to ``<unk>``. Left padding, ``chat_template`` set;
        it round-trips through ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    specials = (PAD_TOKEN, BOS_TOKEN, END_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
    vocab = {token: index for index, token in enumerate((*specials, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    from transformers import PreTrainedTokenizerFast  # loaded here: importing this module stays light

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=END_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
