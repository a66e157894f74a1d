"""Data-parallel reduction started per stage vs after the step: OctoPipeEngine on stand-ins, PP 2 x DP 2.

    python examples/deepspeed/benchmark_dp_overlap.py                 # 4 local CPU processes (gloo)
    python examples/deepspeed/benchmark_dp_overlap.py --schedule zb-v --reduce-ms 600

Every layer of the model is a sleeping stand-in (the same SleepLayer and DeviceClock as
benchmark.py --stand-in), scaled so that one step's compute lasts about --target-ms. The
data-parallel all-reduce of the gradients is given a modelled cost: a rank's whole gradient
takes --reduce-ms, each bucket in proportion to its elements, spent on a separate link (a
background thread sleeping before the real gloo all-reduce), as a GPU's reduction runs on its
own stream beside the compute. Three runs of the same plan: no reduction cost (compute only),
the reduction after the step (`"overlap_dp_reduction": false`, PipelineEngine's order), and each
stage's reduction started at its last backward (the default). Prints the mean step time of each.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time

import torch


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3", help="zoo name or model file (default gemma3)")
    p.add_argument("--schedule", default="interleaved-1f1b", help="built-in schedule of the plan (2 devices)")
    p.add_argument("--stages-per-rank", type=int, default=2, help="stages per pipeline rank (default 2)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--target-ms", type=float, default=1500.0, help="simulated compute of one step, scaled to this")
    p.add_argument("--reduce-ms", type=float, default=400.0, help="modelled DP all-reduce time of a rank's gradients")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode after one warm-up")
    return p.parse_args(argv)


class _Link:
    """The modelled data-parallel link: one thread runs the group's collectives in the order they were issued
    (gloo, like NCCL, matches a group's collectives by order), each after sleeping its modelled cost."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            run, cost_s, done = self.queue.get()
            time.sleep(cost_s)
            run()
            done.set()

    def submit(self, run, cost_s: float) -> threading.Event:
        done = threading.Event()
        self.queue.put((run, cost_s, done))
        return done


class _Handle:
    """The work handle of an all-reduce on the modelled link."""

    def __init__(self, done: threading.Event):
        self.done = done

    def wait(self, *args, **kwargs):
        self.done.wait()
        return True

    def is_completed(self):
        return self.done.is_set()


def _model_reduce_cost(current: dict):
    """Route deepspeed.comm.all_reduce on current["group"] through the link at current["s_per_element"]."""
    import deepspeed.comm as dcomm

    real = dcomm.all_reduce
    link = _Link()

    def all_reduce(tensor, op=dcomm.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        if group is not current["group"]:
            return real(tensor, op=op, group=group, async_op=async_op, **kwargs)
        done = link.submit(lambda: real(tensor, op=op, group=group), tensor.numel() * current["s_per_element"])
        if async_op:
            return _Handle(done)
        done.wait()
        return None

    dcomm.all_reduce = all_reduce


def _worker(rank, world, port, model_doc, plan_path, scale, m, args, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    import octopipe_plugin.deepspeed  # noqa: F401  (OctoPipeEngine for the block)
    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule
    from octopipe_plugin.executor.clock import DeviceClock
    from octopipe_plugin.formats import model_from_dict

    from octopipe_plugin.testing.deepspeed_standin import standin_loss, standin_specs, timed_train_batches

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = model_from_dict(model_doc)
    clock = DeviceClock("device")
    specs = standin_specs(model, scale, 1e3, clock)
    current = {"group": None, "s_per_element": 0.0}
    _model_reduce_cost(current)
    results = {}
    for mode, overlap, cost in (("compute only", True, 0.0), ("reduce after the step", False, args.reduce_ms),
                                ("reduce per stage at its last backward", True, args.reduce_ms)):
        config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": m * 2, "steps_per_print": 10 ** 9,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "gradient_clipping": 0.0,
                  "octopipe": {"plan": plan_path, "overlap_dp_reduction": overlap}}
        module = OctoPipePipelineModule(specs, config=config, loss_fn=standin_loss)
        engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=list(module.parameters()))
        current["group"] = engine.mpu.get_data_parallel_group()  # each engine's grid has its own groups
        current["s_per_element"] = cost / 1000.0 / sum(p.numel() for p in module.parameters())
        results[mode] = {"spans": timed_train_batches(engine, clock, m, args.steps), "overlap": engine._overlap is not None}
        del engine, module
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    deepspeed.comm.barrier()


def main(argv=None) -> int:
    """Run the three modes and print their step times."""
    args = parse_args(argv)
    import torch.multiprocessing as mp

    from octopipe_plugin.costs import resolve_model
    from octopipe_plugin.executor.dryrun import zero_cost_cluster
    from octopipe_plugin.executor.launch import free_port
    from octopipe_plugin.formats import model_to_dict, write_plan
    from octopipe_plugin.schedules.registry import build_plan
    from octopipe_plugin.simulator import simulate

    model = resolve_model(args.model)
    plan = build_plan(model, args.schedule, 2, args.microbatches, stages_per_device=args.stages_per_rank,
                      split="balanced")
    sim = simulate(model, zero_cost_cluster(2), plan, detail=False).step_time_ms
    scale = args.target_ms / sim
    print(f"model {model.name} ({model.num_layers} layers), plan {args.schedule} on 2 pipeline ranks "
          f"({plan.num_stages} stages) x 2 data-parallel replicas, {args.microbatches} micro-batches; simulated "
          f"compute {sim * scale:.0f} ms, modelled DP all-reduce {args.reduce_ms:.0f} ms per rank", flush=True)
    with tempfile.TemporaryDirectory(prefix="octopipe-ds-overlap-") as out:
        write_plan(plan, os.path.join(out, "plan.json"))
        mp.spawn(_worker, args=(4, free_port(), model_to_dict(model), os.path.join(out, "plan.json"), scale,
                                args.microbatches,
                                args, out), nprocs=4, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    print(f"{'mode':42s} {'step ms':>9s}")
    measured = {}
    for mode in ranks[0]:
        steps = zip(*(r[mode]["spans"] for r in ranks))
        measured[mode] = sum(max(s) for s in steps) / args.steps * 1000.0
        print(f"{mode:42s} {measured[mode]:9.1f}")
    after, per_stage = measured["reduce after the step"], measured["reduce per stage at its last backward"]
    print(f"reduction hidden: {(after - per_stage) / args.reduce_ms * 100:.0f}% of its {args.reduce_ms:.0f} ms "
          f"(step {after:.1f} -> {per_stage:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
