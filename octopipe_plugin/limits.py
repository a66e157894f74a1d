"""The stated range of every number OctoPipe reads, from a command line or a document, in one place.

Readers and commands check against these before any work, so a typo (a NaN, a negative
time, a billion devices) is one clear refusal instead of a hang, a memory blow-up or a
silently wrong answer. Sizes (devices x micro-batches) are capped by what a command does in
seconds and a few hundred MB on a laptop-class machine: the simulator holds about 0.6 KB and
spends about 10 us per action (`octopipe simulate`, 8 devices x 100k micro-batches: 17 s, 0.9 GB).
"""

from __future__ import annotations

MAX_DEVICES = 4096  # pipeline devices of a cluster or plan
MAX_LAYERS = 100_000  # partitioning units of a model
MAX_MICROBATCHES = 1_000_000  # micro-batches per step (a document field; commands cap the product below)
MAX_STAGES_PER_DEVICE = 64
# stages x micro-batches one simulation may hold: 2-3 actions each, ~1.2M actions, ~10 s and ~1 GB
MAX_STAGE_MICROBATCHES = 400_000
# devices x micro-batches the tuner accepts: issue 12's largest scale (128 devices x 1024) and some room
MAX_TUNE_DEVICE_MICROBATCHES = 262_144
# layers x stages of one exact balanced split: its DP keeps a cut table of that many entries (~40 B each)
MAX_SPLIT_CELLS = 2_000_000
MAX_DRYRUN_DEVICES = 64  # one local process each
MAX_DRYRUN_STAGE_MICROBATCHES = 20_000  # every action is a real message exchange and a sleep
MAX_DRYRUN_STEP_S = 600.0  # the scaled step a dry run sleeps through
MAX_TIME_BUDGET_S = 86_400.0
MAX_TIMEOUT_S = 86_400.0
MIN_TIMEOUT_S = 1.0  # below this a busy 2-core machine reports false deadlocks
MAX_TIME_SCALE = 1e6
MAX_LAUNCH_US = 1e6  # one second per message
MAX_LAYER_MS = 1e7  # one layer, one micro-batch: about three hours
MAX_PHASES = 64  # sub-layer phases of one layer (attention, all-to-alls, experts...)
MAX_FUSED_RATIO = 10.0  # a fused backward B at most ten times its split halves I + W (a measurement gone wrong beyond)
MAX_GRAPH_NODES = 10**9  # autograd nodes one layer's forward records
MAX_BYTES = 2**50  # 1 PiB: memory of one device, state or activation of one layer
MAX_BANDWIDTH_GB_PER_S = 1e6
MAX_LATENCY_US = 1e6
MAX_SEED = 2**32 - 1
MAX_ITERATIONS = 10**8
MAX_ARCH_INT = 2**31 - 1  # hidden sizes, heads, vocabulary, sequence length of an architecture file
MAX_SEQ_LEN = 2**24
MAX_MICRO_BATCH_SIZE = 65_536
MAX_TP = 4096
MAX_DP = 2**20
