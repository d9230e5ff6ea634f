"""Adaptive stress testing of a language model (red teaming, as ASTRA-RL and ASTPrompter frame it).

A trained **auditor** talks with a frozen **target**; a **scorer** rates
what both say, and the auditor is rewarded for making the target say what
the scorer flags while its own utterances stay likely under the target.
:mod:`~nip_like.scenarios.stress_test.scenario` registers
``stress_test``; the game is in ``environment`` (the conversation, the tree,
the rewards of ``reward``), the target and its chats in ``target``, the
prompts in ``prompts`` and the scorers in ``scorers``. ``docs/stress_test.rst``
is the guide. This package imports none of its modules.
"""
