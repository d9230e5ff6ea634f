"""Sphinx directives that draw the docs' lists of components from the package itself.

``.. registry-table:: protocol`` renders the registry table of a kind
(:mod:`nip_like.registry`): every built-in component's name, class, options
schema and summary. ``.. config-options:: trainer`` lists the options of a
config group (the YAML files under ``nip_like/configs/<group>/``) with the
first sentence of each file's leading comment. ``.. allowed-values::`` lists
what every schema field allows. No page writes such a list by
hand, so a new component appears in the docs when it is added.
"""

from __future__ import annotations

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
        from nip_like.config import ExperimentConfig
        from nip_like.registry import REGISTRIES

        sections = {"trainer": "trainer.objective", "protocol": "protocol", "scenario": "scenario"}
        schemas = [("", ExperimentConfig)]
        seen = {ExperimentConfig}
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
    return {"parallel_read_safe": True}
