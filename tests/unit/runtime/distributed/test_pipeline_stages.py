"""Pipeline parallelism's pure parts: how layers split into stages, where ranks sit, how ranks find the leader."""
from __future__ import annotations

import pytest

from kaon_runtime.distributed.rendezvous import DEFAULT_PORT, DEV_KEY, GroupConfigError, parse_address, rendezvous_from
from kaon_runtime.distributed.stages import Placement, ranks_of_host, split_layers, stage_of
from kaon_runtime.errors import KaonError


def test_layers_split_into_contiguous_stages_the_first_ones_larger():
    assert split_layers(8, 2) == [range(4), range(4, 8)]
    assert split_layers(3, 2) == [range(2), range(2, 3)]
    assert split_layers(10, 4) == [range(3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(5, 1) == [range(5)]
    for layers, pp in ((7, 3), (126, 8), (4, 4)):
        spans = split_layers(layers, pp)
        assert [i for span in spans for i in span] == list(range(layers))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        split_layers(2, 3)
    with pytest.raises(ValueError, match=">= 1"):
        split_layers(2, 0)


def test_a_stage_knows_its_ends():
    first, last = stage_of(3, 2, 0), stage_of(3, 2, 1)
    assert (first.is_first, first.is_last, first.layers(3)) == (True, False, range(2))
    assert (last.is_first, last.is_last, last.layers(3)) == (False, True, range(2, 3))
    whole = stage_of(3, 1, 0)
    assert whole.is_first and whole.is_last and whole.layers(3) == range(3)


def test_ranks_are_stage_major_and_pair_with_the_same_tp_rank():
    p = Placement(rank=5, tp_size=2, pp_size=3)
    assert (p.world_size, p.stage, p.tp_rank) == (6, 2, 1)
    assert p.peer(1) == 3 and p.stage_ranks(0) == [0, 1]


def test_hosts_take_equal_contiguous_shares_of_the_ranks():
    assert ranks_of_host(4, 2, 0) == range(2) and ranks_of_host(4, 2, 1) == range(2, 4)
    assert ranks_of_host(4, 1, 0) == range(4)
    with pytest.raises(ValueError, match="cannot share 3 ranks"):
        ranks_of_host(3, 2, 0)


def test_ranks_find_the_leader_from_leaderworkerset_or_the_flag():
    lws = {"LWS_LEADER_ADDRESS": "svc-0.svc.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
           "KAON_DIST_AUTHKEY": "k"}
    rdv = rendezvous_from(None, lws)
    assert (rdv.host, rdv.port, rdv.num_hosts, rdv.host_index, rdv.is_leader) == ("svc-0.svc.ns", DEFAULT_PORT, 2, 1,
                                                                                 False)
    assert rdv.init_method == f"tcp://svc-0.svc.ns:{DEFAULT_PORT}" and rdv.control_address[1] == DEFAULT_PORT + 1
    flagged = rendezvous_from("10.0.0.7:4000", lws)  # the flag wins over LWS's address
    assert (flagged.host, flagged.port, flagged.host_index) == ("10.0.0.7", 4000, 1)
    alone = rendezvous_from(None, {})
    assert (alone.num_hosts, alone.port, alone.is_leader) == (1, 0, True)
    assert rendezvous_from(None, {"KAON_DIST_JOIN_TIMEOUT_S": "5"}).join_timeout_s == 5


def test_a_group_without_the_leaders_address_or_a_bad_one_is_refused():
    with pytest.raises(ValueError, match="needs the leader's address"):
        rendezvous_from(None, {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "KAON_DIST_AUTHKEY": "k"})
    with pytest.raises(ValueError, match="outside a group of 2"):
        rendezvous_from("h:1", {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2", "KAON_DIST_AUTHKEY": "k"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("leader")
    assert parse_address("[::1]:29500") == ("[::1]", 29500)


def test_a_group_of_several_hosts_needs_its_key():
    """The plans are pickled: a group reachable over the network refuses the built-in key unless told."""
    group = {"LWS_LEADER_ADDRESS": "10.0.0.7", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    with pytest.raises(GroupConfigError, match="needs KAON_DIST_AUTHKEY") as refused:
        rendezvous_from(None, group)
    assert isinstance(refused.value, KaonError) and "\n" not in str(refused.value)  # one line from `kaon serve`
    assert rendezvous_from(None, {**group, "KAON_DIST_AUTHKEY": "s3cret"}).authkey == b"s3cret"
    assert rendezvous_from(None, {**group, "KAON_DIST_INSECURE_KEY": "1"}).authkey == DEV_KEY
    alone, again = rendezvous_from(None, {}), rendezvous_from(None, {})  # one host: a random key of its own
    assert alone.authkey != again.authkey and len(alone.authkey) == 64 and alone.authkey not in repr(alone).encode()
