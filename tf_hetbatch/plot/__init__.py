"""`python -m tf_hetbatch.plot LOG_DIR [--out file.png]`: the balance PNG's command line.

The command line is `tf_hetbatch.plot.__main__` (a command line prints; the library logs);
the picture itself is drawn by `tf_hetbatch.dashboards.plot` (`tf_hetbatch.plot_balance`).
"""
