"""The main job trains to the promised accuracy."""

from jreplicate import demo


def test_demo_reaches_accuracy():
    metrics = demo.train(steps=300, progress=False)
    assert metrics["num_replicas"] == 8
    assert metrics["accuracy"] >= 0.95, metrics


def test_demo_cli(capsys):
    assert demo.main(["--steps", "300"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "8 cpu devices" in out
