"""The list scheduler's event loop compiled with numba: the same decisions as `listsched._Scheduler`.

`listsched.build_schedule` calls this for large jobs when numba is installed (scripts/install.sh
installs it); the pure-Python `_Scheduler` stays the reference, and the tests require both to
return the same orders. Everything here is flat arrays: no Python object per action.

Kind codes are `actions.CODE`. What each kind costs, frees and sends is passed in as arrays that
`listsched` builds from the kind table (actions.RULES, simulator.costs, simulator.memory), so the
rules stay stated once; what is kind-specific here is the scheduling policy itself.
"""

from __future__ import annotations

import numpy as np

try:  # numba is optional: without it the Python scheduler runs
    from numba import njit
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None

from ..actions import CODE, Kind

F, B, I, W = CODE[Kind.F], CODE[Kind.B], CODE[Kind.I], CODE[Kind.W]  # the simulator's kind codes
FUSED, SPLIT, AUTO = 0, 1, 2
PAIR = 100  # a decision: the forward of stage s2 and the backward of stage s as one overlapped pair
INF = np.inf

AVAILABLE = njit is not None


def _jit(fn):
    return njit(cache=True, nogil=True)(fn) if AVAILABLE else fn


@_jit
def _push(ht, hd, hv, size, t, d, v):
    """Push (t, d, v) on the binary min-heap held in ht/hd/hv; returns the new size."""
    i = size
    ht[i], hd[i], hv[i] = t, d, v
    while i > 0:
        p = (i - 1) >> 1
        if ht[p] < ht[i] or (ht[p] == ht[i] and (hd[p] < hd[i] or (hd[p] == hd[i] and hv[p] <= hv[i]))):
            break
        ht[p], ht[i] = ht[i], ht[p]
        hd[p], hd[i] = hd[i], hd[p]
        hv[p], hv[i] = hv[i], hv[p]
        i = p
    return size + 1


@_jit
def _pop(ht, hd, hv, size):
    """Remove the heap's top (read it first); returns the new size."""
    size -= 1
    ht[0], hd[0], hv[0] = ht[size], hd[size], hv[size]
    i = 0
    while True:
        l, r, s = 2 * i + 1, 2 * i + 2, i
        if l < size and (ht[l] < ht[s] or (ht[l] == ht[s] and (hd[l] < hd[s] or (hd[l] == hd[s] and hv[l] < hv[s])))):
            s = l
        if r < size and (ht[r] < ht[s] or (ht[r] == ht[s] and (hd[r] < hd[s] or (hd[r] == hd[s] and hv[r] < hv[s])))):
            s = r
        if s == i:
            break
        ht[s], ht[i] = ht[i], ht[s]
        hd[s], hd[i] = hd[i], hd[s]
        hv[s], hv[i] = hv[i], hv[s]
        i = s
    return size


@_jit
def _back_kind(split_d, s):
    """The kind code a backward of stage s runs as under a device's split mode (listsched._backward_kind)."""
    return B if split_d == FUSED or (split_d == AUTO and s == 0) else I


@_jit
def _b_ready(s, m, next_b, f_end, grad_arr):
    """When stage s's next backward can start (its F ended, its gradient in), or -1 while either is unknown."""
    mb = next_b[s]
    if mb >= m:
        return -1.0
    idx = s * m + mb
    fe, g = f_end[idx], grad_arr[idx]
    if fe < 0 or g < 0:
        return -1.0
    return fe if fe > g else g


