"""ParallelDims validation (no process group) and the mesh built from it (gloo ranks)."""

import pytest

from tests._dist import init_gloo, run_ranks
from ultrascale.parallel.dims import MESH_AXES, ParallelDims, build_mesh


def test_rest_is_resolved():
    dims = ParallelDims.resolve(8, dp_replicate=2, dp_shard=-1)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == (2, 4, 1, 1, 1)
    assert dims.dp == 8 and dims.dp_shard_cp == 4 and dims.fsdp_enabled and dims.dp_replicate_enabled


def test_tp_is_the_rest():
    dims = ParallelDims.resolve(8, dp_shard=2, tp=-1)
    assert dims.tp == 4 and dims.dp == 2


def test_frozen():
    dims = ParallelDims.resolve(4)
    with pytest.raises(AttributeError):
        dims.tp = 2  # type: ignore[misc]


def test_wrong_product_names_every_factor():
    with pytest.raises(ValueError) as info:
        ParallelDims.resolve(10, dp_replicate=2, dp_shard=2, tp=2)
    message = str(info.value)
    assert "dp_replicate(2) * dp_shard(2) * cp(1) * tp(2) * pp(1) != world size(10)" in message
    assert "[1, 2, 5, 10]" in message


def test_rest_that_does_not_divide():
    with pytest.raises(ValueError, match=r"cannot infer `dp_shard`.*does not divide world size 6"):
        ParallelDims.resolve(6, tp=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dp_shard": -1, "tp": -1}, "only one degree may be -1"),
        ({"tp": 0}, r"`tp=0` must be a positive integer"),
        ({"cp": 1.5}, r"`cp=1.5` must be a positive integer"),
        ({"ep": -1}, "ep=-1"),
        ({"dp_shard": 2, "cp": 2, "ep": 3}, r"`ep=3` must divide dp_shard\(2\) \* cp\(2\) = 4"),
    ],
)
def test_invalid_degrees(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.resolve(4, **kwargs)


def test_seq_len_divisor():
    dims = ParallelDims.resolve(8, dp_shard=1, cp=2, tp=4)
    assert dims.seq_len_divisor(sequence_parallel=True) == 16
    assert dims.seq_len_divisor(sequence_parallel=False) == 4  # plain TP takes any length; CP still chunks it


def test_check_seq_len_names_the_fitting_lengths():
    dims = ParallelDims.resolve(2, dp_shard=1, tp=2)
    dims.check_seq_len(32, sequence_parallel=True)
    dims.check_seq_len(31, sequence_parallel=False)  # no SP: nothing splits the sequence
    with pytest.raises(ValueError, match=r"sequence length 31 of the batch must be a multiple of 2 \(sequence parallel "
                       r"splits it over tp=2 ranks\): use 30 or 32 .*or turn off `sequence_parallel`"):
        dims.check_seq_len(31, sequence_parallel=True)


def _mesh_worker(rank, world_size):
    init_gloo(rank, world_size)
    dims = ParallelDims.resolve(world_size, dp_replicate=2, dp_shard=-1)
    mesh = build_mesh(dims, "cpu")
    out = {axis: mesh[axis].size() for axis in MESH_AXES}
    out["dp"] = (mesh["dp"].size(), mesh["dp"].get_local_rank())
    out["dp_shard_cp"] = mesh["dp_shard_cp"].size()
    out["dp_cp"] = mesh["dp_cp"].size()
    out["hsdp"] = mesh.fsdp.shape
    out["hsdp_names"] = mesh.fsdp.mesh_dim_names
    out["world"] = mesh.world.mesh_dim_names
    try:
        mesh["data"]
    except KeyError as error:
        out["error"] = str(error)
    return out


def test_build_mesh_world4():
    results = run_ranks(_mesh_worker, 4)
    for rank, out in enumerate(results):
        assert (out["pp"], out["dp_replicate"], out["dp_shard"], out["cp"], out["tp"]) == (1, 2, 2, 1, 1)
        assert out["dp"] == (4, rank)
        assert out["dp_shard_cp"] == 2
        assert out["dp_cp"] == 4
        assert tuple(out["hsdp"]) == (2, 2) and out["hsdp_names"] == ("dp_replicate", "dp_shard_cp")
        assert out["world"] == MESH_AXES
        assert "valid axes: pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp" in out["error"]
