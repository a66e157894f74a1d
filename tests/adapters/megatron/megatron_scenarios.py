"""Spawned workers: train the tiny GPT for a few optimizer steps under one pipeline setup after another.

One process group serves many cases (each re-initialises Megatron's parallel state), so a
test pays for process start-up and imports once. Results (per-step global losses,
forward-only losses, every weight by global name, counters) are written by rank 0 to a
file the test reads.
"""

from __future__ import annotations

import contextlib
import logging
import traceback

import torch
import torch.distributed as dist

import megatron_harness as H

STEPS = 3


def _global_loss(out) -> torch.Tensor:
    """(sum of losses, sum of tokens) over every micro-batch of every replica: the step's per-token loss."""
    acc = torch.zeros(2, dtype=torch.float64)
    for d in out:
        v = d["lm loss"].double().view(-1)
        acc += v if v.numel() == 2 else torch.stack([v[0], torch.ones((), dtype=torch.float64)])
    dist.all_reduce(acc)
    return acc[0] / acc[1]


def _octopipe_chunks(spec: H.TinyGPT, plan, rank: int):
    """The plan's chunks for this pipeline rank, built as Megatron's get_model would, through plan_model_provider."""
    from megatron.core import parallel_state as ps

    from octopipe_plugin.adapters.megatron import plan_model_provider

    # --overlap-moe-expert-parallel-comm at PP > 1 asks for a virtual pipeline size, which the user's launch gives
    # as the plan's layout (its validation derives the size from it)
    layout = None
    if "--overlap-moe-expert-parallel-comm" in spec.args:
        from octopipe_plugin.adapters.megatron.layout import plan_to_layout

        layout = plan_to_layout(plan, spec.graph())
    config = H.make_config(spec, plan.num_devices, layout=layout)

    def model_provider(pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return H.build_chunk(spec, config, pre_process, post_process, vp_stage)

    # vocab_size: a split head's shard ranks build their HeadShard without Megatron's global arguments
    provider = plan_model_provider(plan, spec.graph(), model_provider, vocab_size=spec.vocab)
    vp = len(plan.stages_of(rank))
    chunks = []
    for i in range(vp):  # get_model's loop and its round-robin flags, which the wrapper replaces
        vs = i if vp > 1 else None
        chunks.append(provider(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs),
                               vp_stage=vs, config=config, pg_collection=None))
    return config, chunks


def _megatron_chunks(spec: H.TinyGPT, layout: str | None, pp: int):
    """Megatron's own round-robin chunks (get_model's pre/post rule)."""
    from megatron.core import parallel_state as ps

    config = H.make_config(spec, pp, layout=layout)
    vp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vp):
        vs = v if vp > 1 else None
        chunks.append(H.build_chunk(spec, config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vs),
                                    ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vs), vs))
    if spec.tied and pp > 1:
        # the harness seeds the embedding after Megatron's construction all-reduce made the head's copy on the last
        # rank: Megatron's own tying step once more (zero the copy, all-reduce over the embedding group) makes it equal
        for c in chunks:
            c.setup_embeddings_and_output_layer()
    return config, chunks


@contextlib.contextmanager
def _peak_memory(out: list | None):
    """Peak bytes held by torch's CPU allocator above the start, inside: every allocation and free the profiler
    recorded (its raw memory records, in time order); appended to `out` (None: nothing measured).

    Not the FunctionEvents' self memory: torch's parser gives each memory record to every event whose time span
    covers it, and an async event (a gloo send or receive, open from its issue to its wait) reports no self memory,
    so frees outside any op during an open transfer vanished and the sum climbed by every activation freed then.
    """
    if out is None:
        yield
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    current = peak = 0
    for _, nbytes in records:  # + allocation, - free
        current += nbytes
        peak = max(peak, current)
    out.append(peak)


def _placement_check(case: dict, chunks):
    """(context for the steps, problems list): with case["device_check"], every tensor the plugin makes must be
    placed on the model's device and no object collective may carry a tensor (device_check.py)."""
    problems: list[str] = []
    if not case.get("device_check"):
        return contextlib.nullcontext(), problems
    import device_check

    device = next(chunks[0].parameters()).device
    stack = contextlib.ExitStack()

    class _Both:
        def __enter__(self):
            mode = device_check.PlacementCheck(device)
            stack.enter_context(mode)
            stack.enter_context(device_check.object_sends_with_tensors(problems))
            self.mode = mode

        def __exit__(self, *exc):
            stack.close()
            problems.extend(self.mode.problems)
            return False

    return _Both(), problems


