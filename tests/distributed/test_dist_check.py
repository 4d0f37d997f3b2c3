"""``HYBRIDRL_CHECK_COLLECTIVES``: a tensor on the wrong device for its group's backend is refused at once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridrl.distributed import check as dist_check


@pytest.fixture()
def gloo_world(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name in dist_check._TENSOR_ARGS:  # undo the wrapping after the test
        monkeypatch.setattr(dist, name, getattr(dist, name))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist_check.install()
    yield
    dist.destroy_process_group()


def test_a_tensor_off_its_groups_device_is_refused(gloo_world: None) -> None:
    before = sum(dist_check.CHECKED.values())
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    assert sum(dist_check.CHECKED.values()) == before + 2 and torch.equal(t, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"dist.all_reduce on a gloo group got a tensor on meta"):
        dist.all_reduce(torch.ones(3, device="meta"))
    with pytest.raises(RuntimeError, match=r"dist.all_gather on a gloo group got a tensor on meta"):
        dist.all_gather([torch.ones(1, device="meta")], torch.ones(1))
    assert "calls checked" in dist_check.report()
