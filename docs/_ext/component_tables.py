"""Sphinx directives that draw the docs' lists of components from the package itself.

``.. registry-table:: protocol`` renders the registry table of a kind
(:mod:`nip_like.registry`): every built-in component's name, class, options
schema and summary. ``.. config-options:: trainer`` lists the options of a
config group (the YAML files under ``nip_like/configs/<group>/``) with the
first sentence of each file's leading comment. ``.. allowed-values::`` lists
what every schema field allows. ``.. schema-options:: module.Schema`` is the
options table of one schema: each field's type, default, allowed values and
the one-line comment it is declared with. No page writes such a list by
hand, so a new component or option appears in the docs when it is added.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import tokenize
import typing

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList


def _reference(cls: type) -> str:
    return f":class:`~{cls.__module__}.{cls.__qualname__}`"


class _Table(Directive):
    required_arguments = 1

    def rows(self) -> list[tuple[str, ...]]:
        raise NotImplementedError

    header: tuple[str, ...] = ()

    def run(self) -> list[nodes.Node]:
        lines = [".. list-table::", "   :header-rows: 1", ""]
        for row in [self.header, *self.rows()]:
            lines.append(f"   * - {row[0]}")
            lines.extend(f"     - {cell}" for cell in row[1:])
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="component_tables"), self.content_offset, container)
        return container.children


class RegistryTable(_Table):
    """The built-in components of one registry kind (``trainer``, ``protocol``, ``scenario``)."""

    header = ("name", "class", "options", "what it is")

    def rows(self) -> list[tuple[str, ...]]:
        from nip_like.registry import REGISTRIES

        registry = REGISTRIES[self.arguments[0]]
        return [
            (f"``{entry.name}``", _reference(entry.cls), _reference(entry.schema) if entry.schema else "none", entry.summary)
            for entry in registry.entries()
            if entry.cls.__module__.startswith("nip_like.")
        ]


class ConfigOptions(_Table):
    """The options of one config group: its YAML files, each with the first line of its comment."""

    header = ("option", "what it is")

    def rows(self) -> list[tuple[str, ...]]:
        from nip_like.config import CONFIG_DIR

        rows = []
        for path in sorted((CONFIG_DIR / self.arguments[0]).glob("*.yaml")):
            if path.stem.startswith("_"):
                continue
            rows.append((f"``{path.stem}``", _first_sentence(path.read_text())))
        return rows


class AllowedValues(_Table):
    """What every field allows (``nip_like.allowed``): the global schema, then each registered component's."""

    required_arguments = 0
    header = ("field", "allowed", "schema")

    def rows(self) -> list[tuple[str, ...]]:
        from nip_like.allowed import allowed_values
        from nip_like.config import LOOP_SCHEMAS, ExperimentConfig
        from nip_like.registry import REGISTRIES

        sections = {"trainer": "trainer.objective", "protocol": "protocol", "scenario": "scenario"}
        schemas = [("", ExperimentConfig), *(("trainer.", schema) for schema in LOOP_SCHEMAS)]
        seen = {ExperimentConfig, *LOOP_SCHEMAS}
        for kind, registry in REGISTRIES.items():
            for entry in registry.entries():
                if entry.schema is not None and entry.schema not in seen and entry.cls.__module__.startswith("nip_like."):
                    seen.add(entry.schema)
                    schemas.append((f"{sections[kind]}.", entry.schema))
        return [
            (f"``{prefix}{name}``", allowed.replace("*", "\\*"), _reference(schema))
            for prefix, schema in schemas
            for name, allowed in allowed_values(schema)
        ]


def _field_comments(schema: type) -> dict[str, str]:
    """The one-line comment of each field of ``schema``, from the source of the class that declares it last."""
    comments: dict[str, str] = {}
    for cls in reversed([base for base in schema.__mro__ if dataclasses.is_dataclass(base)]):
        source = inspect.getsource(cls)
        lines = {}
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                lines[token.start[0]] = token.string.lstrip("#").strip()
        for number, line in enumerate(source.splitlines(), start=1):
            name, colon, _ = line.strip().partition(":")
            if colon and name.isidentifier() and line.startswith("    ") and not line.startswith("     "):
                comments[name] = lines.get(number, "")
    return comments


def _type_name(hint: object) -> str:
    """A field's type as the tables write it: ``int``, ``list of float``, ``dict``, a schema's reference."""
    if dataclasses.is_dataclass(hint):
        return _reference(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args and args[0] is not typing.Any else "list"
    if origin is dict:
        return "dict"
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        inner = [_type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> str:
    if dataclasses.is_dataclass(field.type) or (
        field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory)
    ):
        return "its own defaults"
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, bool) or value is None:
        return f"``{str(value).lower() if value is not None else 'null'}``"
    if isinstance(value, dict) and any(len(str(item)) > 30 for item in value.values()):
        return "see the schema"
    return f"``{value!r}``" if isinstance(value, (dict, list, tuple)) else f"``{value}``"


class SchemaOptions(_Table):
    """The options of one schema (a dotted path): field, type, default, what it allows, its comment."""

    header = ("field", "type", "default", "allowed", "meaning")

    def rows(self) -> list[tuple[str, ...]]:
        from nip_like.allowed import allowed_of

        module, _, name = self.arguments[0].rpartition(".")
        schema = getattr(importlib.import_module(module), name)
        hints = typing.get_type_hints(schema)
        comments = _field_comments(schema)
        rows = []
        for field in dataclasses.fields(schema):
            allowed = allowed_of(field)
            description = allowed.describe().replace("*", "\\*") if allowed is not None else ""
            comment = comments.get(field.name, "").replace("*", "\\*")
            rows.append((f"``{field.name}``", _type_name(hints[field.name]), _default(field), description, comment))
        return rows


def _first_sentence(text: str) -> str:
    """The first sentence of a YAML file's leading comment (it may wrap over several lines)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            lines.append(line.lstrip("# ").strip())
    comment = " ".join(lines)
    end = comment.find(". ")
    return comment[: end + 1] if end >= 0 else comment


def setup(app):
    app.add_directive("registry-table", RegistryTable)
    app.add_directive("config-options", ConfigOptions)
    app.add_directive("allowed-values", AllowedValues)
    app.add_directive("schema-options", SchemaOptions)
    return {"parallel_read_safe": True}
