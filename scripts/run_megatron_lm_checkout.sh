#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py under --pipeline-schedule octopipe on 2 CPU ranks, against Megatron's own
# schedule on the same layers per stage: per-iteration losses side by side.
#
#   scripts/run_megatron_lm_checkout.sh CHECKOUT_DIR [WORK_DIR]
#
# CHECKOUT_DIR: a Megatron-LM checkout matching megatron-core 0.19.x, e.g.
#   mkdir -p /tmp/mlm && git -C Megatron-LM archive core_v0.19.0 | tar -x -C /tmp/mlm
# WORK_DIR (default: a new temporary folder): plans, logs, checkpoints.
# Environment: PYTHON (default: python) with torch, megatron-core's dependencies and this project importable
# (the project root is put on PYTHONPATH); nothing is installed and no network is used.
#
# Every launch goes through the documented CPU way: examples/megatron/cpu_run.py --nproc 2 --megatron-lm
# CHECKOUT pretrain_gpt.py ... (gloo ranks, the CPU shims, examples/megatron/launch.py), a tiny GPT on mock
# data (ARGS below: 8 layers, 8 micro-batches, PP=2).
#  (a) a plan tuned by `octopipe plan --megatron-args` (looped placement): fused B on the first stage,
#      split I/W on the last, non-uniform stages; against the same command with --pipeline-schedule default
#      on the plan's stages (--pipeline-model-parallel-layout from examples/megatron/layout_from_plan.py);
#      10 iterations, evaluation at 5 and 10.
#  (b) Megatron's own schedule on 4 stages (virtual pipeline 2) trains 5 iterations and saves; a V-shape plan
#      (zb-v: stages 0,3 on rank 0 and 1,2 on rank 1, split backward) on the same stages resumes from that
#      checkpoint to 10, against Megatron's own resumed run. (From scratch a V-shape has no twin: Megatron
#      seeds each pipeline rank's weights by rank.)
# Prints the loss columns; exit status 1 when a column differs from its twin, 0 when all agree.
#
# Traps met on a bare machine, worked around here (neither GPU nor plugin):
#  - the checkout ships no compiled dataset helpers and building them needs pybind11: when the checkout has no
#    helpers_cpp for this Python, the prebuilt one of the installed megatron-core package is copied in (and
#    cpu_shims.py skips Megatron's start-up `make`, which also fails where pyenv reads the checkout's
#    .python-version and picks another Python's extension suffix);
#  - resumed runs take --no-load-rng (the CUDA RNG state a CPU run saves is empty).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 CHECKOUT_DIR [WORK_DIR]  (CHECKOUT_DIR: a Megatron-LM checkout at core_v0.19.x)" >&2
  exit 2
fi
CHECKOUT=$(cd "$1" && pwd)
if [[ ! -f "$CHECKOUT/pretrain_gpt.py" || ! -d "$CHECKOUT/megatron/core" ]]; then
  echo "$0: $CHECKOUT has no pretrain_gpt.py and megatron/core: give the root of a Megatron-LM checkout" >&2
  exit 2
