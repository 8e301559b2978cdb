"""The main job trains to the promised accuracy and reports clearly (issue 9, item 16)."""

import io
import os
import re
import subprocess
import sys

import pytest

from jreplicate import demo
from tests._optional import needs


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@needs("sklearn")
def test_demo_reaches_accuracy_with_plain_progress_lines():
    stream = io.StringIO()  # not a terminal: plain lines, no progress bar
    metrics = demo.train(steps=300, progress=stream)
    assert metrics["num_replicas"] == 8
    assert metrics["accuracy"] >= 0.95, metrics
    assert not metrics["diverged"] and metrics["steps_run"] == 300
    out = stream.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    # Compilation is its own phase, reported before any step.
    assert re.fullmatch(r"compiling the step .*\.\.\. done in \d+\.\d s", lines[0]), lines[0]
    steps = [re.fullmatch(r"step +(\d+)/300  loss (\d+\.\d+)  (\d+\.\d) steps/s", line)
             for line in lines[1:]]
    assert all(steps), lines
    assert [int(m.group(1)) for m in steps] == list(range(30, 301, 30))  # every 10 %
    assert float(steps[-1].group(2)) == pytest.approx(metrics["final_loss"], abs=1e-4)
    assert max(len(line) for line in lines) < 80


@needs("sklearn", "tqdm")
def test_demo_progress_bar_on_a_terminal_starts_after_compilation():
    stream = _Terminal()
    metrics = demo.train(steps=40, progress=stream)
    renders = [r for r in re.split(r"[\r\n]", stream.getvalue()) if r.strip()]
    assert renders[0].startswith("compiling the step") and "done in" in renders[0]
    bars = [r for r in renders if r.startswith("training on 8 replicas")]
    assert bars, renders
    # The bar's clock starts after compilation: no ETA inflated by the compile time.
    assert "1/40 [00:00<" in bars[0], bars[0]
    counts = [int(re.search(r"(\d+)/40", b).group(1)) for b in bars]
    assert counts == sorted(counts) and counts[-1] == 40
    assert f"loss={metrics['final_loss']:.4f}" in bars[-1], bars[-1]


@needs("sklearn")
def test_demo_cli_keeps_stdout_for_results(capsys):
    assert demo.main(["--steps", "300"]) == 0
    captured = capsys.readouterr()
    assert "held-out accuracy" in captured.out and "8 cpu devices" in captured.out
    assert "step" not in captured.out.replace("300 steps", "")  # no progress on stdout
    assert "compiling the step" in captured.err and "step 300/300" in captured.err


def test_demo_help_has_texts_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--steps", "600"), ("--global-batch", "128"), ("--lr", "0.003"),
                            ("--seed", "0")]:
        assert re.search(rf"{option} \S+ \w[^-]*\(default: {re.escape(default)}\)", text), \
            (option, text)
    assert "CPU devices to simulate" in text and "default: the count in XLA_FLAGS" in text


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--steps", "ten"], "argument --steps: expected a positive integer, got 'ten'"),
    (["--devices", "0"], "argument --devices: must be at least 1, got 0"),
    (["--global-batch", "-8"], "argument --global-batch: must be at least 1, got -8"),
    (["--lr", "0"], "argument --lr: must be a positive finite number, got 0"),
    (["--lr", "nan"], "argument --lr: must be a positive finite number, got nan"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--global-batch", "100"], "--global-batch 100 is not divisible by the 8 devices"),
])
def test_demo_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and message in err, err


@needs("sklearn")
def test_demo_train_rejects_bad_values():
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        demo.train(steps=0, progress=False)
    with pytest.raises(ValueError, match="global_batch=100 is not divisible by the 8"):
        demo.train(global_batch=100, progress=False)


@needs("sklearn")
def test_demo_diverging_learning_rate_says_so(capsys):
    assert demo.main(["--lr", "10", "--steps", "30"]) == 1
    err = capsys.readouterr().err
    assert "error: training diverged with --lr 10: the loss rose from" in err, err
    assert "try a smaller one, e.g. --lr 0.003 (the default)" in err, err


@needs("sklearn")
def test_demo_piped_with_devices_flag():
    """Piped (as under the launcher): short plain lines, --devices honoured over XLA_FLAGS."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "jreplicate.demo", "--devices", "2",
                           "--steps", "20"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert "2 cpu devices" in proc.stdout, (proc.stdout, proc.stderr)
    assert "\r" not in proc.stdout + proc.stderr
    assert "step 20/20" in proc.stderr and "compiling the step" in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("step")]
    assert len(progress) == 10 and max(map(len, progress)) < 80, proc.stderr
    # 20 steps do not reach the target: exit 1 with the reason and the fix.
    assert proc.returncode == 1 and "try more steps (--steps 600)" in proc.stderr, proc.stderr


def test_demo_without_scikit_learn_names_it(monkeypatch, capsys):
    """The GPU image has no scikit-learn: the demo's data set says so in one line."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert demo.main(["--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the demo's data set is scikit-learn's bundled digits")
    assert "pip install scikit-learn" in err and "Traceback" not in err


def test_demo_progress_without_tqdm_is_plain_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = _Terminal()  # a terminal, but no tqdm: the plain lines
    progress = demo._Progress(stream, 20, "training")
    assert progress.bar is None
    progress.update(2, 0.5)
    assert stream.getvalue().startswith("step  2/20  loss 0.5000")
