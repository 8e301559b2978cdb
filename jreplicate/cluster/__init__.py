"""The multi-process runtime, one module per concern, below the strategies.

``spec`` holds what a job is made of (:class:`ClusterSpec`, :class:`Timeouts`, the
errors and the ``JREPLICATE_*`` environment names); ``discovery`` finds the cluster
from arguments, the launcher's environment, ``TF_CONFIG`` or JAX's detection;
``runtime`` joins ``jax.distributed`` with bounded waits on the right sockets;
``agreement`` all-gathers small checked messages through the coordination service so
that every process takes the same decision; ``watchdog`` ends a process on time,
saying why; ``launch`` starts a local job (``python -m jreplicate.cluster.launch``).
Strategies import this package; it imports no strategy, executor, PS or checkpoint
module.
"""

from jreplicate.cluster.spec import ClusterError, ClusterSpec, Timeouts

__all__ = ["ClusterError", "ClusterSpec", "Timeouts"]
