"""A URL given as the checkpoint directory is refused: the manager works through the
local file system, so ``gs://bucket/ckpt`` would silently become ``./gs:/bucket/ckpt`` on
each host's own disk, and the checkpoints would vanish with the hosts."""

import os

import pytest

import jreplicate as jr


@pytest.mark.parametrize("url", ["gs://bucket/ckpt", "s3://bucket/run/ckpt",
                                 "file:///tmp/ckpt"])
def test_a_url_is_refused_naming_the_fix_and_creates_nothing(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"URL is not a path(.|\n)*Mount the bucket"):
        jr.CheckpointManager(url, jr.MirroredStrategy())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("path", ["ckpt", "runs/gs:/x", "c:/ckpt"])
def test_paths_that_look_alike_are_paths(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jr.CheckpointManager(path, jr.MirroredStrategy()).close()
    assert os.path.isdir(tmp_path / path)
