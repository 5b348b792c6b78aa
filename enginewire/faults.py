"""enginewire.faults: the failure-injection harness (stable, documented API; docs/faults.md).

Break an engine on purpose and check that the front end survives it as the spec says:

* ``FaultPlan`` / ``Fault`` with ``FaultPoint`` and ``FaultAction``: faults armed in the
  engine process at start-up (client option ``engine_fault=plan``) or at run time through the
  ``arm_fault`` utility when the plan sets ``allow_arm=True``;
* ``Interposer`` with ``FrameRule``: a ZMQ proxy that drops, delays, duplicates, reorders,
  truncates or bit-flips frames (client option ``engine_connect=proxy.engine_addresses``);
* ``run_fault_matrix``: every fault at every point in every lifecycle state, checked against
  the spec, with detection latency and leaks; ``enginewire faults matrix [--quick]``;
* ``run_dp_fault_matrix``: a fault on one engine of a data-parallel client while the others
  serve (``enginewire faults matrix --engines 2``).
"""

from __future__ import annotations

from .runtime.faults import (
    ARM_FAULT_UTILITY,
    Fault,
    FaultAction,
    FaultInjector,
    FaultPlan,
    FaultPoint,
    InjectedFault,
    InjectedOOM,
)
from .testing.fault_matrix import (
    Cell,
    CellResult,
    Outcome,
    Scenario,
    expected_outcome,
    matrix_cells,
    run_cell,
    run_fault_matrix,
)
from .testing.fault_matrix_dp import run_dp_fault_matrix
from .testing.interposer import Direction, FrameAction, FrameKind, FrameRule, Interposer

__all__ = [
    "ARM_FAULT_UTILITY",
    "Cell",
    "CellResult",
    "Direction",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "FaultPlan",
    "FaultPoint",
    "FrameAction",
    "FrameKind",
    "FrameRule",
    "InjectedFault",
    "InjectedOOM",
    "Interposer",
    "Outcome",
    "Scenario",
    "expected_outcome",
    "matrix_cells",
    "run_cell",
    "run_dp_fault_matrix",
    "run_fault_matrix",
]
