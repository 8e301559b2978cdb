"""The Ray carrier: parameter-server shards and workers as Ray actors.

Every module that touches Ray lives here, and only here; the rest of
:mod:`jreplicate.ps` never imports Ray. Importing this package does not import Ray
either: :func:`jreplicate.ps.ray.carrier.ensure_ray` does, when a strategy built with
``carrier="ray"`` starts.

* :mod:`jreplicate.ps.ray.carrier`: the driver's side (:class:`RayCarrier`).
* :mod:`jreplicate.ps.ray.actors`: the shard and worker actors.
* :mod:`jreplicate.ps.ray.proxy`: a worker actor's view of the shard actors.
* :mod:`jreplicate.ps.ray.options`: ``ray_worker_options`` / ``ray_shard_options``.
* :mod:`jreplicate.ps.ray.wire`: arrays packed into bytes for the object store.
"""
