"""The per-peer message rule: which messages a plan implies and their order."""

from octopipe_plugin.formats import Plan, Stage
from octopipe_plugin.actions import B, F, I, W
from octopipe_plugin.schedules.messages import MsgKind, messages_by_action, plan_messages


def _v_plan():
    # V-shape on 2 devices: stages 0,3 on device 0 and 1,2 on device 1; stage 1->2 stays on device 1.
    stages = (Stage(start=0, end=1, device=0), Stage(start=1, end=2, device=1),
              Stage(start=2, end=3, device=1), Stage(start=3, end=4, device=0))
    d0 = (F(0, 0), F(0, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), I(0, 1), I(0, 0), W(0, 0), W(0, 1))
    d1 = (F(1, 0), F(2, 0), F(1, 1), F(2, 1), B(2, 0), B(1, 0), B(2, 1), B(1, 1))
    return Plan(model="t", num_devices=2, num_microbatches=2, stages=stages, schedule=(d0, d1))


def test_same_device_hand_off_is_not_a_message():
    plan = _v_plan()
    sends, recvs = messages_by_action(plan)
    assert F(1, 0) not in sends and F(2, 0) not in recvs
    assert sends[F(2, 0)].consumer == F(3, 0)
    assert all(not (m.src_stage == 1 and m.dst_stage == 2) for m in sends.values())
    assert all(not (m.src_stage == 2 and m.dst_stage == 1) for m in sends.values())


def test_messages_follow_sender_production_order_and_name_their_consumer():
    plan = _v_plan()
    msgs = plan_messages(plan)
    assert [str(m.producer) for m in msgs[(0, 1)]] == ["0F0", "0F1", "3B0", "3B1"]
    assert [str(m.producer) for m in msgs[(1, 0)]] == ["2F0", "2F1", "1B0", "1B1"]
    grad = msgs[(1, 0)][2]
    assert grad.kind is MsgKind.GRAD and str(grad.consumer) == "0I0"
    assert grad.consumer == I(0, 0)


def test_tags_are_unique_within_a_step():
    plan = _v_plan()
    tags = [m.tag(plan.num_stages) for ms in plan_messages(plan).values() for m in ms]
    assert len(tags) == len(set(tags))
