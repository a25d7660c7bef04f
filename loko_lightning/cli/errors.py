"""What the ``loko`` command reads from errors: jsonargparse's parse errors, and a distributed run's lost process.

A parse error of jsonargparse is read from its chain of exceptions (:func:`read_parse_error`) and written as one line
naming the flag and the valid keys closest to it (:func:`parse_error_message`). A collective that fails because
another process is gone becomes a :class:`~loko_lightning.errors.LostProcessError` (:func:`lost_process_error`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import types
import typing
from argparse import ArgumentError
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer

from loko_lightning.errors import LostProcessError

# How the collective backends say that another process is gone (gloo's socket errors, a wait past its timeout, NCCL's
# abort); an error of torch.distributed's own types counts too.
LOST_PROCESS_WORDING = re.compile(
    r"connection reset by peer|connection closed by peer|broken pipe|timed out|timeout|nccl communicator was aborted|"
    r"connection refused",
    re.IGNORECASE,
)
# What jsonargparse says only in words, one pattern each; the rest comes from the exceptions' types and chain of
# causes, the parser's keys and the configured classes' signatures. tests/test_cli_errors.py reads real jsonargparse
# errors with each pattern, so a change of wording fails there instead of turning a user's error into a worse one.
JSONARGPARSE_WORDING = {
    # Each level of the chain that names the key whose value failed: 'Parser key "model.optimizer": ...'.
    "key": re.compile(r'^Parser key "(?P<key>[^"]+)"'),
    # The configured class whose argument failed: "class_path='loko_lightning.LoKO'" or "class_path 'loko_...'".
    "class_path": re.compile(r"class_path[=\s]'(?P<class_path>[\w.]+)'"),
    # An option that no parser or class takes (a KeyError): "Option 'p00' is not accepted".
    "option": re.compile(r"[Oo]ption '(?P<option>[^']+)'"),
    # The value given, at the end of the innermost message: "Expected a <class 'float'>. Got value: big".
    "value": re.compile(r"(?:Got|Given) value: (?P<value>.*)\Z", re.DOTALL),
    # A class name that names no importable class (an unknown family at a subclass-typed key): "Expected a dot import
    # path string: Nope".
    "import_path": re.compile(r"Expected a dot import path string: (?P<name>\S+)"),
    # Command-line arguments that no parser took (argparse's own wording).
    "unrecognized": re.compile(r"^unrecognized arguments: (?P<arguments>.*)", re.DOTALL),
}


@dataclass(frozen=True)
class ParseError:
    """What a jsonargparse parse error says, read from its chain of exceptions.

    Attributes:
        keys: the keys whose value failed, outermost first: ``("model.optimizer", "beta")`` for ``beta`` of the class
            configured at ``model.optimizer``; empty for an option no parser took.
        class_path: the configured class whose argument failed (the innermost one named), if any.
        unknown: options nobody takes: the command-line flags no parser took (``"model.netwrk.r"``), or the one
            option a class or section does not accept (``"p00"``, ``"model.windoww"``).
        value: the value given, as jsonargparse shows it, if it says.
        message: the outermost message on one line.
        unknown_class: a class name given for a key that takes a class, which names no class it knows.
    """

    keys: tuple[str, ...] = ()
    class_path: str | None = None
    unknown: tuple[str, ...] = ()
    value: str | None = None
    message: str = ""
    unknown_class: str | None = None


def read_parse_error(error: BaseException) -> ParseError:
    """Read a jsonargparse parse error: its chain of causes, the exceptions' types, and :data:`JSONARGPARSE_WORDING`."""
    chain = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    texts = [_text(e) for e in chain]
    keys: list[str] = []
    for text in texts:
        match = JSONARGPARSE_WORDING["key"].match(text)
        if match and (not keys or keys[-1] != match["key"]):  # a wrapper repeats its cause's key
            keys.append(match["key"])
    class_path = next(
        (m["class_path"] for t in reversed(texts) if (m := JSONARGPARSE_WORDING["class_path"].search(t))), None
    )
    unknown: tuple[str, ...] = ()
    unrecognized = JSONARGPARSE_WORDING["unrecognized"].match(texts[0])
    rejected = next((text for e, text in zip(chain, texts, strict=True) if isinstance(e, KeyError)), None)
    if unrecognized:
        flags = (a for a in unrecognized["arguments"].split() if a.startswith("--"))
        unknown = tuple(dict.fromkeys(flag[2:].partition("=")[0] for flag in flags))
    elif rejected is not None and (option := JSONARGPARSE_WORDING["option"].search(rejected)):
        unknown = (option["option"],)
    values = (list(JSONARGPARSE_WORDING["value"].finditer(t)) for t in reversed(texts))
    value = next((found[-1]["value"] for found in values if found), None)
    unknown_class = next((m["name"] for t in texts if (m := JSONARGPARSE_WORDING["import_path"].search(t))), None)
    return ParseError(tuple(keys), class_path, unknown, value, " ".join(texts[0].split()), unknown_class)


