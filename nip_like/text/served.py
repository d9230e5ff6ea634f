"""Frozen co-players played by an OpenAI-compatible chat server: the player, its checks, and an LM agent's served turn.

A ``served`` entry (:class:`~nip_like.lm.served_config.ServedConfig`) names the
server. :func:`served_player` is its client (a
:class:`~nip_like.text.remote.OpenAIChatModel`), :func:`check_served` and
:func:`check_served_agent` the preflight's checks, and :class:`ServedAgent`
plays an LM agent's turns through it (the agent's chat read back from its
prompt tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from nip_like.errors import ConfigError, ModelServerError
from nip_like.lm.lora import lora_enabled

if TYPE_CHECKING:
    import re

    import torch

__all__ = ["ServedAgent", "check_served", "check_served_agent", "served_player"]


def served_player(served: Any, where: str):
    """The chat client of a served co-player (``served``: its :class:`~nip_like.lm.served_config.ServedConfig` entry at config path ``where``).

    Returns
    -------
    OpenAIChatModel
        A :class:`~nip_like.text.interface.TextModel`: ``reply(chats, sampling, seed)``
        answers each chat with the server's text.

    Raises
    ------
    ConfigError
        ``base_url`` or ``model`` missing, or the URL not ``http(s)://host``, in one line naming ``where``.
    """
    from nip_like.openai_client import check_base_url
    from nip_like.text.remote import OpenAIChatModel

    for name in ("base_url", "model"):
        if not getattr(served, name, None):
            raise ConfigError(f"{where}.{name} is missing: a served co-player needs the server's base_url and model")
    check_base_url(str(served.base_url), f"{where}.base_url")
    return OpenAIChatModel.from_config(served, default_model=str(served.model))


def check_served(served: Any, where: str) -> None:
    """Refuse, in one line, a served co-player whose server does not answer ``GET /models`` (after its retries)."""
    from nip_like.text.remote import check_text_model_server

    served_player(served, where).close()  # base_url and model given, the URL well-formed
    check_text_model_server(served, where)


def listed_models(served: Any, where: str) -> Optional[list[str]]:
    """The models the server of ``served`` lists (``GET /models``), with the client's retries; None if it lists none (404, 405).

    Raises
    ------
    ModelServerError
        The server does not answer, after its retries, in one line naming ``where``.
    """
    import openai

    player = served_player(served, where)

    def ask() -> Optional[list[str]]:
        try:
            return [str(model.id) for model in player.client.models.list()]
        except openai.APIStatusError as error:
            if error.status_code in (404, 405):  # a server without a model list
                return None
            raise

    try:
        return player.map(lambda _, failed: player.with_retries(ask, "GET /models", failed), [None])[0]
    except ModelServerError as error:
        raise ModelServerError(f"{where}: {error}") from None
    finally:
        player.close()


def check_served_agent(where: str, config: Any, chat_view: bool) -> None:
    """Refuse, in one line, a language-model agent whose ``served`` entry cannot play (see :class:`ServedAgent`).

    A served agent plays in the chat view, is a frozen co-player
    (``frozen_from``: the folder whose tokenizer and chat template read its
    chat and its replies), takes no LoRA, no value head and no inference-server
    sampler, and its server answers and lists its model (a server without a
    model list passes on its answer alone).

    Parameters
    ----------
    where : str
        The agent's config path (``scenario.agents.verifier``).
    config : LMAgentConfig
        The agent's config.
    chat_view : bool
        Whether the scenario's agents play in the chat view.
    """
    from nip_like.lm.models import agent_option

    served = agent_option(config, "served")
    if served is None:
        return
    get = lambda name: agent_option(config, name)  # noqa: E731
    if not chat_view:
        raise ConfigError(f"{where}.served: a served agent plays in the chat view only (scenario.view=chat): its server reads chats, not the game's tokens")
    if not get("frozen_from"):
        raise ConfigError(
            f"{where}.served: a served agent is a frozen co-player: set {where}.frozen_from to the model folder whose tokenizer "
            f"and chat template read its chat and its replies"
        )
    if lora_enabled(get("lora")):
        raise ConfigError(f"{where}.served: a served agent trains nothing, so it takes no LoRA adapters: set {where}.lora.r=0")
    if get("value_head"):
        raise ConfigError(f"{where}.served: a served agent has no value head (its server gives none): leave {where}.value_head null")
    if str(agent_option(get("sampler"), "kind", "local")) != "local":
        raise ConfigError(f"{where}.served and {where}.sampler.kind={agent_option(get('sampler'), 'kind')}: its server samples its messages, give one of them")
    check_served(served, f"{where}.served")
    models = listed_models(served, f"{where}.served")
    if models is not None and str(served.model) not in models:
        raise ConfigError(
            f"{where}.served.model: the server {served.base_url} serves no model {served.model!r} (it lists: {', '.join(models[:8]) or 'none'})"
        )


#: Stand-ins for the system and user messages' contents in a chat template's text (private-use characters).
_SYSTEM_SLOT, _USER_SLOT = "\ue010", "\ue011"


def chat_patterns(tokenizer: Any) -> list[tuple[tuple[str, ...], "re.Pattern[str]"]]:
    """How ``tokenizer``'s chat template writes a system and a user message, or a user message alone, as patterns.

    Each entry: the roles, and a regular expression that matches the
    template's text (with the generation prompt) of exactly such a chat and
    captures the messages' contents. A template that refuses the layout, or
    writes a content other than as given, has no entry for it.
    """
    import re

    patterns = []
    for roles in (("system", "user"), ("user",)):
        slots = (_SYSTEM_SLOT, _USER_SLOT)[-len(roles):]
        try:
            text = tokenizer.apply_chat_template(
                [{"role": role, "content": slot} for role, slot in zip(roles, slots)], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 - a template that raises for a layout (no system role) offers the other one
            continue
        pieces = re.split(f"({_SYSTEM_SLOT}|{_USER_SLOT})", text)
        if pieces[1::2] != list(slots):  # each content written once, as given, in order
            continue
        groups = {_SYSTEM_SLOT: "(.*?)", _USER_SLOT: "(.*)"}
        expression = "".join(re.escape(piece) if index % 2 == 0 else groups[piece] for index, piece in enumerate(pieces))
        patterns.append((roles, re.compile(expression, re.DOTALL)))
    return patterns


class ServedAgent:
    """A frozen language-model agent whose messages an OpenAI-compatible chat server writes (``served`` on its config).

    The chat view renders each agent's prompt as its tokenizer's chat
    template over a system message and a user message
    (:class:`~nip_like.scenarios.chat_prompts.ChatSpeaker`). For each row
    where the agent acts, the prompt's tokens are decoded and read back into
    those messages (:func:`chat_patterns`), which go to the server as one
    chat-completions request (:class:`~nip_like.text.remote.OpenAIChatModel`:
    ``max_concurrency`` in flight, retries, timeout, stop requests). The
    answer's text, encoded by the agent's tokenizer with its eos appended
    and cut to ``max_new_tokens``, is the agent's message, which the game
    parses as a local agent's. Its log-probabilities and entropies are 0:
    the agent never trains, and the actor leaves its messages out of every
    scoring pass and loss (:meth:`~nip_like.lm.actor_critic.LMActor.score_actions`).

    Parameters
    ----------
    served : ServedConfig
        The server.
    where : str
        The ``served`` entry's config path, for messages.
    tokenizer : PreTrainedTokenizerBase
        The agent's tokenizer, with its chat template.
    max_new_tokens : int
        The longest message, in the agent's tokens, eos included.
    temperature, top_p : float
        The agent's sampling settings, sent with each request (temperature 0 when the actor samples greedily).
    """

    def __init__(self, served: Any, where: str, tokenizer: Any, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"{where}: the agent's tokenizer has no eos token to end the server's replies")
        self.served, self.where, self.tokenizer = served, where, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = int(max_new_tokens), float(temperature), float(top_p)
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.eos_id
        self.patterns = chat_patterns(tokenizer)
        if not self.patterns:
            raise ConfigError(f"{where}: the agent's chat template does not write a user message's content as given, so its prompts cannot be read back into a chat")
        self._player = None  # the client, opened on the first request

    def __deepcopy__(self, memo: dict) -> "ServedAgent":
        return self  # a copy of the actor (a moving reference) plays with the same server

    def chat(self, ids: Sequence[int]) -> list[dict[str, str]]:
        """The messages that the prompt ``ids`` (its real tokens) renders; one line if it is no chat of the agent's template."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for roles, pattern in self.patterns:
            found = pattern.fullmatch(text)
            if found is not None:
                return [{"role": role, "content": content} for role, content in zip(roles, found.groups())]
        raise ModelServerError(
            f"{self.where}: a prompt of the agent is not its chat template over a system and a user message, so it cannot be "
            f"sent as a chat (it begins {text[:60]!r})"
        )

    def sample(self, prompt_ids: "torch.Tensor", prompt_mask: "torch.Tensor", greedy: bool = False) -> dict[str, "torch.Tensor"]:
        """The server's messages for the prompts ``(B, P)`` (left-padded; ``prompt_mask`` their real tokens).

        Returns
        -------
        dict
            ``tokens`` and ``token_mask`` ``(B, max_new_tokens)`` (the reply's
            tokens and eos, pad after), ``token_log_probs`` and
            ``token_entropy`` (zeros).
        """
        import torch

        from nip_like.text.interface import Sampling

        rows = [row[mask].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        chats = [self.chat(row) for row in rows]
        sampling = Sampling(self.max_new_tokens, 0.0 if greedy else self.temperature, self.top_p)
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # the global generator, as local sampling: a resumed run asks alike
        if self._player is None:
            self._player = served_player(self.served, self.where)
        try:
            texts = self._player.reply(chats, sampling, seed)
        except ModelServerError as error:
            raise ModelServerError(f"{self.where}: {error}") from None
        encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        tokens = torch.full((len(rows), self.max_new_tokens), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), self.max_new_tokens), dtype=torch.bool)
        for row, ids in enumerate(encoded):
            reply = [*ids, self.eos_id][: self.max_new_tokens]
            tokens[row, : len(reply)] = torch.tensor(reply, dtype=torch.long)
            mask[row, : len(reply)] = True
        device = prompt_ids.device
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        return {"tokens": tokens.to(device), "token_mask": mask.to(device), "token_log_probs": zeros, "token_entropy": zeros.clone()}

    def close(self) -> None:
        """Close the client (a later request opens it again)."""
        if self._player is not None:
            self._player.close()
            self._player = None
