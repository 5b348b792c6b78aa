"""The harness's time bounds and the stateful machines' sizes: how long a death may take (the
one bound the conformance suite, the fault matrix and the stateful machines share), how long
the machines' waits and shutdowns may take, how large their rules' requests are, and
``RuleLimits``, what an engine config leaves of those sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .oracle import OracleViolation

# An engine's death is seen by its client within this many seconds of the fault, on every
# path: a blocked call woken, a pending one failed, a handshake refused. 1 s is the runtime's
# promise (docs/faults.md: a death seen later than 1 s after the fault fails its cell), timed
# by the conformance suite and the fault matrix from the kill or the fault's own record. A
# kill or an exit is seen in milliseconds (the sentinel, the exit code); the slow path is a
# SIGSTOPped engine, seen at the heartbeat deadline, which the fault matrix sets to fit in
# this bound with slack (fault_matrix's HEARTBEAT_TIMEOUT_S: 0.7 s, detected in 525-772 ms).
DEATH_BOUND_S = 1.0
# The stateful machines time a death from the start of the rule that causes it, which for a
# crash in a step comes before the fault is armed: the arming call's round trip and a request
# reaching the engine's next step, on a machine Hypothesis keeps busy, are inside the wait.
# One second more than the promise covers them (2 s, the campaign's bound since it began).
RULE_DEATH_BOUND_S = DEATH_BOUND_S + 1.0
# Ordinary waits: a drain, a utility reply (null-model drains take milliseconds).
WAIT_S = 10.0
# A client whose factory declares DEAD_DELIVERED_ONCE owes no second EngineDeadError once a
# read had one, and its read would then block for good: the machines read this long instead,
# and fail outputs (nothing follows a death). Whatever is queued is read at once; this only
# bounds the wait for more (the same 50 ms each read of the "queued, then the error" loop
# waits on a dead client).
READ_AFTER_DEATH_S = 0.05
# The conformance suite's upper bound on the same waits. It judges a user's client and engine
# (a real model's generation, a slow CI host), where only a hang must fail, so it allows six
# times the campaign's bound; the campaign keeps the short one, to fail fast mid-program.
CONFORMANCE_WAIT_S = 6 * WAIT_S
# A parent's death makes its engine exit within this many seconds (the lifeline's EOF, then
# the engine's own shutdown of a model that may hold a device).
ORPHAN_BOUND_S = 5.0
# A clean shutdown, SIGTERM to reaped, on a loaded machine.
SHUTDOWN_BOUND_S = 4.0
# Long enough that an abort sent right after its ADD lands first (null steps take tens of
# microseconds: thousands of tokens take far longer than the abort's trip). A config whose
# max_model_len allows fewer gets fewer (``RuleLimits``); see MIN_JUDGED_LONG_TOKENS.
LONG_MAX_TOKENS = 2000
# Below this many tokens a multi-process engine can finish an aborted request before the abort
# lands (the engine's input thread can wait a GIL switch interval, 5 ms, a few hundred null
# steps), so add_then_abort still races the abort but does not judge the ABORT ending.
MIN_JUDGED_LONG_TOKENS = 1000
# The longest prompt a rule sends (``add`` draws 1 to 8 tokens); fixed prompts have 2 or 3.
MAX_PROMPT = 8
# The shortest max_model_len the machine runs on: a 3-token fixed prompt and one token.
MIN_MODEL_LEN = 4
# The strict "abort right after ADD ends ABORT" check holds only when the client really sent
# the abort right after: a client descheduled longer than this between the two sends (a
# loaded CI machine) widens the allowed set to include a natural finish.
ABORT_GAP_S = 0.005
MAX_LIVE = 8
# The orphan check starts two interpreters (about a second): at most once per example, and
# only on an engine that has lived this many steps (the default of ``orphan_min_life``), so
# short or crash-heavy examples skip it.
ORPHAN_MIN_LIFE = 12
# The request a wait-mode pause drains: long enough to be running when the pause lands (null
# steps take tens of microseconds; the pause follows the ADD at once). Capped by
# max_model_len; a shorter one may finish first, which makes the drain trivial, not wrong.
WAIT_MODE_TOKENS = 500
# timed_out_utility: the call's timeout, and the engine-side delay of its reply. The margin
# between them is what a descheduled client thread may lose before the reply could beat the
# timeout (a false failure); the delay is also what the rule costs. 0.08 s was lost once in
# a 10-minute campaign at load 5 (2 cores; the reply beat the caller's wake-up): 0.25 s.
TIMEOUT_CALL_S = 0.01
TIMEOUT_REPLY_DELAY_S = 0.25


def check_shutdown_took(took: float) -> None:
    """OracleViolation when a shutdown that took ``took`` seconds passed SHUTDOWN_BOUND_S."""
    if took > SHUTDOWN_BOUND_S:
        raise OracleViolation(f"shutdown took {took:.1f} s (bound {SHUTDOWN_BOUND_S} s)")


@dataclass(frozen=True)
class RuleLimits:
    """What the engine config allows the rules, read once from the client's ``config``.

    Every request is sized so that ``max_model_len`` never ends it early: the oracle's LENGTH
    means exactly ``max_tokens`` tokens. A client without a config (or without a field) gets
    the built-in campaign's values."""

    max_model_len: int = LONG_MAX_TOKENS + MAX_PROMPT
    block_size: int = 16
    prefix_caching: bool = False

    @classmethod
    def of(cls, config: Any) -> RuleLimits:
        default = cls()
        return cls(int(getattr(config, "max_model_len", default.max_model_len)),
                   int(getattr(config, "block_size", default.block_size)),
                   bool(getattr(config, "enable_prefix_caching", False)))

    def cap(self, prompt_len: int, max_tokens: int) -> int:
        """``max_tokens``, or what max_model_len leaves after the prompt when that is less."""
        return max(1, min(max_tokens, self.max_model_len - prompt_len))

    @property
    def long_tokens(self) -> int:  # add_then_abort: a 3-token prompt
        return self.cap(3, LONG_MAX_TOKENS)

    @property
    def wait_tokens(self) -> int:  # the request a wait-mode pause drains: a 3-token prompt
        return self.cap(3, WAIT_MODE_TOKENS)

    @property
    def prefix_prompt_len(self) -> int | None:
        """prefix_cache_hit's prompt: one full block and one token more (None: cannot run)."""
        n = self.block_size + 1
        return n if self.prefix_caching and n < self.max_model_len else None

    def notes(self, multiprocess: bool) -> list[str]:
        """What this config changes in the rules, in words (a campaign prints them)."""
        out = []
        if self.long_tokens < LONG_MAX_TOKENS:
            judged = ("not judged: an abort can lose the race on a multi-process engine"
                      if multiprocess and self.long_tokens < MIN_JUDGED_LONG_TOKENS
                      else "still judged")
            out.append(f"add_then_abort: requests of {self.long_tokens} tokens, not"
                       f" {LONG_MAX_TOKENS} (max_model_len={self.max_model_len}); the ABORT"
                       f" ending is {judged}")
        if self.wait_tokens < WAIT_MODE_TOKENS:
            out.append(f"wait_mode/sleep(wait)/pause(wait): the drained request has"
                       f" {self.wait_tokens} tokens, not {WAIT_MODE_TOKENS}; it may finish"
                       " before the pause lands")
        if self.prefix_caching and self.prefix_prompt_len is None:
            out.append(f"prefix_cache_hit skipped: a {self.block_size + 1}-token prompt does not"
                       f" fit max_model_len={self.max_model_len}")
        return out