@_jit
def _decide(d, m, dev_ptr, dev_stages, low, headroom, f_end, act_arr, grad_arr, next_f, next_b, free, live,
            inflight, wq_s, wq_head, wq_tail, depth, w_limit, w_fill_always, f_deep, b_deep, dur, change, cap,
            split, pair_on, hid):
    """(time, kind, stage, forward stage of a pair) of device d's next action; kind -1 when it must wait for news."""
    t0 = free[d]
    nxt = INF
    blocked = False
    for j in range(dev_ptr[d], dev_ptr[d + 1]):
        s = dev_stages[j]
        r = _b_ready(s, m, next_b, f_end, grad_arr)
        if r >= 0 and r < nxt:
            nxt = r
        mb = next_f[s]
        if mb < m:
            a = act_arr[s * m + mb]
            if a < 0:
                continue
            entry = s == low[d]
            if entry and inflight[d] >= depth[d]:
                continue
            if live[d] + change[F, s] + (headroom[d] if entry else 0) > cap[d]:
                blocked = True
                continue
            if a < nxt:
                nxt = a
    nw = wq_tail[d] - wq_head[d]
    if nw > 0 and (blocked or nw > w_limit[d]):
        return t0, W, -1, -1
    if nxt > t0 and nw > 0:
        w_dur = dur[W, wq_s[d, wq_head[d]]]
        if w_fill_always or nxt == INF or nxt - t0 >= w_dur:
            return t0, W, -1, -1
    if nxt == INF:
        return INF, -1, -1, -1
    t = t0 if t0 > nxt else nxt
    # a ready backward first: the deepest stage, or (shallow) the fewest done, deepest on ties
    best_b = -1
    for j in range(dev_ptr[d], dev_ptr[d + 1]):
        s = dev_stages[j]
        r = _b_ready(s, m, next_b, f_end, grad_arr)
        if r >= 0 and r <= t:
            if best_b < 0 or (b_deep and s > best_b) or (
                    not b_deep and (next_b[s] < next_b[best_b] or (next_b[s] == next_b[best_b] and s > best_b))):
                best_b = s
    # with a ready backward, only a forward that hides some of the pair's communication is a candidate
    bk = -1
    if best_b >= 0:
        if not pair_on:
            return t, B, best_b, -1
        bk = 0 if _back_kind(split[d], best_b) == B else 1
    # (with a pair: among forwards whose input is in or due within less than the pair hides; it starts once both are)
    best_f = -1
    best_a = 0.0
    for j in range(dev_ptr[d], dev_ptr[d + 1]):
        s = dev_stages[j]
        mb = next_f[s]
        if mb < m:
            a = act_arr[s * m + mb]
            if a < 0 or (bk < 0 and a > t):
                continue
            if bk >= 0 and (hid[bk, s, best_b] <= 0.0 or (a > t if pair_on == 1 else a - t >= hid[bk, s, best_b])):
                continue
            entry = s == low[d]
            if entry and inflight[d] >= depth[d]:
                continue
            if live[d] + change[F, s] + (headroom[d] if entry else 0) > cap[d]:
                continue
            if best_f < 0 or (f_deep and s > best_f) or (not f_deep and s < best_f):
                best_f = s
                best_a = a
    if best_b >= 0:
        if best_f >= 0:
            return (t if t > best_a else best_a), PAIR, best_b, best_f
        return t, B, best_b, -1
    if pair_on == 2 and best_f >= 0:  # the forward also waits for a backward due within less than the pair hides
        due_b = -1
        due_r = INF
        for j in range(dev_ptr[d], dev_ptr[d + 1]):
            s = dev_stages[j]
            r = _b_ready(s, m, next_b, f_end, grad_arr)
            if r >= 0 and r - t < hid[0 if _back_kind(split[d], s) == B else 1, best_f, s] and r < due_r:
                due_r = r
                due_b = s
        if due_b >= 0:
            return (t if t > due_r else due_r), PAIR, due_b, best_f
    return t, F, best_f, -1


