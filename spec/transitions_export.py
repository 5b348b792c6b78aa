"""Our lifecycles as machines of the third-party ``transitions`` library.

Reviewers who already model with ``transitions`` can step a lifecycle interactively, or draw it
with that library's diagram extension, without learning our tables::

    from enginewire.spec import CLIENT, to_transitions
    from enginewire.spec.client import FULLY_AWAKE

    client = to_transitions(CLIENT)          # the machine is its own model
    client.handshake_ok()                    # CONSTRUCTING -> READY
    client.sleep_acked()                     # READY -> SLEEPING
    client.wake_acked(guard=FULLY_AWAKE)     # SLEEPING -> RUNNING
    client.state                             # 'running'

Theory of operation
-------------------
Rule 1: everything is read from the declaration: the states are the state enum's values, one
trigger per event named by the event's value (in enum order), one ``transitions`` row per table
row (in declaration order), and the terminal states are ``final``. Nothing here names a state.
Rule 2: the semantics are ours, not the library's defaults. An event the table does not allow
raises ``MachineError`` and leaves the state as it was, as ``Lifecycle.fire`` raises
``SpecViolation``; so no ``to_<state>`` auto transitions (rule 1 of every machine: nothing
assigns a state) and no silently ignored triggers.

A guard is passed to the trigger the way it is passed to ``Lifecycle.fire(event, guard)``: as
``guard=`` or the first positional argument (``transitions`` hands trigger arguments to every
condition). Each row carries one condition, "the guard passed is this row's guard", so a
guarded row fires only with its guard and an unguarded row only without one, exactly the
lookup ``Lifecycle`` does. ``model.may_<event>(guard=...)`` answers ``Lifecycle.can``.

Because a trigger whose conditions all fail merely returns False in ``transitions``, the
machine's events are a subclass that raises ``MachineError`` then; a catch-all row would have
done the same but would draw as a spurious edge. A self-loop is an ordinary reflexive row (its
exit and enter callbacks run, as our trace records a self-loop as a step); our tables have no
internal transitions, so none is emitted.

The ``transitions`` package is an optional dependency (the ``test`` and ``docs`` extras); it is
imported only when ``to_transitions`` is called, so ``enginewire.spec`` stays importable and
free of it.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from .machine import Machine

if TYPE_CHECKING:
    from transitions import Machine as TransitionsMachine
    from transitions.extensions.diagrams import GraphMachine

__all__ = ["to_transitions"]

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)

_MISSING = (
    "enginewire.spec.to_transitions needs the third-party `transitions` package; "
    "install it with `pip install transitions` (or `pip install 'enginewire[docs]'`)"
)
# Options that would change our semantics (rule 2) or duplicate what the declaration says.
_FIXED = frozenset({"states", "transitions", "auto_transitions", "ignore_invalid_triggers",
                    "ordered_transitions"})


def _passed_guard(args: tuple[Any, ...], kwargs: dict[str, Any], send_event: bool) -> Any:
    """The guard a trigger was called with: ``guard=``, else the first positional argument."""
    if send_event:  # callbacks then receive one EventData carrying the trigger's arguments
        data = args[0]
        args, kwargs = tuple(data.args), data.kwargs
    if "guard" in kwargs:
        return kwargs["guard"]
    return args[0] if args else None


class _GuardIs:
    """A row's condition: the trigger was called with exactly this row's guard."""

    # ``transitions`` labels a condition by its ``__name__`` in diagrams and skips empty names,
    # so guarded edges draw as ``event [guard]`` (like spec/diagrams.py) and others as ``event``.
    __name__: str

    def __init__(self, guard: str | None, send_event: bool) -> None:
        self.guard = guard
        self.send_event = send_event
        self.__name__ = guard or ""

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        return bool(_passed_guard(args, kwargs, self.send_event) == self.guard)

    def __repr__(self) -> str:
        return f"<guard is {self.guard!r}>"


@functools.cache
def _refusing_machine() -> type[TransitionsMachine]:
    from transitions import Event, EventData, MachineError
    from transitions import Machine as Base

    class RefusingEvent(Event):
        """An event whose rows all refuse raises, as ``Lifecycle.fire`` does (rule 2)."""

        def _process(self, event_data: EventData) -> bool:
            super()._process(event_data)
            if not event_data.result:
                # EventData holds the trigger's own arguments, whatever send_event says.
                guard = _passed_guard(tuple(event_data.args), event_data.kwargs, False)
                raise MachineError(
                    f"{self.machine.name}Can't trigger event {self.name} from state "
                    f"{event_data.state.name} with guard {guard!r}!"
                )
            return True

    class RefusingMachine(Base):
        event_cls = RefusingEvent

    return RefusingMachine


@functools.cache
def _refusing_graph_machine() -> type[GraphMachine]:
    from transitions.extensions.diagrams import GraphMachine as Base

    class RefusingGraphMachine(Base):
        event_cls = _refusing_machine().event_cls

    return RefusingGraphMachine


def to_transitions(
    machine: Machine[S, E],
    *,
    model: object | None = None,
    initial: S | None = None,
    graph: bool = False,
    **options: Any,
) -> TransitionsMachine:
    """An equivalent ``transitions.Machine`` for ``machine``; see the module docstring.

    ``model``: the object (or list of objects, as ``transitions`` accepts) that gets ``state``,
    one trigger method per event, ``may_<event>`` and ``is_<state>``; by default the returned
    machine is its own model. ``initial``: a member of ``machine.states`` to start in (default
    ``machine.initial``). ``graph``: build a ``transitions.extensions.GraphMachine`` instead,
    titled with the machine's name and showing guards as conditions; ``get_graph()`` then draws
    it (``graph_engine="mermaid"`` needs no Graphviz). Other ``options`` go to the ``transitions``
    constructor (callbacks, ``name``, ``send_event``, ``title``, ...), except those that would
    change the semantics: ``states``, ``transitions``, ``auto_transitions``,
    ``ignore_invalid_triggers`` and ``ordered_transitions``.

    Raises ``ImportError`` naming the fix when ``transitions`` is not installed.
    """
    # Imported on every call, not only in the cached factories, so a missing package is
    # reported here with its fix however often the function ran before.
    try:
        import transitions

        if graph:
            import transitions.extensions.diagrams  # noqa: F401
    except ImportError as err:
        raise ImportError(_MISSING) from err
    fixed = sorted(_FIXED & options.keys())
    if fixed:
        raise TypeError(f"to_transitions: {', '.join(fixed)} come from the declaration of "
                        f"{machine.name!r} and cannot be passed")
    start = machine.initial if initial is None else initial
    if not isinstance(start, machine.states):
        raise TypeError(f"to_transitions: initial {start!r} is not a {machine.states.__name__}")

    send_event = bool(options.get("send_event", False))
    options.setdefault("name", machine.name)
    cls: type[TransitionsMachine]
    if graph:
        options.setdefault("title", machine.name)
        options.setdefault("show_conditions", True)
        cls = _refusing_graph_machine()
    else:
        cls = _refusing_machine()
    out = cls(
        model=cls.self_literal if model is None else model,
        states=[{"name": s.value, "final": s in machine.terminal or s in machine.forgets}
                for s in machine.states],
        initial=start.value,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        **options,
    )
    for ev in machine.events:
        # An empty source list registers the trigger with no row, so every event has its
        # trigger in enum order, and one with no row refuses with MachineError too.
        out.add_transition(ev.value, source=[], dest=None)
    for t in machine.transitions:
        out.add_transition(t.event.value, source=t.source.value, dest=t.target.value,
                           conditions=[_GuardIs(t.guard, send_event)])
    return out
