"""The duplicates task: does a list of values hold two equal ones?

:mod:`~nip_like.scenarios.duplicates.data` generates and caches the lists,
:mod:`~nip_like.scenarios.duplicates.environment` plays the interactive proof
in tokens, :mod:`~nip_like.scenarios.duplicates.game` is the game without its
agents (data, roles, environment), and
:mod:`~nip_like.scenarios.duplicates.scenario` registers the ``duplicates``
scenario with language-model agents
(:mod:`~nip_like.scenarios.duplicates.lm_agents`) and the warm start's honest
play (:mod:`~nip_like.scenarios.duplicates.demonstrations`).
:mod:`~nip_like.scenarios.duplicates.chat_view` renders the game as chat for
those agents, and :mod:`~nip_like.scenarios.duplicates.chat` registers
``duplicates_chat``, the same game for text agents.
"""