@_jit
def schedule_kernel(m, devices, dur, change, held, send, hop, cap, depth, split, w_limit, w_fill_always, f_deep,
                    b_deep, pair_on, hid):
    """Per-device (stage, kind, micro-batch) rows and their lengths, ok (False when the policy starves), each
    device's end time and peak live activation bytes (the simulator's figures for this order), and per row
    position whether an overlapped pair starts there (`pair_on`: listsched.Policy.pair, 0 off, 1 ready, 2 wait;
    `hid[0|1, a, b]` what pairing F of stage a with B|I of stage b saves).

    From the kind table, per kind code and stage: `dur` (action time), `change` (live activation
    bytes it adds or frees); per stage `held` (what one micro-batch keeps live); per kind `send`
    (+1 output to the next stage, -1 to the previous, 0 none); `hop[s]` the s -> s+1 transfer.
    """
    ns, nd = devices.shape[0], cap.shape[0]
    counts = np.zeros(nd + 1, np.int64)
    for s in range(ns):
        counts[devices[s] + 1] += 1
    dev_ptr = np.cumsum(counts)
    dev_stages = np.empty(ns, np.int64)
    fill = dev_ptr[:-1].copy()
    for s in range(ns):
        d = devices[s]
        dev_stages[fill[d]] = s
        fill[d] += 1
    low = np.full(nd, -1, np.int64)
    headroom = np.zeros(nd, np.int64)
    most = 1
    for d in range(nd):
        k = dev_ptr[d + 1] - dev_ptr[d]
        most = max(most, k)
        if k > 0:
            low[d] = dev_stages[dev_ptr[d]]
            for j in range(dev_ptr[d] + 1, dev_ptr[d + 1]):
                headroom[d] += held[dev_stages[j]]
    n = ns * m
    f_end = np.full(n, -1.0)
    act_arr = np.full(n, -1.0)
    grad_arr = np.full(n, -1.0)
    act_arr[:m] = 0.0
    grad_arr[(ns - 1) * m:] = 0.0
    next_f = np.zeros(ns, np.int64)
    next_b = np.zeros(ns, np.int64)
    free = np.zeros(nd)
    live = np.zeros(nd, np.int64)
    peak = np.zeros(nd, np.int64)
    inflight = np.zeros(nd, np.int64)
    wcap = most * m
    wq_s = np.zeros((nd, wcap), np.int64)
    wq_mb = np.zeros((nd, wcap), np.int64)
    wq_head = np.zeros(nd, np.int64)
    wq_tail = np.zeros(nd, np.int64)
    out = np.zeros((nd, 3 * wcap, 3), np.int32)
    out_len = np.zeros(nd, np.int64)
    paired = np.zeros((nd, 3 * wcap), np.bool_)
    dec_t = np.full(nd, INF)
    dec_k = np.full(nd, -1, np.int64)
    dec_s = np.full(nd, -1, np.int64)
    dec_f = np.full(nd, -1, np.int64)
    version = np.zeros(nd, np.int64)
    hsize_cap = 4 * nd + 8 * ns * m + 16
    ht = np.empty(hsize_cap)
    hd = np.empty(hsize_cap, np.int64)
    hv = np.empty(hsize_cap, np.int64)
    hsize = 0
    for d in range(nd):
        t, k, s, sf = _decide(d, m, dev_ptr, dev_stages, low, headroom, f_end, act_arr, grad_arr, next_f, next_b, free,
                              live, inflight, wq_s, wq_head, wq_tail, depth, w_limit, w_fill_always, f_deep, b_deep,
                              dur, change, cap, split, pair_on, hid)
        dec_t[d], dec_k[d], dec_s[d], dec_f[d] = t, k, s, sf
        version[d] += 1
        if t < INF:
            hsize = _push(ht, hd, hv, hsize, t, d, version[d])
    total = 2 * m * ns
    done_main = 0
    touched = np.empty(3, np.int64)
    while hsize > 0:
        t, d, ver = ht[0], hd[0], hv[0]
        hsize = _pop(ht, hd, hv, hsize)
        if ver != version[d]:
            continue
        kind0, s0, sf0 = dec_k[d], dec_s[d], dec_f[d]
        nt = 1
        touched[0] = d
        halves = 2 if kind0 == PAIR else 1
        pair_end = -1.0
        if kind0 == PAIR:  # F then B (I), both ending after the pair's time (simulator/pairs.py)
            bk = _back_kind(split[d], s0)
            pair_end = t + dur[F, sf0] + dur[bk, s0] - hid[0 if bk == B else 1, sf0, s0]
            paired[d, out_len[d]] = True
        for half in range(halves):
            kind, s = kind0, s0
            if kind0 == PAIR:
                if half == 0:
                    kind, s = F, sf0
                else:
                    kind = B
            if kind == W:
                h = wq_head[d]
                s, mb = wq_s[d, h], wq_mb[d, h]
                wq_head[d] = h + 1
            elif kind == F:
                mb = next_f[s]
                next_f[s] += 1
                if s == low[d]:
                    inflight[d] += 1
                done_main += 1
            else:
                mb = next_b[s]
                next_b[s] += 1
                kind = _back_kind(split[d], s)
                if kind == I:
                    wq_s[d, wq_tail[d]] = s  # its W (which runs after it) is placed later on this device
                    wq_mb[d, wq_tail[d]] = mb
                    wq_tail[d] += 1
                if s == low[d]:
                    inflight[d] -= 1
                done_main += 1
            end = t + dur[kind, s] if pair_end < 0 else pair_end
            live[d] += change[kind, s]
            if live[d] > peak[d]:
                peak[d] = live[d]
            idx = s * m + mb
            if kind == F:
                f_end[idx] = end
            step = send[kind]
            if step != 0 and 0 <= s + step < ns:
                arrivals = act_arr if step > 0 else grad_arr
                arrivals[idx + step * m] = end + hop[min(s, s + step)]
                if devices[s + step] != d:
                    touched[nt] = devices[s + step]
                    nt += 1
            p = out_len[d]
            out[d, p, 0], out[d, p, 1], out[d, p, 2] = s, kind, mb
            out_len[d] = p + 1
            free[d] = end
        for j in range(nt):
            e = touched[j]
            seen = False
            for i in range(j):
                if touched[i] == e:
                    seen = True
            if seen:
                continue
            te, ke, se, fe = _decide(e, m, dev_ptr, dev_stages, low, headroom, f_end, act_arr, grad_arr, next_f,
                                     next_b, free, live, inflight, wq_s, wq_head, wq_tail, depth, w_limit,
                                     w_fill_always, f_deep, b_deep, dur, change, cap, split, pair_on, hid)
            dec_t[e], dec_k[e], dec_s[e], dec_f[e] = te, ke, se, fe
            version[e] += 1
            if te < INF:
                if hsize >= hsize_cap:
                    return out, out_len, False, free, peak, paired
                hsize = _push(ht, hd, hv, hsize, te, e, version[e])
    ok = done_main >= total
    for d in range(nd):
        if wq_tail[d] > wq_head[d]:
            ok = False
    return out, out_len, ok, free, peak, paired
