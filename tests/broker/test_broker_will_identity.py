"""A will handed out by SessionHousekeeping names the connection it fell due for, as of that entry.

sim --cluster seed 40087: will2's connection (epoch 156) ended without DISCONNECT, its will delay
running; the SessionHousekeeping that fired the will and the SessionOpen of its next connection
(clean start 0, epoch 180) applied in one batch. The proposer of the housekeeping read the
fired will's connection from the Session object, by then at epoch 180: it published the will
under the GUID of epoch 180 and proposed WillPublished for epoch 180, so the owed record
(epoch 156) stayed, and the shard's leader published it again under epoch 156's GUID: two copies
of one will, delivered twice to every subscriber (duplicate, packet_id_misuse)."""

from __future__ import annotations

from moorline.broker import commands as c
from moorline.broker.effects import Effects
from moorline.broker.shard import ShardState
from moorline.broker.topic_state import TopicLimits


def test_a_fired_will_names_its_connection_after_a_resume_in_the_same_batch() -> None:
    s = ShardState(0, "inc0", TopicLimits(), 3600)
    will = c.WillSpec("w/c1", b"gone", 1, False, delay_s=5)
    opened = s.apply(c.SessionOpen(1_000, "c1", True, 30, will), Effects())
    s.apply(c.SessionClose(2_000, "c1", opened.epoch, True), Effects())  # without DISCONNECT
    wills, _ended = s.apply(c.SessionHousekeeping(7_000), Effects())  # the delay ran out
    resumed = s.apply(c.SessionOpen(7_000, "c1", False, 0, c.WillSpec("w/c1", b"next", 1, False)), Effects())
    assert resumed.session_present and resumed.epoch != opened.epoch
    # What the proposer reads once the batch applied: the connection the will fell due for.
    [(fired, fired_will)] = wills
    assert fired_will.payload == b"gone"
    assert (fired.client_id, fired.incarnation, fired.epoch) == ("c1", opened.incarnation, opened.epoch)
    # Its WillPublished clears the owed record: the followups do not publish it again.
    assert s.apply(c.WillPublished(fired.client_id, fired.incarnation, fired.epoch), Effects()) is True
    assert not s.sessions.wills_owed
