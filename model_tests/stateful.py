"""The stateful campaign machines, one import away: ``from enginewire.testing.stateful import
EngineClientStateMachine, builtin_factory`` (``stateful_client.py``'s docstring shows the
run).

Each name lives in the module of its concept; this one re-exports them, so that programs,
reproducers and docs that import from here keep working:

- ``stateful_client.py``: ``EngineClientStateMachine``, the machine on one client and its
  engine, with its theory of operation;
- ``stateful_standalone.py``: ``StandaloneEngine``, ``AttachPool`` and
  ``StandaloneEngineStateMachine``, front ends attached one after another to one engine;
- ``stateful_base.py``: ``CampaignMachine``, what every campaign machine shares
  (``stateful_dp.py``'s data-parallel one too), and ``_after_end.py``, how it judges a
  client after its end;
- ``campaign_stats.py``: ``CampaignStats``, the counters a campaign's machines share;
- ``pools.py``: ``builtin_factory``, the warm-up, ``ClientPool`` and ``close_and_check``;
- ``bounds.py``: the time bounds and request sizes, and ``RuleLimits``.
"""

from __future__ import annotations

from .bounds import (
    ABORT_GAP_S,
    DEATH_BOUND_S,
    LONG_MAX_TOKENS,
    MAX_LIVE,
    MAX_PROMPT,
    MIN_JUDGED_LONG_TOKENS,
    MIN_MODEL_LEN,
    ORPHAN_MIN_LIFE,
    SHUTDOWN_BOUND_S,
    TIMEOUT_CALL_S,
    TIMEOUT_REPLY_DELAY_S,
    WAIT_MODE_TOKENS,
    WAIT_S,
    RuleLimits,
)
from .campaign_stats import CampaignStats
from .pools import WARMED as WARMED  # re-exported: tests/model_tests/test_process_warm_up.py
from .pools import (
    ClientFactory,
    ClientPool,
    builtin_factory,
    close_and_check,
    warm_up_engine,
    warm_up_process,
)
from .stateful_client import EngineClientStateMachine
from .stateful_standalone import (
    ATTACH_KINDS,
    ATTACHED_HEARTBEAT_TIMEOUT_S,
    LEFT_SEED,
    PROBE_SEED,
    PROBE_TOKENS,
    STANDALONE_DIR_PREFIX,
    STANDALONE_HEARTBEAT_S,
    AttachPool,
    StandaloneEngine,
    StandaloneEngineStateMachine,
)

__all__ = [
    "ABORT_GAP_S",
    "ATTACHED_HEARTBEAT_TIMEOUT_S",
    "ATTACH_KINDS",
    "DEATH_BOUND_S",
    "LEFT_SEED",
    "LONG_MAX_TOKENS",
    "MAX_LIVE",
    "MAX_PROMPT",
    "MIN_JUDGED_LONG_TOKENS",
    "MIN_MODEL_LEN",
    "ORPHAN_MIN_LIFE",
    "PROBE_SEED",
    "PROBE_TOKENS",
    "SHUTDOWN_BOUND_S",
    "STANDALONE_DIR_PREFIX",
    "STANDALONE_HEARTBEAT_S",
    "TIMEOUT_CALL_S",
    "TIMEOUT_REPLY_DELAY_S",
    "WAIT_MODE_TOKENS",
    "WAIT_S",
    "AttachPool",
    "CampaignStats",
    "ClientFactory",
    "ClientPool",
    "EngineClientStateMachine",
    "RuleLimits",
    "StandaloneEngine",
    "StandaloneEngineStateMachine",
    "builtin_factory",
    "close_and_check",
    "warm_up_engine",
    "warm_up_process",
]
