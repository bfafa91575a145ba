import sys

from cukern.cli import main

if __name__ == "__main__":   # not when a process pool's spawned worker imports it
    sys.exit(main())
