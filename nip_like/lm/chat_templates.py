"""Chat templates that nip_like knows by name, and the choice of one for an agent.

A base model (Gemma 3 270M as its GGUF file ships, a model trained without
chat data) has no chat template, and an instruction-tuned model's own template
may not fit a game (one that refuses a system message, say). An agent's
``chat_template`` option names the template its tokenizer renders chats with:

* a family name: ``chatml`` (Qwen, many fine-tunes: ``<|im_start|>role`` ...
  ``<|im_end|>``), ``llama3`` (``<|start_header_id|>role<|end_header_id|>`` ...
  ``<|eot_id|>``), ``gemma`` (``<start_of_turn>user`` / ``model`` ...
  ``<end_of_turn>``; a system message is put at the start of the first user
  turn, as Gemma's own template does), ``plain`` (``role: text`` lines, for
  any tokenizer: the turn ends with the tokenizer's eos);
* or the path of a Jinja file (``.jinja``), used as it is.

Each family also says which text ends a turn (:attr:`ChatTemplate.turn_end`).
Where the tokenizer holds that text as one token, the agent's messages end
with it: it becomes the tokenizer's eos (:func:`apply_chat_template`), so
sampling stops there and the reply span ends with it, as with a chat model's
own folder. Otherwise it becomes a stop string of the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from nip_like.errors import ConfigError

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatTemplate", "TEMPLATES", "apply_chat_template", "resolve_chat_template"]


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the text that ends each turn in it.

    Parameters
    ----------
    name : str
        The family name, or the Jinja file's path.
    text : str
        The Jinja source (``messages``, ``add_generation_prompt``,
        ``bos_token`` and ``eos_token`` are defined when it renders).
    turn_end : str or None
        The text that closes a turn (and so a reply); None when it is the
        tokenizer's own eos.
    """

    name: str
    text: str
    turn_end: Optional[str]


_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Gemma has two roles, user and model; a system message opens the first user turn.
_GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if ns.system %}{{ '<start_of_turn>user\n' + ns.system | trim + '<end_of_turn>\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_PLAIN = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

#: The templates known by family name.
TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate("chatml", _CHATML, "<|im_end|>"),
    "llama3": ChatTemplate("llama3", _LLAMA3, "<|eot_id|>"),
    "gemma": ChatTemplate("gemma", _GEMMA, "<end_of_turn>"),
    "plain": ChatTemplate("plain", _PLAIN, None),
}


def resolve_chat_template(choice: str, field_name: str = "chat_template") -> ChatTemplate:
    """The template an agent's ``chat_template`` option names: a family or a Jinja file.

    Parameters
    ----------
    choice : str
        A key of :data:`TEMPLATES`, or the path of a readable text file.
    field_name : str
        The config field, for the message.

    Raises
    ------
    ConfigError
        For a name that is neither a family nor an existing file, or a file
        that is empty, not UTF-8 or not a Jinja template.
    """
    if choice in TEMPLATES:
        return TEMPLATES[choice]
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"{field_name}={choice!r} is neither a known chat template ({', '.join(TEMPLATES)}) nor an existing Jinja file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{field_name}: {path} cannot be read as UTF-8 text ({type(error).__name__})") from None
    if not text.strip():
        raise ConfigError(f"{field_name}: {path} is empty; a chat template is a Jinja text over 'messages'")
    try:
        from jinja2 import Environment, TemplateSyntaxError

        Environment().parse(text)
    except TemplateSyntaxError as error:
        raise ConfigError(f"{field_name}: {path} is not a Jinja template (line {error.lineno}: {error.message})") from None
    return ChatTemplate(str(path), text, None)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, template: ChatTemplate) -> list[str]:
    """Give ``tokenizer`` the template, in place; the stop strings the agent then needs.

    When the template's turn end is one token of the tokenizer, that token
    becomes its eos (a reply ends where the template closes a turn, and the
    model's old eos is no longer a reply's end). Otherwise the turn end, if
    any, is returned as a stop string.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The agent's tokenizer.
    template : ChatTemplate
        The chosen template.

    Returns
    -------
    list of str
        Stop strings to add to the agent's (empty when none are needed).
    """
    tokenizer.chat_template = template.text
    if template.turn_end is None:
        return []
    ids = tokenizer.encode(template.turn_end, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == template.turn_end:
        tokenizer.eos_token = template.turn_end
        return []
    return [template.turn_end]

