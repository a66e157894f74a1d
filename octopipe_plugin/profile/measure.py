"""Measure one layer on one device: F, I and W with the executor's split backward, fused B, memory.

I and W are timed with the very functions the executor runs (executor/split_backward.py), on the
same kind of input (a float input that requires grad, as every stage but an integer-fed first one
sees), so the figures are those of the actions the plans schedule. A module whose runtime splits its
backward its own way (Megatron's linears: wgrad.input_pass / weight_pass) offers that as
`octopipe_split_backward` (an object with `backward_input` and `backward_weight` of the executor's
signatures), and is timed through it: I and W are then what its stage runner will run. Samples of F, I, W and B are
interleaved repeat by repeat, so a slow spell of a shared machine hits every phase alike.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..costs.analytic import adam_state_bytes_per_param
from ..executor.memory_choices import checkpointed, named_submodules
from ..executor.split_backward import accumulate_grad, backward_input, backward_weight
from .layer import tensor_meta
from .timing import Timer, Timing, summarise

WALK_NODES = 1000  # alias nodes under the layer when timing W's walk: enough that their cost stands above the noise


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerProfile:
    """What one layer costs for one micro-batch on one device."""

    fwd: Timing
    bwd: Timing  # I: input gradient
    wgrad: Timing  # W: weight gradient deferred by I
    fused: Timing  # B: input and weight gradients in one pass
    activation_bytes: int  # distinct storages saved for backward, parameters excluded
    output_bytes: int
    params: int
    state_bytes: int
    input: dict
    output: dict
    allocated_bytes: int | None = None  # CUDA allocator growth over the forward (output included), GPU only
    # median over repeats of (I + W) / B, each repeat's three taken back to back: how well the split adds up
    split_ratio: float | None = None
    graph_nodes: int | None = None  # autograd nodes the forward adds (float input only)
    walk_ms_per_node: float | None = None  # W's extra ms per graph node below the layer (see the module doc)
    # the re-run of the layer's forward inside the backward under full recompute (the executor's checkpoint)
    recompute: Timing | None = None
    # per selective module found in the layer: (activation bytes its checkpoint frees, the re-run's timing)
    selective: tuple[tuple[str, int, Timing], ...] = ()

    def to_dict(self) -> dict:
        """JSON form (the cache's record)."""
        d = {k: getattr(self, k) for k in ("activation_bytes", "output_bytes", "params", "state_bytes", "input",
                                           "output", "allocated_bytes", "split_ratio", "graph_nodes",
                                           "walk_ms_per_node")}
        d.update({k: getattr(self, k).to_dict() for k in ("fwd", "bwd", "wgrad", "fused")})
        d["recompute"] = None if self.recompute is None else self.recompute.to_dict()
        d["selective"] = {m: {"freed_bytes": freed, "rerun": t.to_dict()} for m, freed, t in self.selective}
        return d

    @staticmethod
    def from_dict(d: dict) -> "LayerProfile":
        """Inverse of to_dict."""
        times = {k: Timing.from_dict(d[k]) for k in ("fwd", "bwd", "wgrad", "fused")}
        rec = d.get("recompute")
        sel = tuple((m, int(c["freed_bytes"]), Timing.from_dict(c["rerun"])) for m, c in d.get("selective", {}).items())
        return LayerProfile(**times, activation_bytes=int(d["activation_bytes"]), output_bytes=int(d["output_bytes"]),
                            params=int(d["params"]), state_bytes=int(d["state_bytes"]), input=d["input"],
                            output=d["output"], allocated_bytes=d.get("allocated_bytes"),
                            split_ratio=d.get("split_ratio"), graph_nodes=d.get("graph_nodes"),
                            walk_ms_per_node=d.get("walk_ms_per_node"),
                            recompute=Timing.from_dict(rec) if rec is not None else None, selective=sel)


def _fused_backward(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor | None, params: list,
                    sink: str) -> None:
    """B as the executor runs it (TorchStages._fused): one autograd pass over parameters and input."""
    targets = params + ([x] if x is not None else [])
    if not targets:
        return
    if sink == "autograd":
        torch.autograd.backward([out], [grad], inputs=targets)
        return
    grads = torch.autograd.grad([out], targets, [grad], allow_unused=True)
    for p, g in zip(params, grads):
        if g is not None:
            accumulate_grad(p, g)


def saved_bytes(module: nn.Module, x: torch.Tensor, held=()) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages the forward saves for backward (parameters and buffers excluded); `held`:
    callables whose `inputs` after the forward are tensors a checkpoint inside it keeps (counted once too)."""
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in own and ptr != 0:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    for clock in held:  # a checkpoint's inputs are kept by its frame, not through the (outer) saved-tensor hooks
        for t in clock.inputs:
            pack(t)
    return sum(seen.values()), out


class ReRunClock:
    """`fn` timing each of its calls (ms; CUDA events on a GPU): under a checkpoint the calls after the first are
    its re-runs in the backward, what a recompute costs there (timed up to torch's early stop of a re-run).
    `inputs`: the tensors of the latest first call (what the checkpoint keeps)."""

    def __init__(self, fn, cuda: bool):
        self.fn, self.cuda = fn, cuda
        self.calls: list = []
        self.inputs: list[torch.Tensor] = []

    def __call__(self, *args, **kwargs):
        if not self.calls:
            self.inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return self.fn(*args, **kwargs)
            finally:
                end.record()
                self.calls.append((start, end))
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - t0)

    def rerun_ms(self) -> float:
        """The re-runs' ms since the last `reset` (0 where nothing was re-run)."""
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.calls[1:])
        return sum(self.calls[1:]) * 1e3

    def reset(self) -> None:
        """Forget the calls so far (the next call is a first one again)."""
        self.calls = []


def graph_nodes(out: torch.Tensor, x: torch.Tensor) -> int:
    """Autograd nodes between `out` and the leaf input `x` (the parameters' accumulators included, `x`'s not):
    what a W walk that starts above this layer traverses."""
    stop = _node_of(x)
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node is stop:
            continue
        seen.add(node)
        todo.extend(edge for edge, _ in node.next_functions)
    return len(seen)


def _node_of(x: torch.Tensor):
    """The node a leaf's gradient flows into (its AccumulateGrad), None for a tensor without one."""
    if not x.requires_grad:
        return None
    return x.grad_fn if x.grad_fn is not None else x.view_as(x).grad_fn.next_functions[0][0]


def measure_layer(module: nn.Module, x: torch.Tensor, device: torch.device, *, warmup: int = 2,
                  repeats: int = 10, dp: int = 1, grad_sink: str = "autograd",
                  walk_nodes: int = WALK_NODES, flush_bytes: int = 0, kind: str | None = None) -> LayerProfile:
    """Profile `module` on input `x`: medians over `repeats` after `warmup` untimed runs.

    Also the memory choices' costs: the forward's re-run under full recompute (the executor's non-reentrant
    checkpoint, timed inside B) and, for each selective module of `kind` the layer has, the bytes its checkpoint
    frees and its re-run, on the same repeats as the walk.

    `grad_sink` is TorchStages' (its default 'autograd': weight gradients through AccumulateGrad).
    `walk_nodes` > 0 times W's walk over that many nodes below the layer too (`walk_ms_per_node`); 0 skips it.
    `flush_bytes` > 0 writes over that many bytes before each timed call (timing.Timer: caches left cold).
    """
    module = module.to(device).train()
    x = x.to(device)
    split = getattr(module, "octopipe_split_backward", None)  # the module's own I / W (its stage runner's)
    run_input = split.backward_input if split is not None else backward_input
    run_weight = split.backward_weight if split is not None else backward_weight
    params = [p for p in module.parameters() if p.requires_grad]
    float_in = x.is_floating_point()
    timer = Timer(device, flush_bytes)

    def fresh() -> torch.Tensor:
        return x.detach().requires_grad_(True) if float_in else x

    def split_sample() -> tuple[float, float, float]:
        xi = fresh()
        out, tf = timer.timed(lambda: module(xi))
        g = torch.ones_like(out)
        if not float_in:
            # Integer input (token ids): the graph has no input side, the executor runs all of it as W.
            return tf, 0.0, timer.timed(lambda: _fused_backward(out, g, None, params, grad_sink))[1]
        (_, work), ti = timer.timed(lambda: run_input([out], [g], [xi], params))
        tw = timer.timed(lambda: run_weight(work, grad_sink))[1] if params else 0.0
        return tf, ti, tw

    def walk_sample() -> float:
        """W with `walk_nodes` alias nodes (views: no memory, no arithmetic) between the input and the layer."""
        xi = fresh()
        h = xi
        for _ in range(walk_nodes):
            h = h.view_as(h)
        out = module(h)
        _, work = run_input([out], [torch.ones_like(out)], [xi], params)
        return timer.timed(lambda: run_weight(work, grad_sink))[1]

    walks = walk_nodes > 0 and float_in and bool(params)

    def fused_sample() -> float:
        xi = fresh()
        out = module(xi)
        g = torch.ones_like(out)
        return timer.timed(lambda: _fused_backward(out, g, xi if float_in else None, params, grad_sink))[1]

    cuda = device.type == "cuda"
    whole = ReRunClock(module.__call__, cuda)
    recomputed = checkpointed(whole)
    parts = {m: [ReRunClock(sub.forward, cuda) for sub in subs] for m, subs in _selective_parts(module, kind)}

    def rerun_sample(run, clocks) -> float:
        """B of one micro-batch with `run` (the layer, some sub-modules checkpointed): the clocks' re-run ms."""
        for c in clocks:
            c.reset()
        xi = fresh()
        out = run(xi)
        _fused_backward(out, torch.ones_like(out), xi if float_in else None, params, grad_sink)
        return sum(c.rerun_ms() for c in clocks)

    f, i, w, b, ratios, chained = [], [], [], [], [], []
    rec, sel = [], {m: [] for m in parts}
    for r in range(warmup + repeats):
        tf, ti, tw = split_sample()
        tb = fused_sample()
        # the walk and the re-runs on about a third of the repeats, spread over them
        sparse = r >= warmup and (r - warmup) % max(1, repeats // 3) == 0
        tc = walk_sample() if walks and sparse else None
        if sparse:
            rec.append(rerun_sample(recomputed, [whole]))
            for m, clocks in parts.items():
                with _checkpointed_parts(module, m, clocks):
                    sel[m].append(rerun_sample(module, clocks))
        if r >= warmup:
            f.append(tf), i.append(ti), w.append(tw), b.append(tb)
            if tc is not None:
                chained.append(tc)
            if tb > 0:
                ratios.append((ti + tw) / tb)
    xn = fresh()
    nodes = graph_nodes(module(xn), xn) if float_in else None
    act, out = _activation(module, fresh(), device)
    selective = []
    for m, clocks in parts.items():
        with _checkpointed_parts(module, m, clocks):
            for c in clocks:
                c.reset()
            kept, _ = saved_bytes(module, fresh(), clocks)
        if act - kept > 0:  # a module whose checkpoint frees nothing is no choice
            selective.append((m, act - kept, summarise(sel[m])))
    allocated = _allocated(module, fresh(), device)
    for p in params:
        p.grad = None
    n = sum(p.numel() for p in params)
    state = sum(p.numel() * adam_state_bytes_per_param(p.element_size(), dp) for p in params)
    return LayerProfile(fwd=summarise(f), bwd=summarise(i), wgrad=summarise(w),
                        fused=summarise(b), activation_bytes=act, output_bytes=out.numel() * out.element_size(),
                        params=n, state_bytes=int(state), input=tensor_meta(x), output=tensor_meta(out),
                        allocated_bytes=allocated,
                        split_ratio=statistics.median(ratios) if ratios else None, graph_nodes=nodes,
                        # medians of interleaved samples; a walk cheaper than noise reads as none
                        walk_ms_per_node=max(0.0, (statistics.median(chained) - statistics.median(w)) / walk_nodes)
                        if walks else None, recompute=summarise(rec), selective=tuple(selective))


def _selective_parts(module: nn.Module, kind: str | None) -> list[tuple[str, list[nn.Module]]]:
    """The selective modules of `kind` (costs/recompute.py `kind_modules`) the built layer has, each with the
    sub-modules the executor checkpoints for it (executor/memory_choices.py `named_submodules`)."""
    if kind is None:
        return []
    from ..costs.recompute import kind_modules

    return [(m, subs) for m in kind_modules(kind) if (subs := named_submodules(module, m))]


@contextlib.contextmanager
def _checkpointed_parts(module: nn.Module, name: str, clocks):
    """The layer with the sub-modules of selective module `name` checkpointed (as the executor runs them), each
    through its clock; their own forwards back afterwards."""
    found = named_submodules(module, name)
    for sub, clock in zip(found, clocks):
        sub.forward = checkpointed(clock)
    try:
        yield
    finally:
        for sub in found:
            del sub.forward  # the instance attribute set above: the class's forward again


def _activation(module: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[int, torch.Tensor]:
    nbytes, out = saved_bytes(module, x)
    return nbytes, out.detach()


def _allocated(module: nn.Module, x: torch.Tensor, device: torch.device) -> int | None:
    """CUDA allocator growth across one forward with the graph kept (a cross-check of the saved bytes)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = module(x)
    torch.cuda.synchronize(device)
    grown = torch.cuda.memory_allocated(device) - before
    del out
    return int(grown)
