"""``python -m ray_app`` is the same as ``ray-app``."""

import sys

from ray_app.cli import main

sys.exit(main())
