"""The balance picture: a PNG drawn from the event files, one series per replica."""

from __future__ import annotations

import numpy as np
import pytest

from tf_hetbatch.plot import __main__ as plot_cli
from tf_hetbatch.dashboards import plot
from test_summaries import NUM_REPLICAS, write_synthetic_balance_run


@pytest.fixture(scope="module")
def balance_log(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("plot_logs"))
    written = write_synthetic_balance_run(log_dir)
    return log_dir, written


def test_read_balance_returns_what_was_written(balance_log):
    log_dir, written = balance_log
    run = plot.read_balance(log_dir)
    assert run.num_replicas == NUM_REPLICAS
    for k in range(NUM_REPLICAS):
        assert list(run.batch_sizes[k].steps) == written["steps"]
        assert list(run.batch_sizes[k].values) == [split[k] for split in written["batch_sizes"]]
        assert all(t > 0 for t in run.compute_times_ms[k].values)
    assert [step for step, _ in run.adjustments] == written["adjustment_steps"]
    assert 0 < run.mean_balance_efficiency < 1


def test_figure_has_one_labelled_line_per_replica_and_adjustment_lines(balance_log):
    import matplotlib.pyplot as plt

    log_dir, written = balance_log
    fig = plot.make_balance_figure(plot.read_balance(log_dir))
    try:
        top, bottom = fig.axes
        replicas = [f"replica {k}" for k in range(NUM_REPLICAS)]
        for ax in (top, bottom):
            assert [t.get_text() for t in ax.get_legend().get_texts()][:NUM_REPLICAS] == replicas
            lines = [line for line in ax.get_lines() if line.get_label() in replicas]
            assert len({line.get_color() for line in lines}) == NUM_REPLICAS
            vertical = [line for line in ax.get_lines() if len(set(line.get_xdata())) == 1]
            assert sorted(line.get_xdata()[0] for line in vertical) == written["adjustment_steps"]
        assert "mean balance efficiency" in fig.get_suptitle()
    finally:
        plt.close(fig)


def test_png_is_written_readable_and_shows_every_replica_colour(balance_log, tmp_path):
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    log_dir, _ = balance_log
    out = plot.plot_balance(log_dir, str(tmp_path / "balance.png"))
    assert out == str(tmp_path / "balance.png")
    image = mpimg.imread(out)[..., :3]
    assert image.shape[0] > 300 and image.shape[1] > 400
    cmap = plt.get_cmap("tab10")
    for k in range(NUM_REPLICAS):
        colour = np.array(cmap(k)[:3])
        close = np.abs(image - colour).max(axis=-1) < 0.02
        assert close.sum() > 200, f"replica {k}'s colour is not in the picture"


def test_cli_writes_the_png_and_default_path(balance_log, tmp_path, capsys):
    log_dir, _ = balance_log
    assert plot_cli.main([log_dir, "--out", str(tmp_path / "cli.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli.png")
    assert (tmp_path / "cli.png").stat().st_size > 10_000


def test_missing_logs_fail_naming_the_dir_and_the_fix(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="DynamicBatching\\(log_dir=...\\)"):
        plot.read_balance(str(tmp_path))
    assert plot_cli.main([str(tmp_path)]) == 1
    assert str(tmp_path) in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_install(balance_log, monkeypatch):
    log_dir, _ = balance_log
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        plot.plot_balance(log_dir)


def test_cli_runs_as_python_dash_m_tf_hetbatch_plot():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tf_hetbatch.plot", "--help"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "python -m tf_hetbatch.plot" in proc.stdout and "--out" in proc.stdout