def _gathered(value) -> list:
    """`value` of every rank, by rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run_case(case: dict) -> dict:
    """Train one case for STEPS steps (plus a forward-only pass per step); its losses and final weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from octopipe_plugin.adapters.megatron.mapping import embedding_ranks_fn
    from octopipe_plugin.adapters.megatron.schedule import make_forward_backward_func
    from octopipe_plugin.formats import plan_from_dict
    from octopipe_plugin.testing.megatron_wgrad import counting_gemms

    spec: H.TinyGPT = case["spec"]
    pp, m = case["pp"], case["microbatches"]
    plan = plan_from_dict(case["plan"]) if case.get("plan") else None
    tp, ep = H.tp_size(spec), H.ep_size(spec)
    if plan is not None:
        vp = len(plan.stages_of(0))
        H.init_parallel(pp, vp, embedding_ranks=embedding_ranks_fn(plan, spec.graph(), spec.tied), tp=tp, ep=ep)
        config, chunks = _octopipe_chunks(spec, plan, ps.get_pipeline_model_parallel_rank())
    else:
        layout = case.get("layout")
        vp = len(layout.split("|")) // pp if layout else 1
        H.init_parallel(pp, vp, tp=tp, ep=ep)
        config, chunks = _megatron_chunks(spec, layout, pp)
    overlap = bool(case.get("overlap_grad_reduce"))
    chunks = H.wrap_ddp(chunks, config, overlap_grad_reduce=overlap)
    opt = H.make_optimizer(chunks)
    scheduler = H.make_scheduler(opt)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if overlap:  # as training.py sets it: each chunk's reduce-scatter starts once its gradients are final
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    if plan is not None:
        from octopipe_plugin.adapters.megatron.schedule import ScheduleOptions

        fb = make_forward_backward_func(plan, options=ScheduleOptions(split_linears=case.get("split", True)))
    else:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
    fs = H.make_forward_step(spec)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    losses, evals, peaks = [], [], []
    placed, device_problems = _placement_check(case, chunks)
    if case.get("deallocate") is False:  # the measurement's control: outputs kept whole after their send
        config.deallocate_pipeline_outputs = False
    with counting_gemms() as gemms, _counting_combined() as combined:  # counted in this test process only
        for step in range(STEPS):
            for c in chunks:
                c.zero_grad_buffer()
            opt.zero_grad()
            its = H.data_iterators(spec, len(chunks), step, m, dp_rank, dp_size)
            with _peak_memory(peaks if case.get("memory") and step == 1 else None), placed:  # step 1: buffers warm
                out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                         num_microbatches=m, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=False)
            losses.append(_global_loss(out))
            if step == 0:  # the gradients the optimizer steps on, before any update has hidden their scale
                grads = H.reduced_main_grads(chunks)
            ok, _, _ = opt.step()
            assert ok, "optimizer step skipped"
            scheduler.step(increment=m * spec.mbs * dp_size)
            if case.get("eval"):
                for c in chunks:
                    c.eval()
                its = H.data_iterators(spec, len(chunks), 100 + step, m, dp_rank, dp_size)
                with placed:
                    out = fb(forward_step_func=fs, data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                             num_microbatches=m, seq_length=spec.seq, micro_batch_size=spec.mbs, forward_only=True)
                evals.append(_global_loss(out))
                for c in chunks:
                    c.train()
    H.release_optimizer(config)
    weights = H.gathered_weights(chunks)
    counts = torch.tensor([gemms.forward_calls, gemms.input_gemms, gemms.weight_gemms], dtype=torch.int64)
    dist.all_reduce(counts)
    return {"losses": torch.stack(losses), "evals": torch.stack(evals) if evals else None, "weights": weights,
            "grads": grads, "device_problems": _gathered(device_problems) if case.get("device_check") else None,
            "peak_bytes": _gathered(peaks[0]) if peaks else None,
            "linear_calls": counts[0].item(), "input_gemms": counts[1].item(), "weight_gemms": counts[2].item(),
            "combined": _gathered(dict(combined))}


@contextlib.contextmanager
def _counting_combined():
    """Inside: megatron-core's combined forward/backward step counts its calls by what they run ("F", "B", "F+B":
    one micro-batch's forward overlapped with another's backward), whoever calls it (Megatron's combined 1F1B, or
    OctoPipe's pairs); the real step runs."""
    import collections

    import megatron.core.pipeline_parallel.combined_1f1b as combined

    counts: collections.Counter = collections.Counter()
    plain = combined.combined_forward_backward_step

    def step(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store,
             b_model, *args, **kwargs):
        counts["+".join(k for k, m in (("F", f_model), ("B", b_model)) if m is not None)] += 1
        return plain(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store,
                     b_model, *args, **kwargs)

    combined.combined_forward_backward_step = step
    try:
        yield counts
    finally:
        combined.combined_forward_backward_step = plain


