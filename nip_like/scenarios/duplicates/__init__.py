"""The duplicates task: does a list of values hold two equal ones?

:mod:`~nip_like.scenarios.duplicates.data` generates and caches the lists,
:mod:`~nip_like.scenarios.duplicates.environment` plays the interactive proof
in tokens, and :mod:`~nip_like.scenarios.duplicates.scenario` registers the
``duplicates`` scenario with language-model agents.
"""
