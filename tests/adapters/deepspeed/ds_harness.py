"""Shared harness of the DeepSpeed engine tests: a GPT-like PipelineModule, its data, a
single-process reference on the same seeds, and a worker running several scenarios per spawn.

The model: a token embedding, Linear/tanh residual blocks and a head tied to the embedding
(TiedLayerSpec with forward_fn), loss cross-entropy. Every layer is seeded as DeepSpeed's
seed_layers does (base_seed + global layer index), so any partition builds the same weights.
Scenarios run in one spawn per world size (DeepSpeed's init is paid once); each writes its
losses and final weights per rank, and the test compares them with the reference.
"""

from __future__ import annotations

import os
import random
import traceback

import torch
from torch import nn

from octopipe_plugin.testing.process_groups import destroy_groups_since, live_groups

VOCAB, HID, SEQ, MBS = 16, 8, 4, 2
NUM_BLOCKS = 7
BASE_SEED = 1234
STEPS = 3


class Block(nn.Module):
    """A residual Linear/tanh block (its input may be a (hidden, mask) pair)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        if isinstance(x, tuple):
            h, mask = x
            return h + torch.tanh(self.fc(h)) * mask.unsqueeze(-1).to(h.dtype), mask
        return x + torch.tanh(self.fc(x))


class MaskedEmbedding(nn.Embedding):
    """Embedding that also hands on a 0/1 integer mask of the tokens (a boundary of two tensors)."""

    def forward(self, ids):
        return super().forward(ids), (ids % 3 != 0).to(torch.int64)


def head(embedding: nn.Embedding, x):
    """Logits from the tied embedding weight."""
    if isinstance(x, tuple):
        x = x[0]
    return x @ embedding.weight.t()


def loss_fn(logits, labels):
    """Mean token cross-entropy (float32, as the reference computes it)."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(masked: bool = False):
    """The DeepSpeed layer list: embedding, blocks, head tied to the embedding."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    emb = MaskedEmbedding if masked else nn.Embedding
    return ([TiedLayerSpec("embed", emb, VOCAB, HID)] + [LayerSpec(Block, HID) for _ in range(NUM_BLOCKS)]
            + [TiedLayerSpec("embed", emb, VOCAB, HID, forward_fn=head)])


NUM_LAYERS = NUM_BLOCKS + 2


def batches(step: int, replica: int, m: int):
    """Micro-batches (ids, labels) of one step for one data-parallel replica."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=gen), torch.randint(0, VOCAB, (MBS, SEQ), generator=gen))
            for _ in range(m)]


class CountingIter:
    """An iterator over a list that counts the `next` calls (DeepSpeed's contract: M per step)."""

    def __init__(self, items):
        self.items = list(items)
        self.calls = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = self.items[self.calls]
        self.calls += 1
        return item


# ---- reference -----------------------------------------------------------------------------------------
def reference_model(masked: bool = False):
    """The whole model in one process, each layer seeded as DeepSpeed's seed_layers does."""
    from deepspeed.runtime.utils import set_random_seed

    set_random_seed(BASE_SEED + 0)
    emb = (MaskedEmbedding if masked else nn.Embedding)(VOCAB, HID)
    blocks = []
    for j in range(NUM_BLOCKS):
        set_random_seed(BASE_SEED + 1 + j)
        blocks.append(Block(HID))
    return emb, nn.ModuleList(blocks)


def reference_forward(emb, blocks, ids):
    """Logits of the reference model."""
    x = emb(ids)
    for b in blocks:
        x = b(x)
    return head(emb, x)


def _layers(emb, blocks) -> dict:
    """The reference's modules by global layer index (the tied embedding as layer 0)."""
    return {"0": emb, **{str(j + 1): b for j, b in enumerate(blocks)}}