def run_train_step_case(case: dict) -> dict:
    """Megatron's own train_step (its optimizer step, LR scheduler, loss averaging) with the plan's schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import get_optimizer_param_scheduler, train_step

    from octopipe_plugin.adapters.megatron.mapping import embedding_ranks_fn
    from octopipe_plugin.adapters.megatron.schedule import get_octopipe_forward_backward_func
    from octopipe_plugin.formats import plan_from_dict

    spec: H.TinyGPT = case["spec"]
    plan = plan_from_dict(case["plan"])
    m = plan.num_microbatches
    pp = plan.num_devices
    args = H.megatron_args(H.megatron_argv(spec, pp, spec.mbs * m * dist.get_world_size() // pp, train_iters=STEPS))
    set_global_variables(args, build_tokenizer=False)
    H.init_parallel(plan.num_devices, len(plan.stages_of(0)), embedding_ranks=embedding_ranks_fn(plan, spec.graph(),
                                                                                                    spec.tied))
    config, chunks = _octopipe_chunks(spec, plan, ps.get_pipeline_model_parallel_rank())
    chunks = H.wrap_ddp(chunks, config)
    opt = H.make_optimizer(chunks)
    scheduler = get_optimizer_param_scheduler(opt)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    # what training.py does: ask Megatron's factory (here the launch integration's answer) for the schedule
    fb = get_octopipe_forward_backward_func(plan, schedule_pg_collection=None)
    fs = H.make_forward_step(spec)
    losses = []
    for step in range(STEPS):
        its = H.data_iterators(spec, len(chunks), step, m)
        out = train_step(fs, its if len(chunks) > 1 else its[0], chunks, opt, scheduler, config, fb, iteration=step)
        loss_dict, skipped = out[0], out[1]
        assert not skipped, "train_step skipped the update"
        got = torch.zeros(2, dtype=torch.float64)
        if loss_dict:  # Megatron reports on its last pipeline rank
            got += torch.tensor([loss_dict["lm loss"].item(), 1.0], dtype=torch.float64)
        dist.all_reduce(got)
        assert got[1] == 1, f"train_step reported the loss on {int(got[1])} ranks, expected exactly one"
        losses.append(got[0])
    H.release_optimizer(config)
    return {"losses": torch.stack(losses), "evals": None, "weights": H.gathered_weights(chunks)}


def _runner(case: dict):
    """The function that runs `case`: a hybrid model's (hybrid_scenarios, scenario="hybrid"), a whole train_step's,
    or the GPT harness's."""
    if case.get("scenario") == "hybrid":
        import hybrid_scenarios

        return hybrid_scenarios.run_case
    return run_train_step_case if case.get("train_step") else run_case


def _threads() -> int | None:
    """This process's thread count (Linux), None elsewhere."""
    import os

    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def worker(rank: int, world: int, port: int, cases: list[dict], out_path: str) -> None:
    """Spawn target: run every case in turn; rank 0 saves {case name: result} (or the first error)."""
    H.init_process(rank, world, port)
    logging.disable(logging.INFO)  # Megatron logs every bucket and optimizer setting at INFO
    results = {}
    for case in cases:
        try:
            results[case["name"]] = _runner(case)(case)
            H.release_parallel()  # the case's groups freed now, not at the next case's start
            results[case["name"]]["threads"] = _threads()  # rank 0's, the case done (test_megatron_split.py)
        except Exception:  # record and stop: later cases would only hang on a broken group
            results[case["name"]] = {"error": f"rank {rank}: {traceback.format_exc()}"}
            torch.save(results, out_path if rank == 0 else f"{out_path}.rank{rank}")
            raise
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def run_spawned(world: int, cases: list[dict], path) -> dict:
    """Spawn `world` ranks of `worker` over `cases` (results in the file `path`); a failing case is reported with
    its worker's traceback."""
    failure = None
    try:
        H.spawn(worker, world, cases, str(path))
    except Exception as exc:  # the traceback the worker saved says more than the spawn error
        failure = exc
    results = torch.load(path) if path.exists() else {}
    errors = [f"case {name}: {res['error']}" for p in [path, *sorted(path.parent.glob(path.name + ".rank*"))]
              for name, res in (torch.load(p) if p.exists() else {}).items() if "error" in res]
    # a rank's own failure first: its peers only report the connection it dropped
    errors.sort(key=lambda e: "Connection reset" in e or "Connection closed" in e)
    assert not errors, "\n".join(errors)
    if failure is not None:
        raise failure
    return results
