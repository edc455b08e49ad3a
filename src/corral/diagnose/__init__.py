"""Diagnosis: turn a failed multi-node run's output into a named cause and a fix.

The knowledge base is ``rules.toml`` (data, validated at load); the matcher
reads logs from any launcher (torchrun, accelerate, DeepSpeed, Lightning,
pdsh, corral) line by line.  Public API::

    load_rules()                         -> list[Rule]
    diagnose_text(text, facts=...)       -> list[Diagnosis]   (most likely first)
    diagnose_path(log_or_run_dir, facts=...) -> list[Diagnosis]
    diagnose_run(log_or_run_dir, facts=...)  -> RunReport (also .first_error, .hang)
    Matcher(...).feed(line) / .diagnoses()   (incremental, for live output)

The library never prints; ``corral diagnose`` (corral.cli.diagnose) renders.
"""

from corral.diagnose.hang import Hang
from corral.diagnose.matcher import Diagnosis, MatchedLine, Matcher, diagnose_text
from corral.diagnose.rules import CATEGORIES, Rule, RulesError, load_rules
from corral.diagnose.rundir import FirstError, RunReport, diagnose_path, diagnose_run, load_facts

__all__ = [
    "CATEGORIES",
    "Diagnosis",
    "FirstError",
    "Hang",
    "MatchedLine",
    "Matcher",
    "Rule",
    "RulesError",
    "RunReport",
    "diagnose_path",
    "diagnose_run",
    "diagnose_text",
    "load_facts",
    "load_rules",
]
