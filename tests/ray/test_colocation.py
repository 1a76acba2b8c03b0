"""The colocated memory hand-over: each phase gets its layout, and no step ever needs more device memory than the
device has (the side that leaves goes first). The real actor and engines run it in test_train_e2e."""

import pytest

from slime_search.ray.colocation import Colocation

ACTOR, WEIGHTS, KV_CACHE, CUDA_GRAPH = 4, 2, 3, 1  # device memory of each part
DEVICE = 6  # fits actor + engine weights, or the whole engine; never the actor with the KV cache
ENGINE = {"weights": WEIGHTS, "kv_cache": KV_CACHE, "cuda_graph": CUDA_GRAPH}


class Device:
    """Who holds memory on the shared device; refuses any step that would overfill it."""

    def __init__(self):
        self.held = {"actor": ACTOR, **ENGINE}  # before the actor makes room
        self.capacity = ACTOR + sum(ENGINE.values())  # start-up: the engines start only after the first offload
        self.log: list[str] = []

    def take(self, part: str, size: int) -> None:
        assert part not in self.held, f"{part} is already on the device"
        self.held[part] = size
        assert sum(self.held.values()) <= self.capacity, f"{self.log + [part]} overfills the device: {self.held}"
        self.log.append(f"+{part}")

    def give(self, part: str) -> None:
        assert part in self.held, f"{part} is not on the device"
        del self.held[part]
        self.log.append(f"-{part}")


class Group:
    def __init__(self, device: Device):
        self.device = device

    def offload(self) -> int:
        self.device.give("actor")
        return ACTOR * 2**30

    def onload(self) -> int:
        self.device.take("actor", ACTOR)
        return ACTOR * 2**30


class RecordingColocation(Colocation):
    """Engine calls go to the device model instead of the RolloutManager actor."""

    def __init__(self, enabled: bool, device: Device, keep_engine_weights: bool = False):
        super().__init__(enabled, Group(device), keep_engine_weights=keep_engine_weights)
        self.device = device

    def _engines(self, method: str, tags: list[str]) -> None:
        for tag in tags:
            if method == "release_memory":
                self.device.give(tag)
            else:
                self.device.take(tag, ENGINE[tag])


def colocation(keep_engine_weights: bool = False) -> tuple[RecordingColocation, Device]:
    device = Device()
    col = RecordingColocation(True, device, keep_engine_weights)
    col.for_generation()  # the actor makes room before the engines start
    device.capacity = DEVICE
    return col, device


def test_a_run_of_phases_never_overfills_the_device():
    col, device = colocation()
    phases = {
        "generation": (col.for_generation, {"weights", "kv_cache", "cuda_graph"}),
        "training": (col.for_training, {"actor"}),
        "push": (col.for_weight_push, {"actor", "weights"}),
    }
    # rollout, train, push, save (a push layout), eval, rollout, train, push, resume (load, push), rollout
    run = ["generation", "training", "push", "push", "generation", "generation", "training", "push"]
    for phase in run + ["training", "push", "generation"]:
        enter, expected = phases[phase]
        enter()
        assert set(device.held) == expected, f"{phase}: {device.held}"
    assert col.metrics() == {"memory/actor_offloaded_gib": ACTOR}


def test_each_hand_over_releases_before_it_takes():
    col, device = colocation()
    device.log.clear()
    col.for_training()
    assert device.log == ["-weights", "-kv_cache", "-cuda_graph", "+actor"]
    device.log.clear()
    col.for_weight_push()
    assert device.log == ["+weights"]
    device.log.clear()
    col.for_generation()
    assert device.log == ["-actor", "+kv_cache", "+cuda_graph"]
    device.log.clear()
    col.for_weight_push()  # straight from generation (a resume): engines out, actor in, weights back
    assert device.log == ["-weights", "-kv_cache", "-cuda_graph", "+actor", "+weights"]


def test_engines_pushed_adapters_alone_keep_their_base_weights_through_training():
    """--lora-sync-from-tensor: a push carries no base, so the engines give up only their KV cache and CUDA graphs."""
    col, device = colocation(keep_engine_weights=True)
    device.log.clear()
    for phase in ("training", "push", "generation", "training", "push", "generation"):
        getattr(col, f"for_{'weight_push' if phase == 'push' else phase}")()
        assert "weights" in device.held, phase
    assert device.log == ["-kv_cache", "-cuda_graph", "+actor", "-actor", "+kv_cache", "+cuda_graph"] * 2
    col.for_training()
    assert set(device.held) == {"actor", "weights"}  # what the device must hold while the actor trains


def test_repeating_a_phase_changes_nothing():
    col, device = colocation()
    for enter in (col.for_generation, col.for_training, col.for_weight_push):
        enter()
        held = dict(device.held)
        device.log.clear()
        enter()
        assert device.log == [] and device.held == held


@pytest.mark.parametrize("enter", ["for_generation", "for_training", "for_weight_push"])
def test_without_colocate_nothing_moves(enter):
    device = Device()
    col = RecordingColocation(False, device)
    getattr(col, enter)()
    assert device.log == [] and col.metrics() == {}
