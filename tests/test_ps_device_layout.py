"""ParameterServerStrategy's device layout: worker groups never share a device; idle or
shared devices are announced (issue 18 item 5)."""

import warnings

import jax
import pytest

import jreplicate as jr
from jreplicate.ps.device_layout import assign_devices


def _groups_disjoint(worker_devices):
    flat = [d for grp in worker_devices for d in grp]
    return len(flat) == len(set(flat))


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("nw", [None, 1, 2, 3, 6])
def test_every_layout_has_disjoint_groups_or_is_an_error(n, num_ps, g, nw):
    devs = [f"d{i}" for i in range(n)]
    if g > n:
        return  # the strategy rejects this before laying out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            lay = assign_devices(devs, num_ps, nw, g)
        except ValueError as e:
            assert (nw or 1) * g > n and "worker groups would share devices" in str(e)
            return
    workers = len(lay.worker_devices)
    assert workers == (nw if nw is not None else max((n - num_ps) // g, 1))
    assert all(len(grp) == g for grp in lay.worker_devices)
    assert _groups_disjoint(lay.worker_devices)
    assert len(lay.shard_devices) == num_ps and set(lay.shard_devices) <= set(devs)
    used = {d for grp in lay.worker_devices for d in grp}
    shards_apart = used.isdisjoint(lay.shard_devices)
    assert shards_apart == (num_ps + workers * g <= n)
    texts = [str(w.message) for w in caught]
    assert any("share devices with workers" in t for t in texts) == (not shards_apart)
    idle = n - len(used | set(lay.shard_devices))
    assert any("left idle" in t for t in texts) == (bool(idle) and nw is None and shards_apart)


def test_two_groups_of_four_beside_two_shards_share_only_with_the_shards_announced():
    devs = jax.local_devices()
    with pytest.warns(UserWarning, match=r"2 \+ 2 x 4 = 10 exceeds the 8 devices; shard\(s\) "
                      r"\[0, 1\] share.*num_workers=1.*device_count=10"):
        s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, num_replicas_in_sync=4)
    assert s.worker_devices == (tuple(devs[:4]), tuple(devs[4:]))
    assert s.shard_devices == tuple(devs[:2])


def test_worker_groups_that_would_share_devices_are_an_error_naming_the_fix():
    with pytest.raises(ValueError) as e:
        jr.ParameterServerStrategy(num_ps=2, num_workers=3, num_replicas_in_sync=4)
    msg = str(e.value)
    assert "num_workers=3, num_replicas_in_sync=4" in msg and "3 x 4 = 12" in msg
    assert "= 14" in msg and "8 devices" in msg and "worker groups would share" in msg
    assert "num_workers=1" in msg and "device_count=14" in msg
    with pytest.raises(ValueError, match="num_workers=6"):  # one device each, 6 beside 2 shards
        jr.ParameterServerStrategy(num_ps=2, num_workers=9)


def test_idle_devices_are_announced_and_the_group_is_apart_from_the_shards():
    with pytest.warns(UserWarning, match=r"2 of the 8 devices are left idle.*num_ps=4"):
        s = jr.ParameterServerStrategy(num_ps=2, num_replicas_in_sync=4)
    devs = jax.local_devices()
    assert s.shard_devices == tuple(devs[:2])
    assert s.worker_devices == (tuple(devs[2:6]),)


def test_shards_sharing_the_workers_devices_is_announced():
    devs = jax.local_devices()[:3]
    with pytest.warns(UserWarning, match=r"2 \+ 2 x 1 = 4 exceeds the 3 devices; shard\(s\) \[1\]"):
        s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, devices=devs)
    assert s.worker_devices == ((devs[1],), (devs[2],))
    assert s.shard_devices == (devs[0], devs[1])


def test_a_device_listed_twice_is_an_error():
    d = jax.local_devices()
    with pytest.raises(ValueError, match="lists a device twice"):
        jr.ParameterServerStrategy(num_ps=1, devices=[d[0], d[1], d[1]])


def test_the_conftest_layouts_keep_their_devices_silently():
    devs = jax.local_devices()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
        three = jr.ParameterServerStrategy(num_ps=2, num_replicas_in_sync=2)
        six = jr.ParameterServerStrategy(num_ps=2)
    assert one.shard_devices == three.shard_devices == tuple(devs[:2])
    assert one.worker_devices == ((devs[2],),)
    assert three.worker_devices == ((devs[2], devs[3]), (devs[4], devs[5]), (devs[6], devs[7]))
    assert six.worker_devices == tuple((d,) for d in devs[2:])
