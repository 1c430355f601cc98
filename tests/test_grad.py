"""clip_grad_norm_ on sharded gradients equals torch's on the full gradients (any placements, p=2 and inf)."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing import assert_close

from tests._dist import init_gloo, run_ranks
from ultrascale.parallel.grad import clip_grad_norm_

PLACEMENTS = [
    (Shard(0), Shard(1)),
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Replicate(), Replicate()),
]


def full_grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=g) for _ in PLACEMENTS] + [torch.randn(5, generator=g)]


def _clip(rank, world_size, norm_type):
    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    params = []
    for grad, placements in zip(full_grads(), PLACEMENTS):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, placements))
        p.grad = distribute_tensor(grad, mesh, placements)
        params.append(p)
    plain = torch.nn.Parameter(torch.zeros(5))
    plain.grad = full_grads()[-1].clone()  # a replicated, non-DTensor gradient
    params.append(plain)
    norm = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    return norm, grads


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_matches_torch_on_full_gradients(norm_type):
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in full_grads()]
    for p, g in zip(reference, full_grads()):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0, norm_type=norm_type)
    assert expected_norm > 1.5  # clipping really happens
    for norm, grads in run_ranks(_clip, 4, norm_type):
        assert_close(norm, expected_norm, rtol=1e-6, atol=1e-6)
        for got, want in zip(grads, reference):
            assert_close(got, want.grad, rtol=1e-6, atol=1e-7)
