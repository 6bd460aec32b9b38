"""The checks every command runs before it works: fail in a second with one line, never after the work.

Importing this module stays cheap (no torch, transformers or polars). The order in each command is:
arguments and numbers, the output path, the model spec (what is on disk, without loading it), then
the task names and the device's availability, which need torch imported, still before the model
loads. Every failure is a :class:`~discovery.errors.GascanError` (exit codes in discovery/errors.py).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from discovery.errors import DeviceError, GascanError, OutputError, TaskError
from discovery.model.spec import check_dtype, check_model

MAX_PROMPTS = 100_000
"""The most prompts per task: the generators build every prompt up front and the sweep keeps a row per
prompt and head in memory, so beyond this a scan runs for hours or exhausts memory; sample fewer."""

DEVICE_PATTERN = re.compile(r"cpu|mps|cuda(:\d+)?")


# -- numbers -----------------------------------------------------------------------------------------
def prompts(n: Any, flag: str = "--prompts", minimum: int = 2) -> int:
    """A prompt count within [minimum, MAX_PROMPTS]."""
    if not isinstance(n, int) or isinstance(n, bool):
        raise GascanError(f"{flag} {n!r} is not a whole number", f"pass {flag} N with {minimum} <= N <= {MAX_PROMPTS:,}")
    if n < minimum:
        raise GascanError(f"{flag} {n} is too few", f"use at least {minimum} prompts (64 is the default)")
    if n > MAX_PROMPTS:
        raise GascanError(f"{flag} {n:,} is more than the limit of {MAX_PROMPTS:,} prompts per task "
                          "(every prompt is generated and its effects held in memory)",
                          f"pass {flag} {MAX_PROMPTS:,} or fewer")
    return n


def positive(n: Any, flag: str) -> None:
    """An optional count that must be at least 1."""
    if n is not None and n < 1:
        raise GascanError(f"{flag} {n} is below 1", f"pass {flag} 1 or more")


# -- the device --------------------------------------------------------------------------------------
def _torch_cuda_version() -> str | None | bool:
    """The installed torch build's CUDA version read from torch/version.py without importing torch
    (None: a CPU-only build; False: unknown)."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        source = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
        for node in ast.parse(source).body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:
                return ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return False


def device(text: str | None) -> None:
    """A well-formed device string, and (cheaply, without torch) one this torch build can have."""
    if text is None:
        return
    if not DEVICE_PATTERN.fullmatch(text):
        raise DeviceError(f"--device {text!r} is not a device", "use cpu, cuda, cuda:N or mps")
    if text.startswith("cuda") and _torch_cuda_version() is None:
        raise DeviceError(f"--device {text}: the installed torch is a CPU-only build (not compiled with CUDA)",
                          "use --device cpu, or install a CUDA build of torch")
    if text == "mps" and sys.platform != "darwin":
        raise DeviceError("--device mps: MPS exists only on Apple silicon (macOS)", "use --device cpu or cuda")


def device_available(text: str | None) -> None:
    """The device exists on this machine (imports torch: call it once torch is needed, before loading)."""
    device(text)
    if text is None or text == "cpu":
        return
    import torch

    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {text}: no CUDA device is available to torch",
                              "use --device cpu, or check the driver and CUDA_VISIBLE_DEVICES")
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                              f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif text == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("--device mps: MPS is not available to this torch", "use --device cpu")


# -- outputs -----------------------------------------------------------------------------------------
def _probe(directory: Path, shown: str, flag: str) -> None:
    """Create and remove a file in ``directory`` to prove it is writable."""
    try:
        handle, name = tempfile.mkstemp(dir=directory, prefix=".gascan-write-test-")
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        raise OutputError(f"{flag} {shown} cannot be written ({directory}: {err.strerror or err})",
                          f"choose a writable {flag} path") from None


def _existing_ancestor(path: Path, shown: str, flag: str) -> Path:
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{flag} {shown} cannot be created: {parent} is a file, not a directory",
                          f"choose a {flag} path under a directory")
    return parent


def out_dir(path: str | os.PathLike | None, flag: str = "--out") -> None:
    """An output directory that is a directory (or can be made one) and is writable; nothing is left."""
    if path is None:
        return
    target, shown = Path(path).expanduser(), str(path)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{flag} {shown} is an existing file, not a directory",
                          f"pass a directory path to {flag}, or move the file away")
    _probe(target if target.is_dir() else _existing_ancestor(target, shown, flag), shown, flag)


