"""Chief-written checkpoints, restored by every process on start (Supervisor's chief duties).

Where things live: ``manager.py`` holds :class:`CheckpointManager` (restore or
initialise on start, save by the chief, the broadcast of the chief's state, moving
incomplete or damaged steps aside) and :class:`CheckpointError`; ``tree.py`` the rule
matching stored arrays to ``init_fn()``'s state and the checksums of stored data;
``checks.py`` the structure and path checks and their messages; ``leaves.py`` the
leaves read to the host for a save or a restore, and what cannot be saved;
``dirlock.py`` the one-job-per-directory lock (``<directory>/jreplicate.lock``);
``preemption.py`` the agreement on where a preempted job stops (:class:`Preempted`,
:data:`EXIT_PREEMPTED`). This ``__init__`` only re-exports the public names; the other
modules are private to the package.
"""

from jreplicate.checkpoint.manager import COMMIT_MARKER, CheckpointError, CheckpointManager
from jreplicate.checkpoint.preemption import EXIT_PREEMPTED, Preempted

__all__ = ["COMMIT_MARKER", "EXIT_PREEMPTED", "CheckpointError", "CheckpointManager",
           "Preempted"]
