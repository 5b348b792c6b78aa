"""The campaign's reproducer: Hypothesis' falsifying program made runnable on its own, for
the client kind (built-in, standalone, a factory, data parallel) that ran it."""

from __future__ import annotations

__all__ = ["reproducer_program"]


def reproducer_program(lines: list[str], kind: str, model: str, faults: bool,
                       recorded: list[str] | None = None, factory: str | None = None,
                       dp: tuple[int, str] | None = None, *, elastic: bool = False,
                       front_ends: int = 1) -> str:
    """Hypothesis' falsifying program (printed steps, or the notes on its exception), made
    runnable on its own. When Hypothesis printed none (it reported the replay as flaky, as a
    timing-dependent failure can make it), the program the machine recorded of the
    failing example, not shrunk (the campaign passes the first failing one for a flaky
    report, whose printed steps are its replay's, and no lines)."""
    body = []
    for chunk in lines:
        for ln in str(chunk).splitlines():
            if ln.startswith("state") or ln.startswith("@reproduce_failure"):
                body.append(ln if ln.startswith("state") else f"# {ln}")
    if not any(ln.startswith("state") for ln in body) and recorded:
        body = ["# Not shrunk: Hypothesis reported its replay as flaky (the failure depends on",
                "# timing); this is the failing example as it ran.", *recorded]
    head = [
        "# Reproducer printed by `enginewire campaign`; paste it into a test.",
        "from enginewire.testing.campaign import _config",
    ]
    if front_ends > 1:
        engines = 1 if dp is None else dp[0]
        head += [
            "from enginewire.testing.stateful_fe import (",
            "    FrontEndsEngine, FrontEndsStateMachine, fe_config)",
            "",
            "# In a script, under `if __name__ == '__main__':` (the engine processes are spawned).",
            f"engine = FrontEndsEngine(fe_config(_config({model!r}"
            f"{'' if dp is None else f', {engines!r}'})),"
            f" front_ends={front_ends!r}, engines={engines!r})",
        ]
        made = f"state = FrontEndsStateMachine(engine, exact_tokens={model == 'null'!r})"
        first = "state = FrontEndsStateMachine("
    elif dp is not None:
        machine = "ElasticDPStateMachine" if elastic else "DataParallelStateMachine"
        head += [
            "from enginewire.testing.stateful import CampaignStats",
            "from enginewire.testing.stateful_dp import (",
            "    DataParallelStateMachine, DPClientPool, dp_factory)",
            *(["from enginewire.testing.stateful_dp_elastic import ElasticDPStateMachine"]
              if elastic else []),
            "",
            "# In a script, under `if __name__ == '__main__':` (the engine processes are spawned).",
            f"pool = DPClientPool(dp_factory({kind!r}, _config({model!r}, {dp[0]!r},"
            f" {dp[1]!r})), CampaignStats())",
        ]
        made = (f"state = {machine}(pool, kind={kind!r}, faults={faults!r},"
                f" exact_tokens={model == 'null'!r})")
        first = f"state = {machine}("
    elif kind == "standalone":
        head += [
            "from enginewire.testing.stateful import (",
            "    AttachPool, CampaignStats, StandaloneEngine, StandaloneEngineStateMachine)",
            "",
            "# In a script, under `if __name__ == '__main__':` (the engine process is spawned).",
            f"pool = AttachPool(StandaloneEngine(_config({model!r}), faults={faults!r}),"
            " CampaignStats())",
        ]
        made = (f"state = StandaloneEngineStateMachine(pool, faults={faults!r},"
                f" exact_tokens={model == 'null'!r})")
        first = "state = StandaloneEngineStateMachine("
    elif factory is not None:
        head += [
            "from enginewire.testing.campaign import load_factory",
            "from enginewire.testing.stateful import EngineClientStateMachine",
            "",
            f"factory = load_factory({factory!r})",
        ]
        made = (f"state = EngineClientStateMachine(factory, kind={kind!r}, faults={faults!r},"
                " exact_tokens=None)")
        first = "state = EngineClientStateMachine("
    else:
        head += [
            "from enginewire.testing.stateful import EngineClientStateMachine, builtin_factory",
            "",
            f"factory = builtin_factory({kind!r}, _config({model!r}), faults={faults!r})",
        ]
        made = (f"state = EngineClientStateMachine(factory, kind={kind!r}, faults={faults!r},"
                f" exact_tokens={model == 'null'!r})")
        first = "state = EngineClientStateMachine("
    out = [made if ln.startswith(first) else ln for ln in body]
    if front_ends > 1:
        out.append("engine.close()")
    elif kind == "standalone" or dp is not None:
        out.append("pool.close()")
    return "\n".join(head + out)
