"""Start-up experiments: `ray-app train` with one change applied from outside the kit.

    python bench/variants.py VARIANT train [ray-app train arguments ...]

Each variant sets Ray's environment variables (they reach every Ray process of
a local cluster: the raylet inherits the driver's environment) and/or wraps a
public Ray call before ``ray_app.driver.cli.main`` runs. Nothing of ray_app is patched;
a variant that pays off is a suggestion for the kit, measured by case ``v`` of
bench/run.py against the kit as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# name -> (environment, wrapper of a Ray call, what it changes)
VARIANTS = {
    "kit": ({}, None, "the kit as it is"),
    "dashboard": ({"RAY_APP_DASHBOARD": "1"}, None,
                  "local Ray with its dashboard (the kit starts none by default; its head and module processes)"),
    "no-watchers": ({"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_METRICS_ENABLED": "0"}, None,
                    "Ray Train without its own metrics callbacks (RAY_TRAIN_METRICS_ENABLED=0) and without the "
                    "preemption watcher (which the kit switches off itself)"),
    "startup-8": ({"RAY_worker_maximum_startup_concurrency": "8"}, None,
                  "the raylet starts up to 8 worker processes at once (default: the CPU count)"),
    "nice0": ({"RAY_worker_niceness": "0"}, None,
              "Ray's worker processes (controller, train workers) at nice 0 like Ray's own daemons "
              "(default 15)"),
    "no-journal": ({"RAY_APP_JOURNAL": "0"}, None,
                   "no run journal in any process (the bench's measure of its cost, case j; not a start-up change)"),
    "ray-poll": ({"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}, None,
                 "Ray Train's controller polls the workers every 2 s, always (Ray's default; the kit polls every "
                 "0.1 s for 3 s after a report, else every 0.5 s)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in VARIANTS:
        print(f"usage: variants.py {{{','.join(VARIANTS)}}} train [ARGS ...]", file=sys.stderr)
        return 2
    env, wrap, _ = VARIANTS[argv[0]]
    os.environ.update(env)
    if wrap is not None:
        wrap()
    from ray_app.driver.cli import main as ray_app_main

    return ray_app_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
