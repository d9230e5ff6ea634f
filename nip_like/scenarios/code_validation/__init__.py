"""The code-validation task: is a Python program a correct solution of a programming problem?

The data: :mod:`~nip_like.scenarios.code_validation.problems` is the family of
small programming problems (statement, signature, reference solution,
hidden-test inputs), written by task family in ``problems_lists``,
``problems_strings`` and ``problems_arithmetic`` over the machinery of
``templates``; :mod:`~nip_like.scenarios.code_validation.mutations` turns a
reference solution into buggy variants and rewrites every program's surface;
:mod:`~nip_like.scenarios.code_validation.sandbox` runs a program's hidden
tests in a separate, limited process (the child's side is ``harness``); and
:mod:`~nip_like.scenarios.code_validation.data` builds, labels (by running
the tests), splits and caches the dataset (its classes in ``dataset``), or
reads one in the Buggy-APPS layout (``buggy_apps``).
``docs/code_validation_data.rst`` is the guide.

The game: :mod:`~nip_like.scenarios.code_validation.scenario` registers
``code_validation``, played by the text trainers' text agents
(``text_agents``) and by the RL loop's language-model agents in the chat view
(``chat_view``), over the game of ``game`` and ``environment`` and the text
rules of ``chat_text``. ``docs/code_validation.rst`` is the guide. This
package imports none of its modules.
"""
