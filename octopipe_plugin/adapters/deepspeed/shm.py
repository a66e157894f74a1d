"""DeepSpeed's CPU shared-memory all-reduce buffers, unlinked from /dev/shm once every rank has mapped them.

With DeepSpeed's CPU accelerator and every rank on one machine (LOCAL_SIZE = world size), `init_distributed`
(TorchBackend.__init__ -> the shm comm op's `initialize`, deepspeed/ops/csrc/cpu/comm/shm.cpp `shm_initialize`)
has each rank `shm_open` a 66 MiB buffer named `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`
and map every other rank's, waiting until it exists; DeepSpeed never unlinks them (its `shared_close` is never
called), so each run left one file per rank in /dev/shm (RAM) until the machine rebooted.

`release_shm_buffers()` unlinks this rank's buffer after a barrier on the world group: past it, every rank has
returned from `shm_initialize`, so every rank has mapped every buffer, and the mappings outlive the names (the
op opens a buffer by name only there). Unlinked this early, a run leaves nothing behind even when it is killed.
"""

from __future__ import annotations

import os

_released = False


def shm_buffer_path(rank: int) -> str:
    """The /dev/shm file DeepSpeed's shm comm op of this process's run creates for `rank` (shm.cpp's name)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def shm_active() -> bool:
    """Whether DeepSpeed's comm backend of this process runs the shm comm op over shared-memory buffers."""
    from deepspeed import comm

    cdb = comm.comm.cdb
    if cdb is None or getattr(cdb, "shm_comm_op", None) is None or not comm.is_initialized():
        return False
    return os.environ.get("LOCAL_SIZE", "").strip() == str(comm.get_world_size())  # shm.cpp's all-local test


def release_shm_buffers() -> bool:
    """Unlink this rank's shm all-reduce buffer once every rank has mapped it; whether it did (the first call of a
    process where the op is active; later calls, and runs without the op such as NCCL's, do nothing).

    A collective on the world group when it acts: every rank calls it together (as OctoPipeEngine's construction
    does, which is itself collective on the world: PipelineParallelGrid's new_group calls)."""
    global _released
    if _released or not shm_active():
        return False
    from deepspeed import comm

    comm.barrier()  # every rank is past shm_initialize: each buffer is mapped by every rank
    _released = True
    try:
        os.unlink(shm_buffer_path(comm.get_rank()))
    except FileNotFoundError:  # the environment's MASTER_ADDR/PORT changed since the init, or already gone
        pass
    return True
