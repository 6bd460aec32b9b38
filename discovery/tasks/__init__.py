"""Tasks: prompts with exactly annotated token positions.

A task is named ``NAME`` (its built-in generator) or ``NAME:PATH`` (that task's rows from a local
file; ``jsonl:PATH`` is the custom format). ``build_task(spec, options)`` returns a
:class:`~discovery.tasks.definition.Task` whose ``prompts()`` are tokenizer-free; :func:`annotate` maps
them through a tokenizer onto a padded :class:`AnnotatedBatch`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from discovery.errors import TaskError
from discovery.registry import Registry
from discovery.tasks.base import AnnotatedBatch, Prompt, annotate
from discovery.tasks.definition import Option, Task, load_task_options, parse_task_options

TASKS: Registry = Registry("task")
TASKS.add("mc", "discovery.tasks.mc:MCTask", aliases=("mmlu",))
TASKS.add("kv", "discovery.tasks.kv:KVTask")
TASKS.add("niah", "discovery.tasks.niah:NIAHTask", aliases=("passkey",))
TASKS.add("vartrack", "discovery.tasks.vartrack:VarTrackTask")
TASKS.add("jsonl", "discovery.tasks.custom:JSONLTask")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"mc:data/x.csv"`` -> ``("mc", "data/x.csv")``; ``"kv"`` -> ``("kv", None)``."""
    name, sep, path = spec.partition(":")
    if not name.strip():
        raise TaskError(f"bad task spec {spec!r}", "use NAME or NAME:PATH, e.g. mc or mc:data/mmlu.csv")
    if sep and not path.strip():
        raise TaskError(f"task spec {spec!r} names no file after ':'", f"use {name} or {name}:PATH")
    return name.strip(), (path.strip() if sep else None)


def get_task_class(name: str) -> type[Task]:
    """The task class registered as ``name`` (did-you-mean error when unknown)."""
    try:
        return TASKS.get(name)
    except TaskError:
        raise
    except Exception as err:  # Registry raises GascanError; re-raise as a task error (exit code 4)
        if err.__class__.__name__ == "GascanError":
            raise TaskError(str(err)) from None
        raise


def build_task(spec: str, options: Mapping[str, Any] | None = None) -> Task:
    """Build the task named by ``spec`` (``NAME`` or ``NAME:PATH``) with ``options`` (strings or typed)."""
    name, path = split_spec(spec)
    cls = get_task_class(name)
    return cls(dict(options or {}), path)


__all__ = [
    "TASKS", "AnnotatedBatch", "Option", "Prompt", "Task", "annotate", "build_task", "get_task_class",
    "load_task_options", "parse_task_options", "split_spec",
]
