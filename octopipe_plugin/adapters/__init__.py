"""Framework adapters: the only part of OctoPipe that imports Megatron-LM or DeepSpeed.

Each sub-package imports its framework lazily, inside the functions that need it, so that
plan-to-layout conversions work (and can be tested) where the framework is not installed.
"""
