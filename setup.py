"""OctoPipe: pipeline-parallel plans for heterogeneous models (Megatron-LM, DeepSpeed)."""

from setuptools import find_packages, setup

setup(
    name="octopipe_plugin",
    version="0.1.0",
    description="Co-optimized partitioning, placement and scheduling for pipeline-parallel training",
    packages=find_packages(include=["octopipe_plugin", "octopipe_plugin.*"]),
    package_data={"octopipe_plugin": ["costs/zoo/*.yaml", "costs/*.json", "data/*.json",
                                      "adapters/megatron/py311/sitecustomize.py"]},
    python_requires=">=3.11",
    install_requires=[
        "networkx>=3.0",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        # The range of adapters/megatron/compat.py SUPPORTED_MEGATRON_CORE (a test keeps them equal). It needs
        # Python 3.12; on 3.11 install it with `--ignore-requires-python --no-deps` (scripts/install.sh).
        "megatron": ["megatron-core>=0.19.0,<0.20", "packaging>=24.2"],
        # Build with DS_BUILD_OPS=0 and --no-build-isolation, after torch (scripts/install.sh).
        "deepspeed": ["deepspeed>=0.19.8,<0.19.9"],  # = adapters/deepspeed/versions.py SUPPORTED
        "test": [
            "torch==2.13.0",
            "pytest>=7",
            "pytest-timeout>=2.1",
            "hypothesis>=6.80",
        ],
        "solver": ["ortools>=9.8"],
        # The tuner's list scheduler compiled (tuner/listsched_kernel.py); without it the Python one runs.
        "fast": ["numba>=0.60"],
    },
    entry_points={"console_scripts": ["octopipe=octopipe_plugin.cli:main"]},
)
