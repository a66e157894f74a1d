"""The step's data source accepts what frameworks hand the schedule, not only Python iterables."""

from octopipe_plugin.executor.data import MicroBatches, StepData


class NextOnly:
    """Shaped like Megatron's RerunDataIterator: `__next__` and no `__iter__`."""

    def __init__(self, items):
        self.items = list(items)

    def __next__(self):
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


def test_next_only_iterator_is_read_in_order():
    batches = MicroBatches(NextOnly(["a", "b", "c"]), rank=0, limit=3)
    assert [batches.get(k) for k in range(3)] == ["a", "b", "c"]


def test_next_only_iterator_per_stage_and_shared():
    per_stage = StepData({0: NextOnly([1, 2]), 1: NextOnly([10, 20])}, stages=[0, 1], num_microbatches=2)
    assert [per_stage.get(s, mb) for s in (0, 1) for mb in (0, 1)] == [1, 2, 10, 20]
    shared = StepData(NextOnly([5, 6]), stages=[0, 3], num_microbatches=2)
    assert [shared.get(s, mb) for mb in (0, 1) for s in (0, 3)] == [5, 5, 6, 6]


def test_megatron_rerun_data_iterator():
    """Megatron's own wrapper, as its training loop builds it around every data iterator."""
    import pytest

    rsm = pytest.importorskip("megatron.core.rerun_state_machine")
    batches = MicroBatches(rsm.RerunDataIterator(iter([{"x": 1}, {"x": 2}])), rank=0, limit=2)
    assert [batches.get(0), batches.get(1)] == [{"x": 1}, {"x": 2}]
