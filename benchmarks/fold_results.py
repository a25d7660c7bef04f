r"""Fold a study's run folders under ``results/`` into one ``runs.json``, keeping every file something points to.

Usage:
    python benchmarks/fold_results.py [--results results] (--study NAME [--study NAME ...] | --all) [--check]

A study is a folder ``results/<study>/``; a run folder is a folder in it (or the study folder itself) that holds a
``summary.json`` (what ``benchmarks/compare.py`` and ``benchmarks/serve_load.py`` write at their ``--out`` path).
Folding a study writes ``results/<study>/runs.json``::

    {"runs": {"<study>/<sub/path>": {"summary": <summary.json>, "results_md": "<results.md>",
                                     "files": {"<name>": "<text>"}}}}

keyed by the run folder's path relative to ``results/`` (``benchmarks/results_table.py``'s ``load_run`` reads a run
there when its folder's ``summary.json`` is gone), and removes the run folders' small text files that went into it
(``summary.json``, ``results.md``, other ``.md``/``.txt``/``.csv``/``.json`` files; not those git ignores, such as
``metrics.csv``), then the folders left empty. An entry holds everything its folder held, so a study's ``runs.json``
alone is its record; an existing ``runs.json`` is merged into (what a folder holds replaces its entry's fields).

It keeps, and refuses to delete, every file referenced by path: a ``results/...`` path (a glob, a shell brace
``{a,b}``, an f-string ``{seed}`` or a ``$var`` in it matches any value) in ``docs/``, ``README.md``, ``benchmarks/``,
``tests/``, ``mkdocs.yml`` or a ``!`` line of ``.gitignore``, and a link or image of a page in ``docs/`` that
resolves under ``docs/results/`` (``docs/hooks/results_figures.py`` publishes ``results/**/*.png`` there). A kept
file is also in its run's entry (the two are checked to agree). Files outside run folders (hashes, device notes,
tables of other scripts) are never touched, nor are a run folder's sub-folders, nor a folder with a ``results.md``
and no ``summary.json`` (an earlier script's output, which ``load_run`` could not read from ``runs.json``).

``--all`` folds every study but those named by ``--skip`` (default: ``default_study``, whose runs are still being
added). ``--check`` writes and removes nothing: it prints what folding would do, checks that every ``runs.json``
entry agrees with the files still in its folder, and exits 1 when something is left to fold or disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNS_FILE = "runs.json"
SUMMARY = "summary.json"
RESULTS_MD = "results.md"
TEXT_SUFFIXES = (".md", ".txt", ".csv", ".json")
NEVER_FOLDED = ("metrics.csv", "log.txt")  # per-step logs .gitignore keeps out, even where git cannot say so
MAX_TEXT_BYTES = 256 * 1024  # larger files are raw logs, not summaries: left where they are
SKIP_DEFAULT = ("default_study",)
REFERENCE_SOURCES = ("docs", "README.md", "benchmarks", "tests", "mkdocs.yml")
SOURCE_SUFFIXES = (".md", ".py", ".sh", ".yml", ".yaml", ".txt", ".toml", ".js", ".cfg", ".ini", "")

# A path under results/ as written in prose, code or a shell command: up to the first character that cannot be in one.
PATH_IN_TEXT = re.compile(r"results/(?:[\w.*\-+=@/]|\{[^{}\s]*\}|\{[^{}\n]*,[^{}\n]*\}|\$\{?\w+\}?)+")
LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclass
class Reference:
    """A path pattern under results/ and where it was read."""

    pattern: str
    source: str


def expand(text: str) -> list[str]:
    """Shell braces ``{a,b}`` expanded; a ``{name}`` (an f-string field) or ``$var`` becomes ``*``."""
    text = re.sub(r"\$\{?\w+\}?", "*", text)
    match = re.search(r"\{([^{}]*)\}", text)
    if match is None:
        return [text]
    head, tail = text[: match.start()], text[match.end() :]
    options = [part.strip() for part in match.group(1).split(",")] if "," in match.group(1) else ["*"]
    return [out for option in options for out in expand(head + option + tail)]


def references(root: Path) -> list[Reference]:
    """Every path pattern under ``results/`` that the docs, the README, the scripts, the tests or .gitignore name."""
    found: list[Reference] = []
    files: list[Path] = []
    for name in REFERENCE_SOURCES:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue  # this script's own examples name no file
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        source = path.relative_to(root).as_posix()
        for match in PATH_IN_TEXT.finditer(text):
            for pattern in expand(match.group(0).rstrip(".,;:")):
                found.append(Reference(pattern.rstrip("/"), source))
        if path.suffix == ".md" and (root / "docs") in path.parents:
            for match in LINK_TARGET.finditer(text):
                target = match.group(1).split("#")[0]
                if not target or "://" in target:
                    continue
                resolved = Path(os.path.normpath(path.parent / target))
                try:
                    relative = resolved.relative_to(root / "docs").as_posix()
                except ValueError:
                    continue
                if relative.startswith("results/"):  # docs/results/<study>/<file> is results/<study>/<file>
                    found.append(Reference(relative, source))
    gitignore = root / ".gitignore"
    if gitignore.is_file():
        for line in gitignore.read_text().splitlines():
            if line.startswith("!") and "results/" in line:
                found.append(Reference(line[1:].strip().lstrip("/"), ".gitignore"))
    return found


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regex: ``*`` and ``?`` within one path segment, ``**`` across segments."""
    parts = re.split(r"(\*\*/?|\*|\?)", pattern)
    wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(wild.get(part, re.escape(part)) for part in parts) + r"\Z")


