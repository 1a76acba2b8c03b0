"""Two Ray nodes on one machine (127.0.0.2 and 127.0.0.3): the train group's rendezvous is on rank 0's node."""

import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def two_nodes(monkeypatch):
    """Ray's test cluster writes its address where ray.init() with no address looks for one: in Ray's own folder
    under RAY_TMPDIR. The cluster gets a folder of its own, so that no driver of another test running meanwhile
    (a second test worker) joins it and dies with it."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from slime_search.ray.session import ray_tmp_dir

    shared_address = ray_tmp_dir() / "ray_current_cluster"
    own = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths must fit
    monkeypatch.setenv("RAY_TMPDIR", str(own))
    head = {"num_cpus": 1, "resources": {"node_a": 1}, "node_ip_address": "127.0.0.2"}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.3")
        assert (own / "ray" / "ray_current_cluster").is_file()
        assert not shared_address.is_file() or cluster.address not in shared_address.read_text()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(own, ignore_errors=True)


def test_the_process_group_meets_on_rank_0s_node(two_nodes):
    from ray.util.placement_group import placement_group

    from slime_search.ray.train_group import RayTrainGroup, TrainGroupConfig

    # rank 0 on the second node, rank 1 on the head node (where the driver runs)
    bundles = [{"CPU": 0.5, "node_b": 0.1}, {"CPU": 0.5, "node_a": 0.1}]
    group_placement = placement_group(bundles, strategy="STRICT_SPREAD")
    two_nodes.get(group_placement.ready())
    group = RayTrainGroup(TrainGroupConfig(num_ranks=2), placement_group=group_placement)
    try:
        # both ranks joined one gloo group (its set-up blocks until they do) at the address of rank 0's node
        assert group.master_address == "127.0.0.3"
        assert group.on_all_ranks("distributed_address") == [("127.0.0.3", 2)] * 2
    finally:
        group.shutdown()
