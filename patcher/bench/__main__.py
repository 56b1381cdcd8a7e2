import sys

from patcher.bench import main

if __name__ == "__main__":
    sys.exit(main())
