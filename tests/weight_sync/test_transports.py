"""The closed registry of weight transports: chosen once by name, an unknown name lists the valid ones."""

import pytest

from slime_search.weight_sync.transport_base import WeightSyncConfig
from slime_search.weight_sync.transports import TRANSPORTS, create_transport, default_transport, transport_kind


def test_each_name_builds_its_transport():
    from slime_search.weight_sync.broadcast import BroadcastTransport
    from slime_search.weight_sync.disk import DiskTransport
    from slime_search.weight_sync.tensor_handles import TensorHandleTransport

    built = {name: create_transport(WeightSyncConfig(name), group=None, engine_urls=["u"]) for name in TRANSPORTS}
    assert {name: type(t) for name, t in built.items()} == {
        "disk": DiskTransport,
        "nccl": BroadcastTransport,
        "tensor": TensorHandleTransport,
    }
    assert built["nccl"].ranks_per_engine == [1]


def test_the_registry_holds_every_transport_name_the_settings_accept():
    from slime_search.weight_sync.transport_base import TRANSPORT_NAMES

    assert tuple(sorted(TRANSPORTS)) == TRANSPORT_NAMES


def test_an_unknown_transport_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown weight transport 'smoke'; valid: disk, nccl, tensor"):
        transport_kind("smoke")
    with pytest.raises(ValueError, match="valid: disk, nccl, tensor"):
        WeightSyncConfig("smoke")
    with pytest.raises(ValueError, match="positive number of bytes"):
        WeightSyncConfig("disk", bucket_bytes=0)


def test_default_and_colocated_choices():
    assert [default_transport(c, g) for c, g in [(False, False), (False, True), (True, False)]] == [
        "disk",
        "nccl",
        "tensor",
    ]
    assert transport_kind("tensor").refused_colocated is None and transport_kind("disk").refused_colocated is None
    assert "one GPU" in transport_kind("nccl").refused_colocated
