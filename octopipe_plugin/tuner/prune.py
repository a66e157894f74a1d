"""Drop empty stages from a plan: they only add hand-offs (and transfers) for no work."""

from __future__ import annotations

from dataclasses import replace

from ..formats.plan import Plan, Stage
from ..schedules.actions import Action


def drop_empty_stages(plan: Plan) -> Plan:
    """The same plan without stages that own no layer, later stages renumbered (at least one stage kept)."""
    keep = [s for s, st in enumerate(plan.stages) if st.end > st.start]
    if len(keep) == plan.num_stages or not keep:
        return plan
    new_index = {old: new for new, old in enumerate(keep)}
    stages = [plan.stages[s] for s in keep]
    # the kept stages must still cover [0, n): stretch each to start where its predecessor ends
    stages = [replace(st, start=stages[i - 1].end if i else 0) for i, st in enumerate(stages)]
    stages[-1] = Stage(start=stages[-1].start, end=plan.stages[-1].end, device=stages[-1].device)
    schedule = tuple(
        tuple(Action(new_index[a.stage], a.kind, a.microbatch) for a in row if a.stage in new_index)
        for row in plan.schedule
    )
    return replace(plan, stages=tuple(stages), schedule=schedule)
