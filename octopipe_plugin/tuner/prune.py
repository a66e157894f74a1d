"""Drop empty stages from a plan: they only add hand-offs (and transfers) for no work."""

from __future__ import annotations

from dataclasses import replace

from ..formats.plan import Plan
from ..actions import Action


def drop_empty_stages(plan: Plan) -> Plan:
    """The same plan without stages that own no layer, later stages renumbered (at least one stage kept)."""
    keep = [s for s, st in enumerate(plan.stages) if st.end > st.start]
    if len(keep) == plan.num_stages or not keep:
        return plan
    new_index = {old: new for new, old in enumerate(keep)}
    # an empty stage spans no layers (start == end), so the kept stages still tile [0, n) as they are
    stages = [plan.stages[s] for s in keep]
    schedule = tuple(
        tuple(Action(new_index[a.stage], a.kind, a.microbatch) for a in row if a.stage in new_index)
        for row in plan.schedule
    )
    def renamed(a: Action) -> Action:
        return Action(new_index[a.stage], a.kind, a.microbatch)

    # a pair with a half on an empty stage goes (its other half runs alone)
    pairs = tuple(sorted((renamed(f), renamed(b)) for f, b in plan.pairs
                         if f.stage in new_index and b.stage in new_index))
    return replace(plan, stages=tuple(stages), schedule=schedule, pairs=pairs)