def out_file(path: str | os.PathLike | None, flag: str = "--out") -> None:
    """An output file whose directory is writable (an existing file is replaced; a directory is refused)."""
    if path is None:
        return
    target, shown = Path(path).expanduser(), str(path)
    if target.is_dir():
        raise OutputError(f"{flag} {shown} is a directory", f"pass a file path to {flag}, e.g. {shown}/out.json")
    parent = target.parent if target.parent.is_dir() else _existing_ancestor(target, shown, flag)
    _probe(parent, shown, flag)


# -- inputs ------------------------------------------------------------------------------------------
def json_file(path: str | os.PathLike, what: str) -> Any:
    """The parsed JSON of an input file, or one line saying why it cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise GascanError(f"{what} {p} does not exist", f"pass an existing {what}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise GascanError(f"{what} {p} is not JSON (not UTF-8 text)", "pass a JSON file") from None
    except json.JSONDecodeError as err:
        raise GascanError(f"{what} {p} is not JSON ({err.msg} at line {err.lineno})", "fix or replace the file") from None
    except OSError as err:
        raise GascanError(f"cannot read {what} {p} ({err.strerror or err})", "check the path's permissions") from None


def head_tables(paths: Iterable[str | os.PathLike]) -> None:
    """Each path is a heads.parquet (by its magic bytes) or a scan directory holding one."""
    for raw in paths:
        p = Path(raw)
        table = p / "heads.parquet" if p.is_dir() else p
        if not table.is_file():
            raise GascanError(f"no head table at {p}", "pass heads.parquet files or scan directories")
        with open(table, "rb") as handle:
            head = handle.read(4)
            handle.seek(max(0, table.stat().st_size - 4))
            tail = handle.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            raise GascanError(f"{table} is not a parquet head table", "pass heads.parquet files written by gascan scan")


def scan_dir(path: str | os.PathLike) -> None:
    """A scan directory: heads.parquet and summary.json (their contents are read by the command)."""
    out = Path(path)
    if not out.is_dir():
        raise GascanError(f"scan directory {out} does not exist", "pass the --out directory of `gascan scan`")
    if (out / "summary.json").is_file() and not (out / "heads.parquet").is_file() and _started_scan(out):
        raise GascanError(f"the scan in {out} stopped before its sweep finished (no heads.parquet yet)",
                          f"rerun the same `gascan scan ... --out {out}` to resume it")
    if not (out / "heads.parquet").is_file() or not (out / "summary.json").is_file():
        raise GascanError(f"{out} is not a scan directory (no heads.parquet and summary.json)",
                          "pass the --out directory of `gascan scan`")


def _started_scan(out: Path) -> bool:
    """Whether ``out/summary.json`` is the record a scan writes before its first stage."""
    try:
        return "fingerprint" in json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


# -- model and tasks ---------------------------------------------------------------------------------
def model(spec: str | None, *, dtype: str | None = None, device_name: str | None = None,
          allow_pickle: bool = False, trust_remote_code: bool = False) -> None:
    """The loading options and what the model spec names on disk (no torch, no weights read)."""
    check_dtype(dtype)
    device(device_name)
    check_model(spec, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


def tasks(specs: Iterable[str], options_for: Callable[[str], Mapping[str, Any]] | None = None,
          n: int | None = None, seed: int = 0) -> None:
    """Known task names (did-you-mean), and the rows of ``jsonl:PATH`` files, built with
    ``options_for(spec)`` before the model loads (imports the task package)."""
    from discovery.tasks import build_task, get_task_class, split_spec

    for spec in specs:
        name, path = split_spec(spec)
        get_task_class(name)
        if path is not None and not Path(path).expanduser().exists():
            raise TaskError(f"{name} file {path!r} does not exist", f"give the path of a file for {name}")
        if name == "jsonl":  # self-describing rows: check them all before the model loads
            opts = {"seed": seed, **({"n": n} if n else {}), **dict(options_for(spec) if options_for else {})}
            build_task(spec, opts).prompts()


def budget(text: str | float | int | None) -> tuple[str, float | None]:
    """A ``--budget`` value: ``auto`` (the default rule), ``none`` (unbounded), ``N`` (forward-equivalents per
    task) or ``Ns`` (seconds per task, converted with the sweep's measured seconds per forward-equivalent)."""
    value = "auto" if text is None else str(text).strip().lower()
    if value in ("auto", "none"):
        return value, None
    unit = "s" if value.endswith("s") else "fe"
    number = value[:-1] if unit == "s" else value.removesuffix("fe")
    try:
        amount = float(number)
    except ValueError:
        amount = float("nan")
    if not amount > 0 or math.isinf(amount):
        raise GascanError(f"--budget {text} is not a budget",
                          "pass auto, none, a number of forward-equivalents (e.g. 200) or seconds (e.g. 600s)")
    return unit, amount
