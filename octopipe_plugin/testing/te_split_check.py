"""GPU check of Transformer Engine's I/W split as OctoPipe's Megatron runner does it; writes the record te.py reads.

    bash scripts/gpu_check.sh --te-split      (python -m octopipe_plugin.testing.te_split_check)

A TE linear of megatron-core (`TEColumnParallelLinear`, `TERowParallelLinear`) with `delay_wgrad_compute`
runs I and W through the runner's own functions (`wgrad.input_pass` / `wgrad.weight_pass`, TE's
`backward_dw` queue, two micro-batches in FIFO order) and is compared, input gradient and weight
gradients, with a twin whose backward is fused B (same weights, fp32). Each weight GEMM must run once:
a W that recomputes it doubles the gradient, which the comparison sees. The verdict goes to
`adapters/megatron/te.record_path()`; start-up's `--octopipe-te-split` needs a passing one. Needs a GPU
with Transformer Engine (elsewhere it says so and writes nothing).
"""

from __future__ import annotations

import copy
import sys

import torch


def _pair(kind: str, config):
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.utils import init_method_normal

    init = init_method_normal(0.02)
    h = config.hidden_size
    def make(cfg):
        if kind == "column":
            return te_ext.TEColumnParallelLinear(h, 2 * h, config=cfg, init_method=init, gather_output=False,
                                                 bias=True, skip_bias_add=False, is_expert=False)
        return te_ext.TERowParallelLinear(h, h, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                          skip_bias_add=False, is_expert=False)

    split = make(config)
    fused_config = copy.copy(config)
    fused_config.delay_wgrad_compute = False  # the twin: TE's own fused backward (B)
    fused = make(fused_config)
    with torch.no_grad():
        for a, b in zip(fused.parameters(), split.parameters()):
            a.copy_(b)
    return split, fused


def _grads(module) -> list[torch.Tensor]:
    return [(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().clone()
            for p in module.parameters()]


def check(kind: str, config, device) -> str | None:
    """None when split I/W equals fused B on a `kind` TE linear, else what differs."""
    from octopipe_plugin.adapters.megatron.wgrad import Phase, input_pass, te_modules_of, weight_pass

    split, fused = _pair(kind, config)
    te_mods = te_modules_of(split)
    if not te_mods:
        return f"{kind}: the TE linear does not defer its weight gradient (delay_wgrad_compute not taken)"
    xs = [torch.randn(16, 2, config.hidden_size, device=device, generator=torch.Generator(device).manual_seed(s))
          for s in range(2)]
    phase = Phase()
    works, dxs = [], []
    for x in xs:  # I of micro-batch 0 then 1, W in the same order (TE's queue is FIFO)
        xi = x.clone().requires_grad_(True)
        out = split(xi)
        out = out[0] if isinstance(out, tuple) else out
        g = torch.ones_like(out)
        (dx,), work = input_pass([out], [g], [xi], [p for p in split.parameters() if p.requires_grad], phase,
                                 te_mods)
        dxs.append(dx)
        works.append(work)
    for work in works:
        weight_pass(work)
    ref_dx = []
    for x in xs:
        xi = x.clone().requires_grad_(True)
        out = fused(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        ref_dx.append(xi.grad)
    for a, b in zip(dxs, ref_dx):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            return f"{kind}: input gradients differ by {(a - b).abs().max().item():.3g}"
    for i, (a, b) in enumerate(zip(_grads(split), _grads(fused))):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            ratio = (a.norm() / b.norm()).item() if b.norm() > 0 else float("inf")
            return f"{kind}: parameter {i} gradient differs (norm ratio {ratio:.3g}, 2 = computed twice)"
    return None


def main() -> int:
    """Run the check and write the record; 0 when it passed, 1 when it failed, 2 when it cannot run here."""
    from octopipe_plugin.adapters.megatron import te

    if not torch.cuda.is_available() or not te.te_available():
        print("te-split check: needs a CUDA GPU with Transformer Engine installed; nothing recorded")
        return 2
    from megatron.core.transformer.transformer_config import TransformerConfig

    from octopipe_plugin.adapters.megatron.profile import ensure_model_parallel

    device = torch.device("cuda", torch.cuda.current_device())
    ensure_model_parallel(device)
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, params_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False)
    config.delay_wgrad_compute = True  # set after validation: Megatron ties it to MoE overlap, the linear does not
    gpu = torch.cuda.get_device_name(device)
    try:
        problems = [p for p in (check("column", config, device), check("row", config, device)) if p]
    except Exception as exc:  # noqa: BLE001 - any failure is a failed check, recorded with its reason
        problems = [f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"]
    detail = "; ".join(problems) or "split I/W equals fused B on TEColumnParallelLinear and TERowParallelLinear"
    path = te.write_record(passed=not problems, gpu=gpu, detail=detail)
    print(f"te-split check on {gpu}: {'PASSED' if not problems else 'FAILED'}: {detail} (record {path})")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
