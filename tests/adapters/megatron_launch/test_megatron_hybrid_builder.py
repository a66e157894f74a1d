"""Inside pretrain, Megatron's own HybridModelBuilder builds a V-shape plan's hybrid chunks (launch hooks installed).

The cfg_container route (`hybrid_config_from_args`, `HybridModelBuilder.build_distributed_models`), the
arguments through Megatron's parser with OctoPipe's start-up (which writes the plan's stages into
`--hybrid-layer-pattern`) and validate_args. A pattern of attention and MLP layers: Mamba layers need GPU
kernels; their builder and placement path is this one. Oracle: the plan's stages — each rank's chunks hold
the plan's layers under their global numbers, of the pattern's kinds, the embedding and the LM head where
the plan puts them, the tied word-embedding group the plan's.
"""

import json
import os
import sys

import pytest

from octopipe_plugin.adapters.megatron.graph import model_from_megatron
from octopipe_plugin.formats import write_plan
from octopipe_plugin.schedules.registry import build_plan

from launch_helpers import parse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron"))
import megatron_harness as H  # noqa: E402  (spawn: the ranks fork from its forkserver, Megatron imported once)

pytestmark = [pytest.mark.framework, pytest.mark.distributed, pytest.mark.timeout(400)]
PATTERN = "*-*-*-"  # graph layers: 0 embedding, 1..6 the pattern, 7 LM head
HYBRID = ["--hybrid-layer-pattern", PATTERN, "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
          "--position-embedding-type", "rope"]
RUN = HYBRID + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--transformer-impl", "local",
                "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
                "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--tokenizer-type",
                "NullTokenizer", "--pipeline-schedule", "octopipe"]


def test_hybrid_builder_builds_the_v_shape_plans_chunks(tmp_path):
    model = model_from_megatron(parse(HYBRID, octopipe=False, validate=False))
    write_plan(build_plan(model, "zb-v", 2, 4, stages_per_device=2, boundaries=[(0, 3), (3, 5), (5, 6), (6, 8)]),
               tmp_path / "v.json")
    H.spawn(_worker, 2, str(tmp_path))
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert got[0]["pattern"] == "*-|*-|*|-"  # the plan's stages in stage order
    # ZB-V map: stages 0..3 on ranks 0, 1, 1, 0; pattern layers (1-based numbers) 1-2 | 3-4 | 5 | 6
    assert got[0]["chunks"] == [{"pre": True, "post": False, "layers": [[1, "TransformerLayer"], [2, "MLPLayer"]]},
                                {"pre": False, "post": True, "layers": [[6, "MLPLayer"]]}]
    assert got[1]["chunks"] == [{"pre": False, "post": False, "layers": [[3, "TransformerLayer"], [4, "MLPLayer"]]},
                                {"pre": False, "post": False, "layers": [[5, "TransformerLayer"]]}]
    assert got[0]["embedding_group"] == [0] and got[1]["embedding_group"] is None  # tied copies both on rank 0
    assert got[0]["tied_equal"]


def _worker(rank, world, port, out):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(here, "..", "megatron")]
    import megatron_cpu_shims

    megatron_cpu_shims.install()
    from octopipe_plugin.executor.launch import init_gloo

    init_gloo(rank, world, port, 120)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.global_vars import set_args

    import hybrid_harness
    from launch_helpers import parse as parse_here
    from octopipe_plugin.adapters.megatron.launch import install

    install()
    args = parse_here(RUN + ["--octopipe-plan", os.path.join(out, "v.json")], world=world, rank=rank)
    set_args(args)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(1234)
    model_cfg = hybrid_config_from_args(args)
    model_cfg.hybrid_stack_spec = hybrid_harness.local_hybrid_stack_spec()  # Megatron's default is TE (CUDA)
    builder = model_cfg.get_builder_cls()(model_cfg)
    chunks = builder.build_distributed_models(ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False,
                                              mixed_precision_wrapper=None)
    report = {"pattern": args.hybrid_layer_pattern,
              "chunks": [{"pre": c.pre_process, "post": c.post_process,
                          "layers": [[layer.layer_number, type(layer).__name__] for layer in c.decoder.layers]}
                         for c in chunks]}
    group = ps.get_embedding_group(check_initialized=False) if ps.is_rank_in_embedding_group() else None
    report["embedding_group"] = dist.get_process_group_ranks(group) if group is not None else None
    weights = [c.shared_embedding_or_output_weight() for c in chunks
               if c.pre_process or (c.post_process and c.share_embeddings_and_output_weights)]
    report["tied_equal"] = len(weights) >= 2 and all(torch.equal(weights[0], w) for w in weights[1:])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()
