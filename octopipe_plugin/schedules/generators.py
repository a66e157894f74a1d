"""Built-in schedule generators: plain functions (stage devices, devices, micro-batches) -> per-device lists.

Every generator has the signature `generate(stage_devices, num_devices, num_microbatches)`
and returns one tuple of Actions per device. Each first checks that the stage map is the
placement it was written for and refuses other inputs with a PlanError saying why.

Overlapped pairs: the schedules that run the forward of one micro-batch and the backward of
another on one device at once (DualPipeV's "F & B" steps, Megatron's combined 1F1B with
`--overlap-moe-expert-parallel-comm`) return an `actions.PairedSchedule`: the same per-device
tuple, each pair's two actions adjacent (forward first), plus `.pairs`, which
`schedules.registry.build_plan` moves into `Plan.pairs`. The simulator prices a pair as its two
phase sequences interleaved (simulator/pairs.py), so the all-to-all one half hides behind the
other's compute is priced; for layers without communication phases a pair costs exactly its two
actions one after the other, so order, memory and the step of such models are those of the
same actions unpaired.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial

from ..errors import PlanError
from ..actions import Action, B, F, I, PairedSchedule, W
from .placement import looped, v_shape

Schedule = tuple[tuple[Action, ...], ...]


def _require_map(name: str, stage_devices: Sequence[int], expected: list[int]) -> None:
    if list(stage_devices) != expected:
        raise PlanError(f"{name}: needs stage->device map {expected}, got {list(stage_devices)}")


def _stages_per_device(name: str, stage_devices: Sequence[int], num_devices: int) -> int:
    if num_devices < 1 or len(stage_devices) % num_devices:
        raise PlanError(f"{name}: {len(stage_devices)} stages do not divide over {num_devices} devices")
    return len(stage_devices) // num_devices


def _check_m(name: str, m: int, minimum: int = 1) -> None:
    if m < minimum:
        raise PlanError(f"{name}: needs at least {minimum} micro-batches, got {m}")


def gpipe(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (micro-batch order), one stage per device."""
    _require_map("gpipe", stage_devices, looped(num_devices, 1))
    _check_m("gpipe", num_microbatches)
    m = num_microbatches
    return tuple(tuple([F(r, i) for i in range(m)] + [B(r, i) for i in range(m)]) for r in range(num_devices))


def one_f_one_b(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush / Megatron non-interleaved): p-r-1 warm-up forwards, then F/B pairs."""
    _require_map("1f1b", stage_devices, looped(num_devices, 1))
    _check_m("1f1b", num_microbatches)
    m, p = num_microbatches, num_devices
    return tuple(tuple(_warm_steady_drain(min(p - r - 1, m), m, partial(F, r), partial(B, r))) for r in range(p))


def _warm_steady_drain(warm: int, total: int, fwd, bwd, wgrad=None, held: int = 0) -> list[Action]:
    """One rank's list: `warm` forwards, then a forward (while any is left) and a backward per step.

    With `wgrad` the backward is the I part: after the j-th I (j >= held) comes the W of the
    (j - held)-th, and the last `held` W's close the list (ZB-H1's deferred weight gradients).
    `fwd(k)`, `bwd(k)` and `wgrad(k)` make the rank's k-th action of their kind.
    """
    row = [fwd(k) for k in range(warm)]
    for j in range(total):
        if warm + j < total:
            row.append(fwd(warm + j))
        row.append(bwd(j))
        if wgrad is not None and j >= held:
            row.append(wgrad(j - held))
    if wgrad is not None:
        row += [wgrad(j) for j in range(max(0, total - held), total)]
    return row


def megatron_group_size(num_devices: int, num_microbatches: int) -> int:
    """Megatron's microbatch_group_size_per_vp_stage: p by default, else the smallest size it accepts.

    Megatron accepts a group size g in [p, m] whose last group (m % g) is empty or >= p;
    its default g = p covers m % p == 0, and for other m the user must pick g, which we do.
    """
    p, m = num_devices, num_microbatches
    for g in range(p, m + 1):
        if m % g == 0 or m % g >= p:
            return g
    raise PlanError(f"interleaved-1f1b: Megatron needs at least {p} micro-batches (one per device), got {m}")


def megatron_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """Megatron's get_schedule_table: (micro-batch, chunk) of each virtual micro-batch id."""
    table = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table += [(mb, c) for c in range(num_chunks) for mb in range(lo, hi)]
    return table


