import sys

from cukern.cli import main

sys.exit(main())
