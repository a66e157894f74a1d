"""The split head's loss-rule probes (split_head.loss_rule) leave Megatron's rerun state machine as they found it.

Megatron's GPT loss function hands each loss to `get_rerun_state_machine().validate_result` (NaN check, and with
--check-for-spiky-loss `is_unexpectedly_large`, whose running maximum over the first 100 losses decides what a
spike is). A probe is no loss of the run: recording it would move that maximum and count toward the 100.
Real megatron-core RerunStateMachine; the loss function is pretrain_gpt's validation calls in miniature.
"""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.framework

rsm = pytest.importorskip("megatron.core.rerun_state_machine")


def _loss_func(output_tensor):
    """pretrain_gpt's loss_func shape: sum of per-token losses, token count, reported dict; spiky-loss check on."""
    machine = rsm.get_rerun_state_machine()
    loss = output_tensor.float().sum()
    machine.validate_result(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss "
                            "calculation", tolerance=0.0, fatal=True)
    machine.validate_result(result=loss, rejection_func=partial(machine.is_unexpectedly_large, threshold=10,
                                                                context="loss"),
                            message="Spiky loss", tolerance=0.0, fatal=False)
    num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
    return loss, num_tokens, {"lm loss": loss.detach()}


@pytest.fixture
def machine():
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    yield rsm.get_rerun_state_machine()
    rsm.destroy_rerun_state_machine()


def test_loss_rule_probes_leave_the_spiky_loss_statistics_alone(machine):
    from octopipe_plugin.adapters.megatron.split_head import loss_rule

    _loss_func(torch.full((2, 3), 0.5))  # one real loss recorded before: 3.0
    before = dict(machine.large_value_counts), dict(machine.max_values), machine.mode
    config = SimpleNamespace(timers=None, calculate_per_token_loss=False, grad_scale_func=None,
                             num_moe_experts=None, mtp_num_layers=None)
    rule = loss_rule(torch.nn.Identity(), _loss_func, config, None, 4, 1, (2, 3))
    out = rule(torch.full((6,), 1000.0))  # a probe far above any real loss
    assert out.item() == pytest.approx(6000.0 / 6 / 4)  # Megatron's scaling still applied: / tokens / micro-batches
    assert (dict(machine.large_value_counts), dict(machine.max_values), machine.mode) == before
    _loss_func(torch.full((2, 3), 0.5))  # the run's next real loss is counted as the second
    assert machine.large_value_counts["loss"] == 2 and machine.max_values["loss"] == 3.0
