"""The frozen app's entry point: the same `miniapp` command line."""

import multiprocessing
import sys

from miniapp.app.cli import main

if __name__ == "__main__":
    multiprocessing.freeze_support()  # the bench starts worker processes
    sys.exit(main())
