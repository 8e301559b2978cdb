"""Executors: how a strategy places state and runs steps.

Where things live: ``base.py`` holds the :class:`Executor` protocol (place state,
assemble a step's input, run a step or a device loop of K steps, reduce); ``spmd.py``
:class:`SPMDExecutor`, shared by the strategies whose replicas form one mesh (Mirrored,
MultiWorker, TPU); ``program.py`` the compiled program of one step signature
(``jax.jit`` over ``jax.shard_map``); ``cache.py`` which program serves a call: one
cache per executor, by step function (its identity; held weakly), of its programs and the
steady-state calls that skip repeated checks (``fast.py``); ``donation.py`` donation
that never destroys an array another live object holds; ``nnx_args.py`` Flax NNX
modules among the arguments; ``nnx_rngs.py`` their random streams, drawn per replica.
An executor receives a frozen
:class:`jreplicate.strategies.Layout`, never a strategy, and knows nothing of the
parameter server (:mod:`jreplicate.ps`), which builds on it.
"""

from jreplicate.execution.base import Executor
from jreplicate.execution.spmd import SPMDExecutor

__all__ = ["Executor", "SPMDExecutor"]
