"""The error of jreplicate.checkpoint (re-exported by the package)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every process alike).

    Example (the directory cannot be created: its parent is a file):
      >>> import os, tempfile, jreplicate as jr
      >>> parent = os.path.join(tempfile.mkdtemp(), "a_file")
      >>> open(parent, "w").close()
      >>> try:
      ...     jr.CheckpointManager(os.path.join(parent, "ckpt"), jr.MirroredStrategy())
      ... except jr.checkpoint.CheckpointError as e:
      ...     print(str(e).split(": ")[1])
      /tmp/.../a_file is a file, where a directory is needed. Give a directory path that ...
    """
