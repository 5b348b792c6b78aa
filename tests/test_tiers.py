"""The two test tiers (README, "Run the tests"): a plain run is the fast tier, ``-m slow`` the
rest, and CI runs both commands exactly as the README writes them, so no test is in neither."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]


def _readme_commands() -> tuple[str, str]:
    section = README[README.index("Run the tests"):]
    fast = re.search(r"```bash\n(.*?)\n```", section, re.S)
    slow = re.search(r"`([^`]*pytest[^`]*-m slow)`", section)
    assert fast and slow, "the README's 'Run the tests' names both tiers' commands"
    return fast.group(1).strip(), slow.group(1)


def test_ci_runs_both_tiers_as_the_readme_writes_them() -> None:
    fast, slow = _readme_commands()
    assert fast in CI, f".ci/run does not run the README's test command {fast!r}"
    assert slow in CI, f".ci/run does not run the README's slow tier {slow!r}"
    assert CI.index(fast) < CI.index(slow)


def _collect(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *args, "tests/spec/test_spin.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_a_plain_run_is_the_fast_tier_and_slow_the_rest() -> None:
    fast, slow = _collect(), _collect("-m", "slow")
    everything = _collect("-m", "slow or not slow")
    assert fast and slow
    assert not set(fast) & set(slow)
    assert sorted(fast + slow) == sorted(everything)
    assert any("test_spin_proves_every_property" in t for t in slow)
