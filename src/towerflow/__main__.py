import sys

from towerflow.cli import main

sys.exit(main())
