"""Strategies: how replicas are laid out over devices and processes, and who runs them.

Where things live: ``base.py`` holds the small :class:`Strategy` protocol (a
:class:`Layout`, computed once, and ``make_executor()``); ``mirrored.py``,
``multi_worker.py``, ``tpu.py`` and ``parameter_server.py`` are the four final
strategies. The strategies sit on top: they build the executors
(:mod:`jreplicate.execution`) and the parameter-server core (:mod:`jreplicate.ps`) and
hand them frozen values (a :class:`Layout`, a ``PSConfig``), never themselves; the
multi-process runtime they connect with is :mod:`jreplicate.cluster`, below them.
:class:`Layout` itself lives in :mod:`jreplicate.layout`, below every layer.
"""

from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS, Layout
from jreplicate.strategies.base import Strategy
from jreplicate.strategies.mirrored import MirroredStrategy
from jreplicate.strategies.multi_worker import MultiWorkerStrategy
from jreplicate.strategies.parameter_server import ParameterServerStrategy
from jreplicate.strategies.tpu import TPUStrategy

__all__ = [
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "Layout",
    "MirroredStrategy",
    "MultiWorkerStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "TPUStrategy",
]
