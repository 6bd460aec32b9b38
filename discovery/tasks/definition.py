"""What a task is: the :class:`Task` base class, its documented :class:`Option` values, and how task
options are read from the command line (``KEY=VALUE``) and from TOML files. Tasks render tokenizer-free
:class:`~discovery.tasks.base.Prompt` objects; :mod:`discovery.tasks.base` annotates them."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from discovery.errors import TaskError
from discovery.tasks.base import SCORING_MODES, Prompt, check_prompt

# ---------------------------------------------------------------------------------------------
# Tasks and their options
# ---------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


@dataclass(frozen=True)
class Option:
    """A documented task option: default, type, allowed range or values, help."""

    default: Any
    help: str
    kind: type = str
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    check: Callable[[Any], str | None] | None = None  # returns a problem or None

    def describe_range(self) -> str:
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.kind is bool:
            return "true or false"
        lo = "" if self.low is None else str(self.low)
        hi = "" if self.high is None else str(self.high)
        name = {int: "an integer", float: "a number"}.get(self.kind, "a string")
        if lo and hi:
            return f"{name} from {lo} to {hi}"
        if lo:
            return f"{name} >= {lo}"
        return name

    def parse(self, key: str, value: Any) -> Any:
        """Convert ``value`` (a string from the command line, or a TOML value) to this option's type."""
        bad = TaskError(
            f"bad value {value!r} for task option {key!r}: must be {self.describe_range()}",
            f"pass --task-option {key}=VALUE ({self.help.rstrip('.')})",
        )
        if value is None:
            return None
        try:
            if self.kind is bool:
                if isinstance(value, bool):
                    out: Any = value
                elif str(value).strip().lower() in _TRUE:
                    out = True
                elif str(value).strip().lower() in _FALSE:
                    out = False
                else:
                    raise bad
            elif self.kind is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise bad
                out = int(str(value).strip()) if isinstance(value, str) else int(value)
            elif self.kind is float:
                if isinstance(value, bool):
                    raise bad
                out = float(value)
            else:
                out = str(value).strip() if self.choices is not None else str(value)
        except (TypeError, ValueError):
            raise bad from None
        if self.choices is not None and out not in self.choices:
            raise bad
        if self.low is not None and out < self.low or self.high is not None and out > self.high:
            raise bad
        if self.check is not None:
            problem = self.check(out)
            if problem:
                raise TaskError(f"bad value {value!r} for task option {key!r}: {problem}")
        return out


COMMON_OPTIONS: dict[str, Option] = {
    "seed": Option(0, "random seed; the same seed gives the same prompts", int, low=0),
    "n": Option(None, "number of prompts (default 100 for a generator; for a file the first n rows, "
                "default 0 = all rows)", int, low=0),
}


class Task:
    """A named prompt source with resolved options; ``prompts()`` is deterministic for the seed."""

    name: str = ""
    description: str = ""
    OPTIONS: ClassVar[dict[str, Option]] = {}
    default_scoring: str = "next_token"
    accepts_file: bool = False

    def __init__(self, options: Mapping[str, Any] | None = None, path: str | None = None) -> None:
        if path is not None and not self.accepts_file:
            raise TaskError(
                f"task {self.name!r} does not read files (got {self.name}:{path})",
                f"use plain {self.name!r}, or a task that reads files (mc:PATH, jsonl:PATH)",
            )
        self.path = path
        self.options = self.resolve_options(options or {})
        if self.options["n"] is None:
            self.options["n"] = 100 if path is None else 0
        self.skipped: list[tuple[int, str]] = []  # (row, reason) of rows skipped on request

    @classmethod
    def all_options(cls) -> dict[str, Option]:
        scoring = Option(cls.default_scoring, "next_token (first-token logits at the query) or "
                         "continuation (summed log-likelihood of each candidate)", str,
                         choices=SCORING_MODES)
        return {**COMMON_OPTIONS, "scoring": scoring, **cls.OPTIONS}

    @classmethod
    def resolve_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with ``options``, each parsed to its type; unknown keys are errors."""
        import difflib

        known = cls.all_options()
        resolved = {k: o.default for k, o in known.items()}
        for key, value in options.items():
            if key not in known:
                close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.5)
                hint = f" — did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise TaskError(
                    f"unknown option {key!r} for task {cls.name!r}{hint}",
                    f"options of {cls.name}: {', '.join(sorted(known))} (see `gascan tasks list`)",
                )
            resolved[key] = known[key].parse(key, value)
        return resolved

    def prompts(self) -> list[Prompt]:
        raise NotImplementedError

    def _finish(self, prompts: list[Prompt]) -> list[Prompt]:
        """Stamp task-wide metadata (scoring mode, index) on every prompt and check it."""
        if not prompts:
            raise TaskError(f"task {self.name!r} produced no prompts", "use --task-option n=1 or more")
        for i, p in enumerate(prompts):
            p.meta.setdefault("task", self.name)
            p.meta["scoring"] = self.options["scoring"]
            p.meta["index"] = i
            problem = check_prompt(p)
            if problem:  # a generator bug, or a file row that slipped through validation
                raise TaskError(f"malformed prompt ({p.where()}): {problem}")
        return prompts


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def parse_task_options(pairs: Iterable[str]) -> dict[str, str]:
    """``["k=v", ...]`` (from ``--task-option``) to a dict of strings; types are parsed by the task.

    Values keep their whitespace (a template's newlines matter) and may spell a newline ``\\n``, a tab
    ``\\t`` and a backslash ``\\\\``, since a shell makes literal newlines awkward."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise TaskError(f"bad task option {pair!r}: expected KEY=VALUE", "e.g. --task-option n_choices=4")
        out[key.strip()] = re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], value)
    return out


def load_task_options(path: str, task: str | None = None) -> dict[str, Any]:
    """Options from a TOML file: top-level ``key = value`` pairs, overlaid by a ``[TASK]`` table."""
    import tomllib
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise TaskError(f"task options file {path!r} does not exist", "give the path of a TOML file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TaskError(f"task options file {path!r} is not valid TOML: {err}") from None
    out = {k: v for k, v in data.items() if not isinstance(v, dict)}
    if task is not None and isinstance(data.get(task), dict):
        out.update(data[task])
    return out
