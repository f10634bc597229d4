"""The documentation: generated reference pages are current, every setting the code reads is
documented, the site builds with --strict, and the README stays a README."""
import ast
import re
import subprocess
import sys

import pytest

from devtools.stack import BIN, ROOT


@pytest.mark.parametrize("script", ["gen_route_docs.py", "gen_settings_docs.py", "gen_alert_docs.py"])
def test_generated_reference_pages_are_current(script):
    result = subprocess.run([sys.executable, f"scripts/{script}", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_reference_documents_every_field():
    from sidecar.protos import route_settings_pb2 as pb
    text = (ROOT / "docs" / "route-settings.md").read_text()
    messages = [pb.DESCRIPTOR.message_types_by_name[name] for name in pb.DESCRIPTOR.message_types_by_name]
    assert len(messages) >= 7
    for message in messages:
        assert f"## {message.name}" in text
        for field in message.fields:
            assert f"| `{field.name}` |" in text, f"{message.name}.{field.name}"


def _settings_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "sidecar-settings.md").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(SLUICE_[A-Z0-9_]+)` \|.*\| ([^|]*) \|$", text, re.M)}


def _variables_named_in(paths) -> set[str]:
    """Every SLUICE_* name in string literals and comments of the code (a prefix such as
    SLUICE_EMBED_ is not a setting)."""
    found = set()
    for path in paths:
        found |= {name for name in re.findall(r"\bSLUICE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    return found


def test_every_setting_the_code_reads_is_documented_with_its_effect():
    rows = _settings_rows()
    code = [p for p in (ROOT / "sidecar").rglob("*.py") if "gen" not in p.relative_to(ROOT / "sidecar").parts]
    named = _variables_named_in(code + list((ROOT / "devtools").rglob("*.py")))
    assert {"SLUICE_LISTEN", "SLUICE_EMBED_PROVIDER", "SLUICE_ADMIN_TARGET"} <= named
    missing = sorted(named - set(rows))
    assert not missing, f"SLUICE_* variables the code names but docs/sidecar-settings.md lacks: {missing}"
    undocumented = sorted(name for name, effect in rows.items() if not effect.strip())
    assert not undocumented, f"settings without a comment saying what they do: {undocumented}"


def test_settings_reference_follows_the_declarations():
    # A field added to a settings dataclass appears in the page with its type and default.
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_settings_docs
    source = ROOT / "sidecar" / "config.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SidecarConfig")
    declared = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    groups = {g.source: g for g in gen_settings_docs.settings_groups()}
    listed = [s.variable for s in groups["sidecar/config.py"].settings]
    assert listed == ["SLUICE_" + name.upper() for name in declared]


def test_site_builds_strict(tmp_path):
    result = subprocess.run([str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    byo = (tmp_path / "site" / "byo-envoy" / "index.html").read_text()
    assert "early_header_mutation_extensions" in byo          # the tested snippet is included as it is


def test_readme_is_a_readme():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    head = "\n".join(lines[:6])
    assert "make run" in head and "make test" in head
    text = "\n".join(lines).lower()
    for history in ("until this round", "before uvloop", "four runs", "used to"):
        assert history not in text
    # Its links into docs/ point at pages that exist.
    for target in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (ROOT / target).exists(), target
