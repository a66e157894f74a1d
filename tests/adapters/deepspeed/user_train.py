"""A training script written as a DeepSpeed user writes one, launched by torchrun in the tests.

A PipelineModule of LayerSpecs (Linear/Tanh), seeded data, fp32, plain SGD, no clipping; the only
OctoPipe lines are the import and the config's "octopipe" block. Flags choose how the user calls
DeepSpeed (model positional, `from deepspeed import initialize` before the plugin's import, a
PipelineModule subclass), so the tests see each way end in OctoPipeEngine or one line.
"""

import argparse
import json
import os

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--plan")
p.add_argument("--layers", type=int, default=14)
p.add_argument("--gas", type=int, default=4)
p.add_argument("--positional", action="store_true")
p.add_argument("--early-import", action="store_true")
p.add_argument("--subclass", choices=["init", "forward"])
p.add_argument("--steps", type=int, default=2)
p.add_argument("--no-block", action="store_true")
p.add_argument("--moe", action="store_true")  # one pipeline stage x EP/data 2: Linear, MoE (EP 2), pick, Linear
args = p.parse_args()

if args.early_import:
    from deepspeed import initialize  # bound before octopipe_plugin.deepspeed is imported
import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule

import octopipe_plugin.deepspeed  # noqa: F401,E402

if not args.early_import:
    initialize = deepspeed.initialize

WIDTH, MBS = 6, 2


class Net(PipelineModule):
    def __init__(self, specs, **kw):
        super().__init__(layers=specs, **kw)


class NetWithForward(Net):
    def forward(self, x):  # noqa: D102 - a user's own override
        return super().forward(x)


def pick(moe_output):
    """The hidden states of MoE's (output, l_aux, exp_counts)."""
    return moe_output[0]


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": args.gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "steps_per_print": 10 ** 6}
    if not args.no_block:
        cfg["octopipe"] = {"plan": args.plan, "timeout_s": 60}
    specs = [LayerSpec(nn.Linear, WIDTH, WIDTH) if j % 2 == 0 else LayerSpec(nn.Tanh) for j in range(args.layers)]
    shape = (MBS, WIDTH)
    if args.moe:
        from deepspeed.moe.layer import MoE

        expert = nn.Sequential(nn.Linear(WIDTH, 12), nn.Tanh(), nn.Linear(12, WIDTH))
        specs = [LayerSpec(nn.Linear, WIDTH, WIDTH),
                 LayerSpec(MoE, WIDTH, expert, num_experts=4, ep_size=2, k=1, min_capacity=2, use_rts=False),
                 pick, LayerSpec(nn.Linear, WIDTH, WIDTH)]
        shape = (MBS, 4, WIDTH)
    cls = {"init": Net, "forward": NetWithForward}.get(args.subclass, PipelineModule)
    kw = dict(num_stages=1 if args.moe else 2, loss_fn=nn.functional.mse_loss, partition_method="uniform",
              seed_layers=True, base_seed=7)
    model = cls(specs, **kw) if args.subclass else PipelineModule(layers=specs, **kw)
    params = [q for q in model.parameters() if q.requires_grad]
    if args.positional:
        engine, _, _, _ = initialize(None, model, None, params, config=cfg)
    else:
        engine, _, _, _ = initialize(model=model, model_parameters=params, config=cfg)
    if args.moe:  # every expert its own weights (DeepSpeed copies one), by its global id: a misrouted token shows
        for sub in engine.module.modules():
            if isinstance(sub, MoE):
                layer = sub.deepspeed_moe
                first = torch.distributed.get_rank(group=layer.ep_group) * layer.num_local_experts
                for i, ex in enumerate(layer.experts.deepspeed_experts):
                    gen = torch.Generator().manual_seed(100 + first + i)
                    with torch.no_grad():
                        for q in ex.parameters():
                            q.copy_(torch.randn(q.shape, generator=gen) * 0.5)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]) if args.moe else 0)  # MoE: data-parallel replicas
    data = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))
            for _ in range(args.gas * args.steps)]
    it = iter(data)
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(args.steps)]
    phased = getattr(getattr(engine, "_runner", None), "phased", None)
    print(f"RANK {os.environ['RANK']} ENGINE {type(engine).__name__} LOSSES {json.dumps(losses)} "
          f"PAIRS {phased.pairs_run if phased is not None else 0}", flush=True)
    # as a user script should: a process ending with its gloo group alive can die in std::terminate at teardown
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
