"""``python -m resilient_training.cli``: the same as the ``resilient-training`` command."""

import sys

from resilient_training.cli.main import main

sys.exit(main())
