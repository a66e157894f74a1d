"""OctoPipe: co-optimized partitioning, placement and scheduling for pipeline-parallel training."""

__version__ = "0.1.0"
