import sys

from compat_matrix.probe.cli import main

if __name__ == "__main__":
    sys.exit(main())