def _text(error: BaseException) -> str:
    """An exception's own message (``str`` of a ``KeyError`` adds quotes; an ``ArgumentError`` keeps it apart)."""
    if isinstance(error, ArgumentError):
        return error.message
    return error.args[0] if error.args and isinstance(error.args[0], str) else str(error)


def parse_error_message(error: ParseError, keys: list[str], sections: Mapping[str, Any]) -> str:
    """One line for a parse error: what is wrong with which flag, and the valid keys closest to an unknown one.

    Args:
        error: the error, as :func:`read_parse_error` reads it.
        keys: the keys the parsers take.
        sections: the class configured at each top-level key (``model``, ``data``, ``trainer``).
    """
    if error.unknown and error.keys and error.class_path:
        return _unknown_argument_message(".".join(error.keys), error.unknown[0], error.class_path)
    if error.unknown_class and len(error.keys) == 1:
        root, _, name = error.keys[0].partition(".")
        message = _unknown_class_message(error.keys[0], error.unknown_class, sections.get(root), name)
        if message is not None:
            return message
    owner, name = None, None
    if error.class_path and len(error.keys) > 1:  # an argument of a configured class: its signature says its type
        owner, name = class_at(error.class_path), error.keys[-1]
    elif len(error.keys) == 1:  # an argument of the model, the data module or the trainer
        root, _, name = error.keys[0].partition(".")
        owner = sections.get(root)
    expected = _expected_type(owner, name) if owner is not None and error.value is not None else None
    if expected and not error.unknown:
        flag = ".".join(error.keys)
        return f"--{flag}: expected {expected}, got {error.value!r}. See `loko fit --help`."
    return _generic_message(error, keys)