def referenced_by(path: str, refs: list[Reference]) -> list[str]:
    """The sources naming ``path`` (``results/...``), exactly or by a pattern."""
    return sorted({ref.source for ref in refs if glob_regex(ref.pattern).match(path)})


def ignored_by_git(root: Path, paths: list[Path]) -> set[Path]:
    """The paths git ignores (none when ``root`` is not in a git work tree or git is missing)."""
    if not paths:
        return set()
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "check-ignore", "--no-index", "--stdin", "-z"],
            input="\0".join(str(p) for p in paths),
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return set()
    if done.returncode not in (0, 1):
        return set()
    return {Path(p) for p in done.stdout.split("\0") if p}


def canonical(value: Any) -> str:
    """JSON text to compare two values by (NaN equals NaN here)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


@dataclass
class Plan:
    """What folding one study does."""

    study: str
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # run key -> entry read from its folder
    remove: list[Path] = field(default_factory=list)
    kept: dict[Path, list[str]] = field(default_factory=dict)  # kept (referenced) file -> who references it
    left: dict[Path, str] = field(default_factory=dict)  # file or folder left alone -> why
    disagree: list[str] = field(default_factory=list)


def run_folders(study_dir: Path) -> list[Path]:
    folders = {p.parent for p in study_dir.rglob(SUMMARY)}
    return sorted(folders)


def plan_study(results: Path, study: str, refs: list[Reference]) -> Plan:
    """Read a study's run folders: their entries, the files to remove and those kept (and why)."""
    root = results.parent
    study_dir = results / study
    plan = Plan(study)
    folders = run_folders(study_dir)
    candidates = [p for folder in folders for p in sorted(folder.iterdir()) if p.is_file()]
    ignored = ignored_by_git(root, candidates)
    for folder in folders:
        key = folder.relative_to(results).as_posix()
        entry: dict[str, Any] = {}
        extra: dict[str, str] = {}
        for path in sorted(folder.iterdir()):
            shown = path.relative_to(root)
            if path.is_dir():
                if next(path.rglob(SUMMARY), None) is not None:
                    continue  # a run folder of its own
                plan.left[shown] = "a sub-folder of a run folder"
                continue
            if path in ignored or path.name in NEVER_FOLDED or path.name == RUNS_FILE:
                continue
            if path.suffix not in TEXT_SUFFIXES or path.stat().st_size > MAX_TEXT_BYTES:
                sources = ", ".join(referenced_by(shown.as_posix(), refs))
                plan.left[shown] = "not a small text file" + (f", referenced by {sources}" if sources else "")
                continue
            text = path.read_text(encoding="utf-8")
            if path.name == SUMMARY:
                entry["summary"] = json.loads(text)
            elif path.name == RESULTS_MD:
                entry["results_md"] = text
            else:
                extra[path.name] = text
            sources = referenced_by(shown.as_posix(), refs)
            if sources:
                plan.kept[shown] = sources
            else:
                plan.remove.append(path)
        if extra:
            entry["files"] = extra
        plan.entries[key] = entry
    folded = load_runs(study_dir)
    for path in sorted(study_dir.rglob(RESULTS_MD)):
        if not (path.parent / SUMMARY).is_file() and path.parent.relative_to(results).as_posix() not in folded:
            plan.left[path.relative_to(root)] = "a results.md without summary.json: not a run load_run could read"
    return plan


def load_runs(study_dir: Path) -> dict[str, dict[str, Any]]:
    path = study_dir / RUNS_FILE
    return json.loads(path.read_text(encoding="utf-8"))["runs"] if path.is_file() else {}


