"""Parameter-server core shared by the carriers of :class:`jreplicate.ParameterServerStrategy`.

* :mod:`jreplicate.ps.placement`: which shard holds which parameter leaf.
* :mod:`jreplicate.ps.shard`: one shard as a plain state machine (push, pull, tokens).
* :mod:`jreplicate.ps.ledger`: each shard's record of what became of every push.
* :mod:`jreplicate.ps.client`: a worker's pull and push over all shards.
"""
