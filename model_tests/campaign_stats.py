"""``CampaignStats``: the counters every machine of a campaign shares (steps, rules, faults,
coverage, the first failure and its program), which the campaign report is built from."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .oracle import Coverage

__all__ = ["CampaignStats"]


@dataclass
class CampaignStats:
    """Counters shared by every machine of a campaign (one process, one thread)."""

    steps: int = 0
    examples: int = 0
    engines_started: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # rule -> s
    coverage: Coverage = field(default_factory=Coverage)
    max_in_flight: int = 0
    on_step: Callable[[], None] | None = None
    started: float = field(default_factory=time.monotonic)
    # (examples run, seconds since start) when the first failure was seen.
    first_failure: tuple[int, float] | None = None
    # The last few errors a rule or teardown raised, as "rule: Type: message". Hypothesis may
    # report a flaky replay (FlakyStrategyDefinition) instead of the error that ended it; the
    # campaign report shows these so the real failure is not lost.
    errors: list[str] = field(default_factory=list)
    # The program of the last example that failed, one ``state.rule(...)`` line per step: the
    # reproducer when Hypothesis reports a flaky replay instead of printing a shrunk one.
    failed_program: list[str] = field(default_factory=list)
    # The first error of this round, as (where, "Type: message"), and its example's program:
    # the campaign's headline when Hypothesis reports its replay of that example as flaky
    # (the replay failed otherwise, or not at all). ``begin_round`` clears them.
    first_error: tuple[str, str] | None = None
    first_program: list[str] = field(default_factory=list)
    # How the engine config narrowed the rules (RuleLimits.notes), once per distinct note.
    limits_notes: list[str] = field(default_factory=list)
    # Finished greedy requests the differential oracle compared with their lone run, and of
    # those, how many it judged only up to a near-tie (reference.py, Rule 2).
    reference_compared: int = 0
    reference_ties: int = 0
    # The engines' own traces (drain_trace, judged by Oracle.judge_engine_traces): drains
    # judged, records they dropped past their bound, and whether the engines refuse to
    # drain (they record no trace: the cross-checks are off for this client kind).
    engine_drains: int = 0
    engine_records_dropped: int = 0
    engine_untraced: bool = False

    def record_failure(self, where: str = "", error: BaseException | None = None,
                       program: list[str] | None = None) -> None:
        if self.first_failure is None:
            self.first_failure = (self.examples, time.monotonic() - self.started)
        if error is not None:
            self.errors = [*self.errors[-4:], f"{where}: {type(error).__name__}: {error}"]
            if self.first_error is None:
                self.first_error = (where, f"{type(error).__name__}: {error}")
                self.first_program = list(program or [])
        if program is not None:
            self.failed_program = list(program)

    def begin_round(self) -> None:
        """A new Hypothesis run (a round) starts: its first error is yet to come."""
        self.first_error = None
        self.first_program = []

    def step(self, name: str) -> None:
        self.steps += 1
        self.rules[name] += 1
        if self.on_step is not None:
            self.on_step()
