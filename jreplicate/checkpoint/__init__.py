"""Checkpoints written by every process (in the background), restored by every process
on start, and the agreed stop of a preempted job.

Where things live: ``manager.py`` holds :class:`CheckpointManager` (restore or
initialise on start, save, closing, moving incomplete or damaged steps aside);
``errors.py`` :class:`CheckpointError`; ``agreement.py`` how every process agrees (the
chief's result shared, outcomes combined, the broadcast); ``chief_files.py`` the chief's
work on the directory (its lock, moving steps aside, the steps to restore);
``recover.py`` restoring the newest undamaged step, or initialising, on every process;
``writer.py`` the background writes and the outcome every process agrees on;
``restore.py`` the reading of a step in both formats (format 1, chief-written and
broadcast; format 2, every process reads its shards) and its checks; ``targets.py``
where each restored leaf goes on this topology; ``tree.py`` the rule matching stored
arrays to ``init_fn()``'s state and the checksums of stored data; ``digest.py`` the
sharding-independent digest of an array's bits (format 2); ``dtypes.py`` the dtypes
stored as others; ``checks.py`` the structure and path checks and their messages;
``leaves.py`` the leaves read to the host for a save or a restore, and what cannot be
saved; ``dirlock.py`` the one-job-per-directory lock (``<directory>/jreplicate.lock``);
``preemption.py`` the agreement on where a preempted job stops (:class:`Preempted`,
:data:`EXIT_PREEMPTED`). This ``__init__`` only re-exports the public names; the other
modules are private to the package.
"""

from jreplicate.checkpoint.manager import COMMIT_MARKER, CheckpointError, CheckpointManager
from jreplicate.checkpoint.preemption import EXIT_PREEMPTED, Preempted

__all__ = ["COMMIT_MARKER", "EXIT_PREEMPTED", "CheckpointError", "CheckpointManager",
           "Preempted"]