def interleaved_1f1b(stage_devices: Sequence[int], num_devices: int, num_microbatches: int,
                     group_size: int | None = None) -> Schedule:
    """Megatron-core's forward_backward_pipelining_with_interleaving, action for action.

    Warm-up of rank r: 2(p-r-1) + (v-1)g virtual micro-batches (capped at v*m); then one
    forward and one backward per step; then the remaining backwards. With v = 1 Megatron runs
    the non-interleaved schedule, so that is what this returns.
    """
    p, m = num_devices, num_microbatches
    v = _stages_per_device("interleaved-1f1b", stage_devices, p)
    if v == 1:
        return one_f_one_b(stage_devices, p, m)
    _require_map("interleaved-1f1b", stage_devices, looped(p, v))
    if p == 1:
        raise PlanError("interleaved-1f1b: Megatron runs no pipeline schedule with one device; use 1 stage")
    g = _megatron_group("interleaved-1f1b", p, m, group_size)
    table = megatron_table(m, v, g)
    total = m * v
    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * g, total)
        out.append(tuple(_warm_steady_drain(warm, total, *_megatron_rank(table, p, v, r))))
    return tuple(out)


def _megatron_group(name: str, p: int, m: int, group_size: int | None) -> int:
    """Megatron's micro-batch group size (given, else `megatron_group_size`), refused where Megatron refuses it."""
    g = group_size if group_size is not None else megatron_group_size(p, m)
    if not p <= g <= m or 0 < m % g < p:
        raise PlanError(f"{name}: group size {g} must be in [p={p}, m={m}] with m % g == 0 or >= p")
    return g


def _megatron_rank(table, p: int, v: int, r: int):
    """(fwd, bwd) of rank r in Megatron's interleaved schedule: the action of virtual micro-batch k (`table`),
    forwards walking the chunks up, backwards down."""
    def fwd(k: int) -> Action:
        mb, c = table[k]
        return F(c * p + r, mb)

    def bwd(k: int) -> Action:
        mb, c = table[k]
        return B((v - 1 - c) * p + r, mb)

    return fwd, bwd


