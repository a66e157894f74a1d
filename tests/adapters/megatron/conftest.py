"""The single-process references of the Megatron harness tests, run once per session for every module using them."""

from __future__ import annotations

import pytest


def _key(case: dict) -> str:
    """A reference case's configuration without its name: two modules' equal cases share one run."""
    return repr(sorted((k, v) for k, v in case.items() if k != "name"))


@pytest.fixture(scope="session")
def single_process_references(request, tmp_path_factory):
    """`lookup(cases)` -> {name: result} for a module's REFERENCE list. The first call runs, in one 1-rank spawn, every
    distinct reference configuration of the modules collected with this fixture (test_megatron_schedule.py and
    test_megatron_split.py share their dense, 2m and bf16 ones): one start-up, each configuration once."""
    import megatron_scenarios as S

    modules = {item.module for item in request.session.items if "single_process_references" in item.fixturenames}
    wanted = {}
    for module in sorted(modules, key=lambda m: m.__name__):
        for case in module.REFERENCE:
            wanted.setdefault(_key(case), {**case, "name": f"ref{len(wanted)}"})
    results = {}

    def lookup(cases: list[dict]) -> dict:
        missing = [c for c in cases if _key(c) not in wanted]
        assert not missing, f"reference cases not declared in a collected module's REFERENCE: {missing}"
        if not results:
            results.update(S.run_spawned(1, list(wanted.values()), tmp_path_factory.mktemp("ref") / "ref.pt"))
        return {c["name"]: results[wanted[_key(c)]["name"]] for c in cases}

    return lookup
