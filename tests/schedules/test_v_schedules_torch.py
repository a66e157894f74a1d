"""ZB-V and DualPipeV against the source of each schedule: torch's ScheduleZBVZeroBubble and ScheduleDualPipeV.

Oracle: the `pipeline_order` torch computes in the schedules' constructors (built with duck-typed
stages, no process group: the constructors only read group_size / group_rank / num_stages /
stage_index of the stages), as tests/schedules/test_interleaved_zb.py does for interleaved-ZB.

ZB-V compares one to one: the same F, I and W in the same order on every rank, and both serve
every m >= 1 (torch, like us, builds for max(m, 2p - 1) micro-batches and drops the extra ones).

DualPipeV also compares one to one. Torch writes the steady state's overlapped steps as one
action, `(0F3;3B1)OVERLAP_F_B` (DeepSeek's runtime runs that F and that B at the same time,
hiding one's communication behind the other's compute); our generator writes the same step as
the overlapped pair `0F3+3B1`: its two actions adjacent, F first, listed in the schedule's
`pairs`. Expanding each torch pair into its sub-actions gives exactly our list on every rank
(fused B inside the pairs and I/W in the cool-down included), and torch's pairs are exactly
ours. Both refuse m < 2p (one micro-batch per stage).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from octopipe_plugin.actions import format_schedule
from octopipe_plugin.errors import PlanError
from octopipe_plugin.schedules.generators import dualpipev, zb_v
from octopipe_plugin.schedules.placement import v_shape

GRID = [(p, m) for p in range(1, 7) for m in range(1, 4 * p + 3)]


def _torch_stage(p: int, s: int) -> SimpleNamespace:
    return SimpleNamespace(submod=None, num_stages=2 * p, group_size=p, group_rank=0, stage_index=s,
                           is_first=s == 0, is_last=s == 2 * p - 1)


def _expanded(action) -> list[str]:
    """An action's text; an OVERLAP_F_B pair becomes its sub-actions, in torch's order (F, then B)."""
    subs = getattr(action, "sub_actions", None)
    return [str(a) for a in subs] if subs else [str(action)]


def torch_order(schedule_cls, p: int, m: int) -> list[list[str]] | None:
    """Every rank's compute actions in torch's pipeline_order (idle slots dropped); None when torch refuses."""
    try:
        sched = schedule_cls([_torch_stage(p, 0), _torch_stage(p, 2 * p - 1)], m)
    except ValueError:
        return None
    return [[t for a in sched.pipeline_order[r] if a is not None for t in _expanded(a)] for r in range(p)]


def torch_pairs(schedule_cls, p: int, m: int) -> list[list[str]]:
    """Every rank's OVERLAP_F_B actions as `F+B` text, in order."""
    sched = schedule_cls([_torch_stage(p, 0), _torch_stage(p, 2 * p - 1)], m)
    return [["+".join(str(s) for s in a.sub_actions) for a in sched.pipeline_order[r]
             if a is not None and getattr(a, "sub_actions", None)] for r in range(p)]


def our_order(generate, p: int, m: int) -> list[list[str]] | None:
    """Our generator's per-device lists as text; None when it refuses."""
    try:
        return [[str(a) for a in row] for row in generate(v_shape(p, 2), p, m)]
    except PlanError:
        return None


@pytest.mark.timeout(120)
def test_zb_v_is_torchs_order():
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    for p, m in GRID:
        want = torch_order(ScheduleZBVZeroBubble, p, m)
        assert want is not None, (p, m)  # any m >= 1
        assert our_order(zb_v, p, m) == want, (p, m)


@pytest.mark.timeout(120)
def test_dualpipev_is_torchs_order_and_its_overlapped_steps_are_our_pairs():
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    pairs = 0
    for p, m in GRID:
        want = torch_order(ScheduleDualPipeV, p, m)
        assert (want is None) == (m < 2 * p), (p, m)
        assert our_order(dualpipev, p, m) == want, (p, m)
        if want is not None:
            ours = dualpipev(v_shape(p, 2), p, m)
            entries = format_schedule(ours, ours.pairs)
            mine = [[e for e in row if "+" in e] for row in entries]
            assert mine == torch_pairs(ScheduleDualPipeV, p, m), (p, m)
            assert sum(map(len, mine)) == len(ours.pairs)
            pairs += len(ours.pairs)
    assert pairs > 100  # the overlapped steady state is really exercised, not only warm-up and cool-down
