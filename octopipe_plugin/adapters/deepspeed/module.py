"""`OctoPipePipelineModule`: a DeepSpeed PipelineModule built at an OctoPipe plan's stages.

Two modes. `parts=`: one stage per pipeline rank at the plan's boundaries, trained by DeepSpeed's
own PipelineEngine. `plan=` (or `config=` with an enabled "octopipe" block): every stage of the
plan is built on its device, several per rank when the plan says so (looped, V-shape, any map),
and `OctoPipeEngine` runs the plan's own action order. Tied layers are tied across the ranks that
really hold them: `stage_owner` answers with the owning pipeline rank, which is what
PipelineModule's tie-group construction and its checkpoint files rely on.

A split head tied to the embedding (head_split.py) leaves DeepSpeed's tie: its entry is kept out
of the tie groups (the owner stage is built without it), and its shards are tied to the whole
weight's holder by `executor/tied_rows.py` instead: rows copied after DeepSpeed's tied broadcast at
construction (`head_tie`), gradients summed at the engine's tied-gradient step (engine.py).

A split embedding (head_split.py) is built as this rank's rows of it (`embedding_shard`), not in stage 0: stage 0's
layers start at entry 1 and take the shards' summed lookups as their input (engine.py feeds the shards the tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepspeed.runtime.pipe.module import PipelineModule

import logging

from ...errors import OctoPipeError
from ...executor.tied_rows import TiedRows, copy_rows
from ...formats.splits import row_range
from .checkpoint import load_head, save_head
from .config import refused
from .head_split import (EMBEDDING_SHARD_NAME, SHARD_NAME, build_shard, embedding_entry, embedding_placement,
                         head_entry, head_placement)
from .partition import layer_starts
from .versions import check_installed

log = logging.getLogger(__name__)


class OctoPipePipelineModule(PipelineModule):
    """A PipelineModule whose stages are an OctoPipe plan's (or given `parts`, one stage per rank).

    `config`: a DeepSpeed config with an enabled "octopipe" block (its plan, or tuning on rank 0);
    `layer_costs`: costs of list entries the analytic model cannot cost, or measured ones, for
    that tuning (graph.model_from_specs).
    `shards`: for a plan that splits the LM head, the object running the shard actions instead of the
    real head shards (the benchmarks' stand-ins), or a callable `(engine) -> that object`; None: the
    real ones.
    A split head (head_split.py) is built as this rank's rows of it, not in the owner stage.

    PipelineModule.__init__ partitions (via `_partition_layers`) before it builds any layer, so the
    stages are fixed before that call and every rank builds only the layers of its own stages.
    """

    def __init__(self, layers, *, parts: Sequence[int] | None = None, plan=None, config: dict | None = None,
                 layer_of_spec: Sequence[int] | None = None, layer_costs: dict | None = None, shards=None,
                 **kwargs):
        if "num_stages" in kwargs or "partition_method" in kwargs:
            raise OctoPipeError("OctoPipePipelineModule: num_stages and partition_method come from the plan "
                                "(or `parts`)")
        if sum(x is not None for x in (parts, plan, config)) != 1:
            raise OctoPipeError("OctoPipePipelineModule: give exactly one of parts=, plan= or config=")
        layers = list(layers)
        # Plain attributes set before nn.Module.__init__: read by _partition_layers during super().__init__.
        self.octopipe_plan = None
        self.octopipe_block = None
        self.octopipe_head = None  # a split LM head's placement (head_split.HeadPlacement), set by the partition
        self.octopipe_embedding = None  # a split embedding's placement (the same, side "input")
        self.octopipe_shards = shards  # None: OctoPipeEngine runs the head shards' real math
        self._octopipe_owners = None
        self._head_index = None  # list index of a split head (not built in the owner stage)
        if parts is not None:
            self._octopipe_parts = tuple(int(p) for p in parts)
            num_stages = len(self._octopipe_parts) - 1
        else:
            from .plan_source import resolve_plan

            check_installed()
            topo = kwargs.get("topology")
            self.octopipe_plan, self.octopipe_block, owners = resolve_plan(
                layers, plan=plan, config=config, layer_of_spec=layer_of_spec, costs=layer_costs,
                pipe_size=topo.get_dim("pipe") if topo is not None else None)
            try:  # a split head that cannot run is refused before anything is built (rank -1: no rows asked)
                head_entry(self.octopipe_plan, owners)
                emb = embedding_entry(self.octopipe_plan, owners)
                if shards is None:
                    head_placement(self.octopipe_plan, layers, owners, -1)
                    embedding_placement(self.octopipe_plan, layers, owners, -1)
                elif emb is not None:
                    raise OctoPipeError("plan splits the embedding, but stand-in shards (shards=) run a split LM "
                                        "head only; drop the embedding's split or the stand-ins")
            except OctoPipeError as exc:
                raise refused(exc) from None
            self._octopipe_owners = owners
            starts = (layer_starts(owners, self.octopipe_plan.stages[-1].end) if owners is not None
                      else list(range(len(layers) + 1)))
            self._octopipe_parts = tuple(starts[st.start] for st in self.octopipe_plan.stages) + (starts[-1],)
            num_stages = self.octopipe_plan.num_devices
        if kwargs.get("topology") is None:
            kwargs["num_stages"] = num_stages
        self._octopipe_defer_sync = False  # load_state_dir: DeepSpeed's tied broadcast once, not once per stage
        super().__init__(layers=layers, partition_method="octopipe", **kwargs)
        tie = self.head_tie()
        if tie is not None:  # the shards := their rows of the tied weight as DeepSpeed just synchronised it
            full, shard = self.head_tie_tensors()
            copy_rows(tie, full, shard)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeedEngine calls this on every module that has it, this one first (named_modules order), before the
        MoE layers make their expert groups: the groups of every MoE entry of the whole list are made here, on every
        rank alike, also where this rank's stages hold none (moe_pairs.create_expert_groups)."""
        from .moe_pairs import create_expert_groups

        create_expert_groups(self._layer_specs, use_data_before_expert_parallel_)

    # ---- partition and build -------------------------------------------------------------------------
    def _partition_layers(self, method: str = "octopipe") -> None:
        """Take the plan's boundaries instead of DeepSpeed's uniform/parameters/type split."""
        parts = list(self._octopipe_parts)
        num_specs = len(self._layer_specs)
        if parts[0] != 0 or parts[-1] != num_specs or parts != sorted(parts):
            raise OctoPipeError(f"parts {parts}: expected non-decreasing indices from 0 to the layer count "
                                f"{num_specs} (give layer_of_spec when the list differs from the model's layers)")
        self.parts = parts
        if self.octopipe_plan is None:
            if len(parts) != self.num_stages + 1:
                raise OctoPipeError(f"parts {parts} describe {len(parts) - 1} stages, the pipeline has "
                                    f"{self.num_stages}")
            self.stage_devices = tuple(range(self.num_stages))
        else:
            plan = self.octopipe_plan
            if plan.num_devices != self.num_stages:
                raise OctoPipeError(f"plan has {plan.num_devices} devices, the pipeline has {self.num_stages} "
                                    "ranks (the topology's pipe dimension)")
            self.stage_devices = tuple(st.device for st in plan.stages)
            self._head_index = head_entry(plan, self._octopipe_owners)
            if self.octopipe_shards is None:  # stand-in shards: no real rows
                self.octopipe_head = head_placement(plan, self._layer_specs, self._octopipe_owners, self.stage_id)
                self.octopipe_embedding = embedding_placement(plan, self._layer_specs, self._octopipe_owners,
                                                              self.stage_id)
        self.local_stages = tuple(s for s, d in enumerate(self.stage_devices) if d == self.stage_id)
        self._stage_funcs: dict[int, list] = {}
        self._stage_layers: dict[int, list] = {}
        # each stage's first built entry: stage 0 of a split embedding starts after it (checkpoint names, seeds)
        self._stage_starts = {s: parts[s] + (s == 0 and self.octopipe_embedding is not None)
                              for s in range(len(parts) - 1)}
        self._stage_checkpointable: dict[int, list] = {}
        self.active_stage = self.local_stages[0] if self.local_stages else None
        first = self.active_stage if self.active_stage is not None else 0
        self._set_bounds(start=parts[first], stop=parts[first + 1] if self.local_stages else parts[first])

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed's broadcast of tied weights, under no_grad: an in-place collective on a parameter in
        grad mode leaves an autograd record that warns "c10d::broadcast_: an autograd kernel was not
        registered" at every later backward (harmless, but noise)."""
        if self._octopipe_defer_sync:
            return
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _index_tied_modules(self):
        """DeepSpeed's tie groups without a split head's entry: the owner stage is built without it (its rows are in
        the shards, tied by head_tie), so neither builds the tied module for it nor joins the group."""
        head = self._head_index
        if head is None:
            return super()._index_tied_modules()
        specs = self._layer_specs
        self._layer_specs = specs[:head] + [None] + specs[head + 1:]  # None: no TiedLayerSpec, no tie
        try:
            return super()._index_tied_modules()
        finally:
            self._layer_specs = specs

    def head_tie(self) -> TiedRows | None:
        """The tie of a split head's shards to the tied weight's holder, over this data-parallel replica's pipeline
        (global ranks), or None (no split head tied to the embedding)."""
        head = self.octopipe_head
        if head is None or head.tied is None:
            return None
        grid = self._grid
        rows = {grid.stage_to_global(d): row_range(head.split, head.vocab, d) for d in head.split.devices}
        return TiedRows(full_rank=grid.stage_to_global(head.tied.full_device), rows=rows,
                        group=grid.get_pipe_parallel_group())

    def head_tie_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the whole tied weight where this rank holds it, this rank's shard weight) of a split tied head."""
        tied = self.octopipe_head.tied
        full = (self._recursive_getattr(self.tied_modules[tied.key], tied.attr)
                if self.stage_id == tied.full_device else None)
        shard = self.head_shard()
        return full, shard.weight if shard is not None else None

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank that holds list entry `layer_idx` (tie groups and checkpoints ask this)."""
        if not 0 <= layer_idx < self._num_layers:
            raise OctoPipeError(f"layer {layer_idx}: expected 0..{self._num_layers - 1}")
        for s, dev in enumerate(self.stage_devices):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return dev
        raise OctoPipeError(f"layer {layer_idx} is in no stage of parts {self.parts}")

    def _build(self) -> None:
        """Build every local stage's layers (tied modules are built once per rank and shared), and this rank's
        shard of a split head (a child module, so the optimizer and DeepSpeed's gradient paths see it)."""
        head, emb = self.octopipe_head, self.octopipe_embedding
        last = len(self.parts) - 2
        emb_shard = None
        for s in self.local_stages:
            if s == 0 and emb is not None and (emb.rows is not None or not self.seed_layers):
                # the embedding drawn where the unsplit stage 0 draws it (first), so without seed_layers the layers
                # after it draw what they draw unsplit; a rank holding no rows only draws
                emb_shard = build_shard(self, emb)
            # the owner of a split head is built without it: its rows live in the shards
            stop = self._head_index if self._head_index is not None and s == last else self.parts[s + 1]
            self._set_bounds(self._stage_starts[s], stop)
            self.forward_funcs = []
            super()._build()
            self._stage_funcs[s] = self.forward_funcs
            # the entries as built: a memory choice (memory.py) wraps the ones forward runs, not these
            self._stage_layers[s] = list(self.forward_funcs)
        if head is not None and head.rows is not None:
            setattr(self, SHARD_NAME, build_shard(self, head))
        if emb is not None and emb.rows is not None and 0 not in self.local_stages:
            emb_shard = build_shard(self, emb)
        if emb_shard is not None:
            setattr(self, EMBEDDING_SHARD_NAME, emb_shard)
        if self.local_stages:
            self.activate_stage(self.local_stages[0])

    def activate_stage(self, stage: int) -> None:
        """Expose stage `stage`'s layers as this module's forward pass (and its checkpoint file names)."""
        if stage not in self._stage_funcs:
            raise OctoPipeError(f"rank {self.stage_id} does not hold stage {stage} (it holds {self.local_stages})")
        self.active_stage = stage
        self.forward_funcs = self._stage_funcs[stage]
        self.is_checkpointable_results = self._stage_checkpointable.get(stage, [])
        self._local_start, self._local_stop = self._stage_starts[stage], self.parts[stage + 1]

    def run_stage(self, stage: int, inputs):
        """Stage `stage`'s forward on `inputs` (PipelineModule.forward, with activation checkpointing)."""
        self.activate_stage(stage)
        return self.forward(inputs)

    def _each_stage(self):
        active = self.active_stage
        try:
            for s in self.local_stages:
                self.activate_stage(s)
                yield s
        finally:
            if active is not None and active in self._stage_funcs:
                self.activate_stage(active)

    def _precompute_checkpointable_values(self) -> None:
        for s in self._each_stage():
            self.is_checkpointable_results_interval = None  # the parent caches per interval, not per stage
            super()._precompute_checkpointable_values()
            self._stage_checkpointable[s] = self.is_checkpointable_results

    def save_state_dict(self, *args, **kwargs) -> None:
        """Write every local stage's layers (files named by global layer index, as DeepSpeed does), and a split
        head's and embedding's files whole (gathered from their shards)."""
        for _ in self._each_stage():
            super().save_state_dict(*args, **kwargs)
        save_dir, engine = _dir_and_engine(args, kwargs, "save_dir")
        save_head(self, save_dir, engine)
        save_head(self, save_dir, engine, self.octopipe_embedding, self.embedding_shard())

    def load_state_dir(self, *args, **kwargs) -> None:
        """Load every local stage's layers from global layer files (any partition wrote them), and this rank's rows
        of a split head from the head's file."""
        self._octopipe_defer_sync = True  # ranks holding different stage counts broadcast the same number of times
        try:
            for _ in self._each_stage():
                super().load_state_dir(*args, **kwargs)
        finally:
            self._octopipe_defer_sync = False
        self._synchronize_tied_weights()
        load_dir, engine = _dir_and_engine(args, kwargs, "load_dir")
        load_head(self, load_dir, engine)
        load_head(self, load_dir, engine, self.octopipe_embedding, self.embedding_shard())

    def compile(self, *args, **kwargs) -> None:
        """torch.compile every local stage's layers."""
        for s in self._each_stage():
            super().compile(*args, **kwargs)
            self._stage_funcs[s] = self.forward_funcs

    def head_shard(self):
        """This rank's HeadShard of a split LM head, or None."""
        return getattr(self, SHARD_NAME, None)

    def embedding_shard(self):
        """This rank's HeadShard of a split embedding (its rows of the embedding's weight), or None."""
        return getattr(self, EMBEDDING_SHARD_NAME, None)

    def shard_dtype_device(self, placement) -> tuple[torch.dtype, torch.device]:
        """(dtype, device) of a split layer's shard weights as the engine holds them, also on a rank holding none
        (stage 0's of a split embedding, which receives the lookups): DeepSpeed casts every parameter to one dtype
        under bf16/fp16 and moves them to its device, so any parameter of the rank tells; none: as built, on the
        accelerator."""
        shard = self.head_shard() if placement.side == "output" else self.embedding_shard()
        if shard is not None:
            return shard.weight.dtype, shard.weight.device
        p = next((p for p in self.parameters() if p.is_floating_point()), None)
        if p is not None:
            return p.dtype, p.device
        from deepspeed.accelerator import get_accelerator

        return placement.dtype, torch.device(get_accelerator().current_device_name())

    def head_shard_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters of this rank's head shard (none without one)."""
        shard = self.head_shard()
        return [p for p in shard.parameters() if p.requires_grad] if shard is not None else []

    def stage_parameters(self, stage: int) -> list[torch.nn.Parameter]:
        """Trainable parameters used by stage `stage` (a tied module counts in every stage using it)."""
        seen, out = set(), []
        for f in self._stage_layers[stage]:
            module = f if isinstance(f, torch.nn.Module) else getattr(f, "args", (None,))[0]
            if isinstance(module, torch.nn.Module):
                for p in module.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out


def _dir_and_engine(args, kwargs, dir_name: str):
    """(folder, checkpoint_engine) of a save_state_dict / load_state_dir call, positional or keyword."""
    folder = kwargs[dir_name] if dir_name in kwargs else args[0]
    engine = kwargs["checkpoint_engine"] if "checkpoint_engine" in kwargs else args[1]
    return folder, engine


def rebuild_at_plan(model: PipelineModule, ds_config: dict) -> OctoPipePipelineModule:
    """A PipelineModule's layer list rebuilt as an OctoPipePipelineModule at the config's plan (same topology,
    loss, seeds and activation checkpointing settings)."""
    log.info("octopipe: rebuilding the %s at the plan of the config's octopipe block", type(model).__name__)
    return OctoPipePipelineModule(
        model._layer_specs, config=ds_config, topology=model._topo, loss_fn=model.loss_fn,
        seed_layers=model.seed_layers, seed_fn=model.seed_fn, base_seed=model.base_seed,
        activation_checkpoint_interval=model.activation_checkpoint_interval,
        activation_checkpoint_func=model.activation_checkpoint_func,
        checkpointable_layers=model.checkpointable_layers, dynamic_shape=model.dynamic_shape)
