#!/usr/bin/env python3
"""How often `corral diagnose` names the right cause on real logs of issue 17's families.

    .venv/bin/python bench/score_diagnose.py

Reads tests/fixtures/diagnose/families/families.toml: real log excerpts, each
with the rule ids that name its right cause and its split: "dev" (read while
the rules were written) or "held-out" (collected after, never fitted to).
A log counts as right when the first cause reported is one of them (for a
notice family, when the notice is reported).  Prints every log and the score
per split; the held-out score is the one that says how well the rules
generalise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from corral.diagnose import diagnose_run
from corral.diagnose.rules import tomllib  # tomli on Python 3.10

FAMILIES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "diagnose" / "families"


def main() -> int:
    entries = tomllib.loads((FAMILIES / "families.toml").read_text(encoding="utf-8"))["log"]
    score: dict[str, list[bool]] = {}
    for e in entries:
        report = diagnose_run(FAMILIES / e["file"])
        causes = [d.rule_id for d in report.diagnoses if not getattr(d, "notice", False)]
        notices = [d.rule_id for d in report.diagnoses if getattr(d, "notice", False)]
        got = notices if e.get("notice") else causes[:1]
        ok = any(r in e["expect"] for r in got)
        score.setdefault(e["split"], []).append(ok)
        print(f"{'ok  ' if ok else 'MISS'} {e['split']:8} {e['family']:40} {Path(e['file']).name:34} "
              f"-> {', '.join(causes[:2] + [n + ' (notice)' for n in notices]) or 'nothing'}")
    for split, oks in score.items():
        print(f"{split}: {sum(oks)}/{len(oks)} = {100 * sum(oks) / len(oks):.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
