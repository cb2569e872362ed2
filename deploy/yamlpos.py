"""YAML loading that remembers where every key came from.

Validation errors must say `file:line: key: problem`, so the loader keeps the line of each
mapping key and list item next to the plain Python values.
"""
from __future__ import annotations

import yaml


class PosDict(dict):
    """A dict that knows the line of itself (`line`) and of each key (`lines[key]`)."""

    line: int = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lines: dict = {}

    def line_of(self, key) -> int:
        return self.lines.get(key, self.line)


class PosList(list):
    """A list that knows its own line and the line of each item (`lines[i]`)."""

    line: int = 0

    def __init__(self, *a):
        super().__init__(*a)
        self.lines: list[int] = []

    def line_of(self, i: int) -> int:
        return self.lines[i] if i < len(self.lines) else self.line


class YamlPosError(ValueError):
    def __init__(self, path: str, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line, self.message = path, line, message


def _loader_for(path: str):
    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        loader.flatten_mapping(node)
        out = PosDict()
        out.line = node.start_mark.line + 1
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in out:
                raise YamlPosError(path, line, f"{key}: duplicate key (first at line {out.lines[key]})")
            out[key] = loader.construct_object(value_node, deep=True)
            out.lines[key] = line
        return out

    def sequence(loader, node):
        out = PosList(loader.construct_object(n, deep=True) for n in node.value)
        out.line = node.start_mark.line + 1
        out.lines = [n.start_mark.line + 1 for n in node.value]
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, sequence)
    return Loader


def load_yaml(path: str, text: str | None = None):
    """Parse YAML from `path` (or `text`), returning PosDict/PosList trees; syntax errors carry file:line."""
    if text is None:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    try:
        return yaml.load(text, Loader=_loader_for(path))  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        raise YamlPosError(path, line, f"YAML syntax: {exc.problem or exc}") from None