fi
WORK=${2:-$(mktemp -d -t octopipe-mlm-XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
octopipe() { "$PY" -c "import sys; from octopipe_plugin.cli import main; sys.exit(main(sys.argv[1:]))" "$@"; }

# the compiled dataset helpers (see the header)
SUFFIX=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
DATASETS="$CHECKOUT/megatron/core/datasets"
if [[ ! -f "$DATASETS/helpers_cpp$SUFFIX" ]]; then
  # the installed package's folder (from /, so not the checkout's); its import warnings are not ours to show
  PREBUILT=$(cd / && "$PY" -c "import megatron.core.datasets as d, os; print(os.path.dirname(d.__file__))" \
    2>/dev/null)/helpers_cpp$SUFFIX
  [[ -f "$PREBUILT" ]] || { echo "$0: no helpers_cpp$SUFFIX in $DATASETS nor $PREBUILT; build them (needs pybind11)" >&2; exit 2; }
  echo "# copying the installed megatron-core's prebuilt dataset helpers into the checkout: $PREBUILT"
  cp "$PREBUILT" "$DATASETS/"
fi

ARGS=(--num-layers 8 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64
      --max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8
      --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data
      # need CUDA: Transformer Engine and fused kernels
      --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
      --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion
      # the oracle: no dropout draws (the schedules run the forwards in different orders)
      --hidden-dropout 0 --attention-dropout 0
      --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.01 --clip-grad 1.0
      --seed 1234 --distributed-backend gloo --pipeline-model-parallel-size 2
      --log-interval 1 --eval-interval 5 --eval-iters 2 --train-iters 10
      --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable --distributed-timeout-minutes 10)
RESUME=(--ckpt-step 5 --no-load-rng)

run() {  # run NAME ARGS...: one 2-rank launch of the checkout's pretrain_gpt.py, its log in WORK/NAME.log
  local name=$1; shift
  echo "# $name: pretrain_gpt.py $*"
  if ! "$PY" "$REPO/examples/megatron/cpu_run.py" --nproc 2 --megatron-lm "$CHECKOUT" pretrain_gpt.py \
      "${ARGS[@]}" "$@" >"$WORK/$name.log" 2>&1; then
    echo "$0: the $name launch failed; the end of $WORK/$name.log:" >&2
    tail -30 "$WORK/$name.log" >&2
    exit 1
  fi
}

# (a) a tuned plan with fused B on the first stage, against Megatron's own schedule on its stages
octopipe plan --megatron-args "${ARGS[*]}" --world-size 2 --cluster h100x2 --placement looped --iterations 200 \
  --no-progress -o "$WORK/tuned.json" >"$WORK/tuned.plan.txt"
LAYOUT=$("$PY" "$REPO/examples/megatron/layout_from_plan.py" --plan "$WORK/tuned.json" \
  --model "$WORK/tuned.model.json" --cluster h100x2 | grep -o -- "--pipeline-model-parallel-layout '[^']*'" \
  | sed "s/.*'\(.*\)'/\1/")
"$PY" - "$WORK/tuned.json" "$LAYOUT" <<'EOF'
import sys
from octopipe_plugin.formats import read_plan
plan = read_plan(sys.argv[1])
kinds = {}
for row in plan.schedule:
    for a in row:
        kinds.setdefault(a.stage, set()).add(a.kind.value)
print(f"# (a) tuned plan: layout {sys.argv[2]}, action kinds per stage "
      f"{ {st: ''.join(sorted(k)) for st, k in sorted(kinds.items())} }")
if "B" not in kinds[0]:
    sys.exit("the tuned plan has no fused B on its first stage; (a) needs one")
EOF
run a_default --pipeline-model-parallel-layout "$LAYOUT"
run a_octopipe --pipeline-schedule octopipe --octopipe-plan "$WORK/tuned.json"

# (b) Megatron's own schedule writes the checkpoint at 5; a V-shape plan on the same stages resumes from it
LAYOUT_B="Ett|tt|tt|ttL"
"$PY" - "$WORK/tuned.model.json" "$LAYOUT_B" "$WORK/vshape.json" <<'EOF'
import sys
from octopipe_plugin.adapters.megatron.layout import layout_to_boundaries
from octopipe_plugin.costs import resolve_cluster
from octopipe_plugin.formats import bind_plan, read_model, write_plan
from octopipe_plugin.schedules.registry import build_plan
model = read_model(sys.argv[1])
plan = build_plan(model, "zb-v", 2, 8, boundaries=layout_to_boundaries(sys.argv[2], model))
write_plan(bind_plan(plan, model, resolve_cluster("h100x2")), sys.argv[3])
print(f"# (b) V-shape plan: stages {[(s.start, s.end) for s in plan.stages]} on ranks {[s.device for s in plan.stages]}")
EOF
rm -rf "$WORK/ck_b"
run b_default --pipeline-model-parallel-layout "$LAYOUT_B" --save "$WORK/ck_b" --save-interval 5 --exit-interval 5
run b_default_resumed --pipeline-model-parallel-layout "$LAYOUT_B" --load "$WORK/ck_b" "${RESUME[@]}"
run b_vshape_resumed --pipeline-schedule octopipe --octopipe-plan "$WORK/vshape.json" --load "$WORK/ck_b" "${RESUME[@]}"

"$PY" - "$WORK" <<'EOF'
import re, sys
work = sys.argv[1]
line = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
valid = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
def losses(name):
    text = open(f"{work}/{name}.log").read()
    return {("train", int(i)): v for i, v in line.findall(text)} | {("valid", int(i)): v for i, v in valid.findall(text)}
bad = 0
for title, names in (("(a) fused B on the first stage vs --pipeline-schedule default", ("a_default", "a_octopipe")),
                     ("(b) resumed at 5 from Megatron's checkpoint", ("b_default", "b_default_resumed", "b_vshape_resumed"))):
    cols = {n: losses(n) for n in names}
    print(f"\n{title}\n{'':>12}" + "".join(f"{n:>20}" for n in names))
    for key in sorted(set().union(*cols.values())):
        vals = [cols[n].get(key, "") for n in names]
        print(f"{key[0]} {key[1]:>6}" + "".join(f"{v:>20}" for v in vals))
    twin, other = names[-2], names[-1]
    if not cols[twin] or cols[twin] != cols[other]:
        print(f"MISMATCH: {other} differs from {twin}")
        bad = 1
print("\nall columns equal their twins" if not bad else "\nsome columns differ")
sys.exit(bad)
EOF
