"""Implementation of :mod:`jreplicate.sync_replicas` (import from there)."""