def reference_run(*, dp: int, m: int, lr: float, momentum: float, clip: float, masked: bool = False,
                  steps: int = STEPS, start: tuple | None = None, first_step: int = 0):
    """Losses per step and final weights (by layer index) of SGD on the mean loss over m x dp micro-batches.

    `clip` is a max norm (0: none) or one per step; clipping uses the norm of every gradient of the model.
    `start` (weights, momenta by layer index, as a run's report holds them) resumes the reference from a
    run's own state at `first_step`: unclipped fp32 training at this learning rate amplifies summation-order
    differences about 100-fold over three steps, so a resumed run is compared from where it started.
    """
    emb, blocks = reference_model(masked)
    params = list(emb.parameters()) + list(blocks.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    if start is not None:
        weights, momenta = start
        for idx, layer in _layers(emb, blocks).items():
            layer.load_state_dict(weights[idx])
            for k, q in layer.named_parameters():
                opt.state[q]["momentum_buffer"] = momenta[idx][k].clone()
    losses = []
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            for ids, labels in batches(step, r, m):
                loss = loss_fn(reference_forward(emb, blocks, ids), labels)
                (loss / (m * dp)).backward()
                total += float(loss.detach())
        c = clip[step] if isinstance(clip, (list, tuple)) else clip
        if c > 0:
            torch.nn.utils.clip_grad_norm_(params, c)
        opt.step()
        losses.append(total / (m * dp))
    weights = {idx: {k: v.detach().clone() for k, v in layer.state_dict().items()}
               for idx, layer in _layers(emb, blocks).items()}
    return losses, weights


# ---- plans ---------------------------------------------------------------------------------------------
def plan_doc(stage_devices, bounds, num_devices: int, m: int, seed: int, split_prob: float = 0.5) -> dict:
    """An irregular plan (random valid order, random split backward) as a document."""
    from octopipe_plugin.testing.plans import make_plan, sample_schedule
    from octopipe_plugin.formats import plan_to_dict

    sched = sample_schedule(stage_devices, num_devices, m, random.Random(seed), split_prob=split_prob)
    return plan_to_dict(make_plan(stage_devices=stage_devices, bounds=bounds, num_devices=num_devices,
                                  num_microbatches=m, schedule=sched))


def ds_config(*, m: int, dp: int, lr: float, momentum: float, clip: float, plan_path: str | None = None,
              extra: dict | None = None) -> dict:
    """A DeepSpeed config for the scenario (with the octopipe block when a plan is given)."""
    cfg = {"train_micro_batch_size_per_gpu": MBS, "train_batch_size": MBS * m * dp,
           "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": momentum}},
           "gradient_clipping": clip, "steps_per_print": 10 ** 6}
    if plan_path is not None:
        cfg["octopipe"] = {"plan": plan_path, "timeout_s": 120}
    cfg.update(extra or {})
    return cfg


# ---- worker --------------------------------------------------------------------------------------------
def _held_layers(module) -> dict:
    """The layers this rank holds by global layer index (the tied embedding as layer 0)."""
    out = {name: sub for name, sub in module.named_children() if name.isdigit()}
    for sub in module.tied_modules.values():
        out["0"] = sub
    return out


def _weights(module) -> dict:
    """Weights of the layers this rank holds, by global layer index."""
    return {idx: {k: v.detach().float().clone() for k, v in sub.state_dict().items()}
            for idx, sub in _held_layers(module).items()}


def _momenta(engine) -> dict:
    """The SGD momentum buffers of the layers this rank holds, by global layer index (fp32 runs: DeepSpeed's
    optimizer is torch's own)."""
    state = engine.optimizer.state
    return {idx: {k: state[q]["momentum_buffer"].detach().float().clone() for k, q in sub.named_parameters()
                  if "momentum_buffer" in state.get(q, {})}
            for idx, sub in _held_layers(engine.module).items()}