def combined_1f1b(stage_devices: Sequence[int], num_devices: int, num_microbatches: int,
                  group_size: int | None = None) -> PairedSchedule:
    """Megatron-core's combined 1F1B (`--overlap-moe-expert-parallel-comm`), action for action, merged steps as pairs.

    With the flag on, megatron-core 0.19.2 runs forward_backward_pipelining_with_interleaving
    (pipeline_parallel/schedules.py) with one change to the order and one to the execution:

    - the warm-up takes one more forward: get_pp_rank_microbatches, schedules.py:937-943,
      `2(p-r-1) + (v-1)g` "+ 1" "to ensure the forward and backward computations are
      independent in all 1f1b steps", capped at v*m (schedules.py:949-951);
    - every steady-state step (schedules.py:1706-1708 and 1863/1875: forward virtual
      micro-batch k + warm-up with backward virtual micro-batch k) goes through
      forward_backward_helper_wrapper's combined path (schedules.py:1458-1459) into
      combined_1f1b_schedule_for_interleaved_pipelining and combined_forward_backward_step
      (pipeline_parallel/combined_1f1b.py), which runs that F and that B as one merged unit:
      TransformerModelChunkSchedulePlan.run (models/common/model_chunk_schedule_plan.py:488,
      544-562) overlaps forward layer i with backward layer n-1-i, each layer's dispatch and
      combine all-to-alls of one micro-batch beside the other's attention / expert compute
      (TransformerLayerSchedulePlan.run, model_chunk_schedule_plan.py:224-266). Those steps are
      this schedule's pairs (F first: `F(k + warm-up) + B(k)`); the warm-up forwards
      (schedules.py:1546, 1595) and the cool-down backwards (schedules.py:1944, 1985) run alone.

    Micro-batch and chunk of a virtual micro-batch come from Megatron's get_schedule_table
    (`megatron_table`), backwards walking the chunks down, as in `interleaved_1f1b`. With one
    device Megatron has no pipeline: combined_1f1b_schedule_for_no_pipelining
    (combined_1f1b.py:35, 76-133, schedules.py:751) runs F0, then F(i+1) with B(i), then B(m-1),
    which is this order with p = 1 (warm-up 1). With p > 1 megatron-core overlaps only in the
    interleaved function (transformer_config.py:2674-2678 requires a virtual pipeline size), so
    v = 1 here is that function with virtual_pipeline_model_parallel_size = 1 (warm-up
    2(p-r-1) + 1, m >= p), not the non-interleaved 1F1B; Megatron-LM's command line maps a
    virtual size of 1 to None (training/arguments.py:917, 944) and so needs v >= 2.

    Order differs from `interleaved_1f1b` only by the extra warm-up forward; memory is one more
    live activation per device. Looped placement, v >= 1 stages per device; m >= p (Megatron's
    micro-batch groups, `megatron_group_size`); one device serves v = 1 and any m.
    """
    name = "combined-1f1b"
    p, m = num_devices, num_microbatches
    v = _stages_per_device(name, stage_devices, p)
    _require_map(name, stage_devices, looped(p, v))
    _check_m(name, m)
    if p == 1:
        if v > 1:
            raise PlanError(f"{name}: Megatron runs no pipeline schedule with one device; use 1 stage")
        g = 1
    else:
        if m < p:
            raise PlanError(f"{name}: Megatron needs at least {p} micro-batches (one per device), got {m}")
        g = _megatron_group(name, p, m, group_size)
    table = megatron_table(m, v, g)
    total = m * v
    rows, pairs = [], []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * g + 1, total)
        fwd, bwd = _megatron_rank(table, p, v, r)
        rows.append(tuple(_warm_steady_drain(warm, total, fwd, bwd)))
        pairs += [(fwd(k + warm), bwd(k)) for k in range(total - warm)]  # each steady step's F merged with its B
    return PairedSchedule(rows, pairs)


