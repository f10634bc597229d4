"""Generate docs/alerts.md from deploy/prometheus/alerts.yaml: each alert, when it fires and
what to do (its summary and description), so the page and the rules cannot drift. `--check`
fails when the committed page is stale (tests/deploy/test_docs.py runs it)."""
from __future__ import annotations

import pathlib
import sys

import yaml

from docs_page import write_or_check  # scripts/docs_page.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
OUT = ROOT / "docs" / "alerts.md"


def render() -> str:
    spec = yaml.safe_load(RULES.read_text())
    lines = ["# Alerts", "",
             "Generated from `deploy/prometheus/alerts.yaml` by `scripts/gen_alert_docs.py`; do not edit "
             "by hand. Load the file with `rule_files:`, or paste its groups into a PrometheusRule's "
             "`spec.groups`. `make test` checks the rules with `promtool check rules` and fires each "
             "alert in `promtool test rules` (`tests/deploy/test_manifests.py`). Metric names: "
             "`deploy/metrics.txt`; what each means: [Metrics](metrics.md).", ""]
    for group in spec["groups"]:
        lines += [f"## {group['name']}", ""]
        for rule in group["rules"]:
            annotations = rule.get("annotations", {})
            severity = rule.get("labels", {}).get("severity", "")
            summary = " ".join(str(annotations.get("summary", "")).split())
            description = " ".join(str(annotations.get("description", "")).split())
            lines += [f"### {rule['alert']} ({severity})", "",
                      f"**Fires** after `{rule.get('for', '0m')}` of:", "", "```promql",
                      str(rule["expr"]).strip(), "```", "",
                      f"**Says**: {summary}", "", f"**What it means and what to do**: {description}", ""]
            if annotations.get("planned"):
                lines += [f"**Planned**: {' '.join(str(annotations['planned']).split())}", ""]
    return "\n".join(lines)


def main() -> int:
    return write_or_check(OUT, render(), ROOT)


if __name__ == "__main__":
    sys.exit(main())
