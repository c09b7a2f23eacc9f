import sys

from splitserve.cli import main

sys.exit(main())
