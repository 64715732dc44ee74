"""The DataPlaneClient contract, run against the in-process store and the two real stores
(TransferQueue actors, Ray's object store with a directory actor).

The real stores run in the held local Ray cluster (``local_ray_8cpu``); TransferQueue runs one
controller + 2 storage units. Every test leaves no partition behind. Every test asks for the
cluster, so the tests keep the file's order: the two that break a store run last.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from nemo_rl.data_plane import (
    Column,
    DataPlaneClient,
    DataPlaneError,
    InProcessDataPlane,
    KVBatchMeta,
    MissingSamplesError,
)
from nemo_rl.data_plane.config import attach_data_plane, start_data_plane
from nemo_rl.distributed.ray_actors import kill_actors

pytestmark = pytest.mark.usefixtures("local_ray_8cpu")

KEYS = [f"k{i}" for i in range(6)]
REMOTE_BACKENDS = ["transfer_queue", "ray_object_store"]


@pytest.fixture(scope="module")
def tq_plane(local_ray_8cpu: None) -> Iterator[Any]:
    plane = start_data_plane({"backend": "transfer_queue", "num_data_storage_units": 2})
    try:
        yield plane
    finally:
        plane.close()


@pytest.fixture(scope="module")
def object_store_plane(local_ray_8cpu: None) -> Iterator[Any]:
    plane = start_data_plane({"backend": "ray_object_store"})
    try:
        yield plane
    finally:
        plane.close()


_FIXTURE = {"transfer_queue": "tq_plane", "ray_object_store": "object_store_plane"}


@pytest.fixture(params=[pytest.param(b, marks=pytest.mark.slow) for b in REMOTE_BACKENDS])
def remote_plane(request: pytest.FixtureRequest) -> Iterator[tuple[str, DataPlaneClient]]:
    """(backend name, the driver's owning client) of each store other processes can reach."""
    client = request.getfixturevalue(_FIXTURE[request.param])
    yield request.param, client
    for partition_id in client.partitions():
        client.clear_partition(partition_id)


@pytest.fixture(params=["in_process", *(pytest.param(b, marks=pytest.mark.slow) for b in REMOTE_BACKENDS)])
def plane(request: pytest.FixtureRequest) -> Iterator[DataPlaneClient]:
    if request.param == "in_process":
        client = InProcessDataPlane()
    else:
        client = request.getfixturevalue(_FIXTURE[request.param])
    yield client
    for partition_id in client.partitions():
        client.clear_partition(partition_id)
    assert client.partitions() == []


def rollout_fields(n: int, seed: int = 0) -> dict[str, Column]:
    """Jagged and regular fields of ``n`` samples, in several dtypes."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    return {
        "input_ids": [torch.randint(0, 1000, (int(n_),), generator=g) for n_ in lengths],
        "token_mask": [torch.rand(int(n_), generator=g) > 0.5 for n_ in lengths],
        "logprobs": [torch.randn(int(n_), generator=g) for n_ in lengths],
        "hidden": [torch.randn(int(n_), 3, generator=g).bfloat16() for n_ in lengths],
        "input_lengths": lengths,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "padded": torch.randn(n, 6, generator=g),
    }


def per_sample(column: Column) -> list[torch.Tensor]:
    return list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)


def assert_samples(got: dict[str, list[torch.Tensor]], fields: dict[str, Column],
                   rows: list[int]) -> None:
    """``got`` holds rows ``rows`` of ``fields``, exactly (values, dtypes, shapes)."""
    assert sorted(got) == sorted(fields)
    for name, column in fields.items():
        expected = [per_sample(column)[i] for i in rows]
        assert len(got[name]) == len(expected), name
        for g, e in zip(got[name], expected):
            assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), name


# ---------------------------------------------------------------------- contract (both stores)


def test_round_trip_of_jagged_and_regular_fields(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    fields = rollout_fields(6)
    plane.put("train", KEYS, fields)
    assert sorted(plane.list_keys("train")) == KEYS
    order = [4, 0, 5, 2]
    got = plane.get("train", [KEYS[i] for i in order], list(fields))
    assert_samples(got, fields, order)
    got[next(iter(got))][0].fill_(7)  # results are copies, not views of the store
    assert_samples(plane.get("train", KEYS, list(fields)), fields, list(range(6)))


def test_write_back_adds_and_overwrites_fields_under_the_same_keys(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    rollout = rollout_fields(6)
    meta = KVBatchMeta("train", KEYS, rollout["input_lengths"])
    meta = plane.put_by_meta(meta, {"input_ids": rollout["input_ids"]})
    assert meta.fields == ("input_ids",)
    # A worker writes its result for its shard; the driver adds advantages for all samples.
    shard = meta.subset([5, 1, 3])
    prev = {"prev_logprobs": [-0.5 * rollout["input_ids"][i].float() for i in (5, 1, 3)]}
    plane.put_by_meta(shard, prev)
    meta = plane.put_by_meta(meta, {"advantages": rollout["advantages"]})
    assert meta.fields == ("input_ids", "advantages")
    got = plane.get("train", [KEYS[i] for i in (5, 1, 3)], ["input_ids", "prev_logprobs"])
    assert_samples({"input_ids": got["input_ids"]}, {"input_ids": rollout["input_ids"]}, [5, 1, 3])
    assert all(torch.equal(a, b) for a, b in zip(got["prev_logprobs"], prev["prev_logprobs"]))
    # Overwriting a field replaces it, also with another shape.
    plane.put("train", ["k0"], {"input_ids": [torch.tensor([1, 2])]})
    assert plane.get("train", ["k0"], ["input_ids"])["input_ids"][0].tolist() == [1, 2]


def test_select_fields_reads_only_the_named_fields(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    fields = rollout_fields(3)
    meta = plane.put_by_meta(KVBatchMeta("train", KEYS[:3], [1, 1, 1]), fields)
    got = plane.get("train", KEYS[:3], ["logprobs", "advantages"])
    assert sorted(got) == ["advantages", "logprobs"]
    assert_samples(got, {k: fields[k] for k in ("logprobs", "advantages")}, [0, 1, 2])
    assert sorted(plane.get_by_meta(meta)) == sorted(fields)
    assert list(plane.get_by_meta(meta, ["hidden"])) == ["hidden"]
    with pytest.raises(ValueError, match=re.escape("fields ['rewards'] are not stored")):
        plane.get_by_meta(meta, ["rewards"])


def test_missing_keys_error_names_partition_and_keys(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.put("train", KEYS[:2], {"advantages": torch.zeros(2)})
    with pytest.raises(MissingSamplesError) as err:
        plane.get("train", ["k0", "ghost-1", "k1", "ghost-2"], ["advantages"])
    assert str(err.value) == (
        "data-plane partition 'train' has no samples under 2 of the 4 requested keys: "
        "['ghost-1', 'ghost-2']; they were never put or were already cleared "
        "(clear_samples / clear_partition)"
    )
    assert (err.value.partition_id, err.value.keys, err.value.fields) == (
        "train", ["ghost-1", "ghost-2"], []
    )


def test_missing_fields_error_names_fields_and_keys(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.put("train", KEYS[:4], {"input_ids": [torch.arange(3)] * 4})
    plane.put("train", KEYS[:2], {"prev_logprobs": [torch.zeros(3)] * 2})
    with pytest.raises(MissingSamplesError) as err:
        plane.get("train", KEYS[:4], ["input_ids", "prev_logprobs"])
    assert str(err.value) == (
        "data-plane partition 'train': fields ['prev_logprobs'] are missing for 2 of the 4 "
        "requested keys: ['k2', 'k3']; put those fields under these keys before reading them"
    )
    assert (err.value.keys, err.value.fields) == (["k2", "k3"], ["prev_logprobs"])
    with pytest.raises(MissingSamplesError, match=re.escape("fields ['never_written']")):
        plane.get("train", KEYS[:1], ["never_written"])


def test_clear_samples_then_partition_leave_nothing(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.put("train", KEYS, {"advantages": torch.arange(6.0)})
    plane.clear_samples("train", ["k1", "k4"])
    assert sorted(plane.list_keys("train")) == ["k0", "k2", "k3", "k5"]
    with pytest.raises(MissingSamplesError, match=re.escape("keys: ['k1']")):
        plane.get("train", ["k0", "k1"], ["advantages"])
    # Clearing a key that is not there drops nothing.
    with pytest.raises(MissingSamplesError, match=re.escape("keys: ['k4']")):
        plane.clear_samples("train", ["k0", "k4"])
    assert sorted(plane.list_keys("train")) == ["k0", "k2", "k3", "k5"]
    assert [t.item() for t in plane.get("train", ["k5", "k0"], ["advantages"])["advantages"]] == [
        5.0, 0.0
    ]
    plane.clear_samples("train", ["k0", "k2", "k3", "k5"])
    assert plane.list_keys("train") == []
    plane.register_partition("train")  # an emptied partition can be reused
    plane.put("train", ["k9"], {"advantages": torch.ones(1)})
    plane.clear_partition("train")
    assert "train" not in plane.partitions()
    not_registered = re.escape(
        "data-plane partition 'train' is not registered (registered: []); call "
        "register_partition('train') first"
    )
    for request in (
        lambda: plane.list_keys("train"),
        lambda: plane.put("train", ["k9"], {"advantages": torch.ones(1)}),
        lambda: plane.get("train", ["k9"], ["advantages"]),
        lambda: plane.get("train", [], ["advantages"]),
        lambda: plane.clear_samples("train", ["k9"]),
    ):
        with pytest.raises(DataPlaneError, match=not_registered):
            request()
    plane.clear_partition("train")  # clearing an unregistered partition is a no-op


def test_register_refuses_a_partition_with_leftover_samples(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.register_partition("train")  # idempotent while empty
    plane.put("train", KEYS[:3], {"advantages": torch.zeros(3)})
    with pytest.raises(DataPlaneError) as err:
        plane.register_partition("train")
    message = str(err.value)
    assert message.startswith("data-plane partition 'train' still holds 3 samples [")
    assert message.endswith(
        "from earlier use; clear them (clear_samples / clear_partition) before registering it "
        "again"
    )
    assert all(repr(k) in message for k in KEYS[:3])


def test_partitions_are_isolated(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.register_partition("val")
    assert sorted(plane.partitions()) == ["train", "val"]
    plane.put("train", KEYS[:2], {"x": torch.tensor([1.0, 2.0])})
    plane.put("val", KEYS[:2], {"x": torch.tensor([-1.0, -2.0])})
    plane.clear_partition("val")
    assert plane.partitions() == ["train"]
    assert [t.item() for t in plane.get("train", KEYS[:2], ["x"])["x"]] == [1.0, 2.0]


def test_empty_requests_touch_nothing(plane: DataPlaneClient) -> None:
    plane.register_partition("train")
    plane.put("train", [], {"x": torch.zeros(0, 3), "y": []})
    assert plane.get("train", [], ["x", "y"]) == {"x": [], "y": []}
    plane.clear_samples("train", [])
    assert plane.list_keys("train") == []


# ---------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("keys", "fields", "error", "message"),
    [
        (["a", "b"], {"x": torch.zeros(3)}, ValueError,
         "field 'x' has shape (3,) but 2 keys were given; a tensor field needs the batch as "
         "dimension 0"),
        (["a", "b"], {"x": [torch.zeros(2)]}, ValueError,
         "field 'x' has 1 samples but 2 keys were given"),
        (["a", "b"], {"x": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]}, ValueError,
         "field 'x': sample 1 is torch.int64 but sample 0 is torch.float32; all samples of a "
         "field share one dtype"),
        (["a", "b"], {"x": [torch.zeros(2, 3), torch.zeros(2, 4)]}, ValueError,
         "field 'x': sample 1 has shape (2, 4) but sample 0 has (2, 3); samples of a field may "
         "differ in their first dimension only"),
        (["a", "b"], {"x": ["not", "tensors"]}, TypeError,
         "field 'x' is a list; give a tensor [batch, ...] or a list of per-sample tensors"),
        (["a", "b"], {}, ValueError, "put needs a non-empty mapping of field name -> tensor(s)"),
        (["a", "a"], {"x": torch.zeros(2)}, ValueError,
         "keys repeat: ['a']; keys must be distinct"),
        ("ab", {"x": torch.zeros(2)}, TypeError,
         "keys must be a sequence of strs, not the single str 'ab'"),
    ],
)
def test_put_argument_errors(keys: Any, fields: Any, error: type, message: str) -> None:
    plane = InProcessDataPlane()
    plane.register_partition("train")
    with pytest.raises(error, match=re.escape(message)):
        plane.put("train", keys, fields)
    assert plane.list_keys("train") == []
    with pytest.raises(ValueError, match="select_fields must name at least one field"):
        plane.get("train", ["a"], [])


# ---------------------------------------------------------------------- stores other processes reach


@pytest.mark.slow
def test_transfer_queue_listens_on_loopback_and_refuses_a_second_start(tq_plane: Any) -> None:
    from nemo_rl.data_plane.transfer_queue_client import TransferQueueDataPlane

    assert tq_plane.server_ips == {"127.0.0.1"}
    with pytest.raises(DataPlaneError, match="a TransferQueue controller already runs"):
        TransferQueueDataPlane.start()


@pytest.mark.slow
def test_object_store_refuses_a_second_start(object_store_plane: Any) -> None:
    with pytest.raises(DataPlaneError, match="a Ray object-store data plane already runs"):
        start_data_plane({"backend": "ray_object_store"})


@ray.remote(num_cpus=1)
class _Worker:
    """A process of its own that attaches to the driver's store."""

    def __init__(self, backend: str) -> None:
        self.plane = attach_data_plane({"backend": backend})

    def write_half_ids(self, keys: list[str]) -> None:
        ids = self.plane.get("train", keys, ["input_ids"])["input_ids"]
        self.plane.put("train", keys, {"half_ids": [t.float() * 0.5 for t in ids]})

    def close(self) -> None:
        self.plane.close()


def test_attached_client_in_another_process_shares_the_store(
    remote_plane: tuple[str, DataPlaneClient],
) -> None:
    backend, plane = remote_plane
    plane.register_partition("train")
    ids = [torch.arange(n) for n in (3, 1, 4, 2)]
    plane.put("train", KEYS[:4], {"input_ids": ids})
    worker = _Worker.remote(backend)
    ray.get(worker.write_half_ids.remote(KEYS[1:4]), timeout=120)
    got = plane.get("train", KEYS[1:4], ["half_ids"])["half_ids"]
    assert [t.tolist() for t in got] == [[0.0], [0.0, 0.5, 1.0, 1.5], [0.0, 0.5]]
    # An attached client's close leaves the store running for everybody else.
    ray.get(worker.close.remote(), timeout=60)
    assert [t.tolist() for t in plane.get("train", ["k0"], ["input_ids"])["input_ids"]] == [
        [0, 1, 2]
    ]
    assert kill_actors([worker], timeout_s=60) == []
    if backend == "transfer_queue":  # the storage units hold what the worker wrote
        got = plane.get("train", KEYS[1:4], ["half_ids"])["half_ids"]
        assert [t.tolist() for t in got] == [[0.0], [0.0, 0.5, 1.0, 1.5], [0.0, 0.5]]
    # the driver's own samples are unaffected
    assert len(plane.get("train", KEYS[:4], ["input_ids"])["input_ids"]) == 4


@pytest.mark.slow
def test_dead_storage_unit_gives_a_clear_error_instead_of_a_hang(tq_plane: Any) -> None:
    """Runs after every other TransferQueue test: it breaks the module's TransferQueue."""
    tq_plane.register_partition("train")
    tq_plane.put("train", KEYS[:4], {"x": torch.arange(4.0)})
    impatient = attach_data_plane({"backend": "transfer_queue", "op_timeout_s": 5})
    for unit in range(2):
        unit_actor = ray.get_actor(f"TransferQueueStorageUnit#{unit}")
        assert kill_actors([unit_actor], timeout_s=60) == []
    with pytest.raises(DataPlaneError) as err:
        impatient.get("train", KEYS[:4], ["x"])
    assert str(err.value) == (
        "get of 4 keys ['k0', 'k1', 'k2', 'k3'] in partition 'train' got no answer within "
        "op_timeout_s=5 s; a TransferQueue controller or storage unit may have died (see the "
        "Ray logs)"
    )
    impatient.close()
    with pytest.raises(DataPlaneError, match="this TransferQueue data-plane client is closed"):
        impatient.partitions()


@pytest.mark.slow
def test_dead_directory_gives_a_clear_error_instead_of_a_hang(object_store_plane: Any) -> None:
    """Runs after every other object-store test: it breaks the module's directory."""
    from nemo_rl.data_plane.ray_object_store import DIRECTORY_NAME, DIRECTORY_NAMESPACE

    object_store_plane.register_partition("train")
    object_store_plane.put("train", KEYS[:4], {"x": torch.arange(4.0)})
    reader = attach_data_plane({"backend": "ray_object_store", "op_timeout_s": 5})
    directory = ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
    assert kill_actors([directory], timeout_s=60) == []
    with pytest.raises(DataPlaneError) as err:
        reader.get("train", KEYS[:4], ["x"])
    assert str(err.value) == (
        "get of 4 keys ['k0', 'k1', 'k2', 'k3'] in partition 'train' failed: the data-plane "
        "directory actor or the objects holding the samples are gone (ActorDiedError); "
        "restart the data plane"
    )
    reader.close()
    with pytest.raises(DataPlaneError, match="this Ray object-store data-plane client is closed"):
        reader.partitions()
