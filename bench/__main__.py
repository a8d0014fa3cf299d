"""``python -m bench [WORKLOAD ...] [--quick] [--monarch]``: run and print the table."""

from bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