def class_at(class_path: str) -> Any:
    """The class (or function) a ``class_path`` names, or ``None`` where it names nothing importable."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _parameters(owner: Any) -> list[str]:
    """The arguments a configured class or function takes (without the ones the learner passes itself)."""
    try:
        parameters = inspect.signature(owner).parameters.values()
    except (ValueError, TypeError):
        return []
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [n for n in named if n not in ("self", "params", "optimizer")]


# How an expected type reads in an error; a type outside these (a class, a callable) keeps jsonargparse's words.
_TYPE_WORDS = {int: "an int", float: "a float", str: "a string", bool: "a bool", type(None): "null"}


def _expected_type(owner: Any, name: str) -> str | None:
    """The type of argument ``name`` of ``owner`` in words (``"a float or 'auto'"``), from its signature."""
    try:
        hint = typing.get_type_hints(owner.__init__ if isinstance(owner, type) else owner).get(name)
    except Exception:  # an annotation that does not evaluate here: say nothing rather than something wrong
        return None
    words = _type_words(hint) if hint is not None else None
    return " or ".join(dict.fromkeys(words)) if words else None


def _type_words(hint: Any) -> list[str] | None:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return [repr(value) for value in typing.get_args(hint)]
    if origin in (typing.Union, types.UnionType):
        parts = [_type_words(arg) for arg in typing.get_args(hint)]
        return None if any(part is None for part in parts) else [w for part in parts for w in part]
    if origin in (list, tuple, dict, set):
        return [f"a {origin.__name__}"]
    return [_TYPE_WORDS[hint]] if hint in _TYPE_WORDS else None


def _unknown_class_message(key: str, given: str, owner: Any, name: str) -> str | None:
    """``--data.source: 'Nope' is not a known Source; choose one of CIFAR10, ...``, or ``None`` if no class is typed."""
    try:
        hint = typing.get_type_hints(owner.__init__).get(name) if isinstance(owner, type) else None
    except Exception:  # an annotation that does not evaluate here: keep jsonargparse's words
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    base = next((t for t in options if isinstance(t, type) and t is not type(None)), None)
    if base is None:
        return None
    known, stack = [], list(base.__subclasses__())
    while stack:  # the leaves: the families to choose (their bases only share code)
        subclass = stack.pop(0)
        children = subclass.__subclasses__()
        stack.extend(children)
        if not children:
            known.append(subclass.__name__)
    close = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    hint_text = f"did you mean {close[0]!r}? K" if close else "k"
    return (
        f"--{key}: {given!r} is not a known {base.__name__}. To fix it: {hint_text}nown ones are "
        f"{', '.join(dict.fromkeys(known))}, or give the full class path of a {base.__name__} subclass. See "
        "`loko fit --help`."
    )


def _unknown_argument_message(key: str, name: str, class_path: str) -> str:
    """``--model.optimizer.p00 is not an option of loko_lightning.LoKO; did you mean 'p0'?``."""
    owner = class_at(class_path)
    moved = getattr(owner, "moved_arguments", {})
    if name in moved:  # a keyword of before each setting had one owner: where it is now
        where = moved[name]
        example = "{name: covariance, " + name + ": ...}" if where == "filter" else "{" + name + ": ...}"
        return (
            f"--{key}.{name} is a setting of the {where.replace('_', ' ')}, not an option of {class_path}: give it "
            f"there, --{key}.{where} '{example}' (a config file: {where}: {example}). See `loko fit --help`."
        )
    options = _parameters(owner)
    close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"its options: {', '.join(options)}."
    return f"--{key}.{name} is not an option of {class_path}; {hint} See `loko fit --help`."


def _generic_message(error: ParseError, keys: list[str]) -> str:
    """The parser's error on one line, with the valid keys closest to an unknown one."""
    hints = []
    for key in error.unknown:
        section, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
        where = f"{section}." if section else ""
        if close:
            hints.append(f"did you mean {' or '.join(repr(where + c) for c in close)} instead of {key!r}?")
        elif siblings:
            scope = f" of {section}" if section else ""
            hints.append(f"{key!r} is not an option; those{scope} are {', '.join(siblings)}")
        else:
            sections = sorted({k.rpartition(".")[0] for k in keys if "." in k})
            close = difflib.get_close_matches(section, sections, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0] + '.' + leaf!r} instead of {key!r}?")
    body = "; ".join([error.message.rstrip("."), *hints])
    help_hint = "See `loko fit --help`" + ("" if error.unknown else " (or --print_config for the resolved values)")
    return f"{body}{'' if body.endswith('?') else '.'} {help_hint}."


def lost_process_error(err: BaseException, trainer: Trainer) -> LostProcessError | None:
    """The one-line account of a distributed run that lost a process, or ``None`` if ``err`` is something else.

    It names this process and the lost one (with 2 processes: the other rank), the step, the backend's reason, the
    newest checkpoint (only the steps after it are lost) and how to resume.
    """
    world, rank = trainer.world_size, trainer.global_rank
    chain, cause = [], err
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    dist_error = getattr(torch.distributed, "DistError", ())
    if world < 2 or not any(isinstance(e, dist_error) or LOST_PROCESS_WORDING.search(str(e)) for e in chain):
        return None
    reason = next((line.strip() for e in chain for line in str(e).splitlines() if line.strip()), type(err).__name__)
    reason = re.sub(r"^\[[^\]]*\]\s*", "", reason).split(". ")[0]  # gloo's "[file.cc:545] Read error ...: reset..."
    lost = f"rank {1 - rank}" if world == 2 else "another process"
    found = []
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            found += Path(callback.dirpath).glob("*.ckpt")
    newest = max(found, key=lambda path: path.stat().st_mtime, default=None)
    saved = (
        f"The newest checkpoint is {newest}: only the steps after it are lost. To resume, start every process again "
        "with the same command and --ckpt_path last"
        if newest is not None
        else "No checkpoint was written yet: start every process again with the same command"
    )
    return LostProcessError(
        f"lost {lost} of the {world} processes at training step {trainer.global_step + 1} ({reason[:200]}); this "
        f"process (rank {rank}) stops too. {saved}"
    )
