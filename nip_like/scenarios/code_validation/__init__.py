"""The code-validation task: is a Python program a correct solution of a programming problem?

:mod:`~nip_like.scenarios.code_validation.problems` is the family of small
programming problems (statement, signature, reference solution, hidden-test
inputs), :mod:`~nip_like.scenarios.code_validation.mutations` turns a
reference solution into buggy variants and rewrites every program's surface,
:mod:`~nip_like.scenarios.code_validation.sandbox` runs a program's hidden
tests in a separate, limited process, and
:mod:`~nip_like.scenarios.code_validation.data` builds, labels (by running
the tests), splits and caches the dataset, or reads one in the Buggy-APPS
layout. ``docs/code_validation_data.rst`` is the guide. This package
registers nothing and imports none of its modules.
"""
