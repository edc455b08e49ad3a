"""Regenerate src/corral/interop/ds_keys.json from the DeepSpeed installed here.

    .venv/bin/python scripts/ds_config_keys.py

The head checks DeepSpeed JSON configs against this list when it has no
DeepSpeed of its own (docs/interop.md).
"""

import json
from pathlib import Path

from corral.interop.dskeys import collect

out = Path(__file__).resolve().parents[1] / "src" / "corral" / "interop" / "ds_keys.json"
out.write_text(json.dumps(collect(), indent=1, sort_keys=True) + "\n")
print(f"wrote {out}")
