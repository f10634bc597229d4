"""Generate docs/sidecar-settings.md from the settings code, so the reference cannot drift.

Read from the declarations, not a list kept here: every dataclass under sidecar/ with a
`from_env` classmethod in a module whose ENV_PREFIX starts with SLUICE_ is a settings class;
each of its fields is the variable ENV_PREFIX + FIELD, its type and default are the field's, its
effect the comments on and just above the field line. Variables read one by one
(`environ.get("SLUICE_...")`) are listed too, with the `help=` of the flag they default or their
line's comment. `--check` fails when the committed page is stale (tests/deploy/test_docs.py runs it).
"""
from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize
from dataclasses import dataclass

from docs_page import write_or_check  # scripts/docs_page.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sidecar"
OUT = ROOT / "docs" / "sidecar-settings.md"


@dataclass(frozen=True)
class Setting:
    variable: str
    type: str
    default: str
    effect: str
    source: str         # module path, for the reader who wants the code


@dataclass(frozen=True)
class Group:
    title: str
    source: str
    settings: tuple[Setting, ...]


def _comments(text: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether the comment is the whole line)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            whole = token.line[:token.start[1]].strip() == ""
            found[token.start[0]] = (token.string.lstrip("#").strip(), whole)
    return found


def _effect(line: int, comments: dict[int, tuple[str, bool]]) -> str:
    above, n = [], line - 1
    while n in comments and comments[n][1]:
        above.insert(0, comments[n][0])
        n -= 1
    trailing = comments.get(line)
    parts = above + ([trailing[0]] if trailing and not trailing[1] else [])
    return " ".join(p for p in parts if p)


def _prefix(tree: ast.Module) -> str | None:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ENV_PREFIX" for t in node.targets)
                and isinstance(node.value, ast.Constant) and str(node.value.value).startswith("SLUICE_")):
            return node.value.value
    return None


def _is_settings_class(node: ast.AST) -> bool:
    if not isinstance(node, ast.ClassDef):
        return False
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    return decorated and any(isinstance(b, ast.FunctionDef) and b.name == "from_env" for b in node.body)


def _default(node: ast.AnnAssign) -> str:
    if node.value is None:
        return "(required)"
    value = node.value
    if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) and not isinstance(value.value, bool):
        number = value.value
        return f"{number:,}" if isinstance(number, int) else repr(number)
    return ast.unparse(value)


def settings_groups(package: pathlib.Path = PACKAGE) -> list[Group]:
    groups, others = [], []
    for path in sorted(package.rglob("*.py")):
        if "gen" in path.relative_to(package).parts:
            continue
        text = path.read_text()
        tree = ast.parse(text)
        source = str(path.relative_to(ROOT))
        prefix = _prefix(tree)
        comments = _comments(text)
        if prefix:
            for node in tree.body:
                if not _is_settings_class(node):
                    continue
                doc = (ast.get_docstring(tree) or node.name).split("\n")[0].split(":")[0].rstrip(".")
                settings = tuple(
                    Setting(prefix + item.target.id.upper(), ast.unparse(item.annotation), _default(item),
                            _effect(item.lineno, comments), source)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
                groups.append(Group(f"{doc} (`{node.name}`)", source, settings))
        singles = tuple(_single_reads(tree, comments, source))
        if singles:
            others.append(Group(f"Read by `{source}`", source, singles))
    return groups + others


def _single_reads(tree: ast.Module, comments, source: str):
    """environ.get("SLUICE_X", default) calls; the effect is the help= of the call it sits in."""
    helps: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            text = next((k.value.value for k in node.keywords if k.arg == "help" and isinstance(k.value, ast.Constant)),
                        None)
            if text:
                for inner in ast.walk(node):
                    helps.setdefault(id(inner), text)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and "environ" in ast.unparse(node.func.value) and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("SLUICE_")):
            continue
        default = ast.unparse(node.args[1]) if len(node.args) > 1 else "(unset)"
        effect = helps.get(id(node)) or _effect(node.lineno, comments)
        yield Setting(node.args[0].value, "str", default, effect, source)


def render() -> str:
    lines = ["# Sidecar settings reference", "",
             "Generated from the settings code (`scripts/gen_settings_docs.py`: every settings dataclass "
             "under `sidecar/` and every variable read one by one); do not edit by hand.", "",
             "Each setting is a `SLUICE_*` environment variable, a line of the file named by "
             "`SLUICE_CONFIG_FILE` (`KEY=VALUE`, `#` comments; `SLUICE_EMBED_*` only from the "
             "environment), or, for a few, a `sluice serve` flag. Later sources win: defaults, "
             "environment, the file, flags. Values are checked at start: a bad one exits with "
             "code 2 and names the setting. `REDIS_URL` is read when `SLUICE_REDIS_URL` is unset. "
             "What a reload (`SIGHUP`) applies live is in [Rollouts and reloads](rollouts.md).", ""]
    for group in settings_groups():
        lines += [f"## {group.title}", "", f"Declared in `{group.source}`.", "",
                  "| variable | type | default | effect |", "|---|---|---|---|"]
        for s in group.settings:
            default = s.default.replace("|", "\\|")
            lines.append(f"| `{s.variable}` | {s.type} | `{default}` | {s.effect.replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    return write_or_check(OUT, render(), ROOT)


if __name__ == "__main__":
    sys.exit(main())
