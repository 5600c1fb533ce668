"""Old name of hyspec.speculative (kept so existing imports keep working):
`import hyspec.spec.loop` and `from hyspec.spec.loop import SpecOptions` give the
hyspec.speculative modules."""

import importlib
import sys

for _name in ("drafter", "loop", "replay", "rollback", "telemetry"):
    _mod = importlib.import_module(f"hyspec.speculative.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _mod
    globals()[_name] = _mod
