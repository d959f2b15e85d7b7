"""Command line: `python -m tf_hetbatch.plot LOG_DIR [--out file.png]`.

The picture itself is drawn by `tf_hetbatch.dashboards.plot` (`tf_hetbatch.plot_balance`); this
module is only its command line (it prints the PNG's path, or the error, as a command does).
"""

import argparse
import sys
from typing import Optional, Sequence

from tf_hetbatch.dashboards.plot import plot_balance


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: `python -m tf_hetbatch.plot LOG_DIR [--out file.png]`.

    Args:
      argv: Arguments without the program name; default `sys.argv[1:]`.

    Returns:
      The exit code: 0 on success, 1 if the logs or matplotlib are missing.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tf_hetbatch.plot",
        description="Draw per-replica batch sizes and compute times from tf_hetbatch logs.",
    )
    parser.add_argument("log_dir", help="the log_dir given to DynamicBatching / BalanceWriter")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: LOG_DIR/hetbatch_balance.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_balance(args.log_dir, args.out)
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
