import sys

from edgerev.source_tree import import_daemon

import_daemon()  # ``PYTHONPATH=. python -m edgerev`` from a checkout: daemon/ is edgerev_daemon only once installed

from edgerev.cli import main  # noqa: E402

sys.exit(main())