def dump_runs(runs: dict[str, dict[str, Any]]) -> str:
    return json.dumps({"runs": dict(sorted(runs.items()))}, indent=1, ensure_ascii=False) + "\n"


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A folder's entry read again: what it holds now replaces, field by field, what ``runs.json`` held."""
    merged = {**old, **new}
    if "files" in old or "files" in new:
        merged["files"] = {**old.get("files", {}), **new.get("files", {})}
    return merged


def agreement(results: Path, runs: dict[str, dict[str, Any]]) -> list[str]:
    """The entries that disagree with a file still in their folder."""
    problems = []
    for key, entry in sorted(runs.items()):
        folder = results / key
        checks = [(SUMMARY, "summary", True), (RESULTS_MD, "results_md", False)]
        checks += [(name, None, False) for name in entry.get("files", {})]
        for name, field_name, is_json in checks:
            path = folder / name
            if not path.is_file():
                continue
            stored = entry.get(field_name) if field_name else entry["files"].get(name)
            if stored is None:
                continue
            text = path.read_text(encoding="utf-8")
            ok = canonical(json.loads(text)) == canonical(stored) if is_json else text == stored
            if not ok:
                problems.append(f"{key}/{name} differs from its entry in {RUNS_FILE}")
    return problems


def remove(path: Path, refs: list[Reference], root: Path) -> None:
    """Delete a folded file, refusing a referenced one."""
    sources = referenced_by(path.relative_to(root).as_posix(), refs)
    if sources:
        raise SystemExit(f"fold_results.py: refusing to delete {path} (referenced by {', '.join(sources)})")
    path.unlink()


def fold(results: Path, study: str, refs: list[Reference], check: bool) -> bool:
    """Fold (or, with ``check``, report) one study; True when it had something to fold or disagreed."""
    root = results.parent
    study_dir = results / study
    plan = plan_study(results, study, refs)
    runs = load_runs(study_dir)
    merged = {**runs, **{key: merge(runs.get(key, {}), entry) for key, entry in plan.entries.items()}}
    plan.disagree = agreement(results, runs)
    pending = bool(plan.remove) or canonical(merged) != canonical(runs)
    if not merged:
        print(f"{study}: no run folders")
        return False
    verb = ("would fold", "would remove") if check else ("folded", "removed")
    print(
        f"{study}: {verb[0]} {len(plan.entries)} run folder(s) into {study}/{RUNS_FILE} ({len(merged)} entries), "
        f"{verb[1]} {len(plan.remove)} file(s), kept {len(plan.kept)} referenced"
    )
    for path, sources in sorted(plan.kept.items()):
        print(f"  kept {path} (referenced by {', '.join(sources)})")
    for path, why in sorted(plan.left.items()):
        print(f"  left {path}: {why}")
    for problem in plan.disagree:
        print(f"  DISAGREES: {problem}")
    if check or not pending:
        return pending or bool(plan.disagree)
    if plan.disagree:
        raise SystemExit(f"fold_results.py: {study}: {RUNS_FILE} disagrees with the files in its folders; not folding")
    text = dump_runs(merged)
    # Nothing is removed unless runs.json, read back, holds every entry as read from its folder.
    back = json.loads(text)["runs"]
    for key in plan.entries:
        if canonical(back[key]) != canonical(merged[key]):
            raise SystemExit(f"fold_results.py: {key} does not read back from {RUNS_FILE}; nothing removed")
    (study_dir / RUNS_FILE).write_text(text, encoding="utf-8")
    for path in plan.remove:
        remove(path, refs, root)
    for folder in sorted({p.parent for p in plan.remove}, key=lambda p: len(p.parts), reverse=True):
        while folder != study_dir and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--study", action="append", help="a folder under --results (repeatable)")
    which.add_argument("--all", action="store_true", help="every study folder but those of --skip")
    default = ",".join(SKIP_DEFAULT)
    parser.add_argument("--skip", action="append", help=f"with --all, a study to leave (repeatable; default {default})")
    parser.add_argument("--check", action="store_true", help="write and remove nothing; exit 1 if anything to fold")
    args = parser.parse_args(argv)
    results = args.results.resolve()
    if args.all:
        skip = set(args.skip or SKIP_DEFAULT)
        studies = sorted(p.name for p in results.iterdir() if p.is_dir() and p.name not in skip)
    else:
        studies = args.study
        for study in studies:
            if "/" in study or not (results / study).is_dir():
                parser.error(f"no study folder {results / study}")
    refs = references(results.parent)
    pending = [study for study in studies if fold(results, study, refs, args.check)]
    if args.check and pending:
        print(f"to fold or disagreeing: {', '.join(pending)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