def run_scenario(sc: dict, rank: int, out_dir: str) -> None:
    """Build the module and engine of one scenario, train (and evaluate), save what the test checks."""
    import deepspeed

    import octopipe_plugin.deepspeed  # noqa: F401  (installs the engine choice)
    from octopipe_plugin.adapters.deepspeed import OctoPipePipelineModule

    cfg = sc["config"]
    kwargs = dict(loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                  activation_checkpoint_interval=sc.get("ckpt_interval", 0))
    specs = layer_specs(sc.get("masked", False))
    if sc.get("parts") is not None:
        module = OctoPipePipelineModule(specs, parts=sc["parts"], **kwargs)
    elif sc.get("plain"):
        from deepspeed.pipe import PipelineModule

        module = PipelineModule(specs, num_stages=sc["pp"], partition_method="uniform", **kwargs)  # "parameters" + seed_layers: DeepSpeed seeds with a numpy int (TypeError)
    else:
        module = OctoPipePipelineModule(specs, config=cfg, **kwargs)
    engine, _, _, _ = deepspeed.initialize(model=module, config=cfg,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    if sc.get("grad_scale") is not None:  # a deliberate scale error: the comparisons must see it
        for q in engine.module.parameters():
            q.register_hook(lambda g, k=sc["grad_scale"]: g * k)
    dp_rank = engine.grid.data_parallel_id
    m = engine.micro_batches
    report = {"engine": type(engine).__name__, "losses": [], "calls": [], "eval": []}
    if sc.get("load") is not None:
        engine.load_checkpoint(sc["load"]["dir"], tag=sc["load"]["tag"],
                               load_optimizer_states=sc["load"].get("optimizer", True))
        if sc.get("record_momenta"):  # where the resumed run starts: the reference resumes from it
            report["loaded"] = {"weights": _weights(engine.module), "momenta": _momenta(engine)}
    first = sc.get("first_step", 0)
    for step in range(first, first + sc.get("steps", STEPS)):
        it = CountingIter(batches(step, dp_rank, m))
        if sc.get("eval"):
            report["eval"].append(float(engine.eval_batch(CountingIter(batches(step, dp_rank, m)))))
        report["losses"].append(float(engine.train_batch(data_iter=it)))
        report["calls"].append(it.calls)
    if sc.get("resize") is not None:
        try:
            engine.set_train_batch_size(sc["resize"])
            report["resize_error"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            report["resize_error"] = str(exc)
    if sc.get("logits"):  # eval_batch(return_logits=True) on step 0's micro-batches
        loss, logits = engine.eval_batch(CountingIter(batches(0, dp_rank, m)), return_logits=True)
        report["logits"] = (float(loss), None if logits is None else logits.detach().float().clone())
    if sc.get("save") is not None:
        engine.save_checkpoint(sc["save"]["dir"], tag=sc["save"]["tag"])
    report["weights"] = _weights(engine.module)
    if sc.get("record_momenta"):
        report["momenta"] = _momenta(engine)
    report["stage"] = engine.grid.get_stage_id()
    report["overlap"] = getattr(engine, "_overlap", None) is not None
    executor = getattr(engine, "_executor", None)  # OctoPipeEngine: the executor runs on the engine's device
    report["executor_device"] = None if executor is None else (str(executor.device), str(engine.device))
    report["dp"] = dp_rank
    report["holds"] = [engine.is_first_stage(), engine.is_last_stage()]
    torch.save(report, os.path.join(out_dir, f"{sc['name']}-rank{rank}.pt"))


def worker(rank: int, world: int, port: int, scenarios: list, out_dir: str, run=None) -> None:
    """One rank: DeepSpeed's gloo init, then every scenario in turn through `run` (default this harness's
    run_scenario; a failure is recorded, not fatal)."""
    run = run or run_scenario
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from octopipe_plugin.adapters.deepspeed.shm import release_shm_buffers

    release_shm_buffers()  # the scenarios' DeepSpeed-only engines too: nothing of the spawn left in /dev/shm
    for sc in scenarios:
        before = live_groups()
        try:
            run(sc, rank, out_dir)
        except Exception as exc:  # noqa: BLE001 - the test reports it with the scenario's name
            with open(os.path.join(out_dir, f"{sc['name']}-rank{rank}.err"), "w") as fh:
                fh.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if sc.get("fatal", True):
                raise
        deepspeed.comm.barrier()
        destroy_groups_since(before)  # the scenario's engine groups (pipeline grid)


def run_all(scenarios: list, world: int, out_dir: str, run=None) -> None:
    """Spawn `world` ranks running every scenario (through `run`, a module-level function: default run_scenario)."""
    import torch.multiprocessing as mp

    from octopipe_plugin.executor.launch import free_port

    mp.spawn(worker, args=(world, free_port(), scenarios, out_dir, run), nprocs=world, join=True)


def load(out_dir, name: str, world: int) -> list[dict]:
    """Reports of one scenario, one per rank (raises with the rank's error when it failed)."""
    out = []
    for r in range(world):
        err = os.path.join(out_dir, f"{name}-rank{r}.err")
        if os.path.exists(err):
            raise AssertionError(f"scenario {name} rank {r} failed: {open(err).read()}")
        out.append(torch.load(os.path.join(out_dir, f"{name}-rank{r}.pt"), weights_only=False))
    return out


def merged_weights(reports, field=lambda rep: rep["weights"]) -> dict:
    """Layer index -> weights (or what `field` reads from each report, e.g. momenta), checking every copy of
    a layer (tied, data-parallel) is identical."""
    merged = {}
    for rep in reports:
        for idx, sd in field(rep).items():
            if idx in merged:
                for k, v in sd.items():
                    assert torch.equal(merged[idx][k], v), f"copies of layer {idx}.{k} differ between ranks"
            else:
                merged[idx] = sd
    return merged
