"""Which megatron-core this adapter runs on, and what megatron.training needs from Python 3.11.

One place for the supported versions: `SUPPORTED_MEGATRON_CORE` (setup.py's `megatron` extra states
the same range; a test keeps the two equal). The adapter calls Megatron functions with the 0.19.x
signatures (schedules.backward_step, the model builders, the linear Functions), so another version is
refused at start-up, before any Megatron name is patched, instead of failing at the first backward.
"""

from __future__ import annotations

import functools
import os
import sys

from ...compat import allow_megatron_training_import  # noqa: F401 - the one typing.override shim, re-exported
from ...errors import OctoPipeError

SUPPORTED_MEGATRON_CORE = ">=0.19.0,<0.20"  # Megatron-LM tag core_v0.19.0 reports 0.19.1; pip has 0.19.2
PY311_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py311")  # holds sitecustomize.py


def megatron_core_version() -> str:
    """The version of the megatron-core that `import megatron` finds (a checkout on sys.path included)."""
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise OctoPipeError(f"--pipeline-schedule octopipe needs megatron-core {SUPPORTED_MEGATRON_CORE}, which "
                            f"does not import here ({exc}); install it (scripts/install.sh)") from None
    return str(package_info.__version__)


def check_megatron_version(version: str | None = None) -> str:
    """Refuse, in one line naming the supported range, a megatron-core outside it; returns the version."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = megatron_core_version() if version is None else version
    try:
        ok = Version(version) in SpecifierSet(SUPPORTED_MEGATRON_CORE, prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise OctoPipeError(f"megatron-core {version}: OctoPipe's Megatron adapter supports megatron-core "
                            f"{SUPPORTED_MEGATRON_CORE} (0.19.x, e.g. pip's 0.19.2 or Megatron-LM's core_v0.19.0 "
                            "checkout); install one of those or run --pipeline-schedule default")
    return version


@functools.cache
def require_supported_megatron() -> str:
    """`check_megatron_version` once per process (every hook installation asks first)."""
    return check_megatron_version()


def reach_child_processes(env: dict | None = None) -> bool:
    """On Python 3.11, put the typing.override sitecustomize first on PYTHONPATH of `env` (os.environ) so that
    every process this one starts has it too; returns whether it did (False on 3.12+)."""
    if sys.version_info >= (3, 12):
        return False
    env = os.environ if env is None else env
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PY311_SHIM_DIR]
    env["PYTHONPATH"] = os.pathsep.join([PY311_SHIM_DIR, *parts])
    return True
