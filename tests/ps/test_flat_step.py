"""A dense ps step crosses the wire as plain values (no pickle) and is read back as the same typed messages."""

import torch

from towerflow.cluster.calls import wire
from towerflow.ps.messages import Endpoints, PushOutcome, PushPull, PushPulled, Pulled, Ticket


def _across(message):
    frames = wire.encode(9, message)
    received = [bytes(frames[0]), *[memoryview(f).cast("B") for f in frames[1:]]]
    return wire.envelope(received[0])[0], wire.decode(received)


def test_a_dense_push_pull_is_laid_out_and_read_back_as_the_same_request():
    grads = [torch.randn(300, 7), torch.arange(5, dtype=torch.int64)]
    request = PushPull(3, Ticket(41, gap=2), grads, None, 17, after_step=42, kind="delta")
    kind, call = _across(wire.Call(Endpoints.push_pull_flat, ("model", *request.flat())))
    assert kind == wire.FLAT_CALL
    assert call.args[0] == "model"
    back = PushPull.from_flat(call.args[1:])
    assert (back.worker, back.ticket, back.lr, back.clock, back.after_step, back.rows, back.kind) == \
           (3, Ticket(41, 2), None, 17, 42, None, "delta")
    assert all(torch.equal(a, b) for a, b in zip(back.grads, grads))


def test_the_reply_is_laid_out_and_read_back_as_the_same_outcome_and_values():
    reply = PushPulled(PushOutcome("dropped", 3, 99), Pulled(Ticket(100, 1), [torch.ones(4), torch.zeros(2, 2)]))
    kind, got = _across(wire.Reply(reply.flat()))
    assert kind == wire.FLAT_REPLY
    back = PushPulled.from_flat(got.value)
    assert back.outcome == reply.outcome and back.pulled.ticket == reply.pulled.ticket
    assert all(torch.equal(a, b) for a, b in zip(back.pulled.values, reply.pulled.values))


def test_the_endpoint_name_is_what_the_ps_unpickles_once_as_its_function():
    kind, call = _across(wire.Call(Endpoints.push_pull_flat, ("model",)))
    from towerflow.ps.server import endpoints

    assert call.fn is endpoints.endpoint("push_pull_flat")
