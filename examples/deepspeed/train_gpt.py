"""A GPT-style DeepSpeed PipelineModule (token embedding tied to the LM head) trained under an OctoPipe plan.

    bash examples/deepspeed/launch.sh                      # 4 local CPU processes (gloo), tunes a plan at start-up
    deepspeed --num_gpus 8 examples/deepspeed/train_gpt.py --ds-config examples/deepspeed/ds_config.json
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --num_gpus 2 examples/deepspeed/train_gpt.py \
        --plan plan.json --save ck --steps 3                  # DeepSpeed's launcher on 2 CPU processes
    ... --load ck --steps 2                                   # resume: the checkpoint's step, weights, optimizer

The only OctoPipe lines are `import octopipe_plugin.deepspeed` and the "octopipe" block of
ds_config.json: `deepspeed.initialize` then returns an OctoPipeEngine running the plan (given or
tuned on rank 0 at start-up, broadcast and saved), and `train_batch` / `eval_batch` /
`save_checkpoint` behave as DeepSpeed's PipelineEngine's do. Remove the block (or set
"enabled": false) and the same script runs DeepSpeed's own engine.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

import octopipe_plugin.deepspeed  # noqa: F401  (the one import: deepspeed.initialize honours the block)


class Block(nn.Module):
    """A pre-norm transformer block (torch's), batch-first."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True,
                                                norm_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype, device=x.device)
        return self.layer(x, src_mask=mask, is_causal=True)


def lm_head(embedding: nn.Embedding, x):
    """Logits from the embedding weight (the head is tied to the embedding)."""
    return x @ embedding.weight.t() / embedding.embedding_dim ** 0.5


def gpt_specs(vocab: int, hidden: int, heads: int, layers: int):
    """Embedding, `layers` blocks, final norm, head tied to the embedding."""
    return ([TiedLayerSpec("embed", nn.Embedding, vocab, hidden)]
            + [LayerSpec(Block, hidden, heads) for _ in range(layers)]
            + [LayerSpec(nn.LayerNorm, hidden),
               TiedLayerSpec("embed", nn.Embedding, vocab, hidden, forward_fn=lm_head)])


def loss_fn(logits, labels):
    """Next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def batches(vocab: int, seq: int, micro_batch: int, seed: int, step: int, count: int):
    """`count` (tokens, next tokens) micro-batches of step `step` from a fixed random corpus (a resumed run
    reads the same batches at the same step as an uninterrupted one)."""
    corpus = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(corpus) - seq - 1, (micro_batch,), generator=gen)
        chunk = torch.stack([corpus[s:s + seq + 1] for s in starts])
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def main() -> None:
    """Build, initialise, (resume,) train a few steps, evaluate, checkpoint."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-config", default="examples/deepspeed/ds_config.json")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--plan", help="run this octopipe-plan/1 file (sets the block's \"plan\")")
    p.add_argument("--no-octopipe", action="store_true", help='"enabled": false: DeepSpeed\'s own engine')
    p.add_argument("--save", help="checkpoint folder written after the steps (optional)")
    p.add_argument("--load", help="checkpoint folder to resume from (optional)")
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    with open(args.ds_config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    if args.plan:
        ds_config["octopipe"] = {"plan": args.plan}
    if args.no_octopipe:
        ds_config.setdefault("octopipe", {})["enabled"] = False
    world = deepspeed.comm.get_world_size()
    module = PipelineModule(gpt_specs(args.vocab, args.hidden, args.heads, args.layers), num_stages=world,
                            loss_fn=loss_fn, partition_method="uniform", seed_layers=True)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    if args.load:
        engine.load_checkpoint(args.load)
    seed, m = engine.grid.data_parallel_id, engine.gradient_accumulation_steps()
    mbs = engine.train_micro_batch_size_per_gpu()
    if engine.global_rank == 0:
        print(f"engine {type(engine).__name__}", flush=True)
    for _ in range(args.steps):
        step = engine.global_steps
        loss = engine.train_batch(data_iter=iter(batches(args.vocab, args.seq, mbs, seed, step, m)))
        if engine.global_rank == 0:
            print(f"step {step}: loss {float(loss)!r}", flush=True)
    loss = engine.eval_batch(iter(batches(args.vocab, args.seq, mbs, seed, -1, m)))
    if engine.global_rank == 0:
        print(f"eval loss {float(loss)!r}", flush=True)
    if args.save:
        engine.save_checkpoint(args.save)
    # a process that ends with its gloo group alive can die in std::terminate while the interpreter tears the
    # group's threads down (exit -6 after a complete run: CI saw it once, in DeepSpeed's own engine's run)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
