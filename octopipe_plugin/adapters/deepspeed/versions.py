"""The DeepSpeed versions the adapter supports: stated once, checked when an "octopipe" block is enabled.

setup.py's `deepspeed` extra reads the same range (a test compares them). The adapter replaces
DeepSpeed names and reuses private engine methods whose contract was measured on these versions
(/work/shared/notes/deepspeed-contract.md); another version is refused with one line before the
block is honoured, rather than run on a contract nobody checked. Pure Python.
"""

from __future__ import annotations

from ...errors import OctoPipeError

SUPPORTED = ">=0.19.8,<0.19.9"  # the pip specifier; setup.py says the same


class UnsupportedVersion(OctoPipeError):
    """The installed DeepSpeed is outside SUPPORTED."""


def supported(version: str) -> bool:
    """Whether a DeepSpeed version string lies in SUPPORTED."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version) in SpecifierSet(SUPPORTED)


def check_version(version: str) -> None:
    """Refuse (one line) a DeepSpeed version outside SUPPORTED."""
    if not supported(version):
        raise UnsupportedVersion(
            f"octopipe: DeepSpeed {version} is not supported (supported: deepspeed{SUPPORTED}); install "
            f"'deepspeed{SUPPORTED}', or set \"octopipe\": {{\"enabled\": false}} to run DeepSpeed's own engine")


def check_installed() -> None:
    """Refuse (one line) the installed DeepSpeed when outside SUPPORTED (imports DeepSpeed)."""
    import deepspeed

    check_version(deepspeed.__version__)
