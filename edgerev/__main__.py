import sys

from edgerev.cli import main

sys.exit(main())
