"""The files a user hands the CLI (a job spec, a sweep): YAML or JSON, read into a mapping, and a mistake in one
is a single line naming the file, the line and the column, never a parser's traceback."""

from __future__ import annotations

import json
from pathlib import Path


class BadFile(ValueError):
    """A file the CLI cannot use; its message is the one line the user reads (`FILE:LINE:COLUMN: why`)."""


def read_mapping(path: str | Path, what: str = "job spec") -> dict:
    """The file's mapping: YAML for .yaml/.yml, JSON otherwise."""
    path = Path(path)
    text = path.read_text()
    data = read_yaml(path, text) if path.suffix in (".yaml", ".yml") else read_json(path, text)
    if data is None:
        raise BadFile(f"{path}: the file is empty; a {what} is a mapping of its fields")
    if not isinstance(data, dict):
        raise BadFile(f"{path}: a {what} is a mapping of its fields (name: ..., resources: ...); this file holds "
                      f"a {type(data).__name__}")
    return data


def read_yaml(path: Path, text: str):
    import yaml  # here: a client command that reads no file does without it (start-up time)

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = exc.context
        if context and exc.context_mark is not None and exc.context_mark is not mark:  # where the unclosed thing began
            context += f" (from line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
        problem = ", ".join(p for p in (context, exc.problem) if p)  # "while parsing a flow sequence ..., expected ..."
        raise BadFile(f"{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise BadFile(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None


def read_json(path: Path, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (a .yaml or .yml file is read as YAML)" if path.suffix != ".json" else ""
        raise BadFile(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}{hint}") from None
