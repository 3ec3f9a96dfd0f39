"""``python -m kvq.cli ...``: the ``kvq`` command (for launchers such as ``mlx.launch`` that take an interpreter)."""

import sys

from . import main

sys.exit(main())