def zb_h1(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B's warm-up with B split into I and W; rank r defers r W's.

    A W follows each I once rank r has r W's outstanding (the W placement of torch's
    ScheduleInterleavedZeroBubble); the deferred W's fill the drain at the end. Every rank then
    peaks at p live activations, 1F1B's peak, and with F = I = W the idle time is a third of 1F1B's.
    """
    _require_map("zb-h1", stage_devices, looped(num_devices, 1))
    _check_m("zb-h1", num_microbatches)
    m, p = num_microbatches, num_devices
    return tuple(tuple(_warm_steady_drain(min(p - r - 1, m), m, partial(F, r), partial(I, r), partial(W, r), held=r))
                 for r in range(p))


def zb_round_size(num_devices: int, num_microbatches: int, num_chunks: int) -> int:
    """Micro-batches per round of interleaved ZB, g = m // max(1, m // p), as torch computes it.

    Forwards visit the chunks in blocks of one round, so with v > 1 the rounds must divide m
    (torch's ScheduleInterleavedZeroBubble refuses the rest too); with v = 1 the round size does
    not shape the order, and any m is served.
    """
    p, m = num_devices, num_microbatches
    rounds = max(1, m // p)
    if num_chunks > 1 and m % rounds:
        raise PlanError(f"interleaved-zb: m={m} micro-batches must be a multiple of the number of rounds "
                        f"max(1, m // p) = {rounds} on {p} devices with {num_chunks} stages per device "
                        f"(as torch's ScheduleInterleavedZeroBubble requires)")
    return m // rounds


def interleaved_zb(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> Schedule:
    """Interleaved zero bubble (ZB1P of Qi et al. 2024, torch's ScheduleInterleavedZeroBubble order).

    Looped placement, v >= 1 stages per device, rounds of g = m // max(1, m // p) micro-batches.
    Rank r warms up with (v-1)g + p-1-r forwards (capped at v*m), then issues one F and one I
    per step, forwards walking the chunks upward and backwards downward, a round at a time.
    Like ZB-H1 it holds back r W's: after its j-th I (j >= r) it runs the W of the (j-r)-th I,
    and the last r W's fill the drain. With v = 1 this is exactly zb-h1.
    """
    p, m = num_devices, num_microbatches
    v = _stages_per_device("interleaved-zb", stage_devices, p)
    _require_map("interleaved-zb", stage_devices, looped(p, v))
    _check_m("interleaved-zb", m)
    g = zb_round_size(p, m, v)
    return tuple(tuple(_interleaved_zb_rank(p, v, m, g, r)) for r in range(p))


def _interleaved_zb_rank(p: int, v: int, m: int, g: int, r: int) -> list[Action]:
    total = v * m

    def chunk_mb(k: int) -> tuple[int, int]:
        """(chunk position, micro-batch) of a rank's k-th forward: rounds of g, every chunk per round."""
        return (k // g) % v, (k // (g * v)) * g + k % g

    def fwd(k: int) -> Action:
        c, mb = chunk_mb(k)
        return F(c * p + r, mb)

    def bwd(make, k: int) -> Action:
        c, mb = chunk_mb(k)  # backwards walk the chunks from the last one down
        return make((v - 1 - c) * p + r, mb)

    # One warm-up forward per hop to the last device (Megatron's interleaving takes two): the first
    # I comes back sooner, and the r held-back W's lift every rank to the same peak, (v-1)g + p.
    warm = min((v - 1) * g + p - 1 - r, total)
    return _warm_steady_drain(warm, total, fwd, lambda k: bwd(I, k), lambda k: bwd(W, k), held=r)


def zb_v(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two stages per device in a V, F/I/W split, as torch orders it.

    Built for max(m, 2p-1) micro-batches and cut back to m (torch's ScheduleZBVZeroBubble does
    the same), so any m >= 1 is served.
    """
    p, m = num_devices, num_microbatches
    _require_map("zb-v", stage_devices, v_shape(p, 2))
    _check_m("zb-v", m)
    out = []
    for r in range(p):
        row = _zb_v_rank(p, r, max(2 * p - 1, m))
        out.append(tuple(a for a in row if a.microbatch < m))
    return tuple(out)


def _zb_v_rank(p: int, r: int, n: int) -> list[Action]:
    s0, s1 = r, 2 * p - 1 - r
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    row: list[Action] = []

    def op(key: str, make, stage: int) -> None:
        row.append(make(stage, cnt[key]))
        cnt[key] += 1

    for _ in range(2 * (p - r) - 1):
        op("f0", F, s0)
    for _ in range(r):
        op("f1", F, s1)
        op("f0", F, s0)
    for _ in range(p - r):
        op("f1", F, s1)
        row += [I(s1, cnt["b1"]), W(s1, cnt["b1"])]
        cnt["b1"] += 1
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
        if cnt["f0"] < n:
            op("f0", F, s0)
        row += [I(s0, cnt["b0"]), W(s0, cnt["b0"])]
        cnt["b0"] += 1
        op("f1", F, s1)
        row += [I(s1, cnt["b1"]), W(s1, cnt["b1"])]
        cnt["b1"] += 1
    w0, w1 = cnt["b0"], cnt["b1"]
    for _ in range(r):
        op("b0", I, s0)
        op("b1", I, s1)
    for _ in range(p - r):
        op("b0", I, s0)
        row.append(W(s0, w0))
        w0 += 1
    row += [W(s1, i) for i in range(w1, cnt["b1"])]
    row += [W(s0, i) for i in range(w0, cnt["b0"])]
    return row


def dualpipev(stage_devices: Sequence[int], num_devices: int, num_microbatches: int) -> PairedSchedule:
    """DualPipeV (DeepSeek; torch's ScheduleDualPipeV order): V placement, its overlapped F&B steps as pairs.

    The main phase's "F0 & B1" and "F1 & B0" steps, and phase 5's "F1 & B0", are overlapped
    pairs, as DeepSeek's `_forward_backward_chunk` and torch's OVERLAP_F_B run them (the last
    rank's first main step runs its F0 and B1 apart, as both do). Needs m >= 2p micro-batches
    (one per stage), like DeepSeek's and torch's implementations.
    """
    p, m = num_devices, num_microbatches
    _require_map("dualpipev", stage_devices, v_shape(p, 2))
    if m < 2 * p:
        raise PlanError(f"dualpipev: needs at least 2 x devices = {2 * p} micro-batches, got {m}")
    ranks = [_DualPipeVRank(p, r) for r in range(p)]
    rows = [tuple(rank.build(m)) for rank in ranks]
    return PairedSchedule(rows, [pair for rank in ranks for pair in rank.pairs])


class _DualPipeVRank:
    """Builds one rank's list step by step; the counters are per (stage, kind) as in DualPipe."""

    def __init__(self, p: int, r: int):
        self.p, self.r = p, r
        self.s0, self.s1 = r, 2 * p - 1 - r
        self.next_mb: dict[tuple[int, str], int] = {}
        self.weights: deque[tuple[int, int]] = deque()
        self.row: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []

    def _take(self, stage: int, kind: str) -> int:
        mb = self.next_mb.get((stage, kind), 0)
        self.next_mb[(stage, kind)] = mb + 1
        return mb

    def f(self, stage: int) -> None:
        """The stage's next forward."""
        self.row.append(F(stage, self._take(stage, "F")))

    def b(self, stage: int, split: bool = False) -> None:
        """Backward input part; a fused B when not split, an I with its W queued when split."""
        mb = self._take(stage, "B")
        if split:
            self.row.append(I(stage, mb))
            self.weights.append((stage, mb))
        else:
            self.row.append(B(stage, mb))

    def fb(self, f_stage: int, b_stage: int) -> None:
        """An overlapped pair: the next forward of `f_stage` with the next fused backward of `b_stage`."""
        self.f(f_stage)
        self.b(b_stage)
        self.pairs.append((self.row[-2], self.row[-1]))

    def w(self) -> None:
        """The oldest queued W, if any."""
        if self.weights:
            stage, mb = self.weights.popleft()
            self.row.append(W(stage, mb))

    def build(self, m: int) -> list[Action]:
        """The rank's whole list for `m` micro-batches, DualPipeV's eight phases in order."""
        p, r, s0, s1 = self.p, self.r, self.s0, self.s1
        for _ in range((p - r - 1) * 2):  # 1: F0 warm-up
            self.f(s0)
        for _ in range(r + 1):  # 2: F0 F1
            self.f(s0)
            self.f(s1)
        for _ in range(p - r - 1):  # 3: I1 W1 F1 (zero bubble)
            self.b(s1, split=True)
            self.w()
            self.f(s1)
        for i in range(m - 2 * p + r + 1):  # 4: main, overlapped (F0 & B1), (F1 & B0)
            if i == 0 and r == p - 1:  # the last rank's first F0, B1 run apart in DualPipe (a smaller bubble)
                self.f(s0)
                self.b(s1)
            else:
                self.fb(s0, s1)
            self.fb(s1, s0)
        for _ in range(p - r - 1):  # 5: B1, overlapped (F1 & B0)
            self.b(s1)
            self.fb(s1, s0)
        split = False
        for i in range(r + 1):  # 6: B1 B0, second half zero-bubble
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.b(s1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.b(s0, split)
        for _ in range(p - r - 1):  # 7: W0 B0
            self.w()
            self.b(s0, split)
        for _ in range(r + 1):  # 8: W drain
            self.w()
        if self.weights:
            raise AssertionError(f"dualpipev rank {r}: {len(self.weights)} W left undrained")
        return self.row
